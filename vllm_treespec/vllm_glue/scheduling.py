"""The scheduler of a tree engine: no placeholder drafts, and KV reserved for what
trees write.

vLLM's V1 scheduler (0.27.1 and 0.32.0, ``Scheduler.schedule``'s waiting loop)
pads a request that joins a decode batch with one token to schedule (a one-token
prompt; a resumed or fully prefix-cached request, which 0.32.0 pads even into an
empty batch) to ``1 + num_speculative_tokens`` tokens: ``num_spec_tokens`` -1
placeholder drafts, for uniform CUDA-graph shapes. A tree engine's
``num_speculative_tokens`` is its node budget (up to 256), and nothing uses
uniform shapes on our paths: every placeholder was forwarded and verified, and
while the adaptive budget had speculation off, a joining request verified dozens
of tokens where a plain server verifies one (issue 83: 10 of 33 soak windows).
It also cost admissions: a request whose padded size did not fit the step's
token budget waited.

vLLM also reserves ``num_speculative_tokens`` KV slots past every running
request's scheduled tokens (``num_lookahead_tokens``): stock EAGLE writes its
chain's drafter KV there. A tree's drafts are scheduled tokens (their slots
are allocated as such); past them, only a one-wide drafting level writes to the
paged cache (``paged_drafts``: the chain's tip, at most ``depth - 1`` positions
past the new root, which lies within the step's scheduled tokens). So a tree
engine reserves ``depth`` slots, not the node budget: in the 600-request soak
(KV cache of 8192 tokens, 64 requests) 32 slots a request held a quarter of the
cache, and the tree server admitted fewer requests at once than plain vLLM.

The scheduler skips that padding when dynamic speculative decoding gives it a
per-batch-size draft count (``dynamic_sd_lookup``, read in exactly two places:
that padding, and the draft count it hands the worker). A tree engine's
scheduler gets a lookup that says ``num_spec_tokens`` at every batch size, so
the count the worker sees is unchanged and the padding is off. The runner still
replaces any placeholder it meets (``verify_inputs.replace_placeholder_drafts``)
and counts it (``placeholder_drafts``), so a vLLM that pads some other way shows.

Stock EAGLE also drops the last block of every prefix-cache hit and recomputes
it; a tree engine keeps hits whole, as plain vLLM does (``versions.clear_block_drop``,
which says why). In the soak's mix (repeated prompts, preempted requests resumed
from the cache, 128-token blocks) the drop made the tree server prefill about a
tenth more prompt tokens than plain vLLM.

With copies from other requests (``cross_request_tokens``) the runner needs each
request's tenant, which the scheduler's request holds and the new-request data
it sends the workers does not: ``attach_tenants`` adds ``{req_id: tenant}`` of
the step's new requests to its output. The tenant is what vLLM's prefix cache
keeps apart, ``(cache_salt, LoRA adapter)`` (``tenant_of``); a request without
a ``cache_salt`` is left out unless ``cross_request_unsalted`` (the runner then
files nothing of it and looks nothing up for it).
"""

from __future__ import annotations

from typing import Any


def patch_scheduler() -> None:
    """Wrap ``Scheduler.__init__`` (idempotent): tree engines' schedulers never pad,
    reserve ``depth`` lookahead slots, keep prefix-cache hits whole and walk
    structured-output requests' grammars down their trees (``grammar_trees``)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_treespec.vllm_glue import grammar_trees, versions
    from vllm_treespec.vllm_glue.spec_config import tree_config_from_vllm

    original = Scheduler.__init__
    if getattr(original, "_treespec_wrapped", False):
        return

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        tree = tree_config_from_vllm(self.vllm_config)
        if tree is not None:
            disable_draft_padding(self)
            reserve_tree_lookahead(self, tree.depth)
            versions.clear_block_drop(self.kv_cache_manager,
                                      self.vllm_config.speculative_config)
            if tree.cross_request_tokens:  # refused without copy branches (config)
                attach_tenants(self, tree.cross_request_unsalted)
            grammar_trees.install(self, tree)

    __init__._treespec_wrapped = True  # type: ignore[attr-defined]
    Scheduler.__init__ = __init__


def disable_draft_padding(scheduler: Any) -> bool:
    """Turn a tree engine's ``scheduler``'s placeholder padding off; whether it
    did. A dynamic lookup already there (not a tree engine's: the tree keys
    replace it) is left alone."""
    k = getattr(scheduler, "num_spec_tokens", 0)
    if not k or getattr(scheduler, "dynamic_sd_lookup", False) is not None:
        return False
    scheduler.dynamic_sd_lookup = [k] * (scheduler.scheduler_config.max_num_seqs + 1)
    return True


def reserve_tree_lookahead(scheduler: Any, depth: int) -> bool:
    """Reserve ``depth`` KV slots past a tree engine's scheduled tokens instead
    of ``num_speculative_tokens`` (the node budget); whether it changed."""
    if getattr(scheduler, "num_lookahead_tokens", 0) <= depth:
        return False
    scheduler.num_lookahead_tokens = depth
    return True


def tenant_of(request: Any) -> tuple:
    """A request's tenant: its ``cache_salt`` and LoRA adapter (name and id;
    None without one), so that two adapters, or two salts, never share."""
    lora = getattr(request, "lora_request", None)
    adapter = None if not lora else (lora.lora_name, lora.lora_int_id)
    return request.cache_salt or None, adapter


def attach_tenants(scheduler: Any, unsalted: bool = False) -> None:
    """Every output of ``scheduler.schedule`` carries ``tree_tenants``: the
    tenant (``tenant_of``) of each request it schedules as new; one without a
    ``cache_salt`` (or with an empty one, which vLLM's prefix cache ignores too)
    only with ``unsalted`` (``cross_request_unsalted``)."""
    schedule = scheduler.schedule

    def with_tenants(*args: Any, **kwargs: Any):
        out = schedule(*args, **kwargs)
        requests = (scheduler.requests.get(new.req_id) for new in out.scheduled_new_reqs)
        out.tree_tenants = {r.request_id: tenant_of(r) for r in requests
                            if r is not None and (unsalted or r.cache_salt)}
        return out

    scheduler.schedule = with_tenants

"""The drafter's own grammar matchers: structured requests drafted under their grammar.

vLLM keeps each structured-output request's grammar in the scheduler process,
which walks it down the drafted tree after the worker drafted it
(``grammar_trees``). To draft under the grammar (``engine.draft_masks``) the
worker needs the grammar's state at drafting time, when the scheduler has not
yet heard of the step's tokens. So the worker compiles each structured
request's grammar itself, with vLLM's own xgrammar backend and the compile call
vLLM's scheduler makes (``versions.compile_request_grammar``): the same grammar,
walked by the same library. Its matcher follows the request's output: at each
drafting step it accepts the tokens emitted since the last, read from the
runner's token table plus the step's sampled tokens not yet written there
(``sampled_tail``, which the copy branches read too).

Compiling runs in a background thread from the step the request arrives; until
its grammar is ready (on every tensor-parallel rank: ranks must draft the same
trees) a request drafts unmasked, as it did before, and the scheduler's walk
still cuts what its grammar rejects. A matcher that rejects an emitted token
(it never should) stops masking that request for good; drafting never fails a
request. Only what ``tree_safe`` gives a tree is compiled here (xgrammar,
outside a reasoning parser's thinking part).
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vllm_treespec.engine.draft_masks import DraftMasks
from vllm_treespec.vllm_glue import rank_agreement
from vllm_treespec.vllm_glue.sampled_tail import SampledTail

logger = logging.getLogger("vllm.treespec")


@dataclasses.dataclass
class _Entry:
    grammar: Future
    matcher: Any = None
    accepted: int = 0      # output tokens the matcher has accepted
    failed: bool = False


class DraftGrammars:
    """A tree drafter's grammar matchers, one per structured request."""

    def __init__(self, vllm_config: Any):
        self.vllm_config = vllm_config
        self.entries: dict[str, _Entry] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._backend: Any = None
        self._recent = SampledTail()

    @property
    def active(self) -> bool:
        return bool(self.entries)

    def load(self) -> None:
        """vLLM's xgrammar backend for this engine's tokenizer (its vocabulary
        decoded once), built while the engine starts: built on a request's
        arrival, it would contend with that request's prefill."""
        if self._backend is not None or self.vllm_config.model_config.skip_tokenizer_init:
            return
        from vllm.tokenizers import cached_tokenizer_from_config
        from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

        model_config = self.vllm_config.model_config
        self._backend = XgrammarBackend(
            self.vllm_config, tokenizer=cached_tokenizer_from_config(model_config),
            vocab_size=model_config.get_vocab_size())

    def _compile(self, params: Any):
        from vllm_treespec.vllm_glue import versions

        self.load()
        if self._backend is None:
            raise RuntimeError("the engine has no tokenizer (skip_tokenizer_init)")
        return versions.compile_request_grammar(self._backend, params)

    def arrived(self, req_id: str, params: Any) -> None:
        """A new request: start compiling its grammar if it has one."""
        if getattr(params, "structured_outputs", None) is None or req_id in self.entries:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1,
                                            thread_name_prefix="treespec-grammar")
        self.entries[req_id] = _Entry(self._pool.submit(self._compile, params))

    def sampled(self, recent: SampledTail) -> None:
        """The step's sampled tokens, before vLLM's bookkeeping writes them."""
        self._recent = recent

    def _output(self, batch: Any, b: int) -> list[int]:
        """Batch row ``b``'s output so far, through this step's sampled tokens."""
        n = int(batch.num_tokens_no_spec[b])
        return (batch.token_ids_cpu[b, int(batch.num_prompt_tokens[b]):n].tolist()
                + self._recent.tail(b, n))

    def _matcher(self, req_id: str, batch: Any, b: int, root: int):
        """The request's matcher, advanced through its root, or None."""
        entry = self.entries.get(req_id)
        if entry is None or entry.failed or not entry.grammar.done():
            return None
        try:
            if entry.matcher is None:
                entry.matcher = entry.grammar.result().matcher
            output = self._output(batch, b)
            if not output or output[-1] != root or len(output) < entry.accepted:
                return None  # the table does not end at the root yet
            for token in output[entry.accepted:]:
                if not entry.matcher.accept_token(token):
                    raise ValueError(f"the grammar rejects emitted token {token}")
                entry.accepted += 1
        except Exception as err:  # noqa: BLE001 -- drafting must not fail the request
            entry.failed = True
            logger.warning("eagle3_tree: request %s drafts without its grammar from now "
                           "on (%s)", req_id, err)
            return None
        return None if entry.matcher.is_terminated() else entry.matcher

    def step_masks(self, batch: Any, rows: list[int], roots: list[int],
                   vocab_size: int, token_map: Any) -> DraftMasks | None:
        """The drafting step's masks for the batch ``rows`` (the builder's rows,
        in order; ``roots``: every batch row's new root), or None where no row
        drafts under a grammar."""
        req_ids = [batch.req_ids[b] for b in rows]
        if not any(r in self.entries for r in req_ids):
            return None
        matchers = [self._matcher(r, batch, b, roots[b]) for r, b in zip(req_ids, rows)]
        # Masked on every tensor-parallel rank or on none.
        unready = rank_agreement.any_rank_each([m is None for m in matchers])
        matchers = [None if u else m for m, u in zip(matchers, unready)]
        if all(m is None for m in matchers):
            return None
        return DraftMasks(matchers, vocab_size, token_map)

    def masked_step(self, step: Any, root_logprobs: Any, runner: Any, rows: list[int],
                    roots: Any, token_map: Any) -> Any:
        """The drafting ``step``'s root log-probabilities [len(rows), V'] masked
        where its structured rows draft under their grammars; the levels'
        masks go on ``step.draft_masks`` (``engine.levels.grow_levels``)."""
        if not self.entries:
            return root_logprobs
        step.draft_masks = self.step_masks(
            runner.input_batch, rows, roots.tolist(),
            runner.vllm_config.model_config.get_vocab_size(), token_map)
        if step.draft_masks is None:
            return root_logprobs
        return step.draft_masks.root(root_logprobs)

    def forget(self, req_ids) -> None:
        """Finished requests."""
        for r in req_ids:
            entry = self.entries.pop(r, None)
            if entry is not None:
                entry.grammar.cancel()

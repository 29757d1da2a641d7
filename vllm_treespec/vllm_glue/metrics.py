"""Tree speculation metrics collected in the worker.

Per verified tree: acceptance length (accepted drafts + bonus), accepted depth
(per-depth acceptance), tree size; per step: draft, verify forward, accept and
commit times. The counters' increments ride on each step's output to the
frontend (``stats_channel``; ``/metrics`` and the periodic log, see
``stat_logger``); without a frontend that reads them (offline ``LLM``) the
worker logs a summary itself every 10 s. Optional JSONL traces (``trace_dir``)
get one line per step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from vllm_treespec.observability import TraceWriter, trace_dir_from

logger = logging.getLogger("vllm.treespec")


@dataclasses.dataclass
class Totals:
    steps: int = 0
    chain_steps: int = 0      # verify steps whose trees were all chains (causal kernel)
    trees: int = 0
    nodes: int = 0
    emitted: int = 0          # accepted drafts + bonus tokens, over trees
    accepted_at_depth: list[int] = dataclasses.field(default_factory=list)
    draft_s: float = 0.0
    prepare_s: float = 0.0
    forward_s: float = 0.0
    accept_s: float = 0.0
    commit_s: float = 0.0
    draft_faults: int = 0     # drafting steps that raised and fell back to no drafts
    unmatched_trees: int = 0  # scheduled drafts that were not their proposed tree: chains
    placeholder_drafts: int = 0  # vLLM's -1 placeholder drafts, verified as token 0
    # Accepted drafts by source (copy branches on): nodes only copies proposed,
    # one from the request's own history; nodes only other requests' copies
    # proposed; nodes the drafter and a copy both proposed. The rest: the drafter's.
    copy_accepted: int = 0
    other_accepted: int = 0
    both_accepted: int = 0
    # Accepted tokens a structured request's grammar forced (grafted, not drafted).
    grammar_accepted: int = 0
    # Draft nodes whose children were drafted under their request's grammar
    # (``draft_grammars``).
    grammar_drafted: int = 0
    # The cross-request store (cross_request_tokens): lookups, those that found
    # a continuation, and the tokens it holds (a level, not a count).
    cross_request_lookups: int = 0
    cross_request_hits: int = 0
    cross_request_tokens: int = 0
    copy_history_mismatches: int = 0  # requests whose history did not end at their root
    # Steps without trees (speculation off, prefill): what a plain server pays,
    # beside the tree steps' stages (counted with the next tree step).
    plain_steps: int = 0
    plain_forward_s: float = 0.0
    plain_sample_s: float = 0.0

    def add_depths(self, counts: list[int]) -> None:
        if len(counts) > len(self.accepted_at_depth):
            self.accepted_at_depth += [0] * (len(counts) - len(self.accepted_at_depth))
        for d, c in enumerate(counts):
            self.accepted_at_depth[d] += c

    def summary(self) -> dict[str, Any]:
        return summarize(dataclasses.asdict(self))


def summarize(t: dict[str, Any]) -> dict[str, Any]:
    """Rates from raw counters (also used by the frontend on counter deltas)."""
    trees, steps = max(t["trees"], 1), max(t["steps"], 1)
    return {
        "steps": t["steps"], "chain_steps": t.get("chain_steps", 0), "trees": t["trees"],
        "draft_faults": t.get("draft_faults", 0),
        "unmatched_trees": t.get("unmatched_trees", 0),
        "placeholder_drafts": t.get("placeholder_drafts", 0),
        "copy_history_mismatches": t.get("copy_history_mismatches", 0),
        "copy_accepted": t.get("copy_accepted", 0),
        "other_accepted": t.get("other_accepted", 0),
        "both_accepted": t.get("both_accepted", 0),
        "grammar_accepted": t.get("grammar_accepted", 0),
        "grammar_drafted": t.get("grammar_drafted", 0),
        "cross_request_lookups": t.get("cross_request_lookups", 0),
        "cross_request_hit_rate": t.get("cross_request_hits", 0)
        / max(t.get("cross_request_lookups", 0), 1),
        "mean_accept_len": t["emitted"] / trees,
        "mean_tree_size": t["nodes"] / trees,
        "per_depth_acceptance": [c / trees for c in t["accepted_at_depth"]],
        "draft_ms_per_step": 1e3 * t["draft_s"] / steps,
        "prepare_ms_per_step": 1e3 * t.get("prepare_s", 0.0) / steps,
        "forward_ms_per_step": 1e3 * t["forward_s"] / steps,
        "accept_ms_per_step": 1e3 * t["accept_s"] / steps,
        "commit_ms_per_step": 1e3 * t["commit_s"] / steps,
        "plain_steps": t.get("plain_steps", 0),
        "plain_forward_ms_per_step": 1e3 * t.get("plain_forward_s", 0.0)
        / max(t.get("plain_steps", 0), 1),
        "plain_sample_ms_per_step": 1e3 * t.get("plain_sample_s", 0.0)
        / max(t.get("plain_steps", 0), 1),
    }


def difference(now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """Counter increments from ``before`` to ``now`` (lists element-wise; ``now``'s
    lists may be longer)."""
    return {k: ([c - (before[k][i] if i < len(before[k]) else 0) for i, c in enumerate(v)]
                if isinstance(v, list) else v - before[k]) for k, v in now.items()}


def format_summary(s: dict[str, Any]) -> str:
    copied = ("; accepted from copy branches %d, other requests' copies %d, drafter and "
              "copies both %d" % (s["copy_accepted"], s.get("other_accepted", 0),
                                  s["both_accepted"])
              if s.get("copy_accepted") or s.get("other_accepted") or s.get("both_accepted")
              else "") + ("; forced by grammars %d" % s["grammar_accepted"]
                          if s.get("grammar_accepted") else "") + (
        "; nodes drafted under grammars %d" % s["grammar_drafted"]
        if s.get("grammar_drafted") else "") + ("; cross-request lookups %d, hit rate %.2f" % (
                  s["cross_request_lookups"], s["cross_request_hit_rate"])
                  if s.get("cross_request_lookups") else "")
    return ("eagle3_tree: mean acceptance length %.2f, tree size %.1f, per-depth acceptance "
            "[%s]; per step: draft %.1f ms, prepare %.1f ms, verify forward %.1f ms, "
            "accept %.1f ms, commit %.1f ms" % (
                s["mean_accept_len"], s["mean_tree_size"],
                ", ".join(f"{x:.2f}" for x in s["per_depth_acceptance"]),
                s["draft_ms_per_step"], s["prepare_ms_per_step"], s["forward_ms_per_step"],
                s["accept_ms_per_step"], s["commit_ms_per_step"])) + copied + (
        "; %d steps without trees: forward %.1f ms, sampling %.1f ms" % (
            s["plain_steps"], s["plain_forward_ms_per_step"], s["plain_sample_ms_per_step"])
        if s.get("plain_steps") else "")


# Fallbacks that keep a step correct at a cost in speculation: counted (``/metrics``)
# and warned of the first time, so that a steady stream of them is seen.
FALLBACKS = {
    "unmatched_trees": "a request's scheduled drafts were not the tree proposed for it "
                       "(another tensor-parallel rank's, or none); verified as a chain",
    "placeholder_drafts": "vLLM scheduled -1 placeholder drafts (a request padded to the "
                          "batch's draft count); verified as a chain of token 0",
    "copy_history_mismatches": "a request's token history did not end at its new root "
                               "(copy branches); it got no copies this step",
}


class TreeMetrics:
    def __init__(self, trace: TraceWriter | None = None, to_frontend: bool = False,
                 log_interval_s: float | None = 10.0):
        self.total = Totals()
        self.window = Totals()
        self.trace = trace
        self.to_frontend = to_frontend
        self._sent = dataclasses.asdict(self.total)  # the totals as of the last payload
        # A frontend exports and logs the counters; log here only without one.
        self.log_interval_s = None if to_frontend else log_interval_s
        self._last_log = time.monotonic()
        self._pending: dict[str, Any] | None = None
        self._forward_s = 0.0
        self._plain = [0, 0.0, 0.0]  # steps without trees since the last tree step
        self._warned: set[str] = set()
        self._store_seen = (0, 0)  # the cross-request store's lookups, hits counted so far

    @classmethod
    def from_vllm_config(cls, vllm_config, tree_cfg) -> "TreeMetrics":
        trace = None
        directory = trace_dir_from(getattr(tree_cfg, "trace_dir", None))
        if directory:
            spec = vllm_config.speculative_config
            trace = TraceWriter(directory, {
                "model": vllm_config.model_config.model,
                "drafter": getattr(getattr(spec, "draft_model_config", None), "model", None),
                "tree_config": tree_cfg.to_dict(),
                "engine": {"dtype": str(vllm_config.model_config.dtype),
                           "max_model_len": vllm_config.model_config.max_model_len,
                           "max_num_seqs": vllm_config.scheduler_config.max_num_seqs,
                           "max_num_batched_tokens":
                               vllm_config.scheduler_config.max_num_batched_tokens,
                           "block_size": vllm_config.cache_config.block_size,
                           "device": str(vllm_config.device_config.device)}})
        # One sender (or logger) per engine: its first worker, whose step output
        # is the one the executor hands the scheduler (pipeline parallelism,
        # where the last stage's would be, is refused: support.check_engine).
        if vllm_config.parallel_config.rank != 0:
            return cls(trace=trace, log_interval_s=None)
        from vllm_treespec.vllm_glue.spec_config import frontend_takes_stats

        return cls(trace=trace, to_frontend=frontend_takes_stats(vllm_config))

    def take_payload(self) -> dict[str, Any] | None:
        """The counters' increments since the last payload and their totals, for
        the step's output (``stats_channel``); None if nothing changed or no
        frontend reads them."""
        if not self.to_frontend:
            return None
        total = dataclasses.asdict(self.total)
        if total == self._sent:
            return None
        delta = difference(total, self._sent)
        self._sent = total
        return {"delta": delta, "total": total}

    def _both(self):
        return (self.total, self.window)

    def on_forward(self, seconds: float, step) -> None:
        """execute_model wall time; its tree preparation is counted separately."""
        self._flush_trace()
        if step is not None:
            seconds = max(0.0, seconds - step.prepare_s)
        self._forward_s = seconds if step is not None else 0.0
        if step is not None:
            for t in self._both():
                t.forward_s += seconds
        else:
            self._plain[0] += 1
            self._plain[1] += seconds

    def on_plain_sample(self, seconds: float) -> None:
        """vLLM's sampler on a step without trees."""
        self._plain[2] += seconds

    def _add_plain_steps(self) -> None:
        """Steps without trees join the totals with the next tree step: a step
        whose totals change sends a payload to the frontend, and a plain server's
        step sends none (steps, forward seconds, sampling seconds)."""
        steps, forward_s, sample_s = self._plain
        if steps:
            for t in self._both():
                t.plain_steps += steps
                t.plain_forward_s += forward_s
                t.plain_sample_s += sample_s
        self._plain = [0, 0.0, 0.0]

    def on_verify(self, step, acc, accepted: list[int], accept_s: float, commit_s: float,
                  req_ids=None) -> None:
        """accepted: drafts accepted per tree (``Outcome.accepted``, already on the
        host: tensor reductions here would add a fraction of a millisecond to
        every step on a cache-cold CPU);
        req_ids: the trees' request ids, needed only while tracing."""
        tree = step.tree
        # accepted_at_depth[d]: trees that accepted at least d+1 drafts
        at_least = [sum(1 for x in accepted if x > d) for d in range(tree.max_depth)]
        chain = tree.is_chain
        self._add_plain_steps()
        for t in self._both():
            t.steps += 1
            t.chain_steps += chain
            t.trees += tree.batch_size
            t.nodes += int(tree.node_counts.sum())
            t.emitted += sum(accepted) + tree.batch_size
            t.add_depths(at_least)
            t.accept_s += accept_s
            t.commit_s += commit_s
            t.prepare_s += step.prepare_s
        if self.trace is not None:
            lists = tree.to_lists()
            paths, tokens = acc.path.tolist(), acc.tokens.tolist()
            prefix = step.prefix_len.tolist()
            probs = [[float(f"{p:.4g}") for p in ps] for ps in step.draft_probs or ()]
            self._pending = {
                "batch": step.num_reqs,
                "requests": [{"id": rid, "prefix_len": prefix[i], "nodes": len(lists[i]["token"]) - 1,
                              "tokens": lists[i]["token"], "parents": lists[i]["parent"],
                              "draft_probs": probs[i] if probs else None,
                              "accepted": accepted[i], "path": paths[i][: accepted[i] + 1],
                              "emitted": [x for x in tokens[i] if x >= 0]}
                             for i, rid in enumerate(req_ids)],
                "ms": {"prepare": round(1e3 * step.prepare_s, 3),
                       "forward": round(1e3 * self._forward_s, 3),
                       "accept": round(1e3 * accept_s, 3), "commit": round(1e3 * commit_s, 3)}}
        self._maybe_log()

    def on_copies(self, own: int, other: int, both: int) -> None:
        """Accepted drafts by source this step (``CopySource.observe``)."""
        for t in self._both():
            t.copy_accepted += own
            t.other_accepted += other
            t.both_accepted += both

    def on_grammar(self, trees, paths: list[list[int]]) -> None:
        """Accepted tokens a grammar forced this step: nodes on the accepted
        ``paths`` (node ids, the first accepted draft first) of ``trees``
        (``ProposedTree``) that the grammar grafted."""
        n = sum(sum(tree.forced[node - 1] for node in path)
                for tree, path in zip(trees, paths) if tree.forced)
        for t in self._both():
            t.grammar_accepted += n

    def on_grammar_drafts(self, nodes: int) -> None:
        """Nodes whose children a drafting step drafted under their grammar."""
        for t in self._both():
            t.grammar_drafted += nodes

    def on_cross_request(self, store) -> None:
        """The cross-request store's lookups and hits since the last call (its
        counters run from its start), and the tokens it holds now."""
        lookups, hits = store.lookups - self._store_seen[0], store.hits - self._store_seen[1]
        self._store_seen = (store.lookups, store.hits)
        for t in self._both():
            t.cross_request_lookups += lookups
            t.cross_request_hits += hits
        self.total.cross_request_tokens = store.tokens

    def on_draft_fault(self) -> None:
        for t in self._both():
            t.draft_faults += 1

    def on_fallback(self, key: str, count: int) -> None:
        """``count`` more of the fallback ``key`` (one of ``FALLBACKS``)."""
        if not count:
            return
        for t in self._both():
            setattr(t, key, getattr(t, key) + count)
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("eagle3_tree: %s (%d this step; counted as vllm_treespec:%s on "
                           "/metrics, not logged again)", FALLBACKS[key], count, key)

    def on_draft(self, seconds: float) -> None:
        for t in self._both():
            t.draft_s += seconds
        if self._pending is not None:
            self._pending["ms"]["draft"] = round(1e3 * seconds, 3)
        self._flush_trace()

    def _flush_trace(self) -> None:
        if self.trace is not None and self._pending is not None:
            self.trace.step(self._pending)
        self._pending = None

    def _maybe_log(self) -> None:
        if self.log_interval_s is None:
            return
        now = time.monotonic()
        if now - self._last_log < self.log_interval_s or not self.window.trees:
            return
        logger.info(format_summary(self.window.summary()))
        self.window = Totals()
        self._last_log = now

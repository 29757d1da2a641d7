"""Tree speculation metrics collected in the worker.

Counts per verified tree: acceptance length (accepted drafts + bonus), accepted
depth histogram (per-depth acceptance), tree size, and per-step stage times
(draft, verify forward, accept, commit). Logged periodically with vLLM's logger;
see ``vllm_treespec.observability`` for traces and the Prometheus export.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

logger = logging.getLogger("vllm_treespec")


@dataclasses.dataclass
class Totals:
    steps: int = 0
    trees: int = 0
    nodes: int = 0
    emitted: int = 0          # accepted drafts + bonus tokens, over trees
    accepted_at_depth: list[int] = dataclasses.field(default_factory=list)
    draft_s: float = 0.0
    forward_s: float = 0.0
    accept_s: float = 0.0
    commit_s: float = 0.0

    def add_depths(self, counts: list[int]) -> None:
        if len(counts) > len(self.accepted_at_depth):
            self.accepted_at_depth += [0] * (len(counts) - len(self.accepted_at_depth))
        for d, c in enumerate(counts):
            self.accepted_at_depth[d] += c

    def summary(self) -> dict:
        trees = max(self.trees, 1)
        return {
            "steps": self.steps, "trees": self.trees,
            "mean_accept_len": self.emitted / trees,
            "mean_tree_size": self.nodes / trees,
            "per_depth_acceptance": [c / trees for c in self.accepted_at_depth],
            "draft_ms_per_step": 1e3 * self.draft_s / max(self.steps, 1),
            "forward_ms_per_step": 1e3 * self.forward_s / max(self.steps, 1),
            "accept_ms_per_step": 1e3 * self.accept_s / max(self.steps, 1),
            "commit_ms_per_step": 1e3 * self.commit_s / max(self.steps, 1),
        }


class TreeMetrics:
    def __init__(self, log_interval_s: float = 10.0):
        self.total = Totals()
        self.window = Totals()
        self.log_interval_s = log_interval_s
        self._last_log = time.monotonic()
        self.on_step = []  # callbacks(step_record: dict) — traces

    @classmethod
    def from_vllm_config(cls, vllm_config, tree_cfg) -> "TreeMetrics":
        return cls()

    def on_forward(self, seconds: float, step) -> None:
        if step is not None:
            for t in (self.total, self.window):
                t.forward_s += seconds

    def on_verify(self, step, acc, accept_s: float, commit_s: float, req_ids) -> None:
        a = acc.num_accepted
        num_nodes = step.tree.num_nodes
        depth_hist = torch.bincount(a, minlength=step.tree.max_depth + 1).tolist()
        # accepted_at_depth[d] = trees that accepted at least d+1 drafts
        at_least = [sum(depth_hist[d + 1:]) for d in range(len(depth_hist) - 1)]
        for t in (self.total, self.window):
            t.steps += 1
            t.trees += step.tree.batch_size
            t.nodes += int(num_nodes.sum())
            t.emitted += int(a.sum()) + step.tree.batch_size
            t.add_depths(at_least)
            t.accept_s += accept_s
            t.commit_s += commit_s
        record = {"req_ids": req_ids, "num_nodes": num_nodes.tolist(),
                  "accepted": a.tolist(), "accept_ms": 1e3 * accept_s,
                  "commit_ms": 1e3 * commit_s}
        for cb in self.on_step:
            cb(record, step, acc)
        self.maybe_log()

    def on_draft(self, seconds: float) -> None:
        for t in (self.total, self.window):
            t.draft_s += seconds

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < self.log_interval_s or not self.window.trees:
            return
        s = self.window.summary()
        logger.info(
            "eagle3_tree: mean acceptance length %.2f, tree size %.1f, per-depth "
            "acceptance %s; per step: draft %.1f ms, verify forward %.1f ms, accept %.1f ms, "
            "commit %.1f ms",
            s["mean_accept_len"], s["mean_tree_size"],
            "[" + ", ".join(f"{x:.2f}" for x in s["per_depth_acceptance"]) + "]",
            s["draft_ms_per_step"], s["forward_ms_per_step"], s["accept_ms_per_step"],
            s["commit_ms_per_step"])
        self.window = Totals()
        self._last_log = now

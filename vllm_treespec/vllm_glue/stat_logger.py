"""Frontend export of tree metrics: Prometheus ``/metrics`` and the periodic log.

Each engine's worker publishes cumulative counters to its file in
``$VLLM_TREESPEC_STATS_DIR`` (``observability.stats_path``); this stat logger,
which vLLM loads through its ``vllm.stat_logger_plugins`` entry-point group
(one per engine, inert unless ``eagle3_tree`` is configured), turns them into
Prometheus series on every engine step and logs a summary at vLLM's log
interval. With several API servers (``--api-server-count``), the first one
exports and logs and the others stay inert: each would read the same files,
and Prometheus' multiprocess mode sums counters over processes. Since the
first API server hears of the engine only when it gets outputs (its own
requests', or the step's scheduler stats), it also re-reads the files at
vLLM's log interval, so its series are never staler than that. Series:

    vllm_treespec:trees_total, vllm_treespec:draft_nodes_total,
    vllm_treespec:emitted_tokens_total (accepted drafts + bonus),
    vllm_treespec:accepted_at_depth_total{depth}, vllm_treespec:stage_seconds_total{stage},
    vllm_treespec:draft_faults_total (drafting steps that raised; no drafts that step),
    vllm_treespec:mean_acceptance_length, vllm_treespec:mean_tree_size (since start)
"""

from __future__ import annotations

import logging

import prometheus_client
from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_treespec.observability import StatsFile, stats_path
from vllm_treespec.vllm_glue.metrics import format_summary, summarize

logger = logging.getLogger("vllm.treespec")
_METRICS: dict[str, object] = {}


def _metric(kind, name, doc, labels=()):
    # One set of series per process, whatever the number of loggers created.
    if name not in _METRICS:
        # Under Prometheus' multiprocess mode (several API servers) a gauge
        # would otherwise be exported once per process, labelled by pid.
        extra = {"multiprocess_mode": "mostrecent"} if kind is prometheus_client.Gauge else {}
        _METRICS[name] = kind(name, doc, list(labels), **extra)
    return _METRICS[name]


class TreeStatLogger(StatLoggerBase):
    def __init__(self, vllm_config, engine_index: int = 0):
        from vllm_treespec.vllm_glue.spec_config import tree_config_from_vllm

        # vLLM creates plugin loggers for every model it serves; only trees
        # export, and only from the first API server (see the module's docstring).
        api_rank = getattr(vllm_config.parallel_config, "_api_process_rank", 0)
        self.active = tree_config_from_vllm(vllm_config) is not None and api_rank <= 0
        self.path = stats_path(engine_index) if self.active else None
        self.engine_index = engine_index
        if not self.active:
            return
        self.model = vllm_config.model_config.served_model_name
        self._seen: dict | None = None
        self._stamp: tuple[int, int, int] | None = None
        self._logged: dict | None = None
        C, G = prometheus_client.Counter, prometheus_client.Gauge
        self.trees = _metric(C, "vllm_treespec:trees", "Verified draft trees")
        self.nodes = _metric(C, "vllm_treespec:draft_nodes", "Draft nodes verified")
        self.emitted = _metric(C, "vllm_treespec:emitted_tokens",
                               "Tokens emitted by tree steps (accepted drafts + bonus)")
        self.faults = _metric(C, "vllm_treespec:draft_faults",
                              "Drafting steps that raised and fell back to no drafts")
        self.at_depth = _metric(C, "vllm_treespec:accepted_at_depth",
                                "Trees that accepted at least `depth` draft tokens", ["depth"])
        self.stage = _metric(C, "vllm_treespec:stage_seconds",
                             "Time spent per stage of tree speculation", ["stage"])
        self.mean_len = _metric(G, "vllm_treespec:mean_acceptance_length",
                                "Mean acceptance length (accepted drafts + bonus) since start")
        self.mean_size = _metric(G, "vllm_treespec:mean_tree_size",
                                 "Mean draft tree size since start")

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        if self.active:
            self._refresh()

    def _refresh(self) -> None:
        # Called on every engine step, in the API server, which shares the CPU
        # with the engine: parse the worker's file only when it was rewritten
        # (at most 4 times a second), not on each of the ~30 steps a second.
        stamp = StatsFile.stamp(self.path)
        if stamp is None or stamp == self._stamp:
            return
        now = StatsFile.read(self.path)
        if now is None:
            return
        self._stamp = stamp
        if now == self._seen:
            return
        before = self._seen or {"trees": 0, "nodes": 0, "emitted": 0, "accepted_at_depth": [],
                                "draft_s": 0.0, "prepare_s": 0.0, "forward_s": 0.0,
                                "accept_s": 0.0, "commit_s": 0.0, "draft_faults": 0}
        if now["trees"] < before["trees"]:  # worker restarted
            before = {k: (0 if not isinstance(v, list) else []) for k, v in before.items()}
        self.trees.inc(now["trees"] - before["trees"])
        self.nodes.inc(now["nodes"] - before["nodes"])
        self.emitted.inc(now["emitted"] - before["emitted"])
        self.faults.inc(max(0, now.get("draft_faults", 0) - before.get("draft_faults", 0)))
        prev = before["accepted_at_depth"]
        for d, c in enumerate(now["accepted_at_depth"]):
            self.at_depth.labels(depth=str(d + 1)).inc(c - (prev[d] if d < len(prev) else 0))
        for stage, key in (("draft", "draft_s"), ("prepare", "prepare_s"),
                           ("verify_forward", "forward_s"),
                           ("accept", "accept_s"), ("commit", "commit_s")):
            self.stage.labels(stage=stage).inc(max(0.0, now.get(key, 0.0) - before.get(key, 0.0)))
        s = summarize(now)
        self.mean_len.set(s["mean_accept_len"])
        self.mean_size.set(s["mean_tree_size"])
        self._seen = now

    def log(self):
        if not self.active:
            return
        self._refresh()  # another API server may have had the last outputs
        now = self._seen
        if now is None:
            return
        base = self._logged
        if base is not None and now["trees"] == base["trees"]:
            return
        if base is None or now["trees"] < base["trees"]:
            window = now
        else:
            window = {k: (v - base[k] if not isinstance(v, list) else
                          [c - (base[k][i] if i < len(base[k]) else 0) for i, c in enumerate(v)])
                      for k, v in now.items()}
        logger.info(format_summary(summarize(window)))
        self._logged = now

    def log_engine_initialized(self):
        if self.active:
            logger.info("eagle3_tree: tree metrics exported as vllm_treespec:* on /metrics")

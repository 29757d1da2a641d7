"""Frontend export of tree metrics: Prometheus ``/metrics`` and the periodic log.

Each engine's first worker sends its counters' increments (and running totals)
with every step's output (``stats_channel``); this stat logger, which vLLM loads
through its ``vllm.stat_logger_plugins`` entry-point group (one per engine, inert
unless ``eagle3_tree`` is configured), takes them out of the step's scheduler
stats, adds the increments to Prometheus counters, sets the gauges from the
totals, and logs a summary at vLLM's log interval. With several API servers
(``--api-server-count``) each gets some steps' stats and adds what it gets:
Prometheus' multiprocess mode sums counters over the processes, so every tree is
counted once; the periodic log is off there, as vLLM's own is (each process
would see part of the steps). Series:

    vllm_treespec:trees_total, vllm_treespec:draft_nodes_total,
    vllm_treespec:emitted_tokens_total (accepted drafts + bonus),
    vllm_treespec:accepted_at_depth_total{depth}, vllm_treespec:stage_seconds_total{stage},
    vllm_treespec:draft_faults_total (drafting steps that raised; no drafts that step),
    vllm_treespec:KEY_total for each fallback KEY of ``metrics.FALLBACKS``:
        unmatched_trees (scheduled drafts not their proposed tree: chains),
        placeholder_drafts (vLLM's -1 placeholders, verified as token 0),
        copy_history_mismatches (histories not ending at their root: no copies),
    vllm_treespec:accepted_tokens_total{source} (accepted drafts by who proposed them:
        "drafter"; "copy", copies only, one from the request's own history;
        "other_requests", copies from other requests only (``cross_request_tokens``);
        "both", the drafter and a copy -- copy branches, ``copy_branches``;
        "grammar", tokens a structured request's grammar forced, ``grammar_trees``),
    vllm_treespec:cross_request_lookups_total, vllm_treespec:cross_request_hits_total
        (lookups in the cross-request store, those that found a continuation),
    vllm_treespec:cross_request_cached_tokens (tokens the store holds),
    vllm_treespec:mean_acceptance_length, vllm_treespec:mean_tree_size (since start)
"""

from __future__ import annotations

import logging

import prometheus_client
from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_treespec.vllm_glue import stats_channel
from vllm_treespec.vllm_glue.metrics import FALLBACKS, difference, format_summary, summarize

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

        # vLLM creates plugin loggers for every model it serves; only trees export.
        self.active = tree_config_from_vllm(vllm_config) is not None
        if not self.active:
            return
        api_servers = getattr(vllm_config.parallel_config, "_api_process_count", 1)
        self.logs = api_servers <= 1
        self._total: dict | None = None   # the engine's totals as of the last payload
        self._logged: dict | None = None
        C, G = prometheus_client.Counter, prometheus_client.Gauge
        # Labelled as vLLM labels its own series: one set per served model and engine.
        labels = {"model_name": str(vllm_config.model_config.served_model_name),
                  "engine": str(engine_index)}

        def series(kind, name, doc, extra=()):
            metric = _metric(kind, name, doc, (*labels, *extra))
            return metric if extra else metric.labels(**labels)

        self.labels = labels
        self.trees = series(C, "vllm_treespec:trees", "Verified draft trees")
        self.nodes = series(C, "vllm_treespec:draft_nodes", "Draft nodes verified")
        self.emitted = series(C, "vllm_treespec:emitted_tokens",
                              "Tokens emitted by tree steps (accepted drafts + bonus)")
        self.faults = series(C, "vllm_treespec:draft_faults",
                             "Drafting steps that raised and fell back to no drafts")
        # Every fallback the worker counts (and warns of once) has its series.
        self.fallbacks = {key: series(C, f"vllm_treespec:{key}", what[:1].upper() + what[1:])
                          for key, what in FALLBACKS.items()}
        self.at_depth = series(C, "vllm_treespec:accepted_at_depth",
                               "Trees that accepted at least `depth` draft tokens", ["depth"])
        self.stage = series(C, "vllm_treespec:stage_seconds",
                            "Time spent per stage of tree speculation", ["stage"])
        self.by_source = series(C, "vllm_treespec:accepted_tokens",
                                "Accepted draft tokens by the source that proposed them",
                                ["source"])
        self.lookups = series(C, "vllm_treespec:cross_request_lookups",
                              "Lookups in the cross-request store of finished outputs")
        self.hits = series(C, "vllm_treespec:cross_request_hits",
                           "Cross-request lookups that found a continuation")
        self.cached = series(G, "vllm_treespec:cross_request_cached_tokens",
                             "Tokens the cross-request store holds")
        self.mean_len = series(G, "vllm_treespec:mean_acceptance_length",
                               "Mean acceptance length (accepted drafts + bonus) since start")
        self.mean_size = series(G, "vllm_treespec:mean_tree_size",
                                "Mean draft tree size since start")

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        # Taken out whatever this logger's state: vLLM's loggers come next.
        payload = stats_channel.take(scheduler_stats)
        if payload is not None and self.active:
            self._add(payload["delta"], payload["total"])

    def _add(self, delta: dict, total: dict) -> None:
        self.trees.inc(delta["trees"])
        self.nodes.inc(delta["nodes"])
        self.emitted.inc(delta["emitted"])
        self.faults.inc(delta["draft_faults"])
        for key, counter in self.fallbacks.items():
            counter.inc(delta.get(key, 0))
        by_source = {"copy": delta.get("copy_accepted", 0),
                     "other_requests": delta.get("other_accepted", 0),
                     "both": delta.get("both_accepted", 0),
                     "grammar": delta.get("grammar_accepted", 0)}
        by_source["drafter"] = delta["emitted"] - delta["trees"] - sum(by_source.values())
        for source, n in by_source.items():
            self.by_source.labels(**self.labels, source=source).inc(max(n, 0))
        self.lookups.inc(delta.get("cross_request_lookups", 0))
        self.hits.inc(delta.get("cross_request_hits", 0))
        self.cached.set(total.get("cross_request_tokens", 0))
        for d, c in enumerate(delta["accepted_at_depth"]):
            self.at_depth.labels(**self.labels, depth=str(d + 1)).inc(c)
        for stage, key in (("draft", "draft_s"), ("prepare", "prepare_s"),
                           ("verify_forward", "forward_s"),
                           ("accept", "accept_s"), ("commit", "commit_s"),
                           ("plain_forward", "plain_forward_s"),
                           ("plain_sample", "plain_sample_s")):
            self.stage.labels(**self.labels, stage=stage).inc(max(0.0, delta[key]))
        trees = max(1, total["trees"])
        self.mean_len.set(total["emitted"] / trees)
        self.mean_size.set(total["nodes"] / trees)
        self._total = total

    def log(self):
        now = self._total if self.active and self.logs else None
        if now is None:
            return
        base = self._logged
        if base is not None and now["trees"] == base["trees"]:
            return
        # since the last summary, or since start if the engine restarted
        window = now if base is None or now["trees"] < base["trees"] else difference(now, base)
        logger.info(format_summary(summarize(window)))
        self._logged = now

    def log_engine_initialized(self):
        if self.active:
            logger.info("eagle3_tree: tree metrics exported as vllm_treespec:* on /metrics")

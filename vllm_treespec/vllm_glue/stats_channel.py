"""The tree counters' way from the worker to the frontend's stat logger, inside
vLLM's own step output: worker → ``ModelRunnerOutput`` → scheduler →
``SchedulerStats`` → stat loggers (one per API server and engine).

vLLM (0.27.1, 0.32.0) has one free-form field a worker fills and the frontend's stat
loggers receive: a KV connector's stats (``KVConnectorOutput.kv_connector_stats``;
the scheduler passes its ``data`` dict on as ``SchedulerStats.kv_connector_stats``
with the step's outputs). Tree mode refuses KV connectors (``support``), so the
field is ours, under one key. The tree stat logger takes that key out before
vLLM's own loggers see the dict: ``StatLoggerManager`` records the loggers a
caller passes and the plugin loggers before its logging and Prometheus
loggers, and the logging one asserts a configured connector for any non-empty
dict.

A payload holds the counters' increments since the worker's previous payload
and its running totals. A step's stats reach exactly one API server, so each
API server adds the increments it receives (Prometheus' multiprocess mode sums
them over API servers: every tree counted once) and sets its gauges from the
totals. Only a frontend that loads the plugin may receive payloads; the
engine's tree settings say whether it does (``spec_config``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

KEY = "vllm_treespec"


@dataclasses.dataclass
class TreeCounters(KVConnectorStats):
    """``data == {KEY: payload}``; only the tree stat logger reads it."""

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not self.data

    def reduce(self) -> dict[str, int | float]:
        return {}


def attach(output: Any, take_payload) -> Any:
    """``output`` carrying the payload ``take_payload()`` returns, if it is a step
    output (else the payload stays with the worker for a later step). A copy:
    vLLM hands out one shared empty output."""
    if not isinstance(output, ModelRunnerOutput):
        return output
    payload = take_payload()
    if payload is None:
        return output
    stats = TreeCounters(data={KEY: payload})
    kv = output.kv_connector_output
    kv = (KVConnectorOutput(kv_connector_stats=stats) if kv is None
          else dataclasses.replace(kv, kv_connector_stats=stats))
    return dataclasses.replace(output, kv_connector_output=kv)


def take(scheduler_stats: Any) -> dict[str, Any] | None:
    """Remove this step's tree payload from the scheduler stats and return it."""
    data = getattr(scheduler_stats, "kv_connector_stats", None)
    if not data or KEY not in data:
        return None
    payload = data.pop(KEY)
    if not data:
        scheduler_stats.kv_connector_stats = None
    return payload

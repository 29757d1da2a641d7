"""Tree counters from the worker to the frontend inside vLLM's step output
(``stats_channel``): increments sum to the worker's totals, every payload is
taken out before vLLM's own loggers see the stats, and only a frontend that
loads the tree stat logger gets payloads."""

import types

import pytest

from vllm_treespec.vllm_glue import stats_channel
from vllm_treespec.vllm_glue.metrics import TreeMetrics


def _step(metrics, trees, nodes, emitted, depths, draft_s=0.0):
    for t in (metrics.total, metrics.window):
        t.steps += 1
        t.trees += trees
        t.nodes += nodes
        t.emitted += emitted
        t.add_depths(depths)
        t.draft_s += draft_s


def test_payloads_carry_increments_that_sum_to_the_totals():
    metrics = TreeMetrics(to_frontend=True)
    assert metrics.take_payload() is None  # nothing happened yet
    _step(metrics, 2, 16, 5, [2, 1], draft_s=0.01)
    first = metrics.take_payload()
    assert first["delta"]["trees"] == 2 and first["delta"]["accepted_at_depth"] == [2, 1]
    assert metrics.take_payload() is None  # nothing new since
    _step(metrics, 3, 24, 9, [3, 2, 1])     # a deeper tree: the depth list grows
    second = metrics.take_payload()
    assert second["delta"]["accepted_at_depth"] == [3, 2, 1]
    summed = {k: first["delta"][k] + second["delta"][k] for k in ("trees", "nodes", "emitted")}
    assert summed == {k: second["total"][k] for k in summed} == {"trees": 5, "nodes": 40,
                                                                 "emitted": 14}
    assert second["total"]["accepted_at_depth"] == [5, 3, 1]


def test_no_payloads_without_a_frontend_that_reads_them():
    metrics = TreeMetrics(to_frontend=False)
    _step(metrics, 1, 8, 3, [1])
    assert metrics.take_payload() is None
    assert metrics.log_interval_s == 10.0  # the worker logs its own summary instead


def test_attach_copies_the_output_and_keeps_the_payload_when_there_is_no_output():
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    metrics = TreeMetrics(to_frontend=True)
    _step(metrics, 1, 8, 3, [1])
    assert stats_channel.attach(None, metrics.take_payload) is None
    out = stats_channel.attach(EMPTY_MODEL_RUNNER_OUTPUT, metrics.take_payload)
    assert EMPTY_MODEL_RUNNER_OUTPUT.kv_connector_output is None  # vLLM's shared one
    data = out.kv_connector_output.kv_connector_stats.data
    assert data[stats_channel.KEY]["delta"]["trees"] == 1  # not lost on the None output


def _scheduler_stats_from(payload):
    """The scheduler stats the frontend receives: vLLM's own scheduler-side
    conversion (``data``) and its msgpack round trip between processes."""
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    stats = SchedulerStats(kv_connector_stats=stats_channel.TreeCounters(
        data={stats_channel.KEY: payload}).data)
    return MsgpackDecoder(SchedulerStats).decode(MsgpackEncoder().encode(stats))


def test_take_removes_the_payload_before_vllms_loggers_see_it():
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    metrics = TreeMetrics(to_frontend=True)
    _step(metrics, 1, 8, 3, [1])
    payload = metrics.take_payload()
    stats = _scheduler_stats_from(payload)
    # Negative control: vLLM's logging logger fails on a payload left in place.
    with pytest.raises((AssertionError, AttributeError)):
        KVConnectorLogging(None).observe(stats.kv_connector_stats)
    assert stats_channel.take(stats) == payload
    assert stats.kv_connector_stats is None  # what vLLM's loggers check
    assert stats_channel.take(stats) is None
    other = types.SimpleNamespace(kv_connector_stats={"x": 1, stats_channel.KEY: payload})
    assert stats_channel.take(other) == payload and other.kv_connector_stats == {"x": 1}


def test_the_stat_logger_adds_each_payload_once():
    from prometheus_client import REGISTRY

    from vllm_treespec.config import TreeSpecConfig
    from vllm_treespec.vllm_glue.spec_config import ADDITIONAL_CONFIG_KEY
    from vllm_treespec.vllm_glue.stat_logger import TreeStatLogger

    config = types.SimpleNamespace(
        additional_config={ADDITIONAL_CONFIG_KEY: TreeSpecConfig().to_dict()},
        model_config=types.SimpleNamespace(served_model_name="m"),
        parallel_config=types.SimpleNamespace(_api_process_count=1))
    logger = TreeStatLogger(config, engine_index=1)
    labels = {"model_name": "m", "engine": "1"}

    def trees_total():
        return REGISTRY.get_sample_value("vllm_treespec:trees_total", labels) or 0.0

    before = trees_total()
    metrics = TreeMetrics(to_frontend=True)
    for trees in (2, 3):
        _step(metrics, trees, 8 * trees, 3 * trees, [trees])
        stats = _scheduler_stats_from(metrics.take_payload())
        logger.record(stats, None)
        assert stats.kv_connector_stats is None
        logger.record(stats, None)  # nothing left to add
    assert trees_total() - before == 5
    assert REGISTRY.get_sample_value("vllm_treespec:mean_acceptance_length", labels) == 3.0
    assert REGISTRY.get_sample_value("vllm_treespec:accepted_at_depth_total",
                                     dict(labels, depth="1")) == 5
    inert = TreeStatLogger(types.SimpleNamespace(additional_config={}))
    stats = _scheduler_stats_from({"delta": {}, "total": {}})
    inert.record(stats, None)  # another method's logger still takes the key out
    assert stats.kv_connector_stats is None and trees_total() - before == 5


def test_only_a_server_frontend_that_loads_the_plugin_gets_payloads(monkeypatch):
    from vllm import envs
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    from vllm_treespec.vllm_glue.spec_config import _frontend_loads_stat_logger

    monkeypatch.setattr(envs, "VLLM_PLUGINS", None, raising=False)
    assert _frontend_loads_stat_logger(AsyncEngineArgs(model="m"))
    assert not _frontend_loads_stat_logger(EngineArgs(model="m"))  # offline LLMEngine
    monkeypatch.setattr(envs, "VLLM_PLUGINS", ["other"], raising=False)
    assert not _frontend_loads_stat_logger(AsyncEngineArgs(model="m"))


def test_steps_without_trees_ride_with_the_next_tree_step():
    """A plain step's forward and sampler times are counted (what a plain
    server pays, beside the tree steps' stages), but a step without trees sends
    no payload by itself, as a plain server's step sends none."""
    from vllm_treespec.tree import TreeBatch

    metrics = TreeMetrics(to_frontend=True)
    for _ in range(3):
        metrics.on_forward(0.020, None)
        metrics.on_plain_sample(0.001)
        assert metrics.take_payload() is None
    tree = TreeBatch.from_parents([[5, 6, 7]], [[0, 0, 1]], tree_size=3, max_children=2)
    step = types.SimpleNamespace(tree=tree, prepare_s=0.0)
    metrics.on_verify(step, None, [1], 0.002, 0.001)
    delta = metrics.take_payload()["delta"]
    assert delta["plain_steps"] == 3 and delta["trees"] == 1
    assert delta["plain_forward_s"] == pytest.approx(0.060)
    assert delta["plain_sample_s"] == pytest.approx(0.003)

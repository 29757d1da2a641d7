"""Startup checks of the glue that keep a broken hook from serving silently."""

from __future__ import annotations

import dataclasses
import logging
import types

import numpy as np
import pytest
import torch

from vllm_treespec.config import TreeSpecConfigError
from vllm_treespec.vllm_glue import runner_class_swapped
from vllm_treespec.vllm_glue.verify_inputs import make_verify_step
from vllm_treespec.tree.proposed import ProposedTrees


class _StockRunner:
    pass


def _tree_class(base: type) -> type:
    return type("TreeRunner", (base,), {})


def _worker_module() -> types.ModuleType:
    module = types.ModuleType("fake_worker")
    module.StockRunner = _StockRunner
    return module


def test_a_worker_that_builds_its_runner_through_the_swapped_name_passes():
    module = _worker_module()

    class Worker:
        def init_device(self):
            self.model_runner = module.StockRunner()

    worker = Worker()
    with runner_class_swapped(module, "StockRunner", _tree_class, worker):
        worker.init_device()
    assert type(worker.model_runner).__name__ == "TreeRunner"
    assert module.StockRunner is _StockRunner  # restored


def test_a_worker_that_builds_its_runner_another_way_fails_startup():
    """It would have served stock eagle3 with k = num_nodes (the old swap did not
    look at what the worker built)."""
    module = _worker_module()

    class Worker:
        def init_device(self):
            self.model_runner = _StockRunner()  # not through module.StockRunner

    worker = Worker()
    with pytest.raises(TreeSpecConfigError, match=r"Worker.init_device built _StockRunner, not "
                                                  r"the tree runner.*fake_worker.StockRunner"):
        with runner_class_swapped(module, "StockRunner", _tree_class, worker):
            worker.init_device()
    assert module.StockRunner is _StockRunner


def test_a_worker_module_without_the_swapped_name_fails_startup_naming_it():
    module = types.ModuleType("fake_worker")
    with pytest.raises(TreeSpecConfigError, match=r"fake_worker.StockRunner is None, not the "
                                                  r"model runner class"):
        with runner_class_swapped(module, "StockRunner", _tree_class, object()):
            pass


def test_an_error_inside_init_device_is_not_masked_by_the_check():
    module = _worker_module()
    with pytest.raises(RuntimeError, match="out of memory"):
        with runner_class_swapped(module, "StockRunner", _tree_class, object()):
            raise RuntimeError("out of memory")
    assert module.StockRunner is _StockRunner


# --- the verify step's trees, as the runner builds them from vLLM's schedule ---

class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings():
    handler = _Warnings()
    log = logging.getLogger("vllm.treespec")
    log.addHandler(handler)
    yield handler.messages
    log.removeHandler(handler)


def _runner(rows: list[tuple[str, list[int], int, int]], proposed: dict, validate: bool = True,
            trace_dir=None):
    """A tree runner over one step's schedule: per batch row (request id, the
    chunk's tokens, tokens computed before it, the drafts at the chunk's end);
    ``proposed``: request id -> ProposedTree, what the drafter proposed."""
    from vllm_treespec.vllm_glue.metrics import TreeMetrics
    from vllm_treespec.vllm_glue.proposer import TreeEagleProposer
    from vllm_treespec.vllm_glue.runner import TreeRunnerMixin

    class Runner(TreeRunnerMixin):
        def __init__(self):  # the attributes make_verify_step reads, nothing of vLLM's
            pass

    runner = Runner()
    drafter = TreeEagleProposer.__new__(TreeEagleProposer)
    drafter.proposed, drafter.last_depth = ProposedTrees(proposed), 2
    lengths = [len(chunk) for _, chunk, _, _ in rows]
    runner.drafter, runner.device = drafter, torch.device("cpu")
    runner.input_batch = types.SimpleNamespace(
        num_reqs=len(rows), req_ids=[r for r, *_ in rows],
        req_id_to_index={r: i for i, (r, *_) in enumerate(rows)}, vocab_size=100,
        num_computed_tokens_cpu=np.array([c for _, _, c, _ in rows]))
    runner.query_start_loc = types.SimpleNamespace(np=np.cumsum([0] + lengths))
    runner.input_ids = types.SimpleNamespace(
        gpu=torch.tensor([t for _, chunk, _, _ in rows for t in chunk]))
    runner.positions = torch.tensor([c + j for _, chunk, c, _ in rows
                                     for j in range(len(chunk))])
    runner.tree_cfg = types.SimpleNamespace(max_children=2, validate_invariants=validate,
                                            trace_dir=trace_dir)
    runner.tree_metrics = TreeMetrics(log_interval_s=None)
    schedule = types.SimpleNamespace(scheduled_spec_decode_tokens={
        r: d for r, _, _, d in rows if d})
    spec_md = types.SimpleNamespace(num_draft_tokens=[len(d) for *_, d in rows])
    return runner, schedule, spec_md


def test_the_root_is_the_token_before_the_drafts_when_a_chunk_carries_more():
    """Request b's chunk holds two prompt tokens it had not computed, its root and
    two drafts (vLLM puts drafts at the end): the root is the chunk's third token,
    at position 12. The old runner took the chunk's first token (41) for the root,
    at position 10, and gave the drafts the wrong rotary positions."""
    from vllm_treespec.tree.proposed import ProposedTree

    branch = ProposedTree([21, 22], [0, 0], [0.5, 0.25])
    runner, schedule, spec_md = _runner(
        [("a", [7, 11, 12], 4, [11, 12]), ("b", [41, 42, 43, 21, 22], 10, [21, 22])],
        {"a": ProposedTree([11, 12], [0, 1], [0.5, 0.25]), "b": branch})
    step = make_verify_step(runner, schedule, spec_md)
    assert step.token_start.tolist() == [0, 5] and step.prefix_len.tolist() == [4, 12]
    assert step.tree.token[:, 0].tolist() == [7, 43]
    assert step.tree.parent[1].tolist() == [0, 0, 0]  # b's tree kept, not a chain
    # b's drafts sit at depth 1, both at position 13; its prompt rows keep theirs.
    assert runner.positions[3:8].tolist() == [10, 11, 12, 13, 13]


@pytest.mark.parametrize("validate", [False, True])
def test_a_tree_wider_than_max_children_never_collides_in_the_child_table(validate, tmp_path):
    """No builder makes one, but the oracle's trees do. The old runner built it on a
    two-column child table anyway (validation off), and the third child overwrote
    the second's column: acceptance at T > 0 never tried the second. Now the
    table is widened to hold it or, validating, the tree is dumped and verified
    as a chain."""
    from vllm_treespec.tree.proposed import ProposedTree

    runner, schedule, spec_md = _runner(
        [("a", [7, 11, 12, 13], 4, [11, 12, 13])],
        {"a": ProposedTree([11, 12, 13], [0, 0, 0], [0.3, 0.2, 0.1])},
        validate=validate, trace_dir=str(tmp_path))
    step = make_verify_step(runner, schedule, spec_md)
    dumps = list(tmp_path.glob("treespec-failure-*.json"))
    if validate:
        assert step.tree.parent.tolist() == [[0, 0, 1, 2]]
        (dump,) = dumps
        assert "node 0 has 3 children; allowed: at most max_children=2" in dump.read_text()
    else:
        assert step.tree.parent.tolist() == [[0, 0, 0, 0]] and not dumps
        assert step.tree.children[0, 0].tolist() == [1, 2, 3]


def test_drafts_verified_as_chains_are_counted_and_warned_of_once(warnings):
    """Placeholder (-1) drafts and drafts that are not the proposed tree used to
    become chains silently; now each is a counter and one warning."""
    from vllm_treespec.tree.proposed import ProposedTree

    rows = [("a", [7, 11, 12], 4, [11, 12]),       # proposed as a branch
            ("c", [8, -1, -1], 6, [-1, -1]),        # vLLM's placeholders
            ("d", [9, 30, 31], 3, [30, 31])]        # not what was proposed
    proposed = {"a": ProposedTree([11, 12], [0, 0], [0.5, 0.25]),
                "d": ProposedTree([30, 32], [0, 0], [0.5, 0.25])}
    runner, schedule, spec_md = _runner(rows, proposed)
    step = make_verify_step(runner, schedule, spec_md)
    assert step.tree.parent.tolist() == [[0, 0, 0], [0, 0, 1], [0, 0, 1]]
    assert step.tree.token[1].tolist() == [8, 0, 0] and runner.input_ids.gpu[4:6].tolist() == [0, 0]
    total = runner.tree_metrics.total
    assert (total.placeholder_drafts, total.unmatched_trees) == (2, 1)
    assert len(warnings) == 2 and "placeholder" in warnings[0] and "chain" in warnings[1]
    metrics = runner.tree_metrics
    runner, schedule, spec_md = _runner(rows, proposed)  # the next step, same counters
    runner.tree_metrics = metrics
    make_verify_step(runner, schedule, spec_md)
    assert (metrics.total.placeholder_drafts, metrics.total.unmatched_trees) == (4, 2)
    assert len(warnings) == 2  # once per kind


def test_the_stat_logger_exports_the_fallback_counters():
    pytest.importorskip("vllm")
    from vllm_treespec.vllm_glue import stat_logger
    from vllm_treespec.vllm_glue.metrics import FALLBACKS, Totals

    logger = stat_logger.TreeStatLogger.__new__(stat_logger.TreeStatLogger)
    counts = {}

    class Counter:
        def __init__(self, name):
            self.name = name

        def inc(self, n):
            counts[self.name] = counts.get(self.name, 0) + n

        def labels(self, **_):
            return self

        def set(self, _):
            pass

    for attr in ("trees", "nodes", "emitted", "faults", "at_depth", "stage", "mean_len",
                 "mean_size", "by_source", "lookups", "hits", "cached"):
        setattr(logger, attr, Counter(attr))
    logger.fallbacks = {key: Counter(key) for key in FALLBACKS}
    logger.labels = {}
    delta = dataclasses.asdict(Totals(trees=3, unmatched_trees=2, placeholder_drafts=5,
                                      copy_history_mismatches=7, emitted=13, copy_accepted=4,
                                      other_accepted=2, both_accepted=1,
                                      cross_request_lookups=6, cross_request_hits=3))
    logger._add(delta, delta)
    assert {k: counts[k] for k in FALLBACKS} == {
        "unmatched_trees": 2, "placeholder_drafts": 5, "copy_history_mismatches": 7}
    # accepted drafts by source: 13 emitted - 3 bonus = 10 = 3 drafter + 4 copy
    # + 2 other requests' + 1 both
    assert counts["by_source"] == 10
    assert (counts["lookups"], counts["hits"]) == (6, 3)


# --- drafting faults ---

def _failing_proposer(error: BaseException):
    from vllm_treespec.vllm_glue.draft_faults import DraftFaults
    from vllm_treespec.vllm_glue.hand_over import DraftHandOver
    from vllm_treespec.vllm_glue.metrics import TreeMetrics
    from vllm_treespec.vllm_glue.proposer import TreeEagleProposer

    proposer = TreeEagleProposer.__new__(TreeEagleProposer)
    proposer.faults, proposer.proposed, proposer.copies = DraftFaults(), {}, None
    proposer.hand_over = DraftHandOver(proposer)
    proposer.deferred = types.SimpleNamespace(forget=lambda req_ids: None)
    proposer.runner = types.SimpleNamespace(input_batch=types.SimpleNamespace(req_ids=["a", "b"]),
                                            tree_metrics=TreeMetrics(log_interval_s=None))

    def draft_trees(*args, **kwargs):
        raise error

    proposer._draft_trees = draft_trees
    return proposer


def test_a_drafting_error_costs_its_step_the_drafts(warnings):
    proposer = _failing_proposer(ValueError("a bad level"))
    assert proposer.propose() == [[], []]
    assert proposer.runner.tree_metrics.total.draft_faults == 1
    assert len(warnings) == 1 and "drafting failed" in warnings[0]


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CPU out of memory"),
                                   RuntimeError("CUDA error: an illegal memory access"),
                                   MemoryError()])
def test_out_of_memory_and_device_errors_are_not_drafted_around(error):
    """They used to become a step without drafts, on a device in an unknown state."""
    proposer = _failing_proposer(error)
    with pytest.raises(type(error)):
        proposer.propose()
    assert proposer.runner.tree_metrics.total.draft_faults == 0


def test_one_drafting_error_step_after_step_fails_the_engine():
    """It used to serve plain decoding at speculative cost for as long as it ran."""
    proposer = _failing_proposer(ValueError("a broken head"))
    steps = proposer.faults.PERSISTENT_STEPS
    for _ in range(steps - 1):
        assert proposer.propose() == [[], []]
    with pytest.raises(RuntimeError, match=rf"drafting failed {steps} steps running with the "
                                           rf"same error \(ValueError\('a broken head'\)\)"):
        proposer.propose()


def test_drafting_errors_that_come_and_go_are_served_around():
    from vllm_treespec.vllm_glue.draft_faults import DraftFaults

    faults = DraftFaults()
    for step in range(3 * faults.PERSISTENT_STEPS):
        if step % 10 == 9:
            faults.succeeded()  # a step that drafted
        else:
            faults.failed(ValueError("now and then"))
    for step in range(3 * faults.PERSISTENT_STEPS):
        faults.failed(ValueError(f"error {step % 2}"))  # not one error
    assert faults.count == 3 * faults.PERSISTENT_STEPS * 2 - 15


# --- the soak's injected invalid trees, outside the serving path ---

def test_the_soaks_invalid_trees_are_armed_only_by_the_worker_extension(monkeypatch, tmp_path):
    """The injector used to live in the proposer, read from the environment by
    every server; now only a worker that imports the soak's extension has it."""
    from vllm_treespec import observability, tree_fallback
    from vllm_treespec.bench import invalid_trees
    from vllm_treespec.tree import TreeBatch
    from vllm_treespec.vllm_glue import proposer as proposer_module

    assert not hasattr(observability, "InvalidTreeInjector")
    assert not hasattr(tree_fallback, "InvalidTreeInjector")
    assert "InvalidTreeInjector" not in vars(proposer_module)
    proposer = proposer_module.TreeEagleProposer.__new__(proposer_module.TreeEagleProposer)
    proposer.runner = types.SimpleNamespace(
        input_batch=types.SimpleNamespace(req_ids=["a", "b"], vocab_size=100))
    proposer.tree_cfg = types.SimpleNamespace(trace_dir=str(tmp_path))
    trees = TreeBatch.from_parents([[5], [5, 6, 7]], [[0], [0, 0, 1]], tree_size=3)

    def check():
        return proposer.checked_trees(trees, torch.tensor([3, 4])).node_counts.tolist()

    monkeypatch.setattr(proposer_module.TreeEagleProposer, "checked_trees",
                        proposer_module.TreeEagleProposer.checked_trees)  # restored after
    monkeypatch.delenv(invalid_trees.INVALID_TREE_ENV, raising=False)
    invalid_trees._arm()
    assert check() == [0, 2] and not list(tmp_path.glob("treespec-failure-*"))
    monkeypatch.setenv(invalid_trees.INVALID_TREE_ENV, "2")
    invalid_trees._arm()
    assert [check(), check()] == [[0, 2], [0, 0]]  # the 2nd batch: b's tree dumped, no drafts
    (dump,) = tmp_path.glob("treespec-failure-*.json")
    assert "token -1" in dump.read_text()

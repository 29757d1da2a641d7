"""collective_rpc targets that watch (or skew) the adaptive budget in a test engine."""

from __future__ import annotations

import types


def record_plans(worker) -> bool:
    """collective_rpc target: record, at every drafting decision of this rank's
    adaptive budget, the batch size, the depth it planned (0: speculation off),
    whether the step was a probe, and for a step that drafts, the decision's
    inputs (``decision_inputs``) (``recorded_plans``)."""
    runner = worker.model_runner
    policy = runner.adaptive_budget
    plans = runner._recorded_plans = []
    original = policy.plan_depth

    def plan_depth(batch):
        depth = original(batch)
        inputs = decision_inputs(policy, batch, depth) if depth else None
        plans.append((batch, depth, bool(policy.probing), inputs))
        return depth

    policy.plan_depth = plan_depth
    return True


def decision_inputs(policy, batch: int, depth: int) -> dict[str, float]:
    """What the budget priced drafting to ``depth`` from (``AdaptiveBudget.predicted_ratios``):
    t(B) and the verify step t(B(1 + n(d))), each with its sampling, the drafting
    cost (with any branching extra), the accepted drafts A(d) a request and the
    predicted ratio."""
    chain = policy.chain_mode
    n = depth if chain else min(float(policy.max_nodes), policy.nodes_at[depth - 1])
    accepted = policy.chain_accepted_at if chain else policy.accepted_at
    plain = policy.plain_cost(batch)
    verify = float(policy.verify_costs(batch, [batch * (1 + n)])[0])
    ratio = policy.predicted_ratio(batch, depth, chain=chain)
    gain = 1.0 + sum(accepted[:depth])
    return {"t_plain": plain, "t_verify": verify, "nodes": n, "accepted": gain - 1.0,
            "draft": gain * plain / ratio - verify if ratio else None, "ratio": ratio,
            "chain": chain}


def recorded_plans(worker) -> list[tuple[int, int, bool, dict | None]]:
    """collective_rpc target: (batch, planned depth, probe, decision inputs) per
    decision, as ``record_plans`` recorded them."""
    return list(getattr(worker.model_runner, "_recorded_plans", []))


def slow_clock(worker, rank: int, factor: float) -> bool:
    """collective_rpc target: on tensor-parallel ``rank``, every timing the tree
    runner, drafter and calibrations take runs ``factor`` times slow (as on a rank
    whose core is busy); every rank records its plans (``record_plans``)."""
    import time as real_time

    from vllm.distributed import get_tp_group

    from vllm_treespec.vllm_glue import calibration, cpu_linear, proposer, runner

    worker_rank = get_tp_group().rank_in_group
    if worker_rank == rank:
        start = real_time.perf_counter()
        clock = types.SimpleNamespace(
            perf_counter=lambda: start + factor * (real_time.perf_counter() - start),
            monotonic=real_time.monotonic, sleep=real_time.sleep, time=real_time.time)
        for module in (calibration, cpu_linear, proposer, runner):
            module.time = clock
    record_plans(worker)
    return worker_rank == rank

"""What a soak found: each server's run, its violations, and the report.

``check`` judges every server of a soak (``bench/soak.py``) against plain vLLM's
run: requests, quiet greedy answers, dumps, preemption, resident memory and
greedy answers under load; ``markdown`` writes the table of ``soak.md``.
"""

from __future__ import annotations

import dataclasses
import statistics

from vllm_treespec.bench.server import metric_sum
from vllm_treespec.bench.soak_mix import SoakRequest

# With --invalid-trees: the fixed tree again; every N-th validated batch gets an invalid tree.
FAULT_SERVER = "fixed-invalid"
RSS_GROWTH_LIMIT = 1.10
MISMATCH_P_VALUE = 0.01


def _pct(values: list[float], q: float) -> float | None:
    if len(values) < 2:
        return round(values[0] * 1e3, 1) if values else None
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1e3, 1)


def load_stats(results, wall_s: float) -> dict:
    ok = [r for r in results if r.expect == "ok" and not r.violation]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [(r.e2e_s - r.ttft_s) / (r.completion_tokens - 1)
            for r in ok if r.ttft_s is not None and r.completion_tokens > 1]
    tokens = sum(r.completion_tokens for r in results)
    return {"wall_s": round(wall_s, 1), "tok_s": round(tokens / wall_s, 1),
            "completion_tokens": tokens,
            "ttft_ms": {f"p{q}": _pct(ttft, q) for q in (50, 90, 99)},
            "tpot_ms": {f"p{q}": _pct(tpot, q) for q in (50, 90, 99)}}


@dataclasses.dataclass
class ServerRun:
    name: str
    quiet_before: list
    quiet_after: list
    loads: list  # one list of SoakResult per pass
    load_walls: list
    rss_by_process: list  # resident_bytes() after the warm-up, then after each load pass
    rss_end: int
    healthy_end: bool
    metrics: dict
    burst: list  # the preemption burst's results (soak_mix.preemption_burst)
    burst_preemptions: float | None  # preemptions during the burst (None: unread)
    dumps: int
    injected_dumps: int  # dumps of the --invalid-trees fault (its token -1)
    untimed: list = dataclasses.field(default_factory=list)  # results of the untimed requests

    @property
    def rss_warm(self) -> int:
        return sum(self.rss_by_process[0].values())

    @property
    def rss_passes(self) -> list[int]:
        return [sum(snapshot.values()) for snapshot in self.rss_by_process[1:]]


def memory_growth(run: ServerRun) -> list[float]:
    """Resident memory right after each load pass over its post-warm-up value."""
    return [rss / max(1, run.rss_warm) for rss in run.rss_passes]


def rss_growth_limit(plain_growth: float) -> float:
    """A tree server may grow 10 % of its baseline more than plain vLLM did."""
    return RSS_GROWTH_LIMIT + max(0.0, plain_growth - 1.0)


def greedy_mismatches(mix: list[SoakRequest], a, b) -> tuple[int, int]:
    """(differing, compared) greedy answers between two passes of the same mix."""
    pairs = [(x, y) for req, x, y in zip(mix, a, b)
             if req.greedy and x.expect == y.expect == "ok" and not x.violation
             and not y.violation]
    return sum(x.texts != y.texts for x, y in pairs), len(pairs)


def server_violations(name: str, run: ServerRun, plain: ServerRun,
                      allow_no_preemption: bool) -> list[str]:
    """A server's violations beyond its requests': health, dumps, faults,
    placeholders, preemption, and resident memory against plain vLLM's growth."""
    violations: list[str] = []
    if not run.healthy_end:
        violations.append(f"{name}: /health failed after the load")
    faulty = name == FAULT_SERVER
    unexpected = run.dumps - (run.injected_dumps if faulty else 0)
    if unexpected:
        violations.append(f"{name}: {unexpected} tree invariant dump(s) in the log")
    if faulty:
        if not run.injected_dumps:
            violations.append(f"{name}: invalid trees were injected, none was dumped")
        if metric_sum(run.metrics, "vllm_treespec:draft_faults_total"):
            violations.append(f"{name}: an injected invalid tree failed a whole drafting "
                              f"step instead of its request's drafts")
    placeholders = metric_sum(run.metrics, "vllm_treespec:placeholder_drafts_total")
    if placeholders:  # a tree engine's scheduler pads no joining request (scheduling)
        violations.append(f"{name}: {placeholders:.0f} placeholder drafts were verified")
    preemptions = metric_sum(run.metrics, "vllm:num_preemptions_total")
    if run.burst and run.burst_preemptions is None:
        violations.append(f"{name}: /metrics did not answer around the preemption burst")
    elif run.burst and not run.burst_preemptions:
        violations.append(f"{name}: the preemption burst preempted no request, against "
                          f"its construction (soak_mix.preemption_burst)")
    if not preemptions and not allow_no_preemption:
        violations.append(f"{name}: no request was preempted, so the soak did not "
                          f"exercise preemption (lower --kv-tokens)")
    growth = memory_growth(run)
    # judged after every pass both servers ran; plain vLLM runs at least as many
    limits = [rss_growth_limit(g) for g in memory_growth(plain)][:len(growth)]
    for i, (g, limit) in enumerate(zip(growth, limits)):
        if name != "plain" and g > limit:
            violations.append(f"{name}: resident memory grew {g:.2f}x after warm-up by the "
                              f"end of load pass {i + 1} (limit {limit:.2f}x: plain vLLM's "
                              f"growth by then + 10 %)")
    return violations


def check(runs: dict[str, ServerRun], mix: list[SoakRequest],
          allow_no_preemption: bool = False) -> tuple[dict, list[str]]:
    from scipy.stats import fisher_exact

    plain = runs["plain"]
    summary, violations = {}, []
    base_diff, base_n = greedy_mismatches(mix, plain.loads[0], plain.loads[1])
    for name, run in runs.items():
        bad = [(r.index, r.kind, r.violation)
               for load in [run.burst, run.untimed, *run.loads] for r in load
               if r.violation]
        violations += [f"{name}: request {i} ({kind}): {why}" for i, kind, why in bad]
        for label, quiet in (("before", run.quiet_before), ("after", run.quiet_after)):
            same = sum(q.texts == p.texts for q, p in zip(quiet, plain.quiet_before))
            if same != len(quiet):
                violations.append(f"{name}: quiet greedy subset {label} the load: "
                                  f"{len(quiet) - same} of {len(quiet)} differ from plain vLLM")
        violations += server_violations(name, run, plain, allow_no_preemption)
        growth = memory_growth(run)
        limits = [rss_growth_limit(g) for g in memory_growth(plain)][:len(growth)]
        placeholders = metric_sum(run.metrics, "vllm_treespec:placeholder_drafts_total")
        preemptions = metric_sum(run.metrics, "vllm:num_preemptions_total")
        entry = {
            "violations": len(bad),
            "requests": {k: sum(r.kind.split(":")[0] == k for r in run.loads[0])
                         for k in ("chat", "completion", "fallback", "abort", "invalid")},
            "aborted": sum(r.aborted for r in run.loads[0]),
            "untimed": len(run.untimed),
            "rss_mb": {"after_warmup": run.rss_warm >> 20,
                       "after_load": [rss >> 20 for rss in run.rss_passes],
                       "end": run.rss_end >> 20, "growth": [round(g, 3) for g in growth],
                       "by_process": [{k: v >> 20 for k, v in snapshot.items()}
                                      for snapshot in run.rss_by_process],
                       "limit": None if name == "plain" else [round(x, 3) for x in limits]},
            "preemptions": preemptions,
            "burst_preemptions": run.burst_preemptions,
            "trees": metric_sum(run.metrics, "vllm_treespec:trees_total"),
            "draft_faults": metric_sum(run.metrics, "vllm_treespec:draft_faults_total"),
            "placeholder_drafts": placeholders,
            "invariant_dumps": run.dumps,
            "load": [load_stats(load, wall) for load, wall in zip(run.loads, run.load_walls)],
        }
        if name != "plain":
            diff, n = greedy_mismatches(mix, plain.loads[0], run.loads[0])
            p = fisher_exact([[diff, n - diff], [base_diff, base_n - base_diff]],
                             alternative="greater").pvalue
            entry["greedy_under_load"] = {"differ_vs_plain": diff, "compared": n,
                                          "plain_vs_plain": base_diff, "plain_compared": base_n,
                                          "p_value": round(float(p), 4)}
            if p < MISMATCH_P_VALUE:
                violations.append(f"{name}: {diff}/{n} greedy answers under load differ from "
                                  f"plain, against {base_diff}/{base_n} plain vs plain (p={p:.4f})")
        # every violation of this server: its requests', memory, greedy under load
        entry["violations"] = sum(v.startswith(f"{name}: ") for v in violations)
        summary[name] = entry
    return summary, violations


def markdown(summary: dict, violations: list[str], args) -> str:
    lines = [f"# Soak: {args.requests} requests, concurrency {args.concurrency}, "
             f"KV cache {args.kv_tokens} tokens, seed {args.seed}", "",
             "| server | violations | preemptions | trees | placeholder drafts "
             "| RSS growth after each pass | tok/s (each pass) | TTFT p50/p99 ms "
             "| TPOT p50/p99 ms | greedy under load differ (plain vs plain) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        load = s["load"][0]
        g = s.get("greedy_under_load")
        greedy = (f"{g['differ_vs_plain']}/{g['compared']} ({g['plain_vs_plain']}/"
                  f"{g['plain_compared']}, p={g['p_value']})" if g else "–")
        rss = " / ".join(map(str, s["rss_mb"]["growth"]))
        limit = s["rss_mb"]["limit"]
        rss_limit = f" (<= {' / '.join(map(str, limit))})" if limit else ""
        tok_s = " / ".join(str(p["tok_s"]) for p in s["load"])
        lines.append(f"| {name} | {s['violations']} | {s['preemptions']:.0f} | {s['trees']:.0f} | "
                     f"{s['placeholder_drafts']:.0f} | "
                     f"{rss}{rss_limit} | {tok_s} | {load['ttft_ms']['p50']} / "
                     f"{load['ttft_ms']['p99']} | {load['tpot_ms']['p50']} / "
                     f"{load['tpot_ms']['p99']} | {greedy} |")
    plain = [p["tok_s"] for p in summary["plain"]["load"]] if "plain" in summary else []
    if plain:
        mean = sum(plain) / len(plain)
        untimed = summary["plain"]["untimed"]
        lines += ["", f"tok/s of the first pass against the mean of plain vLLM's passes (the "
                  f"{untimed} requests vLLM refuses under speculation sent apart, untimed): "
                  + ", ".join(
            f"{name} {s['load'][0]['tok_s'] / mean:.3f}x" for name, s in summary.items()
            if name != "plain")]
    lines += ["", f"**{'PASS' if not violations else 'FAIL'}**: {len(violations)} violation(s)"]
    lines += [f"- {v}" for v in violations[:50]]
    return "\n".join(lines) + "\n"

"""Summary statistics, plots and the markdown report of a benchmark run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from vllm_treespec.bench.server import metric_sum


def pct(values, q) -> float | None:
    v = [x for x in values if x is not None]
    return float(np.percentile(v, q)) if v else None


def mean(values) -> float | None:
    v = [x for x in values if x is not None]
    return float(np.mean(v)) if v else None


def _series(metrics: dict, name: str, label: str) -> list[str]:
    """Keys of ``name``'s samples that carry ``label`` (whatever other labels they have)."""
    return [k for k in metrics if k.startswith(name + "{") and label in k]


def _series_delta(before: dict, after: dict, name: str, label: str) -> float:
    """How much ``name``'s samples that carry ``label`` grew between two scrapes."""
    return sum(after[k] - before.get(k, 0.0) for k in _series(after, name, label))


def per_depth(before: dict, after: dict) -> tuple[list[float], float | None]:
    """(per-depth acceptance, mean tree size) between two /metrics scrapes."""
    d = lambda name: metric_sum(after, name) - metric_sum(before, name)  # noqa: E731
    trees = d("vllm_treespec:trees_total")
    if trees > 0:
        rates, depth = [], 1
        while True:
            name, label = "vllm_treespec:accepted_at_depth_total", f'depth="{depth}"'
            if not _series(after, name, label):
                break
            rates.append(_series_delta(before, after, name, label) / trees)
            depth += 1
        return rates, d("vllm_treespec:draft_nodes_total") / trees
    drafts = d("vllm:spec_decode_num_drafts_total")
    if drafts > 0:
        rates, pos = [], 0
        while True:
            name, label = "vllm:spec_decode_num_accepted_tokens_per_pos_total", f'position="{pos}"'
            if not _series(after, name, label):
                break
            rates.append(_series_delta(before, after, name, label) / drafts)
            pos += 1
        tokens = d("vllm:spec_decode_num_draft_tokens_total")
        return rates, tokens / drafts
    return [], None


SOURCES = ("drafter", "copy", "other_requests", "both")


def accepted_by_source(before: dict, after: dict) -> dict[str, float]:
    """Accepted drafts by source between two /metrics scrapes (observability's
    ``accepted_tokens_total``), and the cross-request store's lookups and hits."""
    out = {src: _series_delta(before, after, "vllm_treespec:accepted_tokens_total",
                              f'source="{src}"') for src in SOURCES}
    for key in ("cross_request_lookups", "cross_request_hits"):
        name = f"vllm_treespec:{key}_total"
        out[key] = metric_sum(after, name) - metric_sum(before, name)
    return out


STAGES = ("draft", "prepare", "verify_forward", "accept", "commit")


def stage_breakdown(before: dict, after: dict, output_tokens: int) -> dict | None:
    """Where a tree step's time goes (EAGLE-Pangu Fig. 5): seconds per stage
    between two /metrics scrapes, each stage's share of their sum, and ms per
    output token. ``overhead_share`` is the tree bookkeeping alone (prepare +
    accept + commit): everything but the drafter's and the target's forwards."""
    secs = {stage: _series_delta(before, after, "vllm_treespec:stage_seconds_total",
                                 f'stage="{stage}"') for stage in STAGES}
    total = sum(secs.values())
    if total <= 0:
        return None
    return {"seconds": secs,
            "share": {k: v / total for k, v in secs.items()},
            "ms_per_output_token": {k: 1e3 * v / max(1, output_tokens) for k, v in secs.items()},
            "overhead_share": (secs["prepare"] + secs["accept"] + secs["commit"]) / total}


def method_summary(results, none_by_turn: dict | None, metrics_window) -> dict:
    tok_s = [r.tok_s for r in results]
    out = {
        "turns": len(results),
        "output_tokens": int(sum(r.output_tokens for r in results)),
        "tok_s_mean": mean(tok_s), "tok_s_p50": pct(tok_s, 50), "tok_s_p90": pct(tok_s, 90),
        "tok_s_p99": pct(tok_s, 99),
        "ttft_ms_mean": 1e3 * mean([r.ttft_s for r in results]),
        "tpot_ms_mean": 1e3 * mean([r.tpot_s for r in results]),
    }
    accept = [r.accept_len for r in results]
    if any(a is not None for a in accept):
        out.update(accept_len_mean=mean(accept), accept_len_p50=pct(accept, 50),
                   accept_len_p90=pct(accept, 90))
    if none_by_turn:
        ratios = [r.tok_s / none_by_turn[r.turn_id].tok_s for r in results
                  if r.turn_id in none_by_turn and none_by_turn[r.turn_id].tok_s > 0]
        out.update(speedup_mean=mean(ratios), speedup_p50=pct(ratios, 50),
                   speedup_p90=pct(ratios, 90), speedup_p99=pct(ratios, 99),
                   speedup_of_means=(out["tok_s_mean"] / mean([none_by_turn[r.turn_id].tok_s
                                                               for r in results
                                                               if r.turn_id in none_by_turn]))
                   if results else None)
    if metrics_window is not None:
        depth, size = per_depth(*metrics_window)
        out["per_depth_acceptance"] = depth
        out["mean_tree_size"] = size
        stages = stage_breakdown(*metrics_window, out["output_tokens"])
        if stages is not None:
            out["stages"] = stages
    return out


def plots(summary: dict, results: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    methods = list(summary["methods"])
    none = {r.turn_id: r for r in results.get(methods[0], [])} if methods else {}

    fig, ax = plt.subplots(figsize=(7, 4))
    for m in methods[1:]:
        ratios = [r.tok_s / none[r.turn_id].tok_s for r in results[m] if r.turn_id in none]
        if ratios:
            ax.hist(ratios, bins=30, alpha=0.5, label=m)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel(f"per-turn speedup vs {methods[0]}")
    ax.set_ylabel("turns")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "speedup_distribution.png", dpi=120)
    plt.close(fig)
    made.append("speedup_distribution.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for m in methods:
        acc = [r.accept_len for r in results[m] if r.accept_len is not None]
        if acc:
            ax.hist(acc, bins=30, alpha=0.5, label=m)
    ax.set_xlabel("acceptance length per turn (accepted drafts + bonus, per step)")
    ax.set_ylabel("turns")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "accept_len_hist.png", dpi=120)
    plt.close(fig)
    made.append("accept_len_hist.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for m in methods:
        depth = summary["methods"][m].get("c1", {}).get("per_depth_acceptance") or []
        if depth:
            ax.plot(range(1, len(depth) + 1), depth, marker="o", label=m)
    ax.set_xlabel("depth")
    ax.set_ylabel("fraction of steps accepting at least this many drafts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "per_depth_acceptance.png", dpi=120)
    plt.close(fig)
    made.append("per_depth_acceptance.png")

    conc = summary.get("concurrency", [1])
    if len(conc) > 1:
        fig, ax = plt.subplots(figsize=(7, 4))
        for m in methods:
            ys = [summary["methods"][m].get(f"c{c}", {}).get("throughput_tok_s") for c in conc]
            ax.plot(conc, ys, marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("output tokens / s (aggregate)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "throughput_vs_concurrency.png", dpi=120)
        plt.close(fig)
        made.append("throughput_vs_concurrency.png")
    return made


def markdown(summary: dict) -> str:
    lines = [f"# {summary['suite']} — {summary['turns']} turns, max_tokens "
             f"{summary['max_tokens']}, temperature {summary['temperature']}", ""]
    lines += ["| method | tok/s mean | p50 | p90 | speedup mean | p50 | p90 | p99 | "
              "accept len mean | p90 | tree size | TTFT ms | TPOT ms |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda x, d=2: "–" if x is None else f"{x:.{d}f}"  # noqa: E731
    for m, s in summary["methods"].items():
        c1 = s.get("c1", {})
        lines.append(
            f"| {m} | {f(c1.get('tok_s_mean'))} | {f(c1.get('tok_s_p50'))} | "
            f"{f(c1.get('tok_s_p90'))} | {f(c1.get('speedup_mean'))} | "
            f"{f(c1.get('speedup_p50'))} | {f(c1.get('speedup_p90'))} | "
            f"{f(c1.get('speedup_p99'))} | {f(c1.get('accept_len_mean'))} | "
            f"{f(c1.get('accept_len_p90'))} | {f(c1.get('mean_tree_size'), 1)} | "
            f"{f(c1.get('ttft_ms_mean'), 0)} | {f(c1.get('tpot_ms_mean'), 1)} |")
    conc = summary.get("concurrency", [1])
    if len(conc) > 1:
        lines += ["", "Aggregate throughput (output tok/s) by concurrency:", "",
                  "| method | " + " | ".join(f"c={c}" for c in conc) + " |",
                  "|---|" + "---|" * len(conc)]
        for m, s in summary["methods"].items():
            lines.append(f"| {m} | " + " | ".join(
                f(s.get(f"c{c}", {}).get("throughput_tok_s"), 1) for c in conc) + " |")
    lines += ["", "Per-depth acceptance (c=1):", ""]
    for m, s in summary["methods"].items():
        depth = s.get("c1", {}).get("per_depth_acceptance")
        if depth:
            lines.append(f"- {m}: " + ", ".join(f"{x:.2f}" for x in depth))
    staged = [(m, s["c1"]["stages"]) for m, s in summary["methods"].items()
              if s.get("c1", {}).get("stages")]
    if staged:
        lines += ["", "Where a tree step's time goes (c=1; share of the step, ms per output token):",
                  "", "| method | " + " | ".join(STAGES) + " | bookkeeping share |",
                  "|---|" + "---|" * (len(STAGES) + 1)]
        for m, st in staged:
            lines.append(f"| {m} | " + " | ".join(
                f"{100 * st['share'][k]:.1f}% ({st['ms_per_output_token'][k]:.2f})" for k in STAGES)
                + f" | {100 * st['overhead_share']:.1f}% |")
    lines += ["", f"Command: `{summary['command']}`", ""]
    return "\n".join(lines)


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=1))

"""Speed of several methods as served, with every server alive at once.

Why: ``vllm-treespec bench`` serves one method after another, and on these
shared machines a server run drifts by 10 % and more against the next one, so
a single served run cannot resolve the differences between speculative methods.
Here one ``vllm-treespec serve`` per method starts first, then each turn is sent
to every server in turn (one request at a time, streaming, greedy unless
``--temperature``): slow drift of the machine hits all methods alike, while
each measurement still includes everything a served request pays (API server,
engine core, worker). Each turn (or round) starts with the next server in turn, so
no method always follows the same one. With
``--concurrency N`` the turns go in rounds of N concurrent requests, each round
to every server in turn (servers get ``--max-num-seqs N``); tok/s is then the
output tokens of the rounds over their wall time, and the per-turn ratios below
are per round. Every server meets every prompt once, so none of them reuses a
cached prefix of another's.

    python -m vllm_treespec.bench.served_ab --methods none,eagle3:k=2,eagle3_tree --turns 16 \
        --out DIR
    python -m vllm_treespec.bench.served_ab --methods none,eagle3_tree --turns 48 --max-tokens 128 \
        --concurrency 16 --out DIR
    python -m vllm_treespec.bench.served_ab --tp 2 --methods none,eagle3:k=2,eagle3_tree --out DIR
    python -m vllm_treespec.bench.served_ab --suite code_edit --methods none,ngram:k=4,eagle3_tree,\
        eagle3_tree:copy_branches=2 --out DIR

Methods take ``vllm-treespec bench``'s syntax (``eagle3_tree:num_nodes=4,depth=1``,
``ngram:k=4`` for vLLM's prompt lookup). ``METHOD@DIR`` serves METHOD with the code of
another checkout DIR (``git worktree add DIR COMMIT``), e.g. ``--methods
none,eagle3_tree@/work/old,eagle3_tree`` for two commits side by side: that server
starts in DIR with DIR first on ``PYTHONPATH``, so it imports DIR's ``vllm_treespec``
(``python -m`` puts the working directory first on ``sys.path``); DIR/vllm_treespec's
``__pycache__`` then shows what the server loaded, and the JSON records each server's
``code_dir``.
Each server gets a 1 GiB KV cache by default (``VLLM_CPU_KVCACHE_SPACE``) and
holds ~4 GB as started (the worker ~2.8), so that four of them fit in 24 GB; a set
that would not fit is refused once the first server is up. Writes
DIR/served_ab.json and prints a markdown table: tok/s over all turns, its ratio
to the first method, the per-turn ratio (mean and p10/p90), TPOT, the
acceptance length from each server's /metrics, and how many turns returned the
first method's text (greedy: all, for a lossless method on a batch-invariant
machine). For ``eagle3_tree`` servers a second table gives what a tree step
costs: decode milliseconds per step (at concurrency 1: each turn's time after its
first token, over the trees verified; with ``adaptive=false`` every decode step
is a tree step), the drafting and verify-forward stages per tree from the
server's ``stage_seconds`` counters, and the per-depth acceptance. Two fixed
trees of one shape (same nodes, same depth) verify the same rows, so the ratio of
their step costs is the speed ratio they would have at equal acceptance.

``--suite structured_output`` (``bench/structured_suite.py``) gives every turn its own
constraint (JSON schemas of three sizes, JSON mode, tool calls, regex, choice, an
SQL grammar); a third table counts, per method and kind, the answers valid under
their constraint (one cut by ``--max-tokens`` as truncated), those identical to the
first method's, and the grammar-forced share of accepted tokens where a server
counts forced tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path


SUITES = ("pangu240", "code_edit", "long_file_edit", "mtbench2", "creative", "structured",
          "code_workflow", "repeated_asks", "structured_output")


def suite_turns(suite: str, n: int) -> list:
    """The first ``n`` turns of a suite (second MT-Bench turns still unresolved)."""
    from vllm_treespec.bench import code_edits, pangu240, repetitive, structured_suite

    if suite == structured_suite.SUITE:
        return structured_suite.build(n)[0]
    if suite in repetitive.SUITES:
        return repetitive.SUITES[suite](n)
    if suite == "code_edit":
        return code_edits.code_edit_turns(n)
    if suite == "long_file_edit":
        return code_edits.long_file_edit_turns(n)
    if suite == "mtbench2":
        return [t for t in pangu240.build_turns() if t.depends_on is not None][:n]
    if suite == "creative":
        return pangu240.mtbench_first_turns(("writing", "roleplay"), n)
    return pangu240.first_turns(n)


def rotated(labels: list[str], i: int) -> list[str]:
    """The servers' order in round ``i``: each starts one round in turn. A server
    runs a little faster or slower by where it sits in a round (the one before it
    may still be winding down), and that must fall on every method alike."""
    k = i % len(labels)
    return labels[k:] + labels[:k]


def split_code_dir(method: str) -> tuple[str, str | None]:
    """'eagle3_tree:depth=4@/work/old' -> ('eagle3_tree:depth=4', '/work/old'): the
    method and the checkout whose code serves it (None: this one's)."""
    spec, at, where = method.partition("@")
    if not at:
        return method, None
    code = Path(where).expanduser().resolve()
    if not (code / "vllm_treespec" / "__init__.py").is_file():
        raise SystemExit(f"--methods {method}: {code} is no checkout of vllm-treespec "
                         f"(no vllm_treespec/__init__.py)")
    return spec, str(code)


def server_env(env: dict, code_dir: str | None) -> dict:
    """A server's environment: ``env``, with ``code_dir`` first on PYTHONPATH."""
    if code_dir is None:
        return env
    path = os.environ.get("PYTHONPATH")
    return {**env, "PYTHONPATH": code_dir + (os.pathsep + path if path else "")}


def check_memory(first, count: int) -> None:
    """Refuse, before starting the others, a set of servers that would not fit in
    memory: the kernel's OOM killer otherwise takes one of them mid-run (seven did
    not fit in 24 GB). Each is assumed to need what the first holds once started,
    and 25 % more while it serves (tree steps, allocator caches)."""
    import psutil

    from vllm_treespec.bench.soak import resident_bytes

    per = sum(resident_bytes(first.proc.pid).values())  # every process of the server
    available = psutil.virtual_memory().available
    fit = int((available + per) // (1.25 * per))
    if fit < count:
        raise SystemExit(
            f"--methods: {count} servers would not fit in memory: the first holds "
            f"{per / 2**30:.1f} GiB as started (+25 % while serving) and "
            f"{available / 2**30:.1f} GiB is left; pass at most {fit} methods at once")


def main(argv: list[str] | None = None) -> int:
    from vllm_treespec.assets import ensure_assets, ensure_tp_pair
    from vllm_treespec.bench import slug, pangu240, parse_method, split_methods, \
        structured_suite
    from vllm_treespec.bench.driver import Driver, accept_len_between, spec_counters
    from vllm_treespec.bench.report import (
        accepted_by_source, mean, pct, per_depth, stage_breakdown)
    from vllm_treespec.bench.server import Server

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="none,eagle3:k=2,eagle3_tree")
    p.add_argument("--suite", default="pangu240", choices=SUITES,
                   help="pangu240: its first turns; code_edit, long_file_edit: "
                        "bench/code_edits.py; mtbench2: "
                        "MT-Bench second turns, after the first method's own first answers; "
                        "creative: MT-Bench's writing and roleplay first turns; structured, "
                        "code_workflow, repeated_asks: bench/repetitive.py; "
                        "structured_output: bench/structured_suite.py, each turn with "
                        "its own constraint")
    p.add_argument("--turns", type=int, default=16, help="turns of the suite")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--eagle3-k", type=int, default=3)
    p.add_argument("--tree", default=None, help="JSON of eagle3_tree settings")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling for every request (default: not sent)")
    p.add_argument("--request-kinds", default=None,
                   help="JSON list of objects: turn i's request also carries the fields of "
                        "object i mod len (e.g. a response_format, bad_words, min_tokens)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="requests in flight per server (rounds of this many turns)")
    p.add_argument("--serve-args", default=None,
                   help="default: --dtype float32 --max-model-len 4096 (8192 for "
                        "long_file_edit) --seed 0 --max-num-seqs CONCURRENCY; "
                        "structured_output adds --enable-auto-tool-choice --tool-call-parser "
                        "pythonic (a parser that takes any tokenizer)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size: serves the head-padded pair (`vllm-treespec "
                        "assets --tp N`) with --tensor-parallel-size N, one core a rank")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.concurrency < 1:
        p.error(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.serve_args is None:  # long files: ~6500-token prompts, the target's 8192 context
        max_len = 8192 if args.suite == "long_file_edit" else 4096
        args.serve_args = (f"--dtype float32 --max-model-len {max_len} --seed 0 "
                           f"--max-num-seqs {args.concurrency}")
        if args.suite == "structured_output":  # named/"required" tool choices need a parser
            args.serve_args += " --enable-auto-tool-choice --tool-call-parser pythonic"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    assets = ensure_assets()
    args.model, args.drafter = str(assets.target), str(assets.drafter)
    bind = f"0-{(os.cpu_count() or 1) - 1}"
    if args.tp > 1:
        args.model, args.drafter = map(str, ensure_tp_pair(multiple=args.tp))
        args.serve_args += f" --tensor-parallel-size {args.tp}"
        bind = "|".join(str(i % (os.cpu_count() or 1)) for i in range(args.tp))
    code_dirs = {m: split_code_dir(m) for m in split_methods(args.methods)}
    methods = [(m, parse_method(spec, args)[1]) for m, (spec, _) in code_dirs.items()]
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", bind)}
    turns = suite_turns(args.suite, args.turns)
    log = lambda msg: print(f"[served_ab] {msg}", file=sys.stderr, flush=True)  # noqa: E731

    servers: dict[str, Server] = {}
    try:
        for label, spec in methods:
            log(f"{label}: starting server")
            code = code_dirs[label][1]
            servers[label] = Server(args.model, shlex.split(args.serve_args), spec,
                                    out / f"server-{slug(label)}.log",
                                    env=server_env(env, code), cwd=code)
            if len(servers) == 1:
                check_memory(servers[label], len(methods))
        kinds = json.loads(args.request_kinds) if args.request_kinds else None
        kind_of = {t.turn_id: kinds[i % len(kinds)] for i, t in enumerate(turns)} \
            if kinds else {}
        # The suite's own constraints, --request-kinds' fields on top of them.
        constraints = structured_suite.build(len(turns))[1] \
            if args.suite == structured_suite.SUITE else {}
        kind_of = {t.turn_id: {**constraints.get(t.turn_id, {}), **kind_of.get(t.turn_id, {})}
                   for t in turns}
        drivers = {label: Driver(s, args.max_tokens, args.temperature, top_p=args.top_p,
                                 extra_for=lambda t: kind_of.get(t.turn_id))
                   for label, s in servers.items()}
        if args.suite == "mtbench2":  # greedy and lossless: every method's own answers
            first_driver = next(iter(drivers.values()))
            turns = pangu240.materialize(turns, lambda t: first_driver.run_turn(t).text)
        for d in drivers.values():
            d.run_turn(pangu240.Turn("warmup", "warmup",
                                     [{"role": "user", "content": "Say hello."}]))
        before = {label: s.metrics() for label, s in servers.items()}
        results: dict[str, list] = {label: [] for label in servers}
        walls: dict[str, list[float]] = {label: [] for label in servers}
        n = args.concurrency
        rounds = [turns[i:i + n] for i in range(0, len(turns), n)]
        for i, group in enumerate(rounds):
            for label in rotated(list(drivers), i):
                d = drivers[label]
                if n == 1:
                    r = d.run_turn(group[0])
                    rs, wall = [r], r.e2e_s
                else:
                    rs, wall = d.run_concurrent(group, n)
                results[label] += rs
                walls[label].append(wall)
                tokens = sum(r.output_tokens for r in rs)
                log(f"{i + 1}/{len(rounds)} {label} {group[0].turn_id}"
                    f"{f' +{len(group) - 1}' if len(group) > 1 else ''}: {tokens} tok "
                    f"{tokens / wall:.1f} tok/s")
        after = {label: s.metrics() for label, s in servers.items()}
    finally:
        for s in servers.values():
            s.close()

    first = methods[0][0]
    summary = {"command": "python -m vllm_treespec.bench.served_ab " + " ".join(
                   shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
               "suite": args.suite, "turns": len(turns), "max_tokens": args.max_tokens,
               "temperature": args.temperature, "top_p": args.top_p,
               "request_kinds": args.request_kinds,
               "concurrency": args.concurrency, "env": env, "methods": {}}

    def round_rates(label):  # output tok/s of each round
        rs, k = results[label], args.concurrency
        return [sum(r.output_tokens for r in rs[j * k:(j + 1) * k]) / w
                for j, w in enumerate(walls[label])]

    def rate(label):
        return sum(r.output_tokens for r in results[label]) / sum(walls[label])

    for label, spec in methods:
        rs = results[label]
        tokens, seconds = sum(r.output_tokens for r in rs), sum(walls[label])
        ratios = [a / b for a, b in zip(round_rates(label), round_rates(first)) if b > 0]
        counts0, counts1 = spec_counters(before[label]), spec_counters(after[label])
        summary["methods"][label] = {
            "speculative_config": spec, "code_dir": code_dirs[label][1],
            "output_tokens": tokens, "seconds": seconds,
            "tok_s": tokens / seconds,
            "ratio": rate(label) / rate(first),
            "turn_ratio_mean": mean(ratios),
            "turn_ratio_p10": pct(ratios, 10),
            "turn_ratio_p90": pct(ratios, 90),
            "tpot_ms": 1e3 * mean([r.tpot_s for r in rs]),
            "accept_len": accept_len_between(counts0, counts1),
            # Greedy: a lossless method returns the first method's text for every turn.
            "same_text_as_first": sum(r.text == f.text for r, f in zip(rs, results[first])),
            "turns": [{"turn": r.turn_id, "tokens": r.output_tokens, "e2e_s": r.e2e_s,
                       "ttft_s": r.ttft_s} for r in rs]}
        trees = counts1["trees"] - counts0["trees"]
        stages = stage_breakdown(before[label], after[label], tokens)
        if trees > 0 and stages is not None:
            depth, size = per_depth(before[label], after[label])
            # One request at a time: one tree per step, so decode time / trees is a step.
            decode_s = sum(r.e2e_s - r.ttft_s for r in rs) if args.concurrency == 1 else None
            summary["methods"][label]["tree_steps"] = {
                "trees": trees, "mean_tree_size": size, "per_depth_acceptance": depth,
                "decode_ms_per_step": None if decode_s is None else 1e3 * decode_s / trees,
                "stage_ms_per_tree": {k: 1e3 * v / trees for k, v in stages["seconds"].items()},
                "accepted_by_source": accepted_by_source(before[label], after[label])}
        if constraints:
            summary["methods"][label]["structured"] = structured_suite.summarize(
                constraints, rs, results[first], before[label], after[label])
    (out / "served_ab.json").write_text(json.dumps(summary, indent=1))
    print(table(summary, first))
    print(step_table(summary))
    if constraints:
        print(structured_suite.table(summary, first))
    return 0


def table(summary: dict, first: str) -> str:
    lines = [f"| method | tok/s | vs `{first}` | per turn mean (p10 / p90) | TPOT ms "
             f"| accept len | same text as `{first}` |",
             "|---|---|---|---|---|---|---|"]
    for label, m in summary["methods"].items():
        acc = "–" if m["accept_len"] is None else f"{m['accept_len']:.2f}"
        lines.append(f"| {label} | {m['tok_s']:.2f} | {m['ratio']:.3f} | "
                     f"{m['turn_ratio_mean']:.3f} ({m['turn_ratio_p10']:.2f} / "
                     f"{m['turn_ratio_p90']:.2f}) | {m['tpot_ms']:.1f} | {acc} | "
                     f"{m['same_text_as_first']}/{len(m['turns'])} |")
    return "\n".join(lines)


def step_table(summary: dict) -> str:
    """What a tree step costs, per tree method (empty without one)."""
    from vllm_treespec.bench.report import SOURCES

    rows = [(label, m["tree_steps"]) for label, m in summary["methods"].items()
            if "tree_steps" in m]
    if not rows:
        return ""
    lines = ["| method | trees | nodes | decode ms / step | draft ms / tree "
             "| verify forward ms / tree | per-depth acceptance "
             "| accepted: drafter / copy / other requests / both | store lookups |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, t in rows:
        st, step = t["stage_ms_per_tree"], t["decode_ms_per_step"]
        src = t.get("accepted_by_source")  # absent in runs before it was recorded
        lines.append(f"| {label} | {t['trees']:.0f} | {t['mean_tree_size']:.2f} | "
                     f"{'–' if step is None else f'{step:.2f}'} | {st['draft']:.2f} | "
                     f"{st['verify_forward']:.2f} | "
                     f"{' / '.join(f'{a:.2f}' for a in t['per_depth_acceptance'])} | "
                     + ("– | – |" if src is None else
                        f"{' / '.join(f'{src[k]:.0f}' for k in SOURCES)} | "
                        f"{src['cross_request_lookups']:.0f} |"))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

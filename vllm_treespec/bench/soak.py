"""`vllm-treespec soak`: a bounded, seeded load with faults and bad input against
`vllm-treespec serve` with `eagle3_tree`, next to plain vLLM.

    vllm-treespec soak --requests 200 --out DIR

Starts a plain server and one server per tree setting (``--trees``: ``adaptive``
= the defaults, ``fixed`` = a branching tree on every step, adaptive off,
``shared_store`` = the defaults with copies from other requests, the store at
its largest), each
on 127.0.0.1 with a KV cache of ``--kv-tokens`` tokens so that requests get
preempted, ``validate_invariants`` on. Each server then gets, in order:

1. the *quiet* greedy subset, one request at a time;
2. a warm-up burst (by default twice ``--concurrency`` requests of the mix's
   kind, so every slot fills, requests get preempted and the longest prompts
   come through), then a burst of greedy requests that must preempt one another
   (``soak_mix.preemption_burst``: preemption by construction), after which the
   server's resident memory (all its processes, read once the server has idled
   ``IDLE_SETTLE_S``) is the baseline;
3. the requests vLLM refuses with any speculative method (``soak_mix.
   REFUSED_WITH_SPECULATION``: a 4xx from a tree server, an answer from plain
   vLLM), apart and untimed, so that every server's timed passes carry the same
   requests;
4. the load: the other ``--requests`` requests of the mix in ``soak_mix`` at up to
   ``--concurrency`` in flight (the plain server runs it twice, to measure how
   often vLLM's own batch-dependent numerics change a greedy answer; a tree server
   runs it ``--tree-passes`` times, and the plain server at least as often);
5. the quiet subset again, ``/health``, resident memory, ``/metrics``.

It fails (exit 1) on any violation: a valid request that does not complete, an
invalid one without a 4xx and a message, any 5xx, a dead server, a quiet answer
that differs from plain vLLM's, an invariant dump in a server log (with
``--invalid-trees N``, one more server, ``fixed-invalid``, gets injected faults:
there a tree server *without* dumps, or a fault that cost a whole drafting step), a tree
server whose resident memory after the load grew more than 10 % of the baseline beyond
what plain vLLM's grew under the same load, a server whose requests were never
preempted (the KV cache too large to test preemption), or a greedy mismatch rate
under load significantly above plain-vs-plain (one-sided Fisher exact test, p < 0.01).
Writes DIR/soak.json, DIR/soak.md and each server's log.

Memory is judged against plain vLLM because plain vLLM-CPU itself grows under
load (larger batches and preemption): after a warm-up burst smaller than the
batch it kept growing over a first load pass and again over a second, which an
absolute limit would call a leak in every server (benchmarks/history/
RESULTS-history.md, "Latest (2026-11-26, late morning): the 200-request soak
passes"). A warm-up that fills every slot twice (the default) takes the baseline
after that working set is reached, and both servers then grow little
(benchmarks/history/RESULTS-history.md, "Soak with a warm-up that fills the
batch (2026-11-27, evening, AVX2 machine): fixed tree PASS, memory 1.079x (plain
1.037x)"). Each server's growth is taken at the same points, right after each
load pass both servers ran, and judged at each: a server that grows more than plain
vLLM only over the first pass has a larger working set, one that keeps growing more
pass after pass (``--tree-passes 2`` or more) leaks.

The plain server gets the mix without per-request seeds: vLLM-CPU's own
engine dies on a seeded request whose prompt is prefilled in chunks (it rewinds
the request's CPU generator with ``set_offset``, which CPU generators lack), and
under load any prompt may be chunked. ``eagle3_tree`` serves them (its runner
keeps seeded generators out of that rewind; ``tests/integration/test_seeded.py``), so the
tree servers get the seeds. Seeds only touch sampled requests, which the soak
never compares between servers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

from vllm_treespec.bench.server import Server, metric_sum
from vllm_treespec.bench.soak_mix import (CHAT, REFUSED_WITH_SPECULATION, SoakRequest, build_mix,
                                          preemption_burst, run_load)
from vllm_treespec.bench.soak_report import FAULT_SERVER, ServerRun, check, markdown

TREES = {
    "adaptive": {"validate_invariants": True},
    "fixed": {"validate_invariants": True, "adaptive": False, "num_nodes": 8, "depth": 3,
              "top_k": 2},
    # the defaults with copies from other requests, the store at its largest and
    # prompts filed too, so that the mix fills it and outputs leave it
    "shared_store": {"validate_invariants": True, "cross_request_tokens": 262144,
                     "cross_request_prompts": True, "cross_request_unsalted": True},
}
BLOCK_SIZE = 128  # the CPU backend's
# Resident memory is read this long after a burst's last answer: a tree worker
# hands its free heap back to the OS when its engine goes idle (vllm_glue/host_heap,
# during the engine's next step, and the trim itself takes a moment; this wait
# leaves ample room for both), and the question is what a server
# keeps between bursts, not where it is caught mid-trim. Plain vLLM does not trim.
IDLE_SETTLE_S = 3.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-treespec soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trees", default="adaptive,fixed",
                   help=f"comma list of {', '.join(TREES)}; empty with --invalid-trees: the "
                        "fault server is the only tree server")
    p.add_argument("--out", required=True, help="results directory")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-tokens", type=int, default=8192, help="KV cache size (tokens)")
    p.add_argument("--quiet", type=int, default=8, help="greedy requests sent alone")
    p.add_argument("--quiet-tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=None,
                   help="requests of the warm-up burst (default: twice --concurrency; a "
                        "burst that never fills the batch leaves the working set to the load)")
    p.add_argument("--max-tokens-cap", type=int, default=512,
                   help="upper bound of the mix's max_tokens (a shorter soak)")
    p.add_argument("--allow-no-preemption", action="store_true",
                   help="do not count a server whose requests were never preempted as a "
                        "violation (the KV cache was too large to exercise preemption)")
    p.add_argument("--tree-passes", type=int, default=1,
                   help="load passes of each tree server (the plain server runs max(2, N)); "
                        "resident memory is judged after every pass, so 2 or more tells a "
                        "leak from a larger working set")
    p.add_argument("--invalid-trees", type=int, default=0, metavar="N",
                   help=f"fault injection: one more server, {FAULT_SERVER!r} (the fixed tree), "
                        "where every N-th validated drafting step gets an invalid tree; each "
                        "must be dumped and its request served without drafts")
    p.add_argument("--eager", action="store_true",
                   help="serve without torch.compile (vLLM's compilation mode 0): every "
                        "promise is checked the same, each server starts about a minute "
                        "sooner on a 2-core CPU, and its timings are not served speed")
    return p


def kv_blocks(args) -> int:
    return -(-args.kv_tokens // BLOCK_SIZE)


def idle_resident_bytes(pid: int) -> dict[str, int]:
    """``resident_bytes`` once the server has idled ``IDLE_SETTLE_S``."""
    time.sleep(IDLE_SETTLE_S)
    return resident_bytes(pid)


def resident_bytes(pid: int) -> dict[str, int]:
    """Resident memory of a server's processes by process name (vLLM names its
    engine-core process; one entry per name, summed), to tell which one grows."""
    import psutil

    proc = psutil.Process(pid)
    by_name: dict[str, int] = {}
    for p in [proc, *proc.children(recursive=True)]:
        try:
            name = "api-server" if p.pid == pid else p.name()
            by_name[name] = by_name.get(name, 0) + p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return by_name


def healthy(base_url: str) -> bool:
    try:
        return urllib.request.urlopen(base_url + "/health", timeout=30).status == 200
    except OSError:
        return False


def soak_server(name: str, tree: dict | None, args, model: str, quiet, warm, mix, out: Path,
                drafter: str, passes: int, invalid_trees: int = 0,
                burst: list[SoakRequest] = (), untimed: list[SoakRequest] = ()) -> ServerRun:
    serve_args = ["--dtype", "float32", "--max-model-len", str(args.max_model_len), "--seed", "0",
                  "--block-size", str(BLOCK_SIZE), "--max-num-seqs", str(args.concurrency),
                  "--num-gpu-blocks-override", str(kv_blocks(args))]
    if args.eager:
        serve_args += ["--compilation-config", '{"mode": 0}']
    spec = {"method": "eagle3_tree", "model": drafter, **tree} if tree is not None else None
    log = out / f"server-{name}.log"
    # The KV cache is the blocks override; the space setting only keeps vLLM's CPU
    # backend from reserving most of the machine's memory.
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    if invalid_trees:  # armed in the workers by the extension's import
        from vllm_treespec.bench.invalid_trees import INVALID_TREE_ENV, WORKER_EXTENSION

        env[INVALID_TREE_ENV] = str(invalid_trees)
        serve_args += ["--worker-extension-cls", WORKER_EXTENSION]
    with Server(model, serve_args, spec, log, served_name="soak", env=env) as server:
        url = server.base_url
        spec_on = tree is not None
        quiet_before = asyncio.run(run_load(url, quiet, 1))
        asyncio.run(run_load(url, warm, args.concurrency, spec_on))
        before = _preemptions(server)
        burst_results = asyncio.run(run_load(url, list(burst), max(1, len(burst)), spec_on))
        after = _preemptions(server)
        burst_preemptions = None if before is None or after is None else after - before
        untimed_results = asyncio.run(run_load(url, list(untimed), args.concurrency, spec_on))
        by_process = [idle_resident_bytes(server.proc.pid)]  # after warm-up, then each pass
        loads, walls = [], []
        for _ in range(passes):
            t0 = time.perf_counter()
            loads.append(asyncio.run(run_load(url, mix, args.concurrency, spec_on)))
            walls.append(time.perf_counter() - t0)
            by_process.append(idle_resident_bytes(server.proc.pid))
        quiet_after = asyncio.run(run_load(url, quiet, 1))
        alive = healthy(url)
        rss_end = sum(idle_resident_bytes(server.proc.pid).values())
        metrics = server.metrics() if alive else {}
    return ServerRun(name, quiet_before, quiet_after, loads, walls, by_process, rss_end,
                     alive, metrics, burst_results, burst_preemptions,
                     dumps=_count_lines(log, "batch dumped to"),
                     injected_dumps=_count_lines(log, "batch dumped to", "token -1 outside"),
                     untimed=untimed_results)


def _preemptions(server: Server) -> float | None:
    """vLLM's preemption counter; None if /metrics does not answer (a dead
    server: its requests' failures and /health are the violations then)."""
    try:
        return metric_sum(server.metrics(), "vllm:num_preemptions_total")
    except OSError:
        return None


def _count_lines(log: Path, *needles: str) -> int:
    return sum(all(n in line for n in needles) for line in log.read_text().splitlines())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tree_passes < 1:
        raise SystemExit(f"--tree-passes: {args.tree_passes} is not allowed; 1 or more")
    trees = [t for t in args.trees.split(",") if t]
    unknown = [t for t in trees if t not in TREES]
    if unknown:
        raise SystemExit(f"--trees: unknown {unknown}; choose from {list(TREES)}")
    from transformers import AutoTokenizer

    from vllm_treespec.assets import ensure_assets
    from vllm_treespec.bench import pangu240

    assets = ensure_assets()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = [t.messages[-1]["content"] for t in pangu240.build_turns() if t.depends_on is None]
    pool = AutoTokenizer.from_pretrained(assets.target)("\n\n".join(texts))["input_ids"]
    burst = preemption_burst("soak", pool, kv_blocks(args), args.concurrency, BLOCK_SIZE,
                             args.max_model_len)
    mix = build_mix(args.requests, args.seed, "soak", texts, pool, args.max_model_len,
                    max_tokens_cap=args.max_tokens_cap)
    untimed = [r for r in mix if r.kind in REFUSED_WITH_SPECULATION]
    mix = [r for r in mix if r.kind not in REFUSED_WITH_SPECULATION]
    if args.warmup is None:
        args.warmup = 2 * args.concurrency
    warm = [r for r in build_mix(args.warmup, args.seed + 1, "soak", texts, pool,
                                 args.max_model_len, max_tokens_cap=args.max_tokens_cap)
            if r.expect == "ok"]
    quiet = [SoakRequest(i, "quiet", CHAT, {"model": "soak", "temperature": 0,
                                            "max_tokens": args.quiet_tokens,
                                            "messages": [{"role": "user", "content": text}]},
                         stream=False, expect="ok") for i, text in enumerate(texts[:args.quiet])]
    runs = {}
    servers = [("plain", None)] + [(t, TREES[t]) for t in trees]
    if args.invalid_trees:
        servers.append((FAULT_SERVER, TREES["fixed"]))
    for name, tree in servers:
        print(f"[soak] {name}: serving and loading", flush=True)
        warm_sent, mix_sent, untimed_sent = (warm, mix, untimed) if tree is not None else (
            [r.unseeded() for r in warm], [r.unseeded() for r in mix],
            [r.unseeded() for r in untimed])
        runs[name] = soak_server(name, tree, args, str(assets.target), quiet=quiet,
                                 warm=warm_sent, mix=mix_sent, out=out,
                                 drafter=str(assets.drafter),
                                 passes=max(2, args.tree_passes) if tree is None
                                 else args.tree_passes,
                                 invalid_trees=args.invalid_trees if name == FAULT_SERVER else 0,
                                 burst=burst, untimed=untimed_sent)
    summary, violations = check(runs, mix, args.allow_no_preemption)
    result = {"args": vars(args), "servers": summary, "violations": violations}
    (out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    md = markdown(summary, violations, args)
    (out / "soak.md").write_text(md)
    print(md)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())

"""`vllm-treespec bench`: side-by-side serving benchmarks, one server per method.

    vllm-treespec bench --suite pangu240 --limit 10 --methods none,eagle3,eagle3_tree --out DIR

Every method is served in turn on 127.0.0.1 with identical flags; turns run at
concurrency 1 (per-turn tok/s, speedup vs the first method, acceptance length
from /metrics deltas), then at each extra ``--concurrency`` level (aggregate
throughput; the prefix cache is emptied before each, see
``Server.reset_prefix_cache``). Writes DIR/summary.json, DIR/summary.md, PNG plots, per-turn
results, the materialised dataset (usable by ``vllm bench serve``), and each
server's log. Methods take options: ``eagle3:k=4``,
``eagle3_tree:num_nodes=16,depth=5,top_k=4``.

Resumable: every finished concurrency-1 turn is appended to
``turns-METHOD.jsonl`` at once, with the /metrics counters of its sitting in
``window-METHOD.json``; ``--resume DIR`` continues with the run's own settings
(``DIR/run.json``; a different one given on the command line is refused) and skips
the turns already there, and a method with all its turns done starts no server. So a long
protocol can be finished over several sittings of under an hour each.
Concurrency > 1 runs are not resumed: a method that has them runs them again.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
from pathlib import Path

from vllm_treespec.bench import pangu240, repetitive, report
from vllm_treespec.bench.driver import Driver, TurnResult
from vllm_treespec.bench.server import Server


def parse_method(text: str, args) -> tuple[str, dict | None]:
    """'eagle3_tree:num_nodes=16,depth=4' -> (label, speculative_config)."""
    name, _, opts = text.partition(":")
    kv = {}
    for part in filter(None, opts.split(",")):
        k, _, v = part.partition("=")
        kv[k.strip()] = json.loads(v) if v.strip()[:1] in "[{0123456789-tf" else v.strip()
    if name == "none":
        return text, None
    if name == "eagle3":
        return text, {"method": "eagle3", "model": args.drafter,
                      "num_speculative_tokens": int(kv.pop("k", args.eagle3_k)), **kv}
    if name == "eagle3_tree":
        tree = dict(json.loads(args.tree) if args.tree else {})
        tree.update(kv)
        return text, {"method": "eagle3_tree", "model": args.drafter, **tree}
    if name == "ngram":  # vLLM's prompt lookup: n-grams of 4 down to 2, as our copy source
        return text, {"method": "ngram", "num_speculative_tokens": int(kv.pop("k", 4)),
                      "prompt_lookup_max": 4, "prompt_lookup_min": 2, **kv}
    if name == "suffix":  # vLLM's SuffixDecoding: needs arctic-inference (docs/benchmarks.md)
        return text, {"method": "suffix", **kv}
    raise SystemExit(f"bench: unknown method {name!r} (one of: {', '.join(METHODS)})")


METHODS = ("none", "eagle3", "eagle3_tree", "ngram", "suffix")


def split_methods(text: str) -> list[str]:
    """'none,eagle3:k=4,eagle3_tree:num_nodes=16,depth=4' -> three methods: a comma
    starts a new method only when a method name follows (``served_ab``'s
    ``METHOD@DIR`` too)."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if out and part.split(":")[0].split("@")[0] not in METHODS:
            out[-1] += "," + part
        else:
            out.append(part)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-treespec bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", default="pangu240", choices=["pangu240", *repetitive.SUITES],
                   help="pangu240, or a suite whose requests repeat each other "
                        "(structured, code_workflow, repeated_asks: bench/repetitive.py)")
    p.add_argument("--limit", type=int, default=None, help="first N turns (interleaved mix)")
    p.add_argument("--methods", default="none,eagle3,eagle3_tree")
    p.add_argument("--concurrency", default="1", help="comma list, e.g. 1,4,16,32,64")
    p.add_argument("--out", help="results directory (a new run)")
    p.add_argument("--resume", metavar="DIR",
                   help="continue the run in DIR: skip the turns it has finished")
    p.add_argument("--model", default=None, help="target (default: the embedded SmolLM2)")
    p.add_argument("--drafter", default=None, help="EAGLE-3 drafter (default: the embedded one)")
    p.add_argument("--eagle3-k", type=int, default=3, help="chain length of stock eagle3")
    p.add_argument("--tree", default=None, help="JSON of eagle3_tree settings")
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--serve-args", default="--dtype float32 --max-model-len 4096 --seed 0",
                   help="extra flags given to every server (identical across methods)")
    p.add_argument("--threads-bind", default=None,
                   help="VLLM_CPU_OMP_THREADS_BIND for the servers (default: all cores)")
    return p


# What defines a run: ``--resume`` takes these from the run's ``run.json``.
RUN_KEYS = ("suite", "limit", "methods", "concurrency", "model", "drafter", "eagle3_k", "tree",
            "max_tokens", "temperature", "serve_args", "threads_bind")


def given_on_command_line(argv: list[str] | None) -> set[str]:
    """The settings actually given (a value equal to its default counts too)."""
    quiet = build_parser()
    for action in quiet._actions:
        action.default = argparse.SUPPRESS
    return set(vars(quiet.parse_args(argv)))


def resumed_args(parser: argparse.ArgumentParser, args: argparse.Namespace, out: Path,
                 given: set[str]) -> None:
    """Fill ``args`` from the run being resumed; a setting given on the command
    line that differs from the run's is an error (a resumed run measured with
    other settings would mix two protocols in one table)."""
    stored_path = out / "run.json"
    if not stored_path.exists():
        parser.error(f"--resume {out}: no run.json there (not a bench run, or one from before "
                     f"resuming kept its settings)")
    stored = json.loads(stored_path.read_text())
    missing = [k for k in RUN_KEYS if k not in stored]
    if missing:
        parser.error(f"--resume {out}: run.json lacks {missing} (written by another version)")
    for key in RUN_KEYS:
        if key in given and getattr(args, key) != stored[key]:
            parser.error(f"--resume {out}: --{key.replace('_', '-')} {getattr(args, key)!r} "
                         f"differs from the run's {stored[key]!r} (leave it out to continue "
                         f"the run as it was)")
        setattr(args, key, stored[key])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.out is None) == (args.resume is None):
        parser.error("give exactly one of --out DIR (a new run) and --resume DIR")
    out = Path(args.out or args.resume)
    if args.resume is not None:
        resumed_args(parser, args, out, given_on_command_line(argv))
    out.mkdir(parents=True, exist_ok=True)
    if args.model is None or args.drafter is None:
        from vllm_treespec.assets import ensure_assets

        assets = ensure_assets()
        args.model = args.model or str(assets.target)
        args.drafter = args.drafter or str(assets.drafter)
    methods = [parse_method(m, args) for m in split_methods(args.methods)]
    concurrency = sorted({int(c) for c in args.concurrency.split(",")} | {1})
    (out / "run.json").write_text(json.dumps({k: getattr(args, k) for k in RUN_KEYS},
                                             indent=1) + "\n")
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
           "VLLM_CPU_OMP_THREADS_BIND": args.threads_bind or os.environ.get(
               "VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}"),
           "VLLM_SERVER_DEV_MODE": "1"}  # for Server.reset_prefix_cache
    serve_args = shlex.split(args.serve_args)
    if "--max-num-seqs" not in serve_args:
        serve_args += ["--max-num-seqs", str(max(concurrency))]
    turns = (pangu240.build_turns(args.limit) if args.suite == "pangu240"
             else repetitive.SUITES[args.suite](args.limit))
    dataset_path = out / "dataset.jsonl"
    log = lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True)  # noqa: E731

    results: dict[str, list[TurnResult]] = {}
    summary = {"suite": args.suite, "turns": len(turns), "max_tokens": args.max_tokens,
               "temperature": args.temperature, "concurrency": concurrency,
               "model": args.model, "drafter": args.drafter, "serve_args": serve_args,
               "env": env, "command": "vllm-treespec bench " + " ".join(
                   shlex.quote(a) for a in (argv if argv is not None else sys.argv[2:])),
               "methods": {}}
    resolved: list[pangu240.Turn] | None = None
    for label, spec in methods:
        turns_path = out / f"turns-{slug(label)}.jsonl"
        window_path = out / f"window-{slug(label)}.json"
        if args.resume is None:
            turns_path.unlink(missing_ok=True)
            window_path.unlink(missing_ok=True)
        done = {r.turn_id: r for r in read_turns(turns_path)}
        if resolved is None and done and len(done) == len(turns) and dataset_path.exists():
            resolved = pangu240.read_jsonl(dataset_path)
        if resolved is not None and done and all(t.turn_id in done for t in resolved) \
                and len(concurrency) == 1:
            log(f"{label}: all {len(done)} turns done in an earlier sitting")
            res_c1 = [done[t.turn_id] for t in resolved]
            results[label] = res_c1
            summary["methods"][label] = _summarise(res_c1, results, methods, spec,
                                                   read_window(window_path))
            continue
        log(f"{label}: starting server")
        t_start = time.time()
        with Server(args.model, serve_args, spec, out / f"server-{slug(label)}.log",
                    env=env) as server:
            drv = Driver(server, args.max_tokens, args.temperature)
            drv.run_turn(pangu240.Turn("warmup", "warmup",
                                       [{"role": "user", "content": "Say hello."}]))
            progress = lambda i, n, r: log(  # noqa: E731
                f"{label}: {i}/{n} {r.turn_id} {r.output_tokens} tok {r.tok_s:.1f} tok/s"
                + (f" accept {r.accept_len:.2f}" if r.accept_len else ""))
            before = server.metrics()
            sitting = f"{os.getpid()}-{t_start}"  # this server's counters start at `before`

            def run(t: pangu240.Turn) -> TurnResult:
                """One concurrency-1 turn, or its result from an earlier sitting."""
                if t.turn_id in done:
                    return done[t.turn_id]
                r = drv.run_sequential([t])[0]
                append_turn(turns_path, r)
                add_window(window_path, sitting, before, server.metrics())
                return r

            if resolved is None:
                # First method: run turns in order; second MT-Bench turns use this
                # method's own first answers (identical across methods at T=0).
                res_c1, answers, resolved = [], {}, []
                for t in turns:
                    if t.depends_on is not None:
                        if t.depends_on not in answers:
                            answers[t.depends_on] = drv.run_turn(
                                pangu240.Turn(t.depends_on, t.source, t.messages[:1])).text
                        t = pangu240.materialize([t], lambda _: "", known=answers)[0]
                    resolved.append(t)
                    r = run(t)
                    res_c1.append(r)
                    if t.turn_id.endswith("/1"):
                        answers[t.turn_id] = r.text
                    progress(len(res_c1), len(turns), r)
                _write_dataset(resolved, dataset_path, args)
            else:
                res_c1 = []
                for t in resolved:
                    res_c1.append(run(t))
                    progress(len(res_c1), len(resolved), res_c1[-1])
            results[label] = res_c1
            ms = _summarise(res_c1, results, methods, spec, read_window(window_path))
            for c in concurrency[1:]:
                log(f"{label}: concurrency {c}")
                server.reset_prefix_cache()  # every method meets these prompts cold
                m0 = server.metrics()
                res_c, wall = drv.run_concurrent(resolved, c)
                s = report.method_summary(res_c, None, (m0, server.metrics()))
                s["throughput_tok_s"] = sum(r.output_tokens for r in res_c) / wall
                s["wall_s"] = wall
                ms[f"c{c}"] = s
            ms["server_seconds"] = time.time() - t_start
            summary["methods"][label] = ms
        report.write_json(out / "summary.json", summary)
        log(f"{label}: done — {json.dumps(ms['c1'])}")
    summary["plots"] = report.plots(summary, results, out)
    report.write_json(out / "summary.json", summary)
    (out / "summary.md").write_text(report.markdown(summary))
    log(f"wrote {out / 'summary.json'} and {out / 'summary.md'}")
    return 0


def slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in label)


def _summarise(res_c1, results, methods, spec, window) -> dict:
    first = methods[0][0]
    none_by_turn = ({r.turn_id: r for r in results[first]}
                    if res_c1 is not results.get(first) else None)
    c1 = report.method_summary(res_c1, none_by_turn, window)
    c1["throughput_tok_s"] = sum(r.output_tokens for r in res_c1) / sum(r.e2e_s for r in res_c1)
    return {"c1": c1, "speculative_config": spec}


def append_turn(path: Path, r: TurnResult) -> None:
    # A line cut off by an interruption must not swallow the next record.
    cut = path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
    with open(path, "a") as f:
        f.write(("\n" if cut else "")
                + json.dumps(dict(dataclasses.asdict(r), tok_s=r.tok_s, tpot_s=r.tpot_s)) + "\n")


def read_turns(path: Path) -> list[TurnResult]:
    """Turns finished so far (a line cut off by an interruption is ignored)."""
    if not path.exists():
        return []
    fields = {f.name for f in dataclasses.fields(TurnResult)}
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(TurnResult(**{k: v for k, v in json.loads(line).items() if k in fields}))
        except (json.JSONDecodeError, TypeError):
            continue
    return out


def add_window(path: Path, sitting: str, before: dict, after: dict) -> None:
    """Keep /metrics counters since the start (``before``) of this ``sitting`` (one
    server): the file holds the finished sittings' deltas plus the current one's."""
    saved = json.loads(path.read_text()) if path.exists() else {"past": {}, "sitting": None}
    if saved.get("sitting_id") != sitting:
        # A new sitting: fold the previous one's counters into the past.
        for k, v in (saved.get("sitting") or {}).items():
            saved["past"][k] = saved["past"].get(k, 0.0) + v
        saved["sitting_id"] = sitting
    saved["sitting"] = {k: v - before.get(k, 0.0) for k, v in after.items()}
    path.write_text(json.dumps(saved))


def read_window(path: Path) -> tuple[dict, dict] | None:
    """(before, after) scrapes equivalent to all sittings' counters (every
    report function uses differences only)."""
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    total = dict(saved["past"])
    for k, v in (saved.get("sitting") or {}).items():
        total[k] = total.get(k, 0.0) + v
    return {}, total


def _write_dataset(turns, path: Path, args) -> None:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
    except Exception:  # the dataset is still useful without templated prompts
        tok = None
    pangu240.write_jsonl(turns, path, tok, output_tokens=args.max_tokens)

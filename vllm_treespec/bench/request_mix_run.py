"""Request mixes sent to a plain and a tree server side by side (``request_mix``).

``run_mix`` sends one mix's requests concurrently to each server (both servers
at once), then checks every answer and that the tree server still answers
``/health``. ``shrink`` reduces a failing mix to a smallest one that still fails
(requests dropped one at a time), to keep as a regression test.

Long run (docs/reliability.md, "Request mixes"), resumable: every finished mix
is appended to ``DIR/mixes.jsonl`` and a rerun skips the mixes already there::

    python -m vllm_treespec.bench.request_mix_run --mixes 2000 --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import concurrent.futures
import json
import os
import random
import time
import urllib.error
import urllib.request
from pathlib import Path

from vllm_treespec.bench.request_mix import check_request, greedy, plain_failed, random_mix
from vllm_treespec.bench.soak_mix import stream_error_status

TIMEOUT_S = 600


def send(base_url: str, request: dict) -> dict:
    """{"status", "json" | "error"}; a stream is gathered into one answer."""
    url = f"{base_url}/v1/{'chat/completions' if request['api'] == 'chat' else 'completions'}"
    req = urllib.request.Request(url, data=json.dumps(request["body"]).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            if not request["stream"]:
                return {"status": r.status, "json": json.loads(r.read())}
            return gathered(line.decode().rstrip("\n") for line in r)
    except urllib.error.HTTPError as e:
        return {"status": e.code, "error": e.read().decode(errors="replace")}
    except (OSError, ValueError) as e:  # refused, reset, timed out; a malformed answer
        return {"status": None, "error": f"{type(e).__name__}: {e}"}


def gathered(lines) -> dict:
    """A streamed answer as one non-streamed answer: text, tool-call arguments,
    logprobs and finish reason per choice, and usage. An error event (vLLM's way
    to refuse a streamed request after its 200 header, or to report a failure)
    has the status its code says."""
    choices: dict[int, dict] = {}
    usage, done = None, False
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        event = json.loads(data)
        if "error" in event:
            status, error = stream_error_status(event["error"])
            return {"status": status, "error": error}
        usage = event.get("usage") or usage
        for c in event.get("choices") or []:
            _merge(choices.setdefault(c["index"], {"index": c["index"]}), c)
    if not done:
        return {"status": 500, "error": "stream ended without [DONE]"}
    return {"status": 200, "json": {"choices": list(choices.values()), "usage": usage}}


def _merge(into: dict, chunk: dict) -> None:
    delta = chunk.get("delta")
    if delta is not None:  # chat
        msg = into.setdefault("message", {"content": None})
        if delta.get("content") is not None:
            msg["content"] = (msg["content"] or "") + delta["content"]
        for call in delta.get("tool_calls") or []:
            calls = msg.setdefault("tool_calls", [])
            while len(calls) <= call.get("index", 0):
                calls.append({"function": {"arguments": ""}})
            args = (call.get("function") or {}).get("arguments") or ""
            calls[call.get("index", 0)]["function"]["arguments"] += args
    else:
        into["text"] = into.get("text", "") + (chunk.get("text") or "")
    lp = chunk.get("logprobs")
    if lp:
        mine = into.setdefault("logprobs", {})
        for key, value in lp.items():
            if isinstance(value, list):
                mine[key] = mine.get(key, []) + value
    if chunk.get("finish_reason"):
        into["finish_reason"] = chunk["finish_reason"]


def healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=30) as r:
            return r.status == 200
    except OSError:
        return False


def run_mix(plain_url: str, tree_url: str, mix: list[dict]) -> dict:
    """Both servers' answers to ``mix`` (sent concurrently) and the problems found."""
    with concurrent.futures.ThreadPoolExecutor(2 * len(mix)) as pool:
        plain = [pool.submit(send, plain_url, r) for r in mix]
        tree = [pool.submit(send, tree_url, r) for r in mix]
        plain, tree = [f.result() for f in plain], [f.result() for f in tree]
    specific = any("logprob_token_ids" in r["body"] for r in mix)
    problems = {i: p for i, (r, a, b) in enumerate(zip(mix, plain, tree))
                if (p := check_request(r, a, b, specific))}
    alive = healthy(tree_url)
    if not alive:
        problems[-1] = ["the tree server stopped answering /health"]
    return {"problems": problems, "alive": alive,
            "statuses": [[a["status"], b["status"]] for a, b in zip(plain, tree)],
            "plain_failed": sum(map(plain_failed, plain)),
            "greedy_compared": sum(greedy(r) and a["status"] == b["status"] == 200
                                   for r, a, b in zip(mix, plain, tree))}


def shrink(plain_url: str, tree_url: str, mix: list[dict]) -> list[dict]:
    """A smallest sub-mix that still fails (one request dropped at a time)."""
    i = 0
    while i < len(mix) and len(mix) > 1:
        smaller = mix[:i] + mix[i + 1:]
        if run_mix(plain_url, tree_url, smaller)["problems"]:
            mix = smaller
        else:
            i += 1
    return mix


def mixes(seed: int, count: int, sizes: tuple[int, int] = (2, 16)):
    """(index, mix) for the run's ``count`` mixes: mix i depends on (seed, i) only,
    so a resumed run sends the same mixes."""
    for i in range(count):
        rng = random.Random(f"{seed}-{i}")
        yield i, random_mix(rng, rng.randint(*sizes))


# Both servers' flags: the HTTP tests' (tests/integration/test_http.py), with a
# reasoning config so that thinking-budget requests reach the tree engine's check.
SERVE_ARGS = ["--dtype", "float32", "--max-model-len", "2048", "--seed", "0",
              "--max-num-seqs", "8", "--compilation-config", '{"mode": 0}',
              "--reasoning-config",
              '{"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}']


@contextlib.contextmanager
def started_pair(out: Path):
    """A plain and a default eagle3_tree server (the shipped pair, copies from
    other requests on), logs in ``out``."""
    from vllm_treespec.assets import cache_home, committed_drafter_dir, ensure_target
    from vllm_treespec.bench.server import Server

    target = str(ensure_target(cache_home()))
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    spec = {"method": "eagle3_tree", "model": str(committed_drafter_dir()),
            "cross_request_tokens": 8192}
    with Server(target, SERVE_ARGS, None, out / "plain.log", "smollm2", env) as plain, \
            Server(target, SERVE_ARGS, spec, out / "tree.log", "smollm2", env) as tree:
        yield plain, tree


def summarize(log: Path) -> dict:
    """The long run's figures from its ``mixes.jsonl``."""
    runs = [json.loads(x) for x in log.read_text().splitlines()]
    statuses = [s for r in runs for s in r["statuses"]]
    return {"mixes": len(runs), "requests": len(statuses),
            "failing_mixes": sum(bool(r["problems"]) for r in runs),
            "failing_requests": sum(len(r["problems"]) for r in runs),
            "engine_deaths": sum(not r["alive"] for r in runs),
            # a 5xx (or no answer) from the tree server where plain answered below 500
            "tree_5xx": sum((t is None or t >= 500) and not (p and p >= 500)
                            for p, t in statuses),
            "plain_5xx": sum(p is not None and p >= 500 for p, _ in statuses),
            "both_5xx": sum(bool(p and p >= 500 and t and t >= 500) for p, t in statuses),
            "refused_by_tree_only": sum(t // 100 == 4 and p // 100 == 2 for p, t in statuses
                                        if p and t),
            "greedy_compared": sum(r.get("greedy_compared", 0) for r in runs),
            "seconds": round(sum(r["seconds"] for r in runs))}


def main() -> None:  # pragma: no cover - the long run, documented in docs/reliability.md
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mixes", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--summarize", action="store_true",
                    help="write DIR/summary.json from DIR/mixes.jsonl and print it; send nothing")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "mixes.jsonl"
    if args.summarize:
        summary = json.dumps(summarize(log), indent=1)
        (args.out / "summary.json").write_text(summary + "\n")
        print(summary)
        return
    done = {json.loads(x)["index"] for x in log.read_text().splitlines()} if log.exists() else set()
    with started_pair(args.out) as (plain, tree):
        for i, mix in mixes(args.seed, args.mixes):
            if i in done:
                continue
            start = time.monotonic()
            result = run_mix(plain.base_url, tree.base_url, mix)
            if result["problems"]:
                result["smallest"] = shrink(plain.base_url, tree.base_url, mix)
            result.update(index=i, size=len(mix), seconds=round(time.monotonic() - start, 2),
                          mix=mix)
            with open(log, "a") as f:
                f.write(json.dumps(result) + "\n")
                f.flush()
                os.fsync(f.fileno())
            print(f"mix {i}: {len(mix)} requests, {len(result['problems'])} failing, "
                  f"{result['seconds']} s", flush=True)
            if not result["alive"]:
                raise SystemExit(f"the tree server died on mix {i}; see {args.out}")


if __name__ == "__main__":
    main()

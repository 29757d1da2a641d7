"""Runs turns against a server and measures each one (streaming OpenAI client)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time

import openai

from vllm_treespec.bench.pangu240 import Turn
from vllm_treespec.bench.server import Server, metric_sum


@dataclasses.dataclass
class TurnResult:
    turn_id: str
    source: str
    output_tokens: int
    e2e_s: float
    ttft_s: float
    text: str
    accept_len: float | None = None  # concurrency 1 only (from /metrics deltas)
    finish_reason: str | None = None  # "length": cut by max_tokens
    # Streamed tool calls, [{"name", "arguments"}] (servers with a tool parser), or None
    tool_calls: list[dict] | None = None

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.e2e_s if self.e2e_s > 0 else 0.0

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / max(self.output_tokens - 1, 1)


def spec_counters(m: dict[str, float]) -> dict[str, float]:
    """Speculation counters of a /metrics scrape (stock eagle3 and eagle3_tree)."""
    return {"drafts": metric_sum(m, "vllm:spec_decode_num_drafts_total"),
            "accepted": metric_sum(m, "vllm:spec_decode_num_accepted_tokens_total"),
            "trees": metric_sum(m, "vllm_treespec:trees_total"),
            "emitted": metric_sum(m, "vllm_treespec:emitted_tokens_total")}


def accept_len_between(before: dict, after: dict) -> float | None:
    """Mean acceptance length (accepted drafts + 1 bonus per step) in a window."""
    trees = after["trees"] - before["trees"]
    if trees > 0:
        return (after["emitted"] - before["emitted"]) / trees
    drafts = after["drafts"] - before["drafts"]
    if drafts > 0:
        return 1.0 + (after["accepted"] - before["accepted"]) / drafts
    return None


class Driver:
    def __init__(self, server: Server, max_tokens: int, temperature: float = 0.0,
                 timeout_s: float = 1800, top_p: float | None = None,
                 extra_for=None):
        self.server = server
        self.max_tokens = max_tokens
        self.temperature = temperature
        # Sent only when set: greedy runs' requests stay exactly what they were.
        self.sampling = {} if top_p is None else {"top_p": top_p}
        # turn -> request fields added to its body (served_ab's --request-kinds), or None
        self.extra_for = extra_for
        self.client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none",
                                    timeout=timeout_s)

    def run_turn(self, turn: Turn) -> TurnResult:
        t0 = time.perf_counter()
        ttft = None
        parts: list[str] = []
        usage, finish, calls = None, None, {}
        stream = self.client.chat.completions.create(
            model=self.server.served_name, messages=turn.messages, max_tokens=self.max_tokens,
            temperature=self.temperature, stream=True,
            stream_options={"include_usage": True}, **self.sampling,
            **({"extra_body": extra} if (extra := self.extra_for and self.extra_for(turn))
               else {}))
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            finish = choice.finish_reason or finish
            if ttft is None and (choice.delta.content or choice.delta.tool_calls):
                ttft = time.perf_counter() - t0
            if choice.delta.content:
                parts.append(choice.delta.content)
            for tc in choice.delta.tool_calls or ():  # a call's name, then its arguments
                call = calls.setdefault(tc.index, {"name": None, "arguments": ""})
                if tc.function is not None:
                    call["name"] = tc.function.name or call["name"]
                    call["arguments"] += tc.function.arguments or ""
        e2e = time.perf_counter() - t0
        tokens = usage.completion_tokens if usage is not None else len(parts)
        return TurnResult(turn.turn_id, turn.source, tokens, e2e, ttft or e2e, "".join(parts),
                          finish_reason=finish,
                          tool_calls=[calls[k] for k in sorted(calls)] or None)

    def run_sequential(self, turns: list[Turn], progress=None) -> list[TurnResult]:
        """Concurrency 1, with per-turn acceptance from /metrics deltas."""
        out = []
        for i, turn in enumerate(turns):
            before = spec_counters(self.server.metrics())
            r = self.run_turn(turn)
            time.sleep(0.05)
            r.accept_len = accept_len_between(before, spec_counters(self.server.metrics()))
            out.append(r)
            if progress:
                progress(i + 1, len(turns), r)
        return out

    def run_concurrent(self, turns: list[Turn], concurrency: int,
                       progress=None) -> tuple[list[TurnResult], float]:
        """All turns with `concurrency` clients; returns (results, wall seconds)."""
        lock, done = threading.Lock(), [0]

        def one(turn):
            r = self.run_turn(turn)
            with lock:
                done[0] += 1
                if progress:
                    progress(done[0], len(turns), r)
            return r

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, turns))
        return results, time.perf_counter() - t0

"""Seeded mixes of OpenAI requests over every field vLLM accepts with speculation,
and the checks a tree server's answers must pass against a plain server's.

``random_mix(rng, size)`` draws ``size`` requests (chat and completions,
streaming or not, greedy and sampled side by side), each with a random subset of
the request fields in ``FIELDS``; ``check_request`` compares one request's
answer from the tree server with the plain server's: the same status class
(a 4xx naming the field where only a speculative server refuses it: ``REFUSED``),
never a 5xx, plain's text for greedy requests, and every field and count the
request asked for. The served run (``request_mix_run``) sends the mixes.
"""

from __future__ import annotations

import random
from typing import Any

QUESTIONS = [
    "What is the capital of France?", "Name three colours.", "Count to five.",
    "Write one sentence about the sea.", "What is 12 plus 30?",
    "Give a short tip for learning Python.", "Describe a cat in one line.",
    "Repeat exactly: red green blue red green blue",
]
PROMPTS = ["The three primary colours are", "def add(a, b):\n   ", "Once upon a time",
           "1, 2, 3, 4,"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
# Fields a server with a speculative method refuses (HTTP 400 naming the field)
# where plain vLLM serves them: vLLM's own refusals, then the tree engine's
# (``vllm_glue.request_checks``).
REFUSED = ("min_p", "logit_bias", "thinking_token_budget")


def _sampling(rng: random.Random, body: dict, chat: bool) -> None:
    """Temperature and the sampling fields: greedy about half the time."""
    if rng.random() < 0.5:
        body["temperature"] = 0.0
    else:
        body["temperature"] = rng.choice([0.5, 1.0])
        if rng.random() < 0.5:
            body["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.4:
            body["top_k"] = rng.choice([1, 5, 20])
        if rng.random() < 0.5:
            body["seed"] = rng.randrange(1000)
    if rng.random() < 0.25:
        body["n"] = rng.choice([2, 3])
    for name, values in (("presence_penalty", [0.5, 1.0]), ("frequency_penalty", [0.5, 1.2]),
                         ("repetition_penalty", [1.2, 1.5])):
        if rng.random() < 0.15:
            body[name] = rng.choice(values)


def _logprobs(rng: random.Random, body: dict, chat: bool) -> None:
    roll = rng.random()
    if roll < 0.2:
        if chat:
            body["logprobs"], body["top_logprobs"] = True, rng.choice([0, 1, 2, 5])
        else:
            body["logprobs"] = rng.choice([0, 1, 2, 5])
    elif roll < 0.3:
        body["logprobs"] = True if chat else 1
        body["logprob_token_ids"] = rng.sample(range(10, 2000), rng.randint(1, 5))
    if rng.random() < 0.1:
        body["prompt_logprobs"] = rng.choice([0, 2])


def _stopping(rng: random.Random, body: dict, chat: bool) -> None:
    body["max_tokens"] = rng.choice([1, 4, 8, 16, 24])
    if rng.random() < 0.2:
        body["stop"] = rng.sample(["\n", ".", " the", ","], rng.randint(1, 2))
        if rng.random() < 0.5:
            body["include_stop_str_in_output"] = True
    if rng.random() < 0.1:
        body["stop_token_ids"] = [rng.randrange(10, 2000)]
    if rng.random() < 0.15:
        body["min_tokens"] = rng.randint(1, body["max_tokens"])
    if rng.random() < 0.15:
        body["ignore_eos"] = True


def _constraints(rng: random.Random, body: dict, chat: bool) -> None:
    roll = rng.random()
    if roll < 0.06 and chat:
        body["response_format"] = {"type": "json_object"}
    elif roll < 0.12 and chat:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "person", "schema": SCHEMA}}
    elif roll < 0.17:
        body["structured_outputs"] = rng.choice([{"regex": "[a-z]{3,8}"},
                                                 {"choice": ["yes", "no", "maybe"]}])
    elif roll < 0.21 and chat:
        body["tools"] = [TOOL]
        body["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    if rng.random() < 0.08:
        body["bad_words"] = rng.sample([" the", " is", " a"], rng.randint(1, 2))
    if rng.random() < 0.06:
        body["allowed_token_ids"] = sorted(rng.sample(range(10, 3000), 60)) + [2]


def _serving(rng: random.Random, body: dict, chat: bool) -> None:
    if rng.random() < 0.2:
        body["cache_salt"] = rng.choice(["tenant-a", "tenant-b"])
    if rng.random() < 0.05:
        body["priority"] = rng.choice([0, 1])
    if rng.random() < 0.05:
        body["min_p"] = 0.1
    if rng.random() < 0.05:
        body["logit_bias"] = {str(rng.randrange(10, 2000)): 5}
    if rng.random() < 0.05:
        body["thinking_token_budget"] = rng.choice([0, 4])
    if not chat and rng.random() < 0.1:
        body["echo"] = True


FIELDS = (_sampling, _logprobs, _stopping, _constraints, _serving)


def random_request(rng: random.Random) -> dict:
    """{"api": "chat" | "completions", "stream": bool, "body": {...}}."""
    chat = rng.random() < 0.7
    body: dict[str, Any] = {"model": "smollm2"}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(QUESTIONS)}]
    else:
        body["prompt"] = rng.choice(PROMPTS)
    for draw in FIELDS:
        draw(rng, body, chat)
    stream = rng.random() < 0.3
    if stream:
        body["stream"] = True
        if rng.random() < 0.7:
            body["stream_options"] = {"include_usage": True}
    return {"api": "chat" if chat else "completions", "stream": stream, "body": body}


def random_mix(rng: random.Random, size: int) -> list[dict]:
    return [random_request(rng) for _ in range(size)]


def greedy(request: dict) -> bool:
    return request["body"].get("temperature", 1.0) == 0.0


def refused_fields(request: dict) -> list[str]:
    return [f for f in REFUSED if f in request["body"]]


def check_request(request: dict, plain: dict, tree: dict,
                  specific_in_mix: bool = False) -> list[str]:
    """Problems of the tree server's answer to ``request`` (``{"status", "json"
    | "error"}`` each, as ``request_mix_run.send`` returns them).

    Where plain vLLM fails a request itself (a 5xx: e.g. allowed tokens that a
    grammar rejects all of, which its scheduler terminates; a completions stream
    with ``echo`` whose logprobs its frontend cannot render), the tree server's
    answer is not judged, as long as it answers (``plain_failed`` counts those). With
    ``specific_in_mix`` (some request of the mix asks ``logprob_token_ids``), a
    request's top-logprob lists may come back short: vLLM's sampler then returns
    the specific-token layout for its whole batch (docs/sampling.md), on the
    plain server too, depending on which requests share a step."""
    problems: list[str] = []
    ts, ps = tree["status"], plain["status"]
    if plain_failed(plain) and ts is not None:
        return []
    if ts is None or ts >= 500:
        return [f"tree answered {ts}: {tree.get('error', '')[:300]}"]
    if ts // 100 != (ps or 0) // 100:
        fields = refused_fields(request)
        named = [f for f in fields if f in tree.get("error", "")]
        if not (ts // 100 == 4 and ps // 100 == 2 and named):
            problems.append(f"status {ts} where plain answered {ps}: "
                            f"{tree.get('error', '')[:300]}")
        return problems
    if ts // 100 != 2:
        return problems
    problems += answer_problems(request, tree["json"], specific_in_mix)
    if greedy(request):
        got, want = texts(tree["json"]), texts(plain["json"])
        if got != want:
            problems.append(f"greedy answer {got!r} differs from plain's {want!r}")
    return problems


def plain_failed(plain: dict) -> bool:
    """Plain vLLM answered a 5xx (its own failure, not the tree path's)."""
    return plain["status"] is not None and plain["status"] >= 500


def texts(answer: dict) -> list:
    """Per choice: its text (tool calls' arguments for a tool call) and finish reason."""
    out = []
    for c in sorted(answer.get("choices", []), key=lambda c: c.get("index", 0)):
        msg = c.get("message") or {}
        text = c.get("text", msg.get("content"))
        calls = [t["function"]["arguments"] for t in msg.get("tool_calls") or []]
        out.append((text, calls, c.get("finish_reason")))
    return out


def answer_problems(request: dict, answer: dict, specific_in_mix: bool = False) -> list[str]:
    """Fields and counts the request asked for, missing or wrong in ``answer``."""
    body, chat = request["body"], request["api"] == "chat"
    problems = []
    choices = answer.get("choices") or []
    if len(choices) != body.get("n", 1):
        problems.append(f"{len(choices)} choices, asked {body.get('n', 1)}")
    usage = answer.get("usage")
    wants_usage = not request["stream"] or body.get("stream_options", {}).get("include_usage")
    if wants_usage and not (usage and usage.get("completion_tokens") is not None):
        problems.append(f"usage missing: {usage!r}")
    for c in choices:
        problems += _logprob_problems(body, chat, c, specific_in_mix)
    if "prompt_logprobs" in body and not request["stream"]:
        rows = answer.get("prompt_logprobs")
        if rows is None and not any("prompt_logprobs" in c for c in choices):
            problems.append("prompt_logprobs missing")
    return problems


def _logprob_problems(body: dict, chat: bool, choice: dict, specific_in_mix: bool) -> list[str]:
    lp = choice.get("logprobs")
    asked = body.get("logprobs") is not None and body.get("logprobs") is not False  # 0 asks
    if not asked:
        return ["logprobs returned unasked"] if lp else []
    if lp is None:
        return ["logprobs missing"]
    if chat:
        entries = lp.get("content") or []
        k = body.get("top_logprobs", 0) if "logprob_token_ids" not in body else None
        tops = [len(e.get("top_logprobs") or []) for e in entries]
    else:
        entries = lp.get("tokens") or []
        # echo: the prompt's entries carry prompt_logprobs' count, not logprobs'
        k = body["logprobs"] if "logprob_token_ids" not in body and not body.get("echo") \
            else None
        tops = [len(t) for t in lp.get("top_logprobs") or [] if t is not None]  # echo: None first
        if len(lp.get("token_logprobs") or []) != len(entries):
            return ["token_logprobs and tokens differ in length"]
    if choice.get("finish_reason") in ("length", "stop") and not entries \
            and (choice.get("text") or (choice.get("message") or {}).get("content")):
        return ["no logprob entries for a non-empty answer"]
    low = 0 if specific_in_mix else k  # vLLM's whole-batch layout (check_request)
    if k is not None and any(not (low <= t <= k + 1) for t in tops):
        return [f"top-logprob counts {tops}, asked {k}"]
    return []

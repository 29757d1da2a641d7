"""The soak's seeded request mix, and an HTTP client that sends one request of it.

A request is a plain record (``SoakRequest``): where it goes, its body, whether
it streams, when the client walks away from it, and what the server owes it:
``ok`` (a complete answer), ``4xx`` (an error with a message) or ``abort`` (the
client left; the server must just keep serving). The same seed gives the same
mix, so every server of a soak sees the same requests in the same order.

No vLLM import here (aiohttp, numpy-free): the mix is testable without a server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# Requests trees do not reproduce token for token; the tree path must hand them to
# plain decoding (README, "Sampling").
FALLBACK_OPTIONS = (
    ("min_p", {"min_p": 0.05, "temperature": 0.8}),
    ("logit_bias", {"logit_bias": {"13": 5.0}}),
    ("structured_choice", {"structured_outputs": {"choice": ["yes", "no", "maybe"]}}),
    ("bad_words", {"bad_words": ["the"]}),
)
# vLLM (0.27.1, 0.32.0) refuses these with any speculative method (HTTP 400, its own check).
REFUSED_WITH_SPECULATION = ("fallback:min_p", "fallback:logit_bias")
# Tenants (vLLM's cache_salt) taken in turn by the valid requests, None for no
# salt: a server that shares drafts across requests must keep them apart.
TENANTS = ("tenant-a", "tenant-b", None)


@dataclasses.dataclass
class SoakRequest:
    index: int
    kind: str
    path: str
    body: dict[str, Any] | bytes  # bytes: sent as is (malformed JSON)
    stream: bool
    expect: str  # "ok" | "4xx" | "abort"
    abort_after: int | None = None  # data chunks read before the client disconnects

    def expect_on(self, speculative: bool) -> str:
        return "4xx" if speculative and self.kind in REFUSED_WITH_SPECULATION else self.expect

    def unseeded(self) -> "SoakRequest":
        """The same request without a per-request ``seed`` (for the plain server:
        see ``soak.py``)."""
        if not isinstance(self.body, dict) or "seed" not in self.body:
            return self
        body = {k: v for k, v in self.body.items() if k != "seed"}
        return dataclasses.replace(self, body=body)

    @property
    def greedy(self) -> bool:
        """Comparable token for token with another server."""
        return (self.expect == "ok" and isinstance(self.body, dict)
                and self.body.get("temperature") == 0 and self.body.get("n", 1) == 1)


@dataclasses.dataclass
class SoakResult:
    index: int
    kind: str
    expect: str
    status: int | None = None  # None: no HTTP status (connection failed, or aborted early)
    error: str = ""
    texts: list[str] = dataclasses.field(default_factory=list)
    completion_tokens: int = 0
    e2e_s: float = 0.0
    ttft_s: float | None = None
    aborted: bool = False

    @property
    def violation(self) -> str:
        """Why this result breaks the soak's promises ('' when it keeps them)."""
        if self.status is not None and self.status >= 500:
            return f"HTTP {self.status}: {self.error[:200]}"
        if self.expect == "ok":
            if self.status != 200:
                return f"valid request failed: HTTP {self.status} {self.error[:200]}"
            if not self.texts or self.completion_tokens < 1:
                return "valid request returned no tokens"
        if self.expect == "4xx":
            if self.status is None or not 400 <= self.status < 500:
                return f"invalid request got HTTP {self.status}, not a 4xx"
            if "message" not in self.error:
                return "4xx without an error message"
        if self.expect == "abort" and self.status not in (None, 200):
            return f"aborted request got HTTP {self.status}: {self.error[:200]}"
        return ""


def _max_tokens(rng: random.Random, room: int, cap: int) -> int:
    r = rng.random()
    n = (1 if r < 0.05 else rng.randint(2, 32) if r < 0.5 else rng.randint(33, 128) if r < 0.9
         else rng.randint(129, 512))
    return max(1, min(n, room, cap))


def _sampling(rng: random.Random, greedy_share: float) -> dict[str, Any]:
    if rng.random() < greedy_share:
        return {"temperature": 0}
    out: dict[str, Any] = {"temperature": rng.choice([0.7, 1.0]), "n": rng.choice([1, 1, 2, 4])}
    if rng.random() < 0.5:
        out["top_p"] = 0.9
    if rng.random() < 0.5:
        out["top_k"] = 20
    if rng.random() < 0.3:
        out["seed"] = rng.randrange(1 << 20)
    return out


def build_mix(n: int, seed: int, model: str, texts: list[str], token_pool: list[int],
              max_model_len: int, greedy_share: float = 0.5,
              max_tokens_cap: int = 512) -> list[SoakRequest]:
    """``n`` seeded requests: chat and completions, streaming or not, greedy or
    sampled (top-p/top-k, n up to 4, seeds), stop strings, logprobs, max_tokens
    1..512 (at most ``max_tokens_cap``), prompts from 1 token to near
    ``max_model_len`` (token-id prompts cut from ``token_pool``), requests that
    need the non-tree fallback, client aborts mid-stream, and invalid requests;
    the valid ones of ``TENANTS`` in turn (by index: the rest of the mix does not
    depend on them)."""
    rng = random.Random(seed)
    out = []
    for i, kind in enumerate(_kinds(n, rng)):
        if kind == "invalid":
            out.append(_invalid(i, rng, model, token_pool, max_model_len))
            continue
        stream = kind == "abort" or rng.random() < 0.5
        body: dict[str, Any] = {"model": model, **_sampling(rng, greedy_share)}
        if kind == "completion":
            length = rng.choice([1, rng.randint(2, 64), rng.randint(65, 400),
                                 max_model_len - rng.randint(8, 40)])
            start = rng.randrange(max(1, len(token_pool) - length))
            body["prompt"] = (token_pool[start:start + length] if rng.random() < 0.5 or length > 400
                              else rng.choice(texts))
            room = max_model_len - (length if isinstance(body["prompt"], list) else 512)
            path = COMPLETIONS
        else:
            body["messages"] = [{"role": "user", "content": rng.choice(texts)}]
            room, path = max_model_len - 512, CHAT
        body["max_tokens"] = _max_tokens(rng, room, max_tokens_cap)
        if rng.random() < 0.2:
            body["stop"] = rng.choice([["\n\n"], ["."], ["def ", "\n\n\n"]])
        if rng.random() < 0.2:
            body.update({"logprobs": True, "top_logprobs": 2} if path == CHAT else {"logprobs": 2})
        if kind == "fallback":
            name, extra = rng.choice(FALLBACK_OPTIONS)
            kind = f"fallback:{name}"
            body.update(extra)
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        tenant = TENANTS[i % len(TENANTS)]
        if tenant is not None:
            body["cache_salt"] = tenant
        out.append(SoakRequest(i, kind, path, body, stream,
                               expect="abort" if kind == "abort" else "ok",
                               abort_after=rng.randint(1, 8) if kind == "abort" else None))
    return out


def preemption_burst(model: str, token_pool: list[int], kv_blocks: int, max_seqs: int,
                     block_size: int, max_model_len: int) -> list[SoakRequest]:
    """Greedy requests, sent at once, that must preempt one another: preemption by
    construction, not by how the mix happens to interleave.

    vLLM keeps one of the ``kv_blocks`` as its null block, so ``U = kv_blocks - 1``
    hold KV. ``n = min(max_seqs, U)`` requests get prompts of ``p * B - B/2``
    tokens (``p = U // n`` blocks each, with room for a tree's lookahead of up to
    B/2 slots), so all ``n`` fit at once; each must then decode ``g * B`` tokens
    (``ignore_eos``), ending in ``p + g`` blocks, with the least ``g`` for which
    even ``n - 1`` of them need more than ``U``. So some running request finds no
    free block and vLLM preempts another (a preempted request is recomputed, never
    lost). Each prompt starts with its own token, so no two share a prefix-cached
    block. Empty when the cache is too large for ``max_model_len`` to force it
    (the mix may still preempt)."""
    usable = kv_blocks - 1
    n = min(max_seqs, max(1, usable))
    per_request = usable // n
    grow = 1
    while n >= 3 and (n - 1) * (per_request + grow) <= usable:
        grow += 1
    prompt_len, answer = per_request * block_size - block_size // 2, grow * block_size
    heads = sorted(set(token_pool))
    if n < 3 or prompt_len + answer > max_model_len or len(heads) < n:
        return []
    burst = []
    for i in range(n):
        start = (i * prompt_len) % max(1, len(token_pool) - prompt_len)
        prompt = [heads[i]] + (token_pool * 2)[start:start + prompt_len - 1]
        body = {"model": model, "prompt": prompt, "max_tokens": answer, "temperature": 0,
                "ignore_eos": True}
        burst.append(SoakRequest(-1 - i, "preempt", COMPLETIONS, body, False, expect="ok"))
    return burst


KINDS = ("invalid", "abort", "fallback", "completion", "chat")
_KIND_SHARES = (0.08, 0.08, 0.10, 0.32, 0.42)


def _kinds(n: int, rng: random.Random) -> list[str]:
    """Seeded kinds in their shares; a mix of at least ``len(KINDS)`` requests holds
    every kind (a short soak must still abort and send bad input)."""
    kinds = rng.choices(KINDS, weights=_KIND_SHARES, k=n)
    for kind in KINDS if n >= len(KINDS) else ():
        if kind not in kinds:
            # Take the slot from the most common kind, so the others keep theirs.
            most = max(KINDS, key=kinds.count)
            kinds[rng.choice([i for i, k in enumerate(kinds) if k == most])] = kind
    return kinds


def _invalid(i: int, rng: random.Random, model: str, token_pool: list[int],
             max_model_len: int) -> SoakRequest:
    base = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
    sub = rng.choice(["negative_max_tokens", "prompt_too_long", "unknown_model",
                      "malformed_json", "wrong_type"])
    path, body = CHAT, dict(base)
    if sub == "negative_max_tokens":
        body["max_tokens"] = -5
    elif sub == "prompt_too_long":
        path = COMPLETIONS
        body = {"model": model, "max_tokens": 8,
                "prompt": (token_pool * 2)[: max_model_len + 16]}
    elif sub == "unknown_model":
        body["model"] = "no-such-model"
    elif sub == "malformed_json":
        body = b'{"model": "' + model.encode() + b'", "messages": [{"role": "user", '
    else:
        body["temperature"] = "hot"
    return SoakRequest(i, f"invalid:{sub}", path, body, False, expect="4xx")


async def send(session, base_url: str, req: SoakRequest, speculative: bool = False,
               timeout_s: float = 900) -> SoakResult:
    """One request; never raises (a transport error is recorded as the result)."""
    import aiohttp

    res = SoakResult(req.index, req.kind, req.expect_on(speculative))
    t0 = time.perf_counter()
    data = req.body if isinstance(req.body, bytes) else json.dumps(req.body).encode()
    try:
        async with session.post(base_url + req.path, data=data,
                                headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            res.status = resp.status
            if resp.status != 200:
                res.error = await resp.text()
            elif req.stream:
                await _read_stream(resp, req, res, t0)
            else:
                payload = await resp.json()
                res.texts = _texts(payload["choices"])
                res.completion_tokens = payload.get("usage", {}).get("completion_tokens", 0)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, KeyError) as e:
        res.status, res.error = None, f"{type(e).__name__}: {e}"
    res.e2e_s = time.perf_counter() - t0
    return res


async def _read_stream(resp, req: SoakRequest, res: SoakResult, t0: float) -> None:
    pieces: dict[int, list[str]] = {}
    chunks = 0
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            res.status, res.error = stream_error_status(chunk["error"])
            return
        chunks += 1
        for choice in chunk.get("choices", []):
            piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if piece and res.ttft_s is None:
                res.ttft_s = time.perf_counter() - t0
            pieces.setdefault(choice["index"], []).append(piece)
        if chunk.get("usage"):
            res.completion_tokens = chunk["usage"].get("completion_tokens", 0)
        if req.abort_after is not None and chunks >= req.abort_after:
            res.aborted = True
            resp.close()
            return
    res.texts = ["".join(pieces[k]) for k in sorted(pieces)]


def stream_error_status(error) -> tuple[int, str]:
    """(HTTP status, the error as JSON) of an error event in a 200 stream: vLLM
    validates some streamed requests only after the header (e.g. min-p under
    speculation) and puts the HTTP code it means in the error; without one it
    is a server failure."""
    err = error if isinstance(error, dict) else {"message": str(error)}
    code = err.get("code")
    return (code if isinstance(code, int) and 400 <= code < 600 else 500), json.dumps(err)


def _texts(choices: list[dict]) -> list[str]:
    return [c.get("text") if "text" in c else (c.get("message") or {}).get("content") or ""
            for c in sorted(choices, key=lambda c: c["index"])]


async def run_load(base_url: str, requests: list[SoakRequest], concurrency: int,
                   speculative: bool = False) -> list[SoakResult]:
    """All ``requests`` with at most ``concurrency`` in flight, results in order."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one(req):
            async with sem:
                return await send(session, base_url, req, speculative)
        return list(await asyncio.gather(*(one(r) for r in requests)))

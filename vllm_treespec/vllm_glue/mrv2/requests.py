"""Requests ``eagle3_tree`` on MRV2 refuses by name at the frontend (HTTP 400).

On V1 a request whose sampling parameters tree acceptance cannot reproduce decodes
without a tree in the same batch (``tree_sampler.tree_safe``). MRV2 verifies the
same number of drafts for every request, and its chain rejection sampler would
verify a tree's BFS drafts against draft probabilities no tree step computes, so
such a request has no exact tree-free path on MRV2 yet: it is refused before it
reaches the engine, the parameter named, as ``request_checks`` refuses on V1
(vLLM answers a ``VLLMValidationError`` raised in ``InputProcessor._validate_params``
with a 400). Seeds, temperature, top-k and top-p are served (``sampler``); min-p at
temperature 0 too (greedy never loses its argmax to it)."""

from __future__ import annotations

from typing import Any

from vllm_treespec.engine.accept import SAMPLING_EPS

# parameter -> (is it set on these params?, why the tree path cannot serve it)
_PENALTY = "penalties apply over each node's own path, which MRV2's sampler state " \
           "does not give tree acceptance yet"
_MASK = "MRV2 applies it in its chain-shaped logits processors, which tree nodes " \
        "do not have"
CHECKS: dict[str, tuple[Any, str]] = {
    "repetition_penalty": (lambda p: p.repetition_penalty != 1.0, _PENALTY),
    "frequency_penalty": (lambda p: p.frequency_penalty != 0.0, _PENALTY),
    "presence_penalty": (lambda p: p.presence_penalty != 0.0, _PENALTY),
    "min_p": (lambda p: p.min_p != 0.0 and p.temperature >= SAMPLING_EPS,
              "tree acceptance does not apply it at temperature > 0"),
    "logit_bias": (lambda p: bool(p.logit_bias), _MASK),
    "allowed_token_ids": (lambda p: p.allowed_token_ids is not None, _MASK),
    "bad_words": (lambda p: bool(p.bad_words) or bool(getattr(p, "bad_words_token_ids", None)),
                  _MASK),
    "min_tokens": (lambda p: bool(p.min_tokens), _MASK),
    "structured_outputs": (lambda p: p.structured_outputs is not None,
                           "grammars mask chain positions on MRV2, not tree nodes"),
    "logits_processors": (lambda p: bool(getattr(p, "logits_processors", None)), _MASK),
    "logprobs": (lambda p: p.logprobs is not None,
                 "logprobs of a tree's accepted nodes are not computed on MRV2 yet"),
    "logprob_token_ids": (lambda p: bool(getattr(p, "logprob_token_ids", None)),
                          "logprobs of a tree's accepted nodes are not computed on MRV2 yet"),
}


def mrv2_refusal(params: Any) -> tuple[str, Any, str] | None:
    """(parameter, value, message) of the first parameter of ``params`` (a
    ``SamplingParams``) that eagle3_tree on MRV2 refuses, else None."""
    if not hasattr(params, "temperature"):
        return None  # pooling requests: not decoded
    for name, (is_set, why) in CHECKS.items():
        if is_set(params):
            value = getattr(params, name, None)
            return name, value, (
                f"request parameter '{name}' has value {value!r}, which speculative method "
                f"'eagle3_tree' on vLLM's Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1) does "
                f"not serve ({why}); allowed: unset, or the V1 runner "
                f"(VLLM_USE_V2_MODEL_RUNNER=0), which serves it (docs/mrv2.md)")
    return None

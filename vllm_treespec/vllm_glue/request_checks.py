"""Requests a tree engine refuses by name (HTTP 400), before they reach the engine.

vLLM validates each request's sampling parameters in its frontend
(``InputProcessor._validate_params``); a ``VLLMValidationError`` raised there is
answered with a 400 that names the parameter, and the engine never sees the
request. The few parameters the tree path cannot serve as plain vLLM serves them,
in any batch, are refused there:

* ``thinking_token_budget``: vLLM forces the end-of-thinking tokens through a
  state holder whose rows, with speculation configured, follow a chain's layout
  (``num_speculative_tokens + 1`` rows a request). A tree's node rows do not, and
  the rows of a tree step's requests without a tree do not either, so the forced
  tokens would land on other requests' rows or on none: text that differs from
  plain vLLM's once the budget runs out.

Everything else a request can ask for is served, with a tree or without one
(``tree_sampler.tree_safe``); on vLLM's Model Runner V2, which has no tree-free
rows yet, more are refused the same way (``mrv2.requests.mrv2_refusal``).
"""

from __future__ import annotations

from typing import Any

from vllm_treespec.vllm_glue.spec_config import METHOD, tree_config_from_vllm

REFUSED = {
    "thinking_token_budget": (
        "its forced end-of-thinking tokens follow a chain's row layout, which draft "
        "trees do not have"),
}


def refusal(params: Any) -> tuple[str, Any, str] | None:
    """(parameter, value, message) for a request a tree engine refuses, else None.
    A parameter counts as a ``SamplingParams`` field or as an extra argument."""
    for name, why in REFUSED.items():
        value = getattr(params, name, None)
        if value is None:
            value = (getattr(params, "extra_args", None) or {}).get(name)
        if value is not None:
            return name, value, (
                f"request parameter '{name}' has value {value!r}, which speculative method "
                f"'{METHOD}' does not serve ({why}); allowed: unset, or a server without "
                f"speculation or with a stock method")
    return None


def patch_request_validation() -> None:
    """Wrap ``InputProcessor._validate_params`` (idempotent): on an engine
    configured with eagle3_tree, a refused parameter raises vLLM's validation
    error (a 400 naming it) after vLLM's own checks pass."""
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_treespec.vllm_glue.mrv2.requests import mrv2_refusal
    from vllm_treespec.vllm_glue.versions import uses_model_runner_v2

    original = InputProcessor._validate_params
    if getattr(original, "_treespec_wrapped", False):
        return

    def _validate_params(self, params, *args, **kwargs):
        result = original(self, params, *args, **kwargs)
        if tree_config_from_vllm(self.vllm_config) is not None:
            refused = refusal(params)
            if refused is None and uses_model_runner_v2(self.vllm_config):
                refused = mrv2_refusal(params)  # MRV2 has no tree-free rows yet
            if refused is not None:
                name, value, message = refused
                raise VLLMValidationError(message, parameter=name, value=value)
        return result

    _validate_params._treespec_wrapped = True  # type: ignore[attr-defined]
    InputProcessor._validate_params = _validate_params

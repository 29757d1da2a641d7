"""Settings of the Ascend tree attention: environment variables and their resolution.

Owns the environment variable names and their defaults, :class:`AscendTreeSettings`,
:func:`resolve_settings` and :func:`requested_settings`. Imports :mod:`.constants` (and, lazily,
:mod:`vllm_treespec.config`).
"""

from __future__ import annotations

import dataclasses

from vllm_treespec.attention.ascend.constants import FULL_MASK, TRITON, VARIANTS

EXEC_MODE_ENV = "VLLM_TREESPEC_EXEC_MODE"            # "fused" | "reference"
VARIANT_ENV = "VLLM_TREESPEC_ASCEND_VARIANT"         # one of VARIANTS
FULL_GRAPH_ENV = "VLLM_TREESPEC_ASCEND_FULL_GRAPH"   # "1": capture tree verify in ACL graphs


@dataclasses.dataclass(frozen=True)
class AscendTreeSettings:
    exec_mode: str        # "fused" or "reference"
    variant: str          # requested fused variant
    full_graph: bool      # capture tree verify in FULL ACL graphs


# Values of the Ascend-only variables that ask for nothing (also what unset means).
DEFAULTS = {VARIANT_ENV: FULL_MASK, FULL_GRAPH_ENV: "0"}


def requested_settings(environ: dict[str, str]) -> list[str]:
    """``$NAME='value'`` of each Ascend-only variable set to other than its
    default (on another platform it would be ignored)."""
    return [f"${name}={environ[name]!r}" for name, default in DEFAULTS.items()
            if environ.get(name, default) not in ("", default)]


def resolve_settings(config_exec_mode: str, environ: dict[str, str]) -> AscendTreeSettings:
    """Settings from the tree config and the environment (the environment wins,
    so a deployment can switch to the debuggable path without editing its
    config). Errors name the variable, the value and what is allowed."""
    from vllm_treespec.config import EXEC_MODES, TreeSpecConfigError

    exec_mode = environ.get(EXEC_MODE_ENV) or config_exec_mode
    if exec_mode not in EXEC_MODES:
        raise TreeSpecConfigError(f"eagle3_tree: ${EXEC_MODE_ENV} has invalid value "
                                  f"{exec_mode!r}; allowed: {' or '.join(map(repr, EXEC_MODES))}")
    variant = environ.get(VARIANT_ENV) or DEFAULTS[VARIANT_ENV]
    if variant not in VARIANTS:
        raise TreeSpecConfigError(f"eagle3_tree: ${VARIANT_ENV} has invalid value "
                                  f"{variant!r}; allowed: {', '.join(map(repr, VARIANTS))}")
    flag = environ.get(FULL_GRAPH_ENV, DEFAULTS[FULL_GRAPH_ENV])
    if flag not in ("0", "1"):
        raise TreeSpecConfigError(f"eagle3_tree: ${FULL_GRAPH_ENV} has invalid value "
                                  f"{flag!r}; allowed: '0' or '1'")
    if variant == TRITON and flag == "1":
        raise TreeSpecConfigError(f"eagle3_tree: ${VARIANT_ENV}={TRITON!r} launches a Triton "
                                  f"kernel, which is not captured in ACL graphs; unset "
                                  f"${FULL_GRAPH_ENV} or choose another variant")
    return AscendTreeSettings(exec_mode, variant, flag == "1")

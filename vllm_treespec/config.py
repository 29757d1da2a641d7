"""User-facing knobs of the ``eagle3_tree`` speculative method.

No vLLM import: the vLLM glue hands us the tree keys of ``--speculative-config``
and we validate them here, at startup, with a pydantic model (types and ranges
as field constraints, the relations between keys in one model validator). Every
error names the key, the value it got and what is allowed, so that a bad flag
fails before a model is loaded rather than mid-serving.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

# Ranges. The node budget bounds the verify query per request (1 + num_nodes
# tokens); depth bounds the number of drafter forwards per step.
NUM_NODES_RANGE = (1, 256)
DEPTH_RANGE = (1, 32)
TOP_K_RANGE = (1, 64)
EXEC_MODES = ("reference", "fused")
DRAFT_MODES = ("sequential", "parallel")
DEPTH_WEIGHT_RANGE = (0.25, 4.0)
COPY_BRANCHES_RANGE = (0, 8)
COPY_LENGTH_RANGE = (1, 32)
GRAMMAR_FORCED_TOKENS_RANGE = (0, 32)
# Tokens the cross-request store holds at most (about half a kilobyte of host
# memory a token: tree.shared_suffixes); 0 turns copies from other requests off.
CROSS_REQUEST_TOKENS_RANGE = (0, 262144)
# Copy branches are on unless a static tree is asked for (its topology is fixed);
# a branch is at most COPY_LENGTH_DEFAULT tokens, and never more than the tree's
# node budget.
COPY_BRANCHES_DEFAULT = 2
COPY_LENGTH_DEFAULT = 8


class TreeSpecConfigError(ValueError):
    """A tree speculation setting is invalid (raised at startup)."""


def _fail(key: str, value: Any, allowed: str) -> TreeSpecConfigError:
    return TreeSpecConfigError(
        f"eagle3_tree: speculative-config key {key!r} has invalid value {value!r}; "
        f"allowed: {allowed}"
    )


def validate_choices(choices: Any, key: str = "choices") -> tuple[tuple[int, ...], ...]:
    """Validate a static tree given as Medusa-style choices.

    Each choice is the path of child ranks from the root, e.g. ``[0, 1]`` is the
    second-best child of the best child of the root. The set must be closed under
    prefixes (every node's parent is present), without duplicates.
    """
    if not isinstance(choices, Sequence) or isinstance(choices, (str, bytes)) or not choices:
        raise _fail(key, choices, "a non-empty list of paths such as [[0], [1], [0, 0]]")
    paths: list[tuple[int, ...]] = []
    for i, path in enumerate(choices):
        if not isinstance(path, Sequence) or isinstance(path, (str, bytes)) or not path:
            raise _fail(f"{key}[{i}]", path, "a non-empty list of child ranks, e.g. [0, 1]")
        for r in path:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < TOP_K_RANGE[1]:
                raise _fail(f"{key}[{i}]", list(path),
                            f"child ranks are integers in [0, {TOP_K_RANGE[1] - 1}]")
        if len(path) > DEPTH_RANGE[1]:
            raise _fail(f"{key}[{i}]", list(path), f"paths of length <= {DEPTH_RANGE[1]}")
        paths.append(tuple(int(r) for r in path))
    seen = set()
    for i, path in enumerate(paths):
        if path in seen:
            raise _fail(f"{key}[{i}]", list(path), "each path at most once")
        seen.add(path)
    for i, path in enumerate(paths):
        if len(path) > 1 and path[:-1] not in seen:
            raise _fail(f"{key}[{i}]", list(path),
                        f"paths whose parent path {list(path[:-1])} is also listed")
    if len(paths) > NUM_NODES_RANGE[1]:
        raise _fail(key, f"<{len(paths)} paths>", f"at most {NUM_NODES_RANGE[1]} paths")
    return tuple(paths)


# What each key allows, in the words of the error messages (pydantic's own
# messages would not say the range).
_ALLOWED = {
    "num_nodes": "an integer in [{}, {}]".format(*NUM_NODES_RANGE),
    "depth": "an integer in [{}, {}]".format(*DEPTH_RANGE),
    "top_k": "an integer in [{}, {}]".format(*TOP_K_RANGE),
    "exec_mode": " or ".join(repr(m) for m in EXEC_MODES),
    "draft": " or ".join(repr(m) for m in DRAFT_MODES),
    "validate_invariants": "true or false",
    "adaptive": "true or false",
    "trace_dir": "a directory path (string) or null",
    "depth_weight": "a number in [{}, {}]".format(*DEPTH_WEIGHT_RANGE),
    "copy_branches": "an integer in [{}, {}]".format(*COPY_BRANCHES_RANGE),
    "copy_length": "an integer in [{}, {}]".format(*COPY_LENGTH_RANGE),
    "cross_request_tokens": "an integer in [{}, {}]".format(*CROSS_REQUEST_TOKENS_RANGE),
    "cross_request_prompts": "true or false",
    "cross_request_unsalted": "true or false",
    "grammar_forced_tokens": "an integer in [{}, {}]".format(*GRAMMAR_FORCED_TOKENS_RANGE),
}


def _from_validation(error: ValidationError) -> TreeSpecConfigError:
    """The first problem pydantic found, worded as key, value and what is allowed."""
    first = error.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, TreeSpecConfigError):  # raised by our own validators
        return cause
    key = ".".join(str(part) for part in first["loc"])
    if first["type"] == "extra_forbidden":
        return TreeSpecConfigError(
            f"eagle3_tree: unknown speculative-config key(s) [{key!r}]; "
            f"tree keys are {list(TreeSpecConfig.keys())}")
    return _fail(key, first["input"], _ALLOWED.get(key, first["msg"]))


class TreeSpecConfig(BaseModel):
    """Validated settings of the ``eagle3_tree`` method.

    num_nodes: node budget M — draft tokens verified per request per step
        (the verify query is 1 + M tokens: the last accepted token + M nodes).
    depth: maximum tree depth D (number of drafter forwards per step).
    top_k: children expanded per frontier node, and frontier width, per depth.
    choices: optional static tree (Medusa-style paths of child ranks); when set,
        the topology is fixed and num_nodes/depth follow from it.
    exec_mode: ``fused`` (device-optimised attention) or ``reference`` (eager,
        debuggable tree attention with invariant checks on).
    validate_invariants: check every tree and its metadata each step and dump
        the failing batch (slow; for debugging).
    trace_dir: write a run manifest and per-step JSONL traces there (also
        enabled by ``$VLLM_TREESPEC_TRACE_DIR``).
    adaptive: size each step's trees with a live cost model (fewer nodes, a
        shallower tree, or no speculation at all as the batch grows); with
        false, every request gets the full ``num_nodes``/``depth`` tree.
    draft: ``sequential`` (one drafter forward per tree level, EAGLE-3) or
        ``parallel`` (one forward for the whole tree: a head trained for
        parallel drafting, P-EAGLE, gives the marginal of every depth at once,
        and the tree ranks paths by the product of the marginals).
    depth_weight: which ``num_nodes`` candidates a dynamic tree verifies (and
        which nodes each level expands): those of highest path draft
        probability times ``depth_weight`` per level.
        1 is EAGLE-2's rule; a little above 1 (1.2) favours deeper nodes, which
        accept more than their draft probability says (``bench/trace_replay.py
        selection``). The adaptive budget still sizes trees from the draft probabilities.
    copy_branches: up to this many copy branches a request per step besides
        the drafter's (``tree.copy_drafts``): the continuations that followed
        the request's last tokens where they occurred before in its prompt or
        output, verified in the same tree; 0 turns copies off. Default 2, and
        0 with ``choices``.
    copy_length: tokens of a copy branch at most (the adaptive budget keeps
        the part whose live acceptance estimate pays for its verification).
        Default 8, or ``num_nodes`` if that is smaller.
    cross_request_tokens: copies from other requests too: the outputs of
        finished requests of the same tenant (``cache_salt`` and LoRA adapter),
        at most this many tokens held, oldest out first; up to ``copy_branches``
        more branches a request per step, priced by their own acceptance
        estimate. 0 (the default) shares nothing across requests.
    cross_request_prompts: file finished requests' prompts with their outputs
        (default false: prompts are never shared).
    cross_request_unsalted: requests without a ``cache_salt`` share too, among
        themselves (per LoRA adapter). Default false: such a request's output
        is never filed and it looks nothing up.
    grammar_forced_tokens: structured-output requests (xgrammar) get trees
        under their grammar: drafts it rejects are cut, and where it forces
        tokens (a JSON key, a closing brace), up to this many are grafted as a
        branch without drafting them (``vllm_glue.grammar_trees``). 0: the
        grammar only cuts. Default 8.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Strict types: bool is an int subclass, and `"depth": true` is a typo, not 1.
    num_nodes: StrictInt = Field(32, ge=NUM_NODES_RANGE[0], le=NUM_NODES_RANGE[1])
    depth: StrictInt = Field(6, ge=DEPTH_RANGE[0], le=DEPTH_RANGE[1])
    top_k: StrictInt = Field(8, ge=TOP_K_RANGE[0], le=TOP_K_RANGE[1])
    choices: tuple[tuple[int, ...], ...] | None = None
    exec_mode: Literal[EXEC_MODES] = "fused"  # type: ignore[valid-type]
    validate_invariants: StrictBool = False
    trace_dir: StrictStr | None = Field(None, min_length=1)
    adaptive: StrictBool = True
    draft: Literal[DRAFT_MODES] = "sequential"  # type: ignore[valid-type]
    depth_weight: float = Field(1.0, ge=DEPTH_WEIGHT_RANGE[0], le=DEPTH_WEIGHT_RANGE[1])
    copy_branches: StrictInt = Field(COPY_BRANCHES_DEFAULT, ge=COPY_BRANCHES_RANGE[0],
                                     le=COPY_BRANCHES_RANGE[1])
    copy_length: StrictInt = Field(COPY_LENGTH_DEFAULT, ge=COPY_LENGTH_RANGE[0],
                                   le=COPY_LENGTH_RANGE[1])
    cross_request_tokens: StrictInt = Field(0, ge=CROSS_REQUEST_TOKENS_RANGE[0],
                                            le=CROSS_REQUEST_TOKENS_RANGE[1])
    cross_request_prompts: StrictBool = False
    cross_request_unsalted: StrictBool = False
    grammar_forced_tokens: StrictInt = Field(8, ge=GRAMMAR_FORCED_TOKENS_RANGE[0],
                                             le=GRAMMAR_FORCED_TOKENS_RANGE[1])

    def __init__(self, **data: Any) -> None:
        # Direct construction fails the way from_dict does.
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise _from_validation(e) from None

    @model_validator(mode="before")
    @classmethod
    def _copy_defaults(cls, data: Any) -> Any:
        # Defaults that depend on other keys; a key given explicitly is kept as
        # given (and validated below).
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("choices") is not None:
            data.setdefault("copy_branches", 0)
        num_nodes = data.get("num_nodes", cls.model_fields["num_nodes"].default)
        if isinstance(num_nodes, int) and not isinstance(num_nodes, bool) and num_nodes >= 1:
            data.setdefault("copy_length", min(COPY_LENGTH_DEFAULT, num_nodes))
        return data

    @field_validator("depth_weight", mode="before")
    @classmethod
    def _number(cls, value: Any) -> Any:
        # JSON numbers only: not true/false, not "1.2" (pydantic would coerce both).
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail("depth_weight", value, _ALLOWED["depth_weight"])
        return value

    @field_validator("choices", mode="before")
    @classmethod
    def _paths(cls, choices: Any) -> Any:
        return None if choices is None else validate_choices(choices)

    @model_validator(mode="after")
    def _consistent(self) -> "TreeSpecConfig":
        if self.choices is not None and self.draft == "parallel":
            raise _fail("draft", self.draft, "'sequential' with 'choices' (a static tree "
                        "ranks children per node; parallel drafting gives one ranking per depth)")
        if self.choices is not None and self.copy_branches:
            raise _fail("copy_branches", self.copy_branches, "0 with 'choices' (a static "
                        "tree verifies its fixed topology only)")
        if self.cross_request_tokens and not self.copy_branches:
            raise _fail("cross_request_tokens", self.cross_request_tokens,
                        "0 with copy_branches 0 (copies from other requests are copy "
                        "branches)")
        if self.cross_request_prompts and not self.cross_request_tokens:
            raise _fail("cross_request_prompts", self.cross_request_prompts,
                        "false with cross_request_tokens 0 (nothing is shared)")
        if self.cross_request_unsalted and not self.cross_request_tokens:
            raise _fail("cross_request_unsalted", self.cross_request_unsalted,
                        "false with cross_request_tokens 0 (nothing is shared)")
        if self.choices is not None and self.depth_weight != 1.0:
            raise _fail("depth_weight", self.depth_weight, "1 with 'choices' (a static tree "
                        "verifies all its nodes; there is nothing to rank)")
        if self.choices is not None:
            paths = self.choices
            for key, implied in (("num_nodes", len(paths)),
                                 ("depth", max(len(p) for p in paths))):
                if getattr(self, key) != implied:
                    raise _fail(key, getattr(self, key),
                                f"{implied} (implied by 'choices'), or leave it out")
            least = max(p[-1] for p in paths) + 1
            if self.top_k < least:
                raise _fail("top_k", self.top_k, f"an integer in [{least}, {TOP_K_RANGE[1]}]")
            return self
        if self.depth > self.num_nodes:
            raise _fail("depth", self.depth,
                        f"an integer in [1, num_nodes={self.num_nodes}] (a tree of "
                        f"{self.num_nodes} nodes is at most {self.num_nodes} deep)")
        if self.copy_branches and self.copy_length > self.num_nodes:
            raise _fail("copy_length", self.copy_length,
                        f"an integer in [1, num_nodes={self.num_nodes}] (a copy branch is "
                        f"verified within the node budget)")
        if self.num_nodes > self.max_candidates():
            raise _fail("num_nodes", self.num_nodes,
                        f"an integer in [1, {self.max_candidates()}]: a tree of depth "
                        f"{self.depth} with top_k {self.top_k} holds at most "
                        f"{self.max_candidates()} candidates")
        return self

    # --- derived -------------------------------------------------------
    @property
    def is_static(self) -> bool:
        return self.choices is not None

    @property
    def draft_width(self) -> int:
        """Children the drafter proposes a node at most."""
        if self.choices is None:
            return self.top_k
        return max(p[-1] for p in self.choices) + 1

    @property
    def max_children(self) -> int:
        """Upper bound on the children of any verified node (width of child
        tables): the drafter's, and a child a copy branch (own history, and
        other requests')."""
        return self.draft_width + self.copy_branches * (1 + bool(self.cross_request_tokens))

    @property
    def tree_size(self) -> int:
        """T = 1 + M: query tokens of one request in a verify step."""
        return 1 + self.num_nodes

    def max_candidates(self, depth: int | None = None) -> int:
        """Candidates a dynamic tree of ``depth`` (default: the configured one)
        ranks: K at depth 1, K*K at each deeper level."""
        depth = self.depth if depth is None else depth
        return self.top_k + (depth - 1) * self.top_k * self.top_k

    # --- construction --------------------------------------------------
    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(cls.model_fields)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> "TreeSpecConfig":
        """Build from the tree keys of ``--speculative-config`` (unknown keys are errors)."""
        raw = dict(raw or {})
        unknown = sorted(set(raw) - set(cls.keys()))
        if unknown:
            raise TreeSpecConfigError(
                f"eagle3_tree: unknown speculative-config key(s) {unknown}; "
                f"tree keys are {list(cls.keys())}"
            )
        if raw.get("choices") is not None:
            # A static tree implies its size, depth and minimum width.
            paths = validate_choices(raw["choices"])
            raw.setdefault("num_nodes", len(paths))
            raw.setdefault("depth", max(len(p) for p in paths))
            raw.setdefault("top_k", max(p[-1] for p in paths) + 1)
            raw["choices"] = paths
        return cls(**raw)

    def to_dict(self) -> dict[str, Any]:
        out = self.model_dump()
        if self.choices is not None:
            out["choices"] = [list(p) for p in self.choices]
        return out

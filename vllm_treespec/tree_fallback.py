"""The step goes on when a request's tree is malformed: ``validated`` checks a
batch of trees (``validate_invariants``), dumps a malformed one to
``treespec-failure-<time>.json`` (in ``trace_dir`` or the temp dir) and has the
caller put a safe stand-in (no drafts, or a chain) in its place.

No vLLM import here.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

from vllm_treespec.jsonl import write_json_atomic

logger = logging.getLogger("vllm.treespec")


def validated(build: Callable[[], Any], vocab_size: int, repair: Callable[[int], None],
              stage: str, req_ids: Sequence[str], prefix_len: Sequence[int],
              trace_dir: str | None, check: bool = True,
              lists: Callable[[], list] | None = None):
    """The ``TreeBatch`` ``build()`` returns (row b: request ``req_ids[b]``), once
    every request's tree is well formed: ``build`` did not refuse it and, with
    ``check``, it passes ``validate``.

    A malformed request tree is dumped (with ``stage``, the drafter's or the
    verifier's, the rows' prefix lengths, and the trees: ``lists()`` where
    ``build`` refused them) and ``repair(request)`` puts a safe stand-in in its
    place before the next ``build()``: the step goes on for every request. A
    repair that is malformed again raises.
    """
    from vllm_treespec.tree import TreeInvariantError

    repaired: set[int] = set()
    while True:
        tree = None
        try:
            tree = build()
            if check:
                tree.validate(vocab_size=vocab_size)
            return tree
        except TreeInvariantError as err:
            if err.request in repaired:
                raise
            repaired.add(err.request)
            trees = tree.to_lists() if tree is not None else lists() if lists else None
            dump_failure(err, {"stage": stage, "request_id": req_ids[err.request],
                               "trees": trees, "prefix_len": [int(n) for n in prefix_len],
                               "req_ids": list(req_ids)}, trace_dir)
            repair(err.request)


def dump_failure(error: Exception, payload: dict[str, Any], directory: str | None) -> Path:
    """Write the failing batch for offline inspection; return the file path."""
    base = Path(directory).expanduser() if directory else Path(tempfile.gettempdir())
    path = base / f"treespec-failure-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"
    write_json_atomic(path, {"error": repr(error), **payload})
    logger.error("eagle3_tree: %s — batch dumped to %s; continuing without this tree",
                 error, path)
    return path

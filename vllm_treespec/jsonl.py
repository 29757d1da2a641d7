"""JSON and JSON Lines files, written atomically (a reader never sees half a file).

No vLLM import here.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


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

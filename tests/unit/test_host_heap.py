"""The idle heap trim (``host_heap``): free heap that glibc keeps goes back to the
OS at an idle moment, and only once the process has grown enough to matter.

Each case runs in a fresh interpreter: in a long test process the heap's holes
would take the blocks below and free() could return them by itself."""

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from vllm_treespec.vllm_glue import host_heap

pytestmark = pytest.mark.skipif(host_heap._MALLOC_TRIM is None,
                                reason="malloc_trim needs glibc")

BLOCK = 96 << 10  # under glibc's 128 KiB mmap threshold: served from the heap
COUNT = 2000  # ~190 MB
MB = 1 << 20


def scenario(delay_trim: bool) -> dict:
    """~190 MB of heap blocks, touched and then freed, each followed by a small
    block that stays allocated, so that free() can neither merge them nor hand
    them back by shrinking the heap's top: freed memory glibc keeps, like a
    served step's temporaries between live tensors. Then the idle trim; with
    ``delay_trim``, first a trimmer that trimmed a moment ago (negative control)."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    process = psutil.Process()
    blocks, pins = [], []
    for _ in range(COUNT):
        blocks.append(libc.malloc(BLOCK))
        pins.append(libc.malloc(64))
    for b in blocks:
        ctypes.memset(b, 1, BLOCK)  # resident
    out = {"held": process.memory_info().rss}
    for b in blocks:
        libc.free(b)
    out["kept"] = process.memory_info().rss
    trimmer = host_heap.IdleHeapTrimmer()
    if delay_trim:
        trimmer._floor = out["kept"] - MB  # as if it had trimmed a moment ago
        out["early"] = trimmer.at_idle() is not None
        out["after_early"] = process.memory_info().rss
        trimmer.min_growth = 0
    out["returned"] = trimmer.at_idle().returned
    out["after"] = process.memory_info().rss
    return out


def _run(delay_trim: bool) -> dict:
    code = ("import json; from tests.unit.test_host_heap import scenario; "
            f"print(json.dumps(scenario({delay_trim})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_idle_trim_returns_the_free_heap():
    r = _run(delay_trim=False)
    assert r["held"] - r["kept"] < 50 * MB  # glibc kept what was freed (the premise)
    assert r["returned"] > 120 * MB
    assert r["after"] < r["kept"] - 120 * MB


def test_no_trim_until_the_process_grew_by_the_threshold():
    r = _run(delay_trim=True)
    assert not r["early"]  # negative control: the free heap stays resident
    assert r["after_early"] > r["kept"] - 20 * MB
    assert r["returned"] > 120 * MB  # once the threshold allows it

"""Hands the free heap memory of a worker back to the OS when its engine goes idle.

Why: on the host, every step allocates its temporaries (logits, hidden states,
the tree's mask and gathers) through the C allocator, and glibc keeps freed
blocks in its arenas instead of returning them. A verify step's temporaries are
larger and vary more in size than a plain step's, so under bursts of load a tree
worker's resident memory climbed by hundreds of MB a burst and stayed there,
most of it free heap that ``malloc_trim`` hands back (``benchmarks/
memory_retention.py``; benchmarks/history/RESULTS-history.md, "Soak with
repeated load passes: the tree server's memory keeps climbing, in the model
worker, mostly free heap the C allocator keeps (2026-11-29, later, AVX-512
machine)"; the soak saw the climb as a leak). Trimming at every step would cost
page faults on the next one; trimming once the batch is empty costs nothing
while requests run, and happens only once the worker has grown enough to matter.

Linux with glibc only; elsewhere every call is a no-op.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import psutil

# Below this much growth since the last trim an idle trim is not worth the next
# step's page faults (a batch-1 server goes idle after every request).
MIN_GROWTH_BYTES = 64 << 20


def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library is not glibc."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the C library this process runs on
    except (OSError, AttributeError):  # musl, macOS
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _malloc_trim()


@dataclass(frozen=True)
class Trim:
    resident_before: int  # the process's resident bytes before the trim
    returned: int  # resident bytes the trim gave back to the OS
    seconds: float

    @property
    def resident_after(self) -> int:
        return self.resident_before - self.returned


def trim_heap() -> Trim | None:
    """``malloc_trim(0)`` now, and what it returned; None without glibc."""
    if _MALLOC_TRIM is None:
        return None
    process = psutil.Process()
    resident, t0 = process.memory_info().rss, time.perf_counter()
    _MALLOC_TRIM(0)
    seconds = time.perf_counter() - t0
    return Trim(resident, resident - process.memory_info().rss, seconds)


class IdleHeapTrimmer:
    """Trims the heap at an idle moment once the process grew by ``min_growth``
    bytes since its last trim (the first idle moment always trims)."""

    def __init__(self, min_growth: int = MIN_GROWTH_BYTES):
        self.min_growth = min_growth
        self._process = psutil.Process()
        self._floor: int | None = None  # resident bytes right after the last trim

    def at_idle(self) -> Trim | None:
        if _MALLOC_TRIM is None:
            return None
        if (self._floor is not None
                and self._process.memory_info().rss - self._floor < self.min_growth):
            return None
        trim = trim_heap()
        self._floor = trim.resident_after
        return trim

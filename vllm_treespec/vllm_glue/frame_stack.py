"""Run a worker step on a CPython frame-stack chunk of its own.

Since CPython 3.11 a thread's Python frames live on a stack of 16 KiB chunks,
each mapped with ``mmap`` when a call does not fit into the current chunk and
unmapped as soon as the last frame on it returns. A hot path whose call depth
keeps crossing a chunk boundary therefore maps and unmaps a chunk on every
crossing. In a served vLLM CPU worker a tree verify step crossed one dozens of
times (thousands of ``mmap``/``munmap`` pairs a second, counted with strace),
and each ``munmap`` in a process whose OpenMP threads run on the other cores
also interrupts them to flush their TLBs: the verify forward took about a
quarter longer, and the served tree was slower than the same tree in an offline
``LLM`` (whose worker calls the model from a different depth;
benchmarks/history/RESULTS-history.md, "Latest (2026-11-25): the served-only
cost found (CPython frame-stack chunks)").

Where the boundary falls depends on how deep vLLM's own loop sits, which this
plugin does not control; so ``call_on_fresh_chunk`` enters through a frame with
3,500 (dead) locals, ~28 KiB. It never fits the free part of an ordinary 16 KiB
chunk, so CPython gives it a chunk of its own, sized for the frame plus 1,000
words of headroom: 64 KiB. The frames below it fill the ~36 KiB left there, a
fixed place whatever the caller's depth, so a step whose call tree fits that
room maps one chunk per step however deep its caller is.

The room has to hold the deepest call tree of a step. The first version of this
entry left ~15 KiB (a 32 KiB chunk); a compiled one-wide tree step later
outgrew it, and every attention call crossed a boundary again: an offline
engine unmapped chunks dozens of times as often as stock ``eagle3`` k=3
(``strace -c``), and vLLM's attention kernel ran at about half the speed it has
with this room, on the same inputs (benchmarks/history/RESULTS-history.md, "The
frame-stack room outgrown (2026-11-28, AVX-512 machine): the attention kernel at
half speed in tree mode; a one-wide tree now 1.04-1.05x stock k=3").
tests/integration/test_frame_stack_room.py runs a compiled tree engine and
fails when a step outgrows it.
"""

from __future__ import annotations

from typing import Any, Callable

# Locals of the entry frame, 8 bytes each. CPython sizes a new chunk by doubling
# 16 KiB until the frame plus 1,000 words fit: 3,500 + 1,000 words (36 KiB) need
# 64 KiB, which leaves ~36 KiB below the entry; ~400 words above the 32 KiB
# step, so a few words more or less per frame in another CPython change nothing.
# A nested entry would fit that room, and leave 8 KiB below it: do not nest.
_PAD_LOCALS = 3500


def _make_entry(pad_locals: int = _PAD_LOCALS) -> Callable[..., Any]:
    # The pad names are locals of the code object (the compiler drops the dead
    # assignment, not the names), so the frame reserves room for them.
    pad = " = ".join(f"_{i}" for i in range(pad_locals))
    source = ("def call_on_fresh_chunk(fn, *args, **kwargs):\n"
              "    if False:\n"
              f"        {pad} = None\n"
              "    return fn(*args, **kwargs)\n")
    namespace: dict[str, Any] = {}
    exec(compile(source, "<call_on_fresh_chunk>", "exec"), namespace)  # noqa: S102 - fixed source
    entry = namespace["call_on_fresh_chunk"]
    entry.__doc__ = "``fn(*args, **kwargs)``, its frames starting on a fresh frame-stack chunk."
    entry.__module__ = __name__
    return entry


call_on_fresh_chunk = _make_entry()

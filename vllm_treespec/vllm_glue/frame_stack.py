"""Run a worker step on a CPython frame-stack chunk of its own.

Since CPython 3.11 a thread's Python frames live on a stack of 16 KiB chunks,
each mapped with ``mmap`` when a call does not fit into the current chunk and
unmapped as soon as the last frame on it returns. A hot path whose call depth
keeps crossing a chunk boundary therefore maps and unmaps a chunk on every
crossing. In a served vLLM CPU worker a tree verify step crossed one about 70
times (about 2,200 ``mmap``/``munmap`` pairs a second, counted with strace),
and each ``munmap`` in a process whose OpenMP threads run on the other cores
also interrupts them to flush their TLBs: the verify forward took 25 ms instead
of 20, and the served tree was 15 % slower than the same tree in an offline
``LLM`` (whose worker calls the model from a different depth).

Where the boundary falls depends on how deep vLLM's own loop sits, which this
plugin does not control; so ``call_on_fresh_chunk`` enters through a frame with
2,100 (dead) locals, ~16.8 KiB. It never fits the free part of an ordinary
16 KiB chunk, so CPython gives it a chunk of its own (sized with headroom,
32 KiB), and the frames below it fill the ~15 KiB left there: a fixed place,
whatever the caller's depth. That room is smaller than the entry frame itself,
so a nested entry starts a chunk of its own again. Measured: a served tree step
then maps about one chunk instead of ~70 (80 ``munmap`` per 3 s instead of
7,478), so a step's call tree fits the room.
"""

from __future__ import annotations

from typing import Any, Callable

# Locals of the entry frame, 8 bytes each: more than a 16 KiB chunk holds, and
# more than the room its own chunk leaves (CPython doubles a chunk from 16 KiB
# until frame + 1,000 words fit: 32 KiB here).
_PAD_LOCALS = 2100


def _make_entry() -> Callable[..., Any]:
    # The pad names are locals of the code object (the compiler drops the dead
    # assignment, not the names), so the frame reserves room for them.
    pad = " = ".join(f"_{i}" for i in range(_PAD_LOCALS))
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

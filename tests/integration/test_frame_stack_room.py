"""A tree step's call tree fits the room ``call_on_fresh_chunk`` gives it.

When it does not, the deepest calls of every step (the attention layers) cross a
CPython frame-stack chunk boundary and map and unmap a chunk each time; each
unmap interrupts the OpenMP threads on the other cores, and the attention
kernel ran at half speed (vllm_glue/frame_stack.py). A mapping faults when first
touched, so the worker thread's minor page faults inside ``execute_model``
count the pages of chunks it touched: a step that stays in its entry's chunk
touches at most that chunk's pages, one that keeps crossing touches more.

The engine is compiled, as served: an eager step is shallower and fits even the
first version's room (measured 2026-11-28: an eager step faulted 6 times with the
first version's entry; a compiled one 38, one chunk per attention layer).
"""

from __future__ import annotations

import resource
import sys

import pytest

from tests.integration.conftest import base_engine, run_engine

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(sys.implementation.name != "cpython" or sys.version_info < (3, 11)
                       or not hasattr(resource, "RUSAGE_THREAD"),
                       reason="frame-stack chunks are a CPython >= 3.11 mechanism; "
                              "faults counted per thread (Linux)"),
]

# The negative control: an entry with 8 KiB of room in a 16 KiB chunk, which a
# compiled step's attention layers outgrow. The first version's entry (2,100 pad
# locals, ~15.8 KiB of room) sits at the edge of a compiled step's depth: it
# crossed a chunk at every layer on 2026-11-28 (38 faults a step), and stayed in
# its chunk in one later run, so it cannot show reliably that this test can fail.
CONTROL_PAD = 1000
FRAME_OVERHEAD_WORDS = 16  # a frame's fixed part and value stack, about


def _chunk_pages(pad_locals: int) -> int:
    """Pages of the chunk CPython maps for an entry frame of ``pad_locals`` locals:
    16 KiB, doubled until the frame plus 1,000 words fit."""
    size = 16 * 1024
    while size < 8 * (pad_locals + FRAME_OVERHEAD_WORDS + 1000):
        size *= 2
    return size // resource.getpagesize()


def test_a_compiled_tree_step_stays_in_its_entry_chunk(target_dir, tokenizer, engine_dir,
                                                       monkeypatch):
    from statistics import median

    from tests.integration.prompts import chat_token_ids
    from vllm_treespec.assets import committed_drafter_dir
    from vllm_treespec.vllm_glue import cpu_linear
    from vllm_treespec.vllm_glue.frame_stack import _PAD_LOCALS

    # The deepest step: every linear layer through its dispatcher's Python frame,
    # which startup timings keep on some machines and starts, not on others (a
    # step without them stayed inside the control's room too, and the negative
    # control failed: 4 faults a step, 2026-11-28).
    monkeypatch.setenv(cpu_linear.ENV, "keep")

    spec = {"method": "eagle3_tree", "model": str(committed_drafter_dir()), "top_k": 1,
            "num_nodes": 3, "depth": 3, "adaptive": False}
    engine = base_engine(target_dir, speculative_config=spec, max_num_seqs=1)
    del engine["compilation_config"]  # vLLM's default: compiled, as served
    out = run_engine({"engine": engine, "prompts": chat_token_ids(tokenizer)[:2],
                      "batch": 1, "chunk_faults": {"control_pad_locals": CONTROL_PAD},
                      "sampling": {"temperature": 0.0, "max_tokens": 48}},
                     engine_dir, "chunk_faults")
    faults = out["chunk_faults"]
    assert min(map(len, faults.values())) >= 20, faults
    # Medians: a new request's first steps allocate (and fault) more.
    shipped, control = median(faults["shipped"]), median(faults["control"])
    assert shipped <= _chunk_pages(_PAD_LOCALS), faults
    # Negative control, same steps: a room too small is outgrown.
    assert _chunk_pages(CONTROL_PAD) == 16 * 1024 // resource.getpagesize()
    assert control > _chunk_pages(CONTROL_PAD), faults

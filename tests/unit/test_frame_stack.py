"""call_on_fresh_chunk: a hot path near a frame-stack chunk boundary stops
mapping a chunk per call (counted as minor page faults: each new mapping is
touched, and so faults, at least once)."""

import resource
import sys

import pytest

from vllm_treespec.vllm_glue.frame_stack import call_on_fresh_chunk

pytestmark = pytest.mark.skipif(
    sys.implementation.name != "cpython" or sys.version_info < (3, 11)
    or not hasattr(resource, "RUSAGE_THREAD"),
    reason="frame-stack chunks are a CPython >= 3.11 mechanism; faults counted per thread (Linux)")

CALLS = 400


def _descend(levels: int) -> int:
    return 0 if levels == 0 else 1 + _descend(levels - 1)


def _hot_path() -> None:
    for _ in range(CALLS):
        _descend(40)  # a few KiB of frames: fits a chunk, not the rest of a full one


def _at_depth(levels: int, fn) -> int:
    """Minor page faults of ``fn()`` called ``levels`` frames below here."""
    if levels:
        return _at_depth(levels - 1, fn)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def _worst_over_positions(fn) -> int:
    # At every depth over more than a chunk's worth of frames (~54 KiB): at some
    # of them the hot path starts just below a boundary. Not from an entry of
    # its own: the entry's room holds a nested entry at some depths, and leaves
    # too little below it (the runner never nests them).
    return max(_at_depth(levels, fn) for levels in range(0, 400, 3))


def test_a_hot_path_across_a_chunk_boundary_maps_a_chunk_per_call():
    # The mechanism, shown so that the test below can fail: where the hot path
    # starts close to a boundary, each of its calls maps and unmaps a chunk.
    assert _worst_over_positions(_hot_path) >= CALLS


def test_on_a_fresh_chunk_the_same_hot_path_maps_none():
    assert _worst_over_positions(lambda: call_on_fresh_chunk(_hot_path)) < CALLS // 10


def test_it_passes_arguments_and_results_through():
    assert call_on_fresh_chunk(divmod, 7, 2) == (3, 1)
    assert call_on_fresh_chunk(dict, a=1) == {"a": 1}

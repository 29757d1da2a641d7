"""Tensor parallelism: every rank takes the same decisions, every step.

Under ``--tensor-parallel-size N`` each rank runs the same runner and drafter on
its shard, and every forward is a sequence of collectives. A decision that
changes the shape of the work (whether to draft, how deep, when a level stops,
how wide, chain or tree, probes, which linear kernel runs, the step-cost table)
taken differently on two ranks makes them run different forwards: the engine
hangs in a collective, or verifies one tree on one rank and a chain on another
(silently wrong). Only the scheduler's drafts come from rank 0.

How they agree:

* the adaptive budget (``policy``) is deterministic in its inputs. Its inputs
  are acceptance outcomes and draft scores, which are the same on every rank
  (same tokens; the drafter's logits are gathered whole on every rank), and
  timings, which are not. So every timing it learns from, and every startup
  calibration result, is rank 0's (``from_rank0``: one small broadcast);
* a drafting step that fails on one rank goes without drafts on every rank
  (``any_rank``), and so does a verify step in which some rank's scheduled
  drafts differ from what it proposed: those requests are verified as chains
  everywhere (always correct), never as a tree on one rank and a chain on
  another.

With one rank (no tensor parallelism) every helper returns its input at no cost.
"""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")


def _group():
    """vLLM's tensor-parallel group, or None outside a distributed worker."""
    try:
        from vllm.distributed import get_tp_group

        group = get_tp_group()
    except (ImportError, AssertionError):  # no model-parallel state in this process
        return None
    return group if group.world_size > 1 else None


def from_rank0(value: T) -> T:
    """``value`` as tensor-parallel rank 0 has it, on every rank."""
    group = _group()
    return value if group is None else group.broadcast_object(value, src=0)


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on some tensor-parallel rank (every rank must call)."""
    return any_rank_each([flag])[0]


def any_rank_each(flags: list[bool]) -> list[bool]:
    """Element-wise ``any_rank`` of a list every rank gives with the same length."""
    group = _group()
    if group is None or not flags:
        return flags
    import torch

    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group.cpu_group)
    return [bool(v) for v in t.tolist()]


def timings(*seconds: float) -> tuple[Any, ...]:
    """Rank 0's timings (what the adaptive budget learns from) on every rank."""
    return tuple(from_rank0(list(seconds)))

"""ACL graph capture and replay-time update of the tree-verify calls.

Owns :class:`CapturedCall`, :func:`capture_issuer` (the issuer
:func:`~vllm_treespec.attention.ascend.execute.run_tree_verify` takes while a
graph is captured) and :func:`update_captured` (re-issues the captured calls with
each step's lengths). ``ops``/``npu`` are passed in: nothing here imports
torch_npu. Imports :mod:`.constants`, :mod:`.plans`, :mod:`.buffers` and
:mod:`.calls`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vllm_treespec.attention.ascend.buffers import TreeAttentionBuffers
from vllm_treespec.attention.ascend.calls import OpCall
from vllm_treespec.attention.ascend.constants import FULL_MASK, TREE_SPARSE, TWO_PASS
from vllm_treespec.attention.ascend.plans import TreeAttentionPlan


@dataclasses.dataclass
class CapturedCall:
    """A tree-attention call captured in an ACL graph, re-issued at each replay
    with the step's host lengths (the device tensors are the captured ones)."""

    call: OpCall
    outs: list[torch.Tensor]
    workspace: torch.Tensor
    handle: Any
    event: Any


def capture_issuer(ops: Any, npu: Any, records: list[CapturedCall],
                   weak_ref: Callable[[Any], Any] = lambda t: t) -> Callable:
    """Issuer for :func:`run_tree_verify` during graph capture (torch_npu's
    task-group protocol, as vllm-ascend's own FIA capture uses it): each FIA call
    gets its max workspace, waits on an external event the replay-time update
    records, runs as ``.out`` into the persistent ``outs``, and is recorded.
    Calls without ``outs`` (the LSE merge) are captured as ordinary ops.

    ops: torch_npu; npu: torch.npu; weak_ref: vllm-ascend's ``weak_ref_tensors``
    (keeps the records from pinning graph-pool memory).
    """

    def issue(call: OpCall, outs: Sequence[torch.Tensor] | None = None):
        if outs is None:
            return call(ops)
        workspace = getattr(ops, f"_{call.op}_get_max_workspace")(*call.args, **call.kwargs)
        stream = ops.npu.current_stream()
        event = npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        getattr(ops, call.op).out(*call.args, **call.kwargs, workspace=workspace, out=list(outs))
        handle = npu.graph_task_group_end(stream)
        ref = OpCall(call.op, tuple(weak_ref(a) if isinstance(a, torch.Tensor) else a
                                    for a in call.args),
                     {k: weak_ref(v) if isinstance(v, torch.Tensor) else v
                      for k, v in call.kwargs.items()}, call.role)
        records.append(CapturedCall(ref, [weak_ref(o) for o in outs], workspace, handle, event))
        return outs[0], outs[1]

    return issue


def update_captured(ops: Any, npu: Any, records: Sequence[CapturedCall],
                    plan: TreeAttentionPlan, buffers: TreeAttentionBuffers, variant: str,
                    update_stream: Any, block_table: torch.Tensor | None = None) -> None:
    """Before a replay runs its attention: rewrite the persistent masks for this
    step, then re-issue every captured call with this step's lengths and record
    its event (the captured task waits for it). Runs on ``update_stream``."""
    with npu.stream(update_stream):
        if variant == FULL_MASK:
            buffers.full_mask(plan)
        elif variant == TWO_PASS:
            buffers.pair_mask(plan)
        elif variant == TREE_SPARSE:
            buffers.flat_tree_mask(plan)
        for rec in records:
            kwargs = rec.call.step_kwargs(plan)
            if block_table is not None and "block_table" in kwargs:
                kwargs["block_table"] = block_table
            npu.graph_task_update_begin(update_stream, rec.handle)
            getattr(ops, rec.call.op).out(*rec.call.args, **kwargs, workspace=rec.workspace,
                                          out=rec.outs)
            npu.graph_task_update_end(update_stream)
            rec.event.record(update_stream)

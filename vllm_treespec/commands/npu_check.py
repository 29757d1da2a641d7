"""`vllm-treespec npu-check`: validate the Ascend tree attention on a real NPU.

Runs, on the device, the exact torch_npu calls the Ascend backend issues and
reports (as text and optionally JSON):

1. numerics: every variant (full_mask, two_pass, tree_sparse, triton) against the
   eager reference on random mixed batches (prefill/decode/tree rows, GQA, padding),
   and at KV lengths either side of 512, 1024, 2048 and 4096 (``kv_boundaries/``);
   triton needs triton-ascend and, like tree_sparse, is reported but not required;
   so is two_pass outside the head sizes and dtype its TND call is documented for
   (the backend refuses it there);
2. chain trees against vllm-ascend's own ``sparse_mode=3`` call;
3. the ``sparse_mode=9`` probe the backend runs at startup;
4. ACL graph capture of the tree call, replayed with new lengths and masks
   through the same update path the backend uses (``--skip-graph`` to skip);
5. speed of each variant against the stock causal call (``--skip-speed``);
6. optionally end to end (``--e2e-model`` and ``--e2e-drafter``,
   :mod:`.npu_e2e`): a fixed tree in float32, the tree worker's counters showing
   that branching trees were verified, greedy outputs equal to plain decoding's,
   and tokens/s.

It ends with one verdict table (Markdown, with the versions that ran) to paste
into an issue.

``--emulate`` runs checks 1-3 through the CPU emulation of the torch_npu contract
instead (no NPU needed); graphs, speed and end-to-end need hardware.
Exit status 0 when every required check passed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from vllm_treespec.attention.ascend.buffers import TreeAttentionBuffers
from vllm_treespec.attention.ascend.calls import causal_paged_call, compressed_causal_mask
from vllm_treespec.attention.ascend.constants import (
    ASCEND_BLOCK_SIZE,
    TREE_SPARSE,
    TRITON,
    VARIANTS,
)
from vllm_treespec.attention.ascend.documented import variant_gap
from vllm_treespec.attention.ascend.execute import run_tree_verify
from vllm_treespec.attention.ascend.graphs import capture_issuer, update_captured
from vllm_treespec.attention.ascend.plans import plan_tree_rows, plan_uniform_batch
from vllm_treespec.commands import npu_e2e
from vllm_treespec.attention.ascend.synthetic import (
    buffers_for,
    kv_boundary_batch,
    make_verify_batch,
    probe_tree_sparse,
    verify_with,
)

# Not required: tree_sparse is probe-gated in the backend, triton needs triton-ascend.
OPTIONAL_VARIANTS = (TREE_SPARSE, TRITON)

_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class Report:
    def __init__(self):
        self.checks: list[dict[str, Any]] = []

    def add(self, name: str, ok: bool | None, detail: str, required: bool = True,
            **data: Any) -> None:
        status = "SKIP" if ok is None else ("PASS" if ok else ("FAIL" if required else "WARN"))
        self.checks.append({"name": name, "status": status, "required": required,
                            "detail": detail, **data})
        print(f"[{status:4}] {name}: {detail}", flush=True)

    @property
    def ok(self) -> bool:
        return all(c["status"] != "FAIL" for c in self.checks)

    def verdict_table(self, versions: str) -> str:
        """One Markdown table of every check, to paste into an issue."""
        lines = [f"npu-check verdict: {'PASS' if self.ok else 'FAIL'} ({versions})", "",
                 "| check | status | required | detail |", "|---|---|---|---|"]
        lines += [f"| {c['name']} | {c['status']} | {'yes' if c['required'] else 'no'} | "
                  f"{str(c['detail']).replace('|', '/')} |" for c in self.checks]
        return "\n".join(lines)


def _max_err(out: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor) -> float:
    d = (out[rows].float() - ref[rows].float()).abs()
    return float("inf") if not bool(torch.isfinite(d).all()) else float(d.max())


def _batches(args, device, dtype):
    H, KVH, D, T = args.heads, args.kv_heads, args.head_size, args.tree_size
    specs = [(["tree", "causal", "chain", "tree", "causal"], False),
             (["tree"] * 6, True),
             (["causal", "tree", "tree"], False)]
    if args.quick:
        specs = specs[:2]
    return [make_verify_batch(100 + i, kinds, T, H, KVH, D, dtype=dtype, device=device,
                              max_ctx=args.max_ctx, full_trees=full)
            for i, (kinds, full) in enumerate(specs)]


def _required(variant: str, args, dtype) -> bool:
    """A variant the backend would use for these heads and dtype must pass."""
    return (variant not in OPTIONAL_VARIANTS
            and variant_gap(variant, args.head_size, dtype) is None)


def check_numerics(report: Report, ops, args, device, dtype) -> None:
    """Every variant against the reference: on random mixed batches (contexts up to
    ``--max-ctx``: ``numerics/``), and on one full tree per KV length of
    ``KV_BOUNDARY_LENS``, 511 to 4097 (``kv_boundaries/``), where a kernel that
    misreads the mask or the keys past some KV position fails though short contexts
    pass (vllm-ascend #15503 fails ``full_mask`` from 513 on, #13699 ``two_pass``:
    docs/ascend.md). A failing row names the KV lengths it fails at."""
    tol = _TOL[dtype]
    boundary = kv_boundary_batch(400, args.tree_size, args.heads, args.kv_heads,
                                 args.head_size, dtype=dtype, device=device)
    for prefix, batches in (("numerics", _batches(args, device, dtype)),
                            ("kv_boundaries", [boundary])):
        refs = [batch.reference_output() for batch in batches]
        for variant in VARIANTS:
            name, required = f"{prefix}/{variant}", _required(variant, args, dtype)
            if variant == TRITON and prefix == "kv_boundaries" and getattr(
                    args, "emulate", False):
                # Triton's CPU interpreter takes minutes at these lengths; the kernel's
                # own tests cover long contexts, and on a device this row runs.
                report.add(name, None, "not emulated (Triton interpreter too slow)", required)
                continue
            try:
                errs = _errors_by_kv_len(ops, variant, batches, refs)
            except Exception as err:  # report, keep checking the other variants
                report.add(name, False, f"{type(err).__name__}: {err}", required)
                continue
            worst = max(errs.values())
            bad = sorted(kv for kv, e in errs.items() if not e <= tol)  # NaN fails too
            report.add(name, not bad, f"max abs err vs reference {worst:.3g} (tol {tol:g})"
                       + (f"; fails at KV lengths {bad}" if bad else ""), required,
                       max_abs_err=worst, failing_kv_lens=bad)


def _errors_by_kv_len(ops, variant, batches, refs) -> dict[int, float]:
    """The backend's mixed-batch path on each batch; worst error per KV length."""
    errs: dict[int, float] = {}
    for batch, ref in zip(batches, refs):
        out = verify_with(ops, variant, batch)
        for b, kv in enumerate(batch.kv_lens):
            errs[kv] = max(errs.get(kv, 0.0), _max_err(out, ref, batch.request_rows(b)))
    return errs


def check_chain(report: Report, ops, args, device, dtype) -> None:
    batch = make_verify_batch(7, ["chain", "chain", "causal", "chain"], args.tree_size,
                              args.heads, args.kv_heads, args.head_size, dtype=dtype,
                              device=device, max_ctx=args.max_ctx)
    h = batch.heads
    stock, _ = causal_paged_call(batch.query, batch.key_cache, batch.value_cache,
                                 batch.block_table, batch.cu_q_lens, batch.kv_lens,
                                 compressed_causal_mask(device),
                                 h.num_heads, h.num_kv_heads, h.scale)(ops)
    plan = plan_tree_rows(batch.tree_rows)
    for variant in VARIANTS:
        out = torch.zeros_like(batch.query)
        try:
            run_tree_verify(ops, variant, plan, buffers_for(batch, plan),
                            batch.query, batch.key, batch.value, batch.key_cache,
                            batch.value_cache, h, out)
        except Exception as err:
            report.add(f"chain==sparse_mode3/{variant}", False, f"{type(err).__name__}: {err}",
                       _required(variant, args, dtype))
            continue
        err = _max_err(out, stock, plan.rows)
        report.add(f"chain==sparse_mode3/{variant}", err <= _TOL[dtype],
                   f"max abs err vs the stock causal call {err:.3g}",
                   _required(variant, args, dtype), max_abs_err=err)


def check_probe(report: Report, ops, args, device, dtype) -> None:
    res = probe_tree_sparse(ops, device, dtype, args.heads, args.kv_heads,
                            args.head_size, args.tree_size)
    report.add("probe/sparse_mode=9", res.ok,
               ("enabled: " if res.ok else "backend falls back to full_mask: ") + res.reason,
               required=False)


def check_graph(report: Report, args, device, dtype) -> None:
    """Capture the tree call in an NPUGraph, then replay it for new steps (new KV
    lengths, new trees) through update_captured, as the backend does."""
    import torch_npu

    for variant in VARIANTS:
        if variant == TRITON:  # launched eagerly; the settings refuse it with graphs
            continue
        try:
            errs = _graph_roundtrip(torch_npu, variant, args, device, dtype)
        except Exception as err:
            report.add(f"acl_graph/{variant}", False, f"{type(err).__name__}: {err}",
                       required=False)
            continue
        worst = max(errs)
        report.add(f"acl_graph/{variant}", worst <= _TOL[dtype],
                   f"replay vs eager max abs err {worst:.3g} over {len(errs)} steps",
                   required=False, max_abs_err=worst)


def _graph_roundtrip(torch_npu, variant, args, device, dtype) -> list[float]:
    T, B = args.tree_size, 4
    steps = [make_verify_batch(200 + s, ["tree"] * B, T, args.heads, args.kv_heads,
                               args.head_size, dtype=dtype, device=device,
                               max_ctx=args.max_ctx, full_trees=True)
             for s in range(3)]
    # One static set of tensors (as a runner's persistent inputs), refilled per step.
    first = steps[0]
    heads = first.heads
    width = max(s.block_table.shape[1] for s in steps)
    blocks = max(s.key_cache.shape[0] for s in steps)
    shape_kv = (blocks,) + tuple(first.key_cache.shape[1:])
    k_cache = torch.zeros(shape_kv, dtype=dtype, device=device)
    v_cache = torch.zeros(shape_kv, dtype=dtype, device=device)
    query = torch.zeros_like(first.query)
    key, value = torch.zeros_like(first.key), torch.zeros_like(first.value)
    table = torch.zeros(B, width, dtype=torch.int32, device=device)
    out = torch.zeros_like(first.query)
    buffers = TreeAttentionBuffers(B, T, heads.num_heads, heads.num_kv_heads,
                                   heads.head_size, dtype, device, width)

    def load(batch):
        k_cache.zero_()
        v_cache.zero_()
        k_cache[: batch.key_cache.shape[0]].copy_(batch.key_cache)
        v_cache[: batch.value_cache.shape[0]].copy_(batch.value_cache)
        query.copy_(batch.query)
        key.copy_(batch.key)
        value.copy_(batch.value)
        table.zero_()
        table[:, : batch.block_table.shape[1]].copy_(batch.block_table)

    def plan_for(batch, with_tree=True):
        return plan_uniform_batch(T, batch.kv_lens, table, ASCEND_BLOCK_SIZE,
                                  batch.tree_rows if with_tree else None)

    load(first)
    run_tree_verify(torch_npu, variant, plan_for(first), buffers, query, key, value,
                    k_cache, v_cache, heads, out)  # warm-up, eager
    records: list = []
    graph = torch.npu.NPUGraph()
    capture_plan = plan_for(first, with_tree=False)
    buffers.mark_written(capture_plan)
    with torch.npu.graph(graph):
        run_tree_verify(torch_npu, variant, capture_plan, buffers, query, key, value,
                        k_cache, v_cache, heads, out,
                        issue=capture_issuer(torch_npu, torch.npu, records))
    update_stream = torch.npu.Stream()
    errs = []
    for batch in steps:
        load(batch)
        plan = plan_for(batch)
        graph.replay()
        update_captured(torch_npu, torch.npu, records, plan, buffers, variant,
                        update_stream, block_table=table)
        torch.npu.synchronize()
        ref = batch.reference_output()
        errs.append(_max_err(out, ref, plan.rows))
    return errs


def check_speed(report: Report, args, device, dtype) -> None:
    import torch_npu

    rows = []
    grid = [(1, 1024), (8, 1024), (8, 8192), (32, 4096)]
    if args.quick:
        grid = grid[:2]
    for B, ctx in grid:
        batch = make_verify_batch(300 + B, ["tree"] * B, args.tree_size, args.heads,
                                  args.kv_heads, args.head_size, dtype=dtype,
                                  device=device, max_ctx=ctx, full_trees=True)
        plan = plan_tree_rows(batch.tree_rows)
        buffers = buffers_for(batch, plan)
        h = batch.heads
        causal = compressed_causal_mask(device)
        out = torch.empty_like(batch.query)
        runs = {"stock_causal": lambda: causal_paged_call(
            batch.query, batch.key_cache, batch.value_cache, batch.block_table,
            batch.cu_q_lens, batch.kv_lens, causal, h.num_heads, h.num_kv_heads,
            h.scale)(torch_npu)}
        for variant in VARIANTS:
            runs[variant] = (lambda v=variant: run_tree_verify(
                torch_npu, v, plan, buffers, batch.query, batch.key, batch.value,
                batch.key_cache, batch.value_cache, h, out))
        row = {"batch": B, "max_ctx": ctx, "tree_size": args.tree_size}
        for name, fn in runs.items():
            try:
                row[name + "_ms"] = round(_time(fn), 4)
            except Exception as err:
                row[name + "_ms"] = f"error: {type(err).__name__}"
        rows.append(row)
    report.add("speed", None if not rows else True,
               "; ".join(", ".join(f"{k}={v}" for k, v in r.items()) for r in rows),
               required=False, table=rows)


def _time(fn, warmup: int = 3, iters: int = 20) -> float:
    for _ in range(warmup):
        fn()
    torch.npu.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.npu.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-treespec npu-check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--emulate", action="store_true",
                   help="run the numeric checks through the CPU emulation (no NPU)")
    p.add_argument("--device", default="npu:0")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    p.add_argument("--heads", type=int, default=None, help="query heads (default 32; 4 emulated)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default 8; 2 emulated)")
    p.add_argument("--head-size", type=int, default=None, help="default 128")
    p.add_argument("--tree-size", type=int, default=33, help="T = 1 + num_nodes (default 33)")
    p.add_argument("--max-ctx", type=int, default=2000, help="longest random context")
    p.add_argument("--quick", action="store_true", help="fewer batches and sizes")
    p.add_argument("--skip-graph", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    npu_e2e.add_arguments(p)
    p.add_argument("--json", help="also write the report to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    dtype = _DTYPES[args.dtype]
    if args.emulate:
        from vllm_treespec.attention.emulation import EmulatedTorchNPU

        ops, device = EmulatedTorchNPU(allow_float32=True), "cpu"
        defaults = (4, 2, 128)  # 128: a head size the TND calls are documented for
        args.max_ctx = min(args.max_ctx, 400)
        args.tree_size = min(args.tree_size, 17)
    else:
        try:
            import torch_npu as ops  # noqa: F401
        except ImportError:
            print("npu-check: torch_npu is not installed; run on an Ascend machine "
                  "(pip install torch-npu vllm-ascend) or pass --emulate", file=sys.stderr)
            return 2
        device = args.device
        torch.npu.set_device(device)
        defaults = (32, 8, 128)
    args.heads = args.heads or defaults[0]
    args.kv_heads = args.kv_heads or defaults[1]
    args.head_size = args.head_size or defaults[2]
    report = Report()
    print(f"npu-check: {'CPU emulation' if args.emulate else device}, {args.dtype}, "
          f"heads {args.heads}/{args.kv_heads}x{args.head_size}, T={args.tree_size}", flush=True)
    check_numerics(report, ops, args, device, dtype)
    check_chain(report, ops, args, device, dtype)
    check_probe(report, ops, args, device, dtype)
    if args.emulate:
        for name in ("acl_graph", "speed", "e2e"):
            report.add(name, None, "needs an NPU", required=False)
    else:
        if not args.skip_graph:
            check_graph(report, args, device, dtype)
        if not args.skip_speed:
            check_speed(report, args, device, dtype)
        if args.e2e_model and args.e2e_drafter:
            npu_e2e.check_e2e(report, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": "emulated" if args.emulate else str(device),
                       "dtype": args.dtype, "ok": report.ok, "checks": report.checks}, f,
                      indent=2, default=str)
    print("npu-check:", "all required checks passed" if report.ok else "FAILED")
    print(report.verdict_table(versions_line("emulated" if args.emulate else str(device),
                                             args.dtype)))
    return 0 if report.ok else 1


def versions_line(device: str, dtype: str) -> str:
    """What ran, for the verdict table: versions of the stack and the device."""
    import importlib.metadata

    def v(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "-"

    cann = getattr(torch.version, "cann", None) or "-"
    return (f"device {device}, {dtype}; vllm {v('vllm')}, vllm-ascend {v('vllm-ascend')}, "
            f"torch {torch.__version__}, torch-npu {v('torch-npu')}, CANN {cann}, "
            f"vllm-treespec {v('vllm-treespec')}")

"""Linear layers for the few-token steps that tree verification adds on the CPU.

vLLM's CPU backend runs every unquantized linear layer through a prepacked
oneDNN matmul. Its one-row kernel streams the weights at memory speed, but on
some CPUs its kernel for 2 to 8 rows is several times slower, so that verifying
even one draft token costs far more than a decode step and speculation cannot
pay. A plain ``W @ x^T`` (weights row-major, the few activation rows as columns)
streams the weights once for all rows, so a forward over a few tokens costs
little more than one token (the gain is smaller compiled, as served, than in
eager mode; benchmarks/history/RESULTS-history.md, "Latest (2026-11-23, later):
few-row linear layers, probes that back off").

So in tree mode on the CPU every linear layer of the target and the drafter gets
a dispatcher (``small_m_linear``, an opaque custom op, so that compiled graphs
keep the runtime choice): ``W @ x^T`` for the row counts where the startup
calibration (``calibrate``) measured it faster, the stock oneDNN kernel
otherwise. Where vLLM dropped a layer's weights after packing them, they are
recovered exactly from the oneDNN handler (a product with the identity): a
second copy of those weights in memory;
``VLLM_TREESPEC_CPU_SMALL_M_LINEAR=0`` turns this off, ``=keep`` keeps the
dispatchers whatever the startup timings say (the deepest call tree a step can
have, for tests and kernel comparisons).

Where oneDNN's few-row kernel is already fast (on some CPUs ``W @ x^T`` is
slower at every row count), the dispatcher only costs: a custom-op call per
layer made a one-wide tree slower than with stock kernels
(benchmarks/history/RESULTS-history.md, "Latest (2026-11-24): a machine where
speculation pays, and where the tree path loses it"). So the runner first times
the layers themselves (``layer_timer``, before anything is compiled) and
removes the dispatchers again (``uninstall``) when ``W @ x^T`` wins for no row
count.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

import torch

from vllm_treespec.vllm_glue import rank_agreement

ENV = "VLLM_TREESPEC_CPU_SMALL_M_LINEAR"
MAX_ROWS = 8  # above this oneDNN's blocked kernel won in every calibration measured

# Row counts that take the W @ x^T path (read at run time by the op, so a
# calibrated choice needs no recompilation). Empty: stock kernels only.
_ROWS: set[int] = set()
# small_m_key -> (W [N, K], stock fn, its oneDNN handler tensor)
_LAYERS: list[tuple[torch.Tensor, Callable, torch.Tensor | None]] = []


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def kept_whatever_the_timings() -> bool:
    return os.environ.get(ENV) == "keep"


# The op runs in every linear layer of every forward, whatever its row count,
# so it is defined with ``torch.library.Library`` and a plain CPU kernel, not the
# ``custom_op`` decorator: the decorator's Python wrappers cost a trivial op
# several times its call, paid in every layer of the target and the drafter,
# which made a 16-request decode forward clearly slower than in plain vLLM while
# speculation was off (benchmarks/history/RESULTS-history.md, "Latest
# (2026-11-26, small hours): the drafting step's fixed work priced, and the
# must-show met").
_LIB = torch.library.Library("vllm_treespec", "FRAGMENT")
_LIB.define("small_m_linear(Tensor x, Tensor? bias, int key, int out_features) -> Tensor")


def small_m_linear(x: torch.Tensor, bias: torch.Tensor | None, key: int,
                   out_features: int) -> torch.Tensor:
    weight, _, handler = _LAYERS[key]
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if m not in _ROWS:
        # The stock kernel, called as vLLM's ``onednn_mm`` calls it but without
        # its two Python frames: this runs in every linear layer of every forward,
        # so each frame saved is saved once per layer.
        out = x.new_empty(*x.shape[:-1], out_features)
        torch.ops._C.onednn_mm(out, rows, bias, handler)
        return out
    # MKL's kernel for an odd column count is far slower (benchmarks/history/
    # RESULTS-history.md, "Latest (2026-11-23, later): few-row linear layers,
    # probes that back off"), so odd row counts are padded to even.
    if m % 2:
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
    y = torch.mm(weight, rows.t()).t()[:m].contiguous()
    if bias is not None:
        y += bias
    return y.reshape(*x.shape[:-1], out_features)


_LIB.impl("small_m_linear", small_m_linear, "CPU")


@torch.library.register_fake("vllm_treespec::small_m_linear")
def _(x: torch.Tensor, bias: torch.Tensor | None, key: int,
      out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


def _dispatcher(key: int, out_features: int) -> Callable:
    def cpu_linear(x, weight, bias):
        return torch.ops.vllm_treespec.small_m_linear(x, bias, key, out_features)
    return cpu_linear


def install(models: Iterable[torch.nn.Module], dtype: torch.dtype) -> int:
    """Give every oneDNN-dispatched linear layer of ``models`` the dispatcher;
    returns how many layers got it. Call after the weights are loaded."""
    count = 0
    for model in models:
        for module in model.modules():
            handler = _handler(getattr(module, "cpu_linear", None))
            if handler is None or hasattr(module, "small_m_key"):
                continue
            stock = module.cpu_linear
            key = module.small_m_key = len(_LAYERS)
            k, n = handler.k, handler.n
            w = getattr(module, "weight", None)
            if w is None or tuple(w.shape) != (n, k):  # vLLM dropped it after packing
                # W^T = I @ W^T exactly: one non-zero term per output element.
                w = stock(torch.eye(k, dtype=dtype), None, None).t().contiguous()
            _LAYERS.append((w, stock, handler.handler_tensor))
            module.cpu_linear = _dispatcher(key, n)
            count += 1
    return count


def uninstall(models: Iterable[torch.nn.Module]) -> int:
    """Give the layers of ``models`` their stock kernel back and drop the weight
    copies; returns how many layers had the dispatcher."""
    count = 0
    for model in models:
        for module in model.modules():
            key = getattr(module, "small_m_key", None)
            if key is None:
                continue
            module.cpu_linear = _LAYERS[key][1]
            _LAYERS[key] = (torch.empty(0), module.cpu_linear, None)  # frees the copy
            del module.small_m_key
            count += 1
    return count


def layer_timer(models: Iterable[torch.nn.Module], dtype: torch.dtype
                ) -> Callable[[int], float]:
    """``time_step(n)`` for ``calibrate``: seconds of every dispatched layer of
    ``models`` applied once to an n-row input (eager, no model around them), each
    as a compiled graph would run it if this were the only choice: through the
    dispatcher where n takes ``W @ x^T``, else the stock oneDNN op called
    directly. So ``W @ x^T`` must win by more than the dispatcher's own cost, which
    every forward pays once it stays (benchmarks/history/RESULTS-history.md,
    "Two per-step costs only the tree path paid, and what a forward costs by row
    count (2026-11-28, afternoon)"); timed through the dispatcher on both sides,
    its own cost never counted, and it had been kept on a machine whose compiled
    forwards then chose no row count."""
    layers = [m for model in models for m in model.modules() if hasattr(m, "small_m_key")]
    gen = torch.Generator().manual_seed(0)
    inputs: dict[int, list[torch.Tensor]] = {}

    def time_step(n: int) -> float:
        if n not in inputs:
            inputs[n] = [torch.randn(n, _LAYERS[m.small_m_key][0].shape[1], generator=gen,
                                     dtype=dtype) for m in layers]
        direct = n not in _ROWS
        t0 = time.perf_counter()
        for m, x in zip(layers, inputs[n]):
            if direct:
                weight, _, handler = _LAYERS[m.small_m_key]
                torch.ops._C.onednn_mm(x.new_empty(n, weight.shape[0]), x, None, handler)
            else:
                m.cpu_linear(x, None, None)
        return time.perf_counter() - t0
    return time_step


def use_rows(rows: Iterable[int]) -> None:
    """Row counts for which the ``W @ x^T`` path is used from now on."""
    _ROWS.clear()
    _ROWS.update(r for r in rows if 2 <= r <= MAX_ROWS)


def calibrate(time_step: Callable[[int], float], sizes: Iterable[int] = range(2, MAX_ROWS + 1),
              repeats: int = 6, margin: float = 0.03
              ) -> tuple[list[int], dict[int, tuple[float, float]]]:
    """Keep ``W @ x^T`` for the row counts where a timed step (``time_step(n)``:
    seconds of one forward over n tokens) is faster with it by ``margin``. The
    two kernels alternate and each keeps its best time, so that a noisy moment
    does not decide; a row count between two chosen ones is chosen too.
    Returns the chosen row counts and {rows: (stock s, W @ x^T s)}."""
    timings = {}
    for n in sizes:
        best = {False: float("inf"), True: float("inf")}
        for _ in range(repeats):
            for new in (False, True):
                use_rows([n] if new else [])
                best[new] = min(best[new], time_step(n))
        timings[n] = (best[False], best[True])
    # Under tensor parallelism every rank runs the kernels rank 0 chose (rank_agreement).
    timings = rank_agreement.from_rank0(timings)
    wins = [n for n, (stock, new) in timings.items() if new < (1.0 - margin) * stock]
    won = set(wins)
    chosen = won | {n for n in range(min(wins, default=0), max(wins, default=0))
                    if n - 1 in won and n + 1 in won}
    use_rows(chosen)
    return sorted(chosen), timings


def _handler(fn) -> object | None:
    """The oneDNN handler a stock ``cpu_linear`` closure holds (None for any
    other kernel, or no ``cpu_linear`` at all)."""
    for cell in getattr(fn, "__closure__", None) or ():
        value = cell.cell_contents
        if hasattr(value, "handler_tensor") and hasattr(value, "k"):
            return value
    return None

"""Few-row linear layers: exact weights, the stock kernel untouched, the runtime choice."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm  # noqa: E402

from vllm_treespec.vllm_glue import cpu_linear  # noqa: E402


def stock_layer(n_out: int, n_in: int, seed: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """A layer dispatched the way vLLM's CPU backend dispatches linear layers."""
    layer = torch.nn.Module()
    weight = torch.randn(n_out, n_in, generator=torch.Generator().manual_seed(seed))
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    if cpu_linear._handler(layer.cpu_linear) is None:
        pytest.skip("this vLLM build does not use oneDNN for CPU linear layers")
    return layer, weight


@pytest.fixture
def layers():
    model = torch.nn.Module()
    model.a, wa = stock_layer(96, 64, 0)
    model.b, wb = stock_layer(48, 96, 1)
    stock = {"a": model.a.cpu_linear, "b": model.b.cpu_linear}
    assert cpu_linear.install([model], torch.float32) == 2
    yield model, {"a": wa, "b": wb}, stock
    cpu_linear.use_rows([])


def test_weights_are_recovered_exactly(layers):
    model, weights, _ = layers
    for name in ("a", "b"):
        recovered = cpu_linear._LAYERS[getattr(model, name).small_m_key][0]
        assert torch.equal(recovered, weights[name])


def test_rows_outside_the_choice_run_the_stock_kernel_bit_for_bit(layers):
    model, _, stock = layers
    cpu_linear.use_rows([2, 3])
    for m in (1, 4, 7):
        x = torch.randn(m, 64)
        assert torch.equal(model.a.cpu_linear(x, None, None), stock["a"](x, None, None))


def test_chosen_rows_compute_the_same_product(layers):
    model, weights, _ = layers
    cpu_linear.use_rows([2, 3])
    for m in (2, 3):
        x = torch.randn(m, 96)
        bias = torch.randn(48)
        got = model.b.cpu_linear(x, None, bias)
        torch.testing.assert_close(got, x @ weights["b"].t() + bias, rtol=1e-5, atol=1e-5)
        assert got.is_contiguous() and got.shape == (m, 48)


def test_a_compiled_graph_follows_the_choice_made_after_compilation(layers):
    model, _, stock = layers
    compiled = torch.compile(lambda x: model.a.cpu_linear(x, None, None), dynamic=True,
                             fullgraph=True)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    # Mark the W @ x^T path: its weight copy doubled, so that which kernel ran
    # shows in the result on every CPU (whether the two kernels round alike
    # depends on the machine).
    cpu_linear._LAYERS[model.a.small_m_key][0].mul_(2.0)
    cpu_linear.use_rows([])
    before = compiled(x)
    cpu_linear.use_rows([3])
    after = compiled(x)
    assert torch.equal(before, stock["a"](x, None, None))
    torch.testing.assert_close(after, 2.0 * before, rtol=1e-5, atol=1e-4)
    assert torch.equal(after, model.a.cpu_linear(x, None, None))


def test_calibration_keeps_the_faster_row_counts_and_fills_single_gaps():
    # W @ x^T is faster for 2, 3, 5 and 8 rows (4 measured slower by noise).
    faster = {2, 3, 5, 8}

    def time_step(n):
        return 1.0 if n in faster and cpu_linear._ROWS == {n} else 2.0

    chosen, timings = cpu_linear.calibrate(time_step, range(2, 9), repeats=1)
    assert chosen == [2, 3, 4, 5, 8]
    assert timings[2] == (2.0, 1.0) and timings[4] == (2.0, 2.0)
    assert cpu_linear._ROWS == {2, 3, 4, 5, 8}
    cpu_linear.use_rows([])


def test_uninstall_gives_the_stock_kernel_back(layers):
    model, _, stock = layers
    key = model.a.small_m_key
    assert cpu_linear.uninstall([model]) == 2
    assert model.a.cpu_linear is stock["a"] and model.b.cpu_linear is stock["b"]
    assert not hasattr(model.a, "small_m_key") and cpu_linear._LAYERS[key][0].numel() == 0
    assert cpu_linear.uninstall([model]) == 0


def test_layer_timer_times_each_side_as_a_compiled_graph_would_run_it(layers):
    """W @ x^T through the dispatcher; the stock kernel as the direct op, so that
    the dispatcher's own cost counts against keeping it."""
    model, _, _ = layers
    calls = []
    original = model.b.cpu_linear
    model.b.cpu_linear = lambda x, w, b: calls.append(tuple(x.shape)) or original(x, w, b)
    time_step = cpu_linear.layer_timer([model], torch.float32)
    assert time_step(3) > 0 and calls == []  # stock: the oneDNN op, no dispatcher
    cpu_linear.use_rows([3])
    assert time_step(3) > 0 and calls == [(3, 96)]
    cpu_linear.use_rows([])
    chosen, timings = cpu_linear.calibrate(time_step, range(2, 4), repeats=1, margin=10.0)
    assert chosen == [] and set(timings) == {2, 3}  # a margin nothing can beat

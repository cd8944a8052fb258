"""Weight layouts made once (lowering.hoist, torch_bridge.kernels.WeightLayouts): a convolution's
kernel is re-laid out for the card's matmul when the weights come to the card, not on every
call; results equal the unsplit kernel's bit for bit (it is data movement only)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

import torch_bridge.backend as tb
from lowering.builder import Builder
from lowering.graph import Graph, Var, check_graph
from lowering.hoist import split_weight_layouts
from torch_bridge.kernels import resident_stats


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, groups=4, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    ).eval()


def _graph(transpose_perm: tuple[int, ...]) -> Graph:
    """x [8, 64] @ (a re-layout of weight w [4, 4, 64] -> [64, 16]); w.T of a Linear-like
    weight v [16, 64] read by a second matmul."""
    b = Builder()
    x, w, v = Var((8, 64), "float32"), Var((4, 4, 64), "float32"), Var((16, 64), "float32")
    f32 = "float32"
    wt = b.reshape(b.transpose(w, transpose_perm), (64, 16))
    x3 = b.reshape(x, (1, 8, 64))
    y = b.emit("matmul", [x3, b.reshape(wt, (1, 64, 16))], (1, 8, 16), f32, dtype=f32)
    vt = b.transpose(v, (1, 0))
    z = b.emit("matmul", [x3, b.reshape(vt, (1, 64, 16))], (1, 8, 16), f32, dtype=f32)
    return Graph("g", (x, w, v), tuple(b.nodes), (y, z))


def test_the_split_moves_only_weight_relayouts():
    g = _graph((2, 0, 1))
    check_graph(g)
    s = split_weight_layouts(g, [1, 2])
    assert s is not None
    check_graph(s.prelude)
    check_graph(s.main)
    # w's re-layout, and the Linear-like v.T: the card's PE takes the rhs sticked on N, so a
    # weight sticked on K is restickified once, not on every call (MatmulStep.nt_form)
    ops = [n.op for n in s.prelude.nodes]
    assert ops == ["transpose", "reshape", "reshape", "transpose", "reshape"]
    assert s.prelude_args == (1, 2)
    assert s.main_args == (0,)
    assert "transpose" not in [n.op for n in s.main.nodes]
    # not a weight: nothing moves; a transpose that keeps the sticks: only v.T moves
    assert split_weight_layouts(g, [0]) is None
    keep = split_weight_layouts(_graph((1, 0, 2)), [1, 2])
    assert keep is not None and [n.op for n in keep.prelude.nodes] == ["transpose", "reshape"]
    assert keep.prelude_args == (2,)


def _captured(model: nn.Module, x: torch.Tensor) -> tuple:
    got: dict = {}

    def backend(gm, ex):
        def fw(g, e):
            got["gm"], got["weights"] = g, tb._weight_inputs()

            def run(*args):
                got["args"] = [a.detach() for a in args]
                return g(*args)

            return make_boxed_func(run)

        return aot_module_simplified(gm, ex, fw_compiler=fw)

    torch._dynamo.reset()  # static shapes: no earlier compile of the same forward in this worker
    with torch.no_grad():
        torch.compile(model, backend=backend)(x)
    return got["gm"], got["weights"], got["args"]


def test_a_cnn_lays_its_weights_out_once_and_again_after_they_change():
    m = _cnn()
    x = torch.randn(2, 3, 16, 16)
    tb.reset_fallback_stats()
    with torch.no_grad():
        c = torch.compile(m, backend="spyre")
        torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-5)
        (k,) = tb.compiled_kernels()
        assert k.weight_layouts is not None and k.weight_layouts.runs == 1
        assert k.weight_layouts.card_runs == 0  # CPU weights: laid out on the host
        assert k.cost_analysis()["weight_layouts_us"] > 0
        c(x)
        assert k.weight_layouts.runs == 1
        before = resident_stats()["bytes"]
        m[2].weight.mul_(-2)  # an in-place change: laid out again
        torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-5)
        assert k.weight_layouts.runs == 2
        assert resident_stats()["bytes"] == before  # the old copies went
        m[2].weight.data = torch.randn_like(m[2].weight)  # same tensor and version counter
        torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-5)
        assert k.weight_layouts.runs == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_split_kernel_is_faster_and_equal_to_the_unsplit_one(dtype):
    m = _cnn().to(dtype)
    x = torch.randn(1, 3, 16, 16).to(dtype)
    gm, weights, ins = _captured(m, x)
    assert weights and len(weights) == len(ins) - 1  # the parameters and buffers, not x
    whole, split = tb._CardGraph(gm), tb._CardGraph(gm, weights)
    with torch.no_grad():
        a, b = whole(*ins), split(*ins)
    # the convolutions' laid-out kernels give the same bytes; the Linear's W.T, laid out once,
    # is an NN product where the unsplit graph's is NT (the rhs read transposed): the fp32
    # sums run in another order, so the last bits may differ, one rounding of the dtype
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol)
    t_whole = whole.cost_analysis()["sim_time_us"]
    t_split = split.cost_analysis()["sim_time_us"]
    assert t_split < t_whole


def test_a_card_that_rounds_stores_to_dl16_lays_weights_out_on_the_card(small_card):
    small_card(dl16_rounding=True)
    m = _cnn().half()
    x = torch.randn(1, 3, 16, 16).half()
    gm, weights, ins = _captured(m, x)
    whole, split = tb._CardGraph(gm), tb._CardGraph(gm, weights)
    with torch.no_grad():
        a, b = whole(*ins), split(*ins)
    for p, q in zip(a, b, strict=True):  # the Linear's sums in another order (above)
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-3)
    assert split.weight_layouts.card_runs == 1


def test_weights_on_the_spyre_device():
    m = _cnn()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        want = m(x)
        md = _cnn().to("spyre")
        tb.reset_fallback_stats()
        got = torch.compile(md, backend="spyre")(x.to("spyre"))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)
    assert [k.weight_layouts.card_runs for k in tb.compiled_kernels()] == [1]
    assert not tb.fallback_stats()


def test_weights_made_in_inference_mode():
    x = torch.randn(1, 3, 16, 16)
    with torch.inference_mode():  # inference tensors have no version counter
        mi = _cnn()
        got = torch.compile(mi, backend="spyre")(x)
        torch.testing.assert_close(got, mi(x), rtol=1e-4, atol=1e-5)

"""Matmul epilogues: an elementwise map on a matmul's product (a bias, an activation, a residual
add, a SwiGLU's gate product, a convert) fused into the matmul's store (``fuse_epilogue``).

The fused stage must give the bits of the two unfused stages (the product is rounded to the
matmul's dtype first, as it was stored), agree with the per-core NumPy reference interpreter and
with ``jax.jit`` / eager torch on the CPU, move fewer bytes and take less simulated time; when
the fused stage does not fit the scratchpad the scheduler runs the two stages instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from test_ops import F16, F32, _arr
from test_ops import _check as _check_host
from test_reference import _check as _check_reference

import lowering.pipeline as pipeline
import spyre_jax
import torch_bridge
from device_model.ops import InputView, MapBody
from lowering.graph import Graph as GraphIR
from lowering.graph import GraphError, Node, Var, check_graph
from lowering.op_params import Fused, Matmul
from spyre_jax.tools.testing import assert_close


def _mlp_in(x, w, b, r):
    """GPT-2's MLP input projection with a residual: bias, tanh-GELU, add."""
    y = jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(x.dtype) + b
    return jax.nn.gelu(y) + r


def _swiglu(x, wg, wu):
    """Llama's MLP: silu(x @ wg) * (x @ wu); the second matmul takes the product as epilogue."""
    return jax.nn.silu(x @ wg) * (x @ wu)


def _w(shape, dtype, seed, scale):
    """Weights scaled to keep activations near 1, in ``dtype``."""
    return (_arr(shape, F32, seed=seed) * scale).astype(dtype)


def _epilogues(kernel) -> list:
    return [s.step.epilogue for s in kernel.stages if s.kind == "matmul"]


def _unfused(monkeypatch, f, *xs):
    """``f`` compiled without the epilogue fusion: (its result, its kernel, its cost)."""
    monkeypatch.setattr(pipeline, "fuse_epilogue", lambda g: g)
    jf = spyre_jax.jit(f)
    got = jf(*xs)
    low = jf.lower(*xs)
    cost = low.compile().cost_analysis()
    monkeypatch.undo()
    return got, low.kernel, cost


SHAPES = [(128, 256, 512), (100, 300, 200), (7, 64, 50), (512, 1024, 1536)]


@pytest.mark.parametrize("mkn", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
@pytest.mark.slow
def test_bias_gelu_residual_is_one_stage_with_the_unfused_bits(mkn, monkeypatch):
    m, k, n = mkn
    x, w = _arr((m, k), F16, seed=1), _w((k, n), F16, 2, 1 / np.sqrt(k))
    b, r = _arr((n,), F16, seed=3), _arr((m, n), F16, seed=4)
    got = _check_host(_mlp_in, x, w, b, r, k=k, chain=4)
    low = spyre_jax.jit(_mlp_in).lower(x, w, b, r)
    assert [s.kind for s in low.kernel.stages] == ["matmul"]
    (ep,) = _epilogues(low.kernel)
    assert ep is not None and "tanh" in str(ep)
    two, kern2, cost2 = _unfused(monkeypatch, _mlp_in, x, w, b, r)
    assert [s.kind for s in kern2.stages] == ["matmul", "map"]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(two))
    cost = low.compile().cost_analysis()
    # the product no longer goes to device memory and back
    assert cost["device_bytes"] < cost2["device_bytes"]
    assert cost["sim_time_us"] < cost2["sim_time_us"]
    assert cost["flops"] == cost2["flops"]


@pytest.mark.parametrize("dtype", [F16, F32], ids=["f16", "f32"])
def test_swiglu_second_matmul_takes_the_gate_product(dtype):
    x = _arr((64, 256), dtype, seed=5)
    wg, wu = _w((256, 384), dtype, 6, 1 / 16), _w((256, 384), dtype, 7, 1 / 16)
    kern, _ = _check_reference(_swiglu, x, wg, wu, k=256, chain=4)
    kinds = [s.kind for s in kern.stages]
    assert kinds == ["matmul", "matmul"], kinds
    eps = _epilogues(kern)
    assert eps[0] is None and eps[1] is not None  # silu(gate) * up rides the second store


def test_batched_epilogue_and_fp32_product_converted_on_the_way_out():
    def f(q, k, bias):
        s = jnp.einsum("bmk,bnk->bmn", q, k, preferred_element_type=jnp.float32)
        return (s * 0.125 + bias).astype(jnp.float16)

    q, k = _arr((4, 64, 128), F16, seed=8), _arr((4, 96, 128), F16, seed=9)
    bias = _arr((4, 64, 96), F32, seed=10)
    kern, _ = _check_reference(f, q, k, bias, k=128, chain=3)
    assert [s.kind for s in kern.stages] == ["matmul"]
    st = kern.stages[0]
    assert st.grid[0] == 4 and st.step.out_dtype == "float32"
    out = {t.name: t for t in kern.tensors}[st.output.tensor]
    assert out.layout.dtype == "float16"  # the fp32 product never reaches device memory


def test_product_used_twice_stays_stored():
    def f(x, w, b):
        p = x @ w
        return p + b, p

    x, w, b = _arr((64, 128), F16, seed=11), _arr((128, 64), F16, seed=12), _arr((64,), F16)
    _check_host(f, x, w, b, k=128)
    kern = spyre_jax.jit(f).lower(x, w, b).kernel
    assert [s.kind for s in kern.stages] == ["matmul", "map"]
    assert _epilogues(kern) == [None]


def test_reductions_after_a_matmul_are_not_epilogues():
    def f(x, w):
        return jax.nn.softmax(x @ w, axis=-1)

    x, w = _arr((64, 128), F16, seed=13), _w((128, 256), F16, 14, 1 / 8)
    _check_host(f, x, w, k=128, chain=4)
    assert _epilogues(spyre_jax.jit(f).lower(x, w).kernel) == [None]


@pytest.mark.slow
def test_an_epilogue_that_does_not_fit_runs_as_two_stages(small_card):
    # a K that is not a whole number of sticks keeps K whole in a block: the fused stage's
    # buffers need more than this scratchpad, the unfused matmul splits K across steps
    card = small_card(scratchpad_bytes=16 * 1024)
    x, w = _arr((32, 1000), F16, seed=15), _w((1000, 64), F16, 16, 1 / 32)
    b, r = _arr((64,), F16, seed=17), _arr((32, 64), F16, seed=18)
    _check_host(_mlp_in, x, w, b, r, k=1000, chain=4)
    low = spyre_jax.jit(_mlp_in).lower(x, w, b, r)
    assert [s.kind for s in low.kernel.stages] == ["matmul", "map"]
    g = low.graph
    for name, fn in pipeline.graph_passes(card):
        if name == "unfuse":  # fused, then split by the unfuse pass (the tiler asked)
            assert any(getattr(n.params, "epilogue", None) for n in g.nodes)
        g = fn(g)
    assert not any(getattr(n.params, "epilogue", None) for n in g.nodes)
    peak = low.compile().cost_analysis()["scratchpad_peak_bytes"]
    assert peak <= card.scratchpad_usable_bytes


def test_torch_mlp_linears_carry_bias_and_gelu():
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(128, 512), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(512, 128)
    ).half()
    x = torch.randn(2, 32, 128).half()
    f = torch.compile(m, backend="spyre", dynamic=False)
    with torch.no_grad():
        got, want = f(x).float(), m.float()(x.float())
    ck = torch_bridge.backend.compiled_kernels()[-1]
    assert [s.kind for s in ck.kernel.stages] == ["matmul", "matmul"]
    assert all(ep is not None for ep in _epilogues(ck.kernel))
    # fp16 on the card against fp32 eager: the rounding of two fp16 layers
    assert_close(got, want, dtype=torch.float16)


def _matmul_node(ep: MapBody, slot: int = 0) -> GraphIR:
    a, b, e = Var((1, 8, 16), "float16"), Var((1, 16, 32), "float16"), Var((32,), "float16")
    out = Var((1, 8, 32), ep.out_dtype)
    n = Node("matmul", (a, b, e), (out,), Matmul("float16", epilogue=Fused(ep, slot)))
    return GraphIR("g", (a, b, e), (n,), (out,), ())


def test_graph_checker_rejects_bad_epilogues():
    prod, bias = InputView.identity(3), InputView((2,), (0,), (1,), (False,))
    add = (("add", (0, 1), None, "float16"),)
    check_graph(_matmul_node(MapBody((1, 8, 32), (prod, bias), add, "", (), "float16")))
    bad = [
        # a reduction is not an epilogue
        (MapBody((1, 8, 32), (prod, bias), add, "sum", (2,), "float16"), 0, "reduces"),
        # the product must be read one-to-one
        (MapBody((1, 8, 32), (bias, prod), add, "", (), "float16"), 0, "1:1"),
        # over the product's shape
        (MapBody((1, 8, 16), (prod, bias), add, "", (), "float16"), 0, "space"),
        (MapBody((1, 8, 32), (prod, bias), add, "", (), "float16"), 5, "acc_slot"),
    ]
    for ep, slot, msg in bad:
        with pytest.raises(GraphError, match=msg):
            check_graph(_matmul_node(ep, slot))


@pytest.mark.slow
def test_vmapped_equinox_linears_swap_their_operands():
    """A vmapped ``eqx.nn.Linear`` traces ``W @ x^T`` then a transpose: swapped to ``x @ W^T``
    the transpose is gone and the bias and activation ride the store."""
    import equinox as eqx

    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    up = eqx.nn.Linear(128, 384, key=k1)
    down = eqx.nn.Linear(384, 128, key=k2)

    def mlp(x):
        return jax.vmap(down)(jax.nn.gelu(jax.vmap(up)(x))) + x

    x = _arr((64, 128), F32, seed=19)
    kern, _ = _check_reference(mlp, x, k=384, chain=4)
    assert [s.kind for s in kern.stages] == ["matmul", "matmul"]
    assert all(ep is not None for ep in _epilogues(kern))


def test_a_slice_of_a_reshaped_product_is_not_read_as_the_whole():
    # regression: a map reading the first columns of a reshaped product has an identity view
    # (start 0, stride 1) of a longer input; sinking the reshape below it lost the slice
    def f(x, w):
        y = (x @ w).reshape(8, 8, 384)
        return y[..., :128] + 1, y[..., 128:256] * 2

    x, w = _arr((64, 128), F16, seed=20), _w((128, 384), F16, 21, 1 / 16)
    _check_host(f, x, w, k=128, chain=2)

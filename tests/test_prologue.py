"""Norm + matmul fusion (``lowering.prologue``): an RMSNorm's row statistic stored by a small
stats map, its per-element part run by the SFUs on each lhs tile of the matmuls after it.

The split must give the norm's bits (checked on the bodies themselves with NumPy, over random
shapes and values); the fused kernels must agree with the per-core NumPy reference and with
``jax.jit`` / eager torch on the CPU, move fewer bytes and take less simulated time (the pass
fuses only then); norms with two statistics or other readers stay; when the fused stage does
not fit the scratchpad the scheduler runs the prologue as a map.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_ops import F16, F32, _arr
from test_ops import _check as _check_host
from test_reference import _check as _check_reference

import lowering.pipeline as pipeline
import spyre_jax
import torch_bridge
from device_model import ops
from device_model.card import CardSpec
from device_model.ops import InputView, MapBody
from lowering import prologue
from lowering.from_jaxpr import from_jaxpr
from lowering.graph import Graph as GraphIR
from lowering.graph import GraphError, Node, Var, check_graph
from lowering.op_params import Fused, Matmul
from spyre_jax.tools.testing import assert_close

BF16 = jnp.bfloat16


def _rms(x, g, eps=1e-6):
    """Llama's RMSNorm: the mean square in fp32, the scale rounded to the input's dtype."""
    x32 = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * r).astype(x.dtype) * g


def _rms_linear(x, g, w):
    return _rms(x, g) @ w.T


def _qkv(x, g, wq, wk, wv):
    h = _rms(x, g)
    return h @ wq, h @ wk, h @ wv


def _ln_linear(x, g, b, w):
    """LayerNorm (the mean and the scale: two row statistics) before a matmul."""
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, axis=-1, keepdims=True)
    return ((x - mu) * jax.lax.rsqrt(var + 1e-5) * g + b) @ w


def _w(shape, dtype, seed, scale):
    return (_arr(shape, F32, seed=seed) * scale).astype(dtype)


def _stages(kernel) -> list[tuple[str, bool]]:
    return [(s.kind, s.kind == "matmul" and s.step.prologue is not None) for s in kernel.stages]


def _before(f, stop: str, *xs) -> GraphIR:
    """``f``'s graph after the passes before ``stop`` (on the default card)."""
    graph = from_jaxpr(jax.make_jaxpr(f)(*xs), "f")
    for name, fn in pipeline.graph_passes(CardSpec()):
        if name == stop:
            break
        graph = fn(graph)
    return graph


def _no_pass(g, card, time_of=None):
    return g


def _forced(g, card, time_of=None):
    """The fusion wherever it applies, not only where the timing model says it saves time."""
    return prologue.fuse_prologue(g, card)


def _compiled(monkeypatch, fuse, f, *xs):
    """``f`` compiled with ``fuse`` as the prologue pass: (its result, kernel, cost)."""
    monkeypatch.setattr(pipeline, "fuse_prologue", fuse)
    jf = spyre_jax.jit(f)
    got = np.asarray(jf(*xs))
    low = jf.lower(*xs)
    cost = low.compile().cost_analysis()
    monkeypatch.undo()
    return got, low.kernel, cost


SHAPES = [(2, 64, 256, 512), (1, 512, 2048, 1024), (2, 96, 320, 512)]


@pytest.mark.parametrize("bmkn", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
@pytest.mark.slow
def test_rmsnorm_rides_the_matmul_loads(bmkn, monkeypatch):
    b, m, k, n = bmkn
    x, g = _arr((b, m, k), F16, seed=1), _arr((k,), F16, seed=2)
    w = _w((n, k), F16, 3, 1 / np.sqrt(k))
    kern, _ = _check_reference(_rms_linear, x, g, w, k=k, chain=3)
    assert _stages(kern) == [("map", False), ("matmul", True)]
    stats = {t.name: t for t in kern.tensors}[kern.stages[0].output.tensor]
    assert stats.layout.shape == (1, b * m) and stats.layout.dtype == "float32"
    got = np.asarray(spyre_jax.jit(_rms_linear)(x, g, w))
    cost = spyre_jax.jit(_rms_linear).lower(x, g, w).compile().cost_analysis()
    two, kern2, cost2 = _compiled(monkeypatch, _no_pass, _rms_linear, x, g, w)
    assert _stages(kern2) == [("map", False), ("matmul", False)]
    # the normalized activations no longer go to device memory and back
    assert cost["device_bytes"] < cost2["device_bytes"]
    assert cost["sim_time_us"] < cost2["sim_time_us"]
    # the same lhs bits; the matmuls may split K differently (another order of fp32 sums)
    assert_close(got, two)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 9),
    k=st.integers(2, 300),
    scale=st.sampled_from([1e-3, 1.0, 60.0]),
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    seed=st.integers(0, 2**16),
    residual=st.booleans(),
    kind=st.sampled_from(["rms", "layernorm", "softmax"]),
)
def test_the_split_gives_the_norms_bits(rows, k, scale, dtype, seed, residual, kind):
    """The stats bodies' statistics (stored in fp32) and the prologue body give exactly what
    the norm's body gives, rounded to its dtype: evaluated with NumPy on whole rows (RMSNorm:
    one statistic; layernorm: the mean and the scale; a softmax: the max and the sum)."""
    jdt = jnp.dtype(dtype)

    def norm(x, r, g):
        h = x + r if residual else x
        if kind == "layernorm":
            mu = jnp.mean(h, axis=-1, keepdims=True)
            var = jnp.mean((h - mu) ** 2, axis=-1, keepdims=True)
            return (h - mu) * jax.lax.rsqrt(var + 1e-5) * g
        if kind == "softmax":
            return jax.nn.softmax(h, axis=-1) * g
        return _rms(h, g)

    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, k)) * scale).astype(jdt)
    r = rng.standard_normal((rows, k)).astype(jdt)
    g = rng.standard_normal(k).astype(jdt)
    graph = _before(norm, "fuse_epilogue", x, r, g)
    norms = [n for n in graph.nodes if n.op == "map" and n.params.body.program_reduce_axes()]
    assume(len(norms) == 1)  # (a one-element row: the fusion keeps the sum a stage)
    (node,) = norms
    body = node.params.body
    parts = prologue.split_norm(body)
    assert parts is not None, body
    stats, pro, ins_p, row = parts
    assert len(stats) == (1 if kind == "rms" else 2)
    vals = {id(v): np.asarray(a) for v, a in zip(graph.inputs, (x, r, g), strict=True)}
    tiles = [vals[id(v)][None] for v in node.inputs]
    dts = [v.dtype for v in node.inputs]
    space = tuple(body.space)

    def run(b, ts, ds):
        return ops.narrow(np, ops.run_map(np, b, ts, ds, space, 1), b.out_dtype, False)

    want = run(body, tiles, dts)
    rowstats = [run(b, [tiles[i] for i in ins], [dts[i] for i in ins]) for b, ins in stats]
    assert all(s.dtype == np.float32 and s.shape == (1, *space[:-1]) for s in rowstats)
    pro_dts = [dts[i] for i in ins_p] + ["float32"] * len(stats)
    got = run(pro, [tiles[i] for i in ins_p] + rowstats, pro_dts)
    assert pro.views[row] == InputView.identity(len(space))
    np.testing.assert_array_equal(got, want)


def test_three_projections_share_one_stats_map():
    x, g = _arr((256, 512), F16, seed=4), _arr((512,), F16, seed=5)
    wq = _w((512, 512), F16, 6, 1 / 22)
    wk, wv = _w((512, 256), F16, 7, 1 / 22), _w((512, 256), F16, 8, 1 / 22)
    kern, _ = _check_reference(_qkv, x, g, wq, wk, wv, k=512, chain=3)
    assert _stages(kern) == [("map", False), ("matmul", True), ("matmul", True), ("matmul", True)]


def test_torch_llama_norm_and_projections_fuse():
    class RMSNorm(torch.nn.Module):  # as transformers' LlamaRMSNorm computes it
        def __init__(self, d: int):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(d))

        def forward(self, h):
            dt = h.dtype
            h = h.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            return self.weight * h.to(dt)

    class Attn(torch.nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.norm = RMSNorm(d)
            self.q = torch.nn.Linear(d, d, bias=False)
            self.k = torch.nn.Linear(d, d // 2, bias=False)
            self.v = torch.nn.Linear(d, d // 2, bias=False)

        def forward(self, x):
            h = self.norm(x)
            return self.q(h), self.k(h), self.v(h)

    torch.manual_seed(0)
    m = Attn(512).half()
    x = torch.randn(2, 128, 512).half()
    f = torch.compile(m, backend="spyre", dynamic=False)
    with torch.no_grad():
        got, want = f(x), m.float()(x.float())
    ck = torch_bridge.backend.compiled_kernels()[-1]
    assert _stages(ck.kernel) == [("map", False)] + [("matmul", True)] * 3
    for a, b in zip(got, want, strict=True):
        # fp16 on the card against fp32 eager: the norm's fp16 rounding, a 512-long dot
        assert_close(a.float(), b, dtype=torch.float16)


def test_layernorm_takes_two_stats_maps_and_fuses_only_when_faster(monkeypatch):
    # GPT-2 small's shape: each stats map loads the rows, about what the unfused norm's load
    # and store cost; the timing model says fused is slower and the pass keeps the norm
    x, g, b = _arr((128, 768), F16, seed=9), _arr((768,), F16, seed=10), _arr((768,), F16)
    w = _w((768, 256), F16, 11, 1 / 28)
    _check_host(_ln_linear, x, g, b, w, k=768, chain=4)
    kern = spyre_jax.jit(_ln_linear).lower(x, g, b, w).kernel
    assert _stages(kern) == [("map", False), ("matmul", False)]
    monkeypatch.setattr(pipeline, "fuse_prologue", _forced)
    kern, _ = _check_reference(_ln_linear, x, g, b, w, k=768, chain=4)
    assert _stages(kern) == [("map", False), ("map", False), ("matmul", True)]


def test_a_norm_read_by_more_than_matmuls_stays(monkeypatch):
    def f(x, g, w):
        h = _rms(x, g)
        return h @ w, h + 1

    x, g, w = _arr((64, 128), F16, seed=12), _arr((128,), F16, seed=13), _w((128, 64), F16, 14, 0.1)
    _check_host(f, x, g, w, k=128, chain=3)
    monkeypatch.setattr(pipeline, "fuse_prologue", _forced)
    kern = spyre_jax.jit(f).lower(x, g, w).kernel
    assert ("matmul", True) not in _stages(kern)


def test_the_pass_fuses_only_where_the_timing_model_says_it_saves_time():
    x, g, w = _arr((32, 64), F16), _arr((64,), F16, seed=1), _w((96, 64), F16, 2, 1 / 8)
    card = CardSpec()
    graph = _before(_rms_linear, "fuse_prologue", x, g, w)
    calls = []

    def time_of(fused_cost: float, sub: GraphIR) -> float:
        fused = any(n.op == "matmul" and n.params.prologue is not None for n in sub.nodes)
        calls.append(fused)
        return fused_cost if fused else 1.0

    same = prologue.fuse_prologue(graph, card, functools.partial(time_of, 1.0))
    assert same is graph and calls == [False, True]  # as slow fused: left as it was
    faster = prologue.fuse_prologue(graph, card, functools.partial(time_of, 0.5))
    check_graph(faster)
    assert any(n.params.prologue is not None for n in faster.nodes if n.op == "matmul")


@pytest.mark.slow
def test_a_prologue_that_does_not_fit_runs_as_a_map(small_card, monkeypatch):
    # a K that is not a whole number of sticks keeps K whole in the fused matmul's lhs block,
    # beside the prologue's: more than this scratchpad holds; the unfused matmul splits K
    card = small_card(scratchpad_bytes=12 * 1024)
    x, g = _arr((32, 1000), F16, seed=15), _arr((1000,), F16, seed=16)
    w = _w((64, 1000), F16, 17, 1 / 32)
    monkeypatch.setattr(pipeline, "fuse_prologue", _forced)
    low = spyre_jax.jit(_rms_linear).lower(x, g, w)
    graph = low.graph
    for name, fn in pipeline.graph_passes(card):
        if name == "unfuse":  # fused, then split by the unfuse pass (the tiler asked)
            assert any(n.op == "matmul" and n.params.prologue is not None for n in graph.nodes)
        graph = fn(graph)
    assert not any(n.op == "matmul" and n.params.prologue is not None for n in graph.nodes)
    kinds = _stages(low.kernel)  # the stats map (through a temp here), the prologue's map
    assert kinds[-1] == ("matmul", False) and ("matmul", True) not in kinds, kinds
    assert [s.kind for s in low.kernel.stages].count("map") >= 2
    _check_host(_rms_linear, x, g, w, k=1000, chain=3)
    assert low.compile().cost_analysis()["scratchpad_peak_bytes"] <= card.scratchpad_usable_bytes


def _matmul_node(pro: MapBody, slot: int = 0) -> GraphIR:
    a, b = Var((1, 8, 16), "float16"), Var((1, 32, 16), "float16")
    s, gw = Var((1, 8), "float32"), Var((16,), "float16")
    out = Var((1, 8, 32), "float16")
    ps = Matmul("float16", rhs_t=True, prologue=Fused(pro, slot))
    n = Node("matmul", (a, b, gw, s), (out,), ps)
    return GraphIR("g", (a, b, gw, s), (n,), (out,), ())


def test_graph_checker_rejects_bad_prologues():
    lhs, gw = InputView.identity(3), InputView((2,), (0,), (1,), (False,))
    stat = InputView((0, 1), (0, 0), (1, 1), (False, False))
    prog = (("mul", (0, 1), None, "float32"), ("mul", (3, 2), None, "float16"))
    check_graph(_matmul_node(MapBody((1, 8, 16), (lhs, gw, stat), prog, "", (), "float16")))
    red = (*prog, ("rsum", (4,), (2,), "float32"))
    bad = [
        # a reduction is not a prologue
        (MapBody((1, 8, 16), (lhs, gw, stat), red, "", (), "float16"), 0, "reduces"),
        # the lhs must be read one-to-one
        (MapBody((1, 8, 16), (gw, lhs, stat), prog, "", (), "float16"), 0, "1:1"),
        # over the lhs's shape
        (MapBody((1, 8, 32), (lhs, gw, stat), prog, "", (), "float16"), 0, "space"),
        (MapBody((1, 8, 16), (lhs, gw, stat), prog, "", (), "float16"), 5, "lhs_slot"),
    ]
    for pro, slot, msg in bad:
        with pytest.raises(GraphError, match=msg):
            check_graph(_matmul_node(pro, slot))


def test_a_softmax_before_a_batched_matmul_splits_at_its_max_and_sum(monkeypatch):
    """Attention's weighted sum: the softmax's two row statistics (max, sum) as stats maps,
    the exponentials run per lhs tile of the batched matmul (forced: compared with the
    reference interpreter and the CPU, whatever the timing model would pick)."""

    def f(s, v):
        return jax.nn.softmax(s, axis=-1) @ v

    s, v = _arr((4, 64, 96), F16, seed=21), _arr((4, 96, 32), F16, seed=22)
    monkeypatch.setattr(pipeline, "fuse_prologue", _forced)
    kern, _ = _check_reference(f, s, v, k=96, chain=4)
    assert _stages(kern) == [("map", False), ("map", False), ("matmul", True)]
    assert kern.stages[-1].grid[0] == 4


def test_a_matmul_with_both_a_prologue_and_an_epilogue(monkeypatch):
    """Llama's MLP after its norm: the up projection carries the SwiGLU gate product as its
    epilogue and the norm as its prologue (inputs: lhs, rhs, the epilogue's, the
    prologue's)."""

    def f(x, g, wg, wu):
        h = _rms(x, g)
        return jax.nn.silu(h @ wg) * (h @ wu)

    x, g = _arr((64, 256), F16, seed=23), _arr((256,), F16, seed=24)
    wg, wu = _w((256, 384), F16, 25, 1 / 16), _w((256, 384), F16, 26, 1 / 16)
    monkeypatch.setattr(pipeline, "fuse_prologue", _forced)
    kern, _ = _check_reference(f, x, g, wg, wu, k=256, chain=4)
    assert _stages(kern) == [("map", False), ("matmul", True), ("matmul", True)]
    bodies = [s.step for s in kern.stages[1:]]
    assert bodies[0].epilogue is None and bodies[1].epilogue is not None


def test_a_prologue_reading_a_rank_0_tensor(monkeypatch):
    # regression: a rank-0 input of the prologue (a scale given as an array; bucketed torch
    # graphs pass fill values so) was windowed as if it had dims: no block fit its one stick
    def f(x, g, w, s):
        return (_rms(x, g) * s) @ w

    x, g, w = _arr((64, 128), F16, seed=27), _arr((128,), F16, seed=28), _w((128, 96), F16, 29, 0.1)
    s = np.asarray(0.5, F16)
    monkeypatch.setattr(pipeline, "fuse_prologue", _forced)
    kern, _ = _check_reference(f, x, g, w, s, k=128, chain=4)
    assert ("matmul", True) in _stages(kern)


def test_a_norm_of_a_slice_keeps_its_stage(monkeypatch):
    # the norm reads the first rows of a longer tensor (an identity view of it): that tensor is
    # not the matmul's lhs, so the norm is not split
    def f(x, g, w):
        return jnp.matmul(_rms(x[:, :48], g), w)

    x, g = _arr((1, 64, 128), F16, seed=30), _arr((128,), F16, seed=31)
    w = _w((1, 128, 96), F16, 32, 0.1)
    monkeypatch.setattr(pipeline, "fuse_prologue", _forced)
    _check_host(f, x, g, w, k=128, chain=3)

"""Row-resident fusion: softmax, layernorm and RMSNorm as one map stage.

``fuse_maps`` recomputes a reduction inside a consumer that reads it broadcast over the reduced
axes (an in-program reduction, ``rsum``/``rmax``/...), and an elementwise producer inside each of
its consumers; the tiler keeps the reduced axes whole in a block. Where the whole rows do not fit
the scratchpad, the fusion is not made and the unfused stages run instead. Results are checked
against ``jax.jit`` on the CPU with the test oracle (``spyre_jax.tools.testing``), through
``tests/test_ops.py``'s ``_check``.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from test_ops import F16, F32, FLOATS, _arr, _check

import spyre_jax
from device_model import ops
from device_model.kernel import Stage
from device_model.ops import ROW_REDUCTIONS, InputView, MapBody
from lowering.from_jaxpr import from_jaxpr
from lowering.graph import Graph
from lowering.passes import dce, fuse_maps, to_maps
from lowering.pipeline import compile_graph
from lowering.schedule import map_fits, schedule
from spyre_jax import CardSpec, TilingError
from spyre_jax.tools.testing import assert_close


def _kernel(f, *xs):
    return spyre_jax.jit(f).lower(*xs).kernel


def _body(s: Stage) -> MapBody:
    return s.step.body


def _row_ops(s: Stage) -> list[tuple]:
    return [op for op in _body(s).program if op[0] in ROW_REDUCTIONS] if s.kind == "map" else []


def _graph(f, *xs) -> Graph:
    return from_jaxpr(jax.make_jaxpr(f)(*xs))


def _softmax(a):
    return jax.nn.softmax(a, axis=-1)


def _log_softmax(a):
    return jax.nn.log_softmax(a, axis=-1)


def _layernorm(a):
    m = jnp.mean(a, axis=-1, keepdims=True)
    v = jnp.var(a, axis=-1, keepdims=True)
    return (a - m) * lax.rsqrt(v + 1e-5)


def _rmsnorm(a):
    return a * lax.rsqrt(jnp.mean(a * a, axis=-1, keepdims=True) + 1e-6)


def _center(a):
    return a - jnp.mean(a, axis=-1, keepdims=True)


# name -> (fn, chain): ``chain`` as in test_ops._check (rounded ops in a row on the CPU side)
ROW_PROGRAMS = {
    "softmax": (_softmax, 3),
    "log_softmax": (_log_softmax, 3),
    "layernorm": (_layernorm, 2),
    "rmsnorm": (_rmsnorm, 2),
    "center": (_center, 1),
}
SHAPES = [(5, 1), (8, 63), (4, 65), (7, 100), (3, 150), (2, 3, 65), (3, 5, 100)]


# ---------------------------------------------------------------------------------------------
# the published softmax: one stage, one read and one write


def test_softmax_4096x2048_is_one_stage():
    x = np.zeros((4096, 2048), np.float16)
    low = spyre_jax.jit(_softmax).lower(x)
    ca = low.compile().cost_analysis()
    assert ca["num_stages"] == 1
    assert ca["device_bytes"] == 2 * 4096 * 2048 * 2
    (st,) = low.kernel.stages
    assert [op[0] for op in _row_ops(st)] == ["rmax", "rsum"]
    assert st.inputs[0].block[-1] == 2048  # whole rows resident in the scratchpad
    assert ca["scratchpad_peak_bytes"] <= CardSpec().scratchpad_usable_bytes


# ---------------------------------------------------------------------------------------------
# correctness: row programs x odd shapes x dtypes, each one stage


@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
@pytest.mark.parametrize("name", list(ROW_PROGRAMS))
@pytest.mark.slow
def test_row_program_fused_and_correct(name, shape):
    f, chain = ROW_PROGRAMS[name]
    dtype = FLOATS[(SHAPES.index(shape) + list(ROW_PROGRAMS).index(name)) % 3]
    x = _arr(shape, dtype, seed=sum(shape)) * 3
    _check(f, x, k=shape[-1], chain=chain)
    (st,) = _kernel(f, x).stages
    assert _row_ops(st)


@pytest.mark.parametrize("dtype", FLOATS, ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("axis", [0, 1])
def test_softmax_over_a_leading_axis(dtype, axis):
    x = _arr((3, 65, 100), dtype, seed=7) * 3
    f = lambda a: jax.nn.softmax(a, axis=axis)
    _check(f, x, chain=3)
    (st,) = _kernel(f, x).stages
    assert {op[2] for op in _row_ops(st)} == {(axis,)}


@pytest.mark.parametrize("dtype", FLOATS, ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("norm", [eqx.nn.LayerNorm, eqx.nn.RMSNorm], ids=["layernorm", "rmsnorm"])
@pytest.mark.slow
def test_equinox_norms_vmapped_are_one_stage(dtype, norm):
    model = norm(100)
    x = _arr((65, 100), dtype, seed=8) * 2 + 0.5
    f = lambda m, a: jax.vmap(m)(a)
    _check(f, model, x, k=100, chain=3)
    (st,) = _kernel(f, model, x).stages
    assert _row_ops(st)


@pytest.mark.parametrize("dtype", FLOATS, ids=["f16", "bf16", "f32"])
def test_reduction_used_broadcast_and_as_output(dtype):
    x = _arr((63, 100), dtype, seed=9) + 3.0

    def f(a):
        s = jnp.sum(a, axis=-1, keepdims=True)
        m = jnp.max(a, axis=-1)
        return s[:, 0], a / s, m, a - m[:, None]

    _check(f, x, k=100, chain=2)


def test_reduction_feeding_a_transposed_broadcast():
    x = _arr((64, 64), F32, seed=10)
    _check(lambda a: a * jnp.sum(a, axis=1)[None, :], x, k=64)
    _check(lambda a: jax.nn.softmax(a, axis=-1).T, x, chain=3)


def test_reduction_over_two_axes():
    x = _arr((3, 5, 65), F16, seed=11)
    for axes in [(1, 2), (0, 2)]:
        f = lambda a, axes=axes: a - jnp.mean(a, axis=axes, keepdims=True)
        _check(f, x, k=325, chain=2)
        (st,) = _kernel(f, x).stages
        assert _row_ops(st)[0][2] == axes


def test_chains_after_a_fused_softmax():
    x = _arr((64, 100), F32, seed=12) * 3
    y = _arr((64,), F32, seed=13)
    _check(lambda a: jnp.argmax(jax.nn.softmax(a), axis=-1), x)
    _check(lambda a: jax.nn.softmax(a).sum(-1), x, k=100, chain=3)
    _check(lambda a: jax.nn.softmax(jax.nn.softmax(a) * 3), x, chain=6)
    _check(lambda a, b: jax.nn.softmax(a + b[:, None]), x, y, chain=3)
    _check(lambda a: jnp.cumsum(a - a.max(-1, keepdims=True), axis=-1), x, k=100)
    i = _arr((64, 100), np.int32, kind="int", seed=14)
    _check(lambda a: a - a.sum(-1, keepdims=True), i)


# ---------------------------------------------------------------------------------------------
# what must not fuse


def test_no_recompute_over_a_slice_of_the_reduced_axis():
    x = _arr((64, 100), F32, seed=15) * 3
    f = lambda a: jax.nn.softmax(a)[:, :50]
    _check(f, x, chain=3)
    for st in _kernel(f, x).stages:
        for _, _, axes, _ in _row_ops(st):
            assert all(_body(st).space[a] == 100 for a in axes)


def test_reduction_read_without_its_axes_stays_a_stage():
    x = _arr((64, 100), F32, seed=16)
    f = lambda a: jnp.sum(a, axis=-1)[:, None] * jnp.ones((1, 7), a.dtype)
    _check(f, x, k=100)
    k = _kernel(f, x)
    assert any(_body(s).reduce == "sum" for s in k.stages)
    assert not any(_row_ops(s) for s in k.stages)


def test_full_reduction_is_not_recomputed():
    x = _arr((64, 100), F32, seed=17)
    f = lambda a: a / jnp.sum(a)
    _check(f, x, k=6400)
    k = _kernel(f, x)
    assert len(k.stages) >= 2 and not any(_row_ops(s) for s in k.stages)


def test_producer_with_a_non_map_consumer_is_stored_once():
    a, b = _arr((64, 64), F16, seed=18), _arr((64, 64), F16, seed=19)

    def f(x, y):
        t = jnp.tanh(x)
        return t @ y + t

    _check(f, a, b, k=64, chain=2)
    k = _kernel(f, a, b)
    tanh = [
        s for s in k.stages if s.kind == "map" and any(op[0] == "tanh" for op in _body(s).program)
    ]
    assert len(tanh) == 1


# ---------------------------------------------------------------------------------------------
# the scratchpad decides: whole rows that do not fit fall back to the unfused stages


# (layernorm is not among them: unfused, its variance reads the (rows,) mean, whose stick dim
# makes the tiler take 64 whole rows at once, so it needs far more scratchpad than fused)
@pytest.mark.parametrize("name", ["softmax", "rmsnorm"])
@pytest.mark.slow
def test_rows_too_long_for_the_scratchpad_fall_back(small_card, name):
    card = small_card(scratchpad_bytes=64 * 1024)
    f, chain = ROW_PROGRAMS[name]
    x = _arr((64, 8192), F16, seed=20) * 3
    _check(f, x, k=8192, chain=chain)
    low = spyre_jax.jit(f).lower(x)
    assert len(low.kernel.stages) > 1
    assert low.compile().cost_analysis()["scratchpad_peak_bytes"] <= card.scratchpad_usable_bytes
    # fused regardless of the card, the one stage would not tile
    g = _graph(f, x)
    fused = dce(fuse_maps(to_maps(g, CardSpec()), CardSpec()))
    (node,) = [n for n in fused.nodes if n.op == "map"]
    assert not map_fits(node, card) and map_fits(node, CardSpec())
    with pytest.raises(TilingError):
        schedule(fused, card)
    compile_graph(g, card, check=True)


@pytest.mark.slow
def test_fused_stage_double_buffers_under_a_small_scratchpad(small_card):
    card = small_card(scratchpad_bytes=32 * 1024)
    x = _arr((256, 1000), F16, seed=21) * 3
    _check(_softmax, x, chain=3)
    (st,) = _kernel(_softmax, x).stages
    assert st.steps > 1 and all(b.slots == 2 for b in st.scratch)
    assert st.sp_peak_bytes <= card.scratchpad_usable_bytes


@pytest.mark.slow
def test_rows_that_fit_nowhere_run_unfused(small_card):
    """Rows far longer than the scratchpad: the fusion is refused and the unfused stages split
    each row across steps; only a card without room for one stick per buffer raises."""
    card = small_card(scratchpad_bytes=4096)
    x = _arr((4, 100000), F16, seed=22) * 3
    _check(_softmax, x, chain=3)
    low = spyre_jax.jit(_softmax).lower(x)
    assert len(low.kernel.stages) > 1 and not any(_row_ops(s) for s in low.kernel.stages)
    assert low.compile().cost_analysis()["scratchpad_peak_bytes"] <= card.scratchpad_usable_bytes
    small_card(scratchpad_bytes=256)
    with pytest.raises(TilingError, match="scratchpad"):
        spyre_jax.jit(_softmax)(np.ones((4, 100000), np.float16))


# ---------------------------------------------------------------------------------------------
# the program op and its cost


def test_row_reduction_op_keeps_dims_and_broadcasts():
    x = np.arange(15, dtype=np.float32).reshape(1, 3, 5)
    ident = InputView.identity(2)
    prog = (
        ("const", (), 2.0, "float32"),
        ("rsum", (1,), (1,), "float32"),  # a broadcast constant sums over the whole row: 10
        ("rmax", (0,), (1,), "float32"),
        ("sub", (0, 3), None, "float32"),
        ("add", (4, 2), None, "float32"),
    )
    body = MapBody((3, 5), (ident,), prog, "", (), "float32")
    assert body.program_reduce_axes() == {1}
    got = ops.run_program(np, body, [x], (3, 5))
    np.testing.assert_array_equal(got, x - x.max(axis=2, keepdims=True) + 10)
    full = MapBody((3, 5), (ident,), (("rmin", (0,), (0, 1), "float32"),), "", (), "float32")
    assert ops.run_program(np, full, [x], (3, 5)).shape == (1, 1, 1)


@pytest.mark.parametrize(
    "f,same", [(_center, True), (_softmax, True), (_layernorm, False)], ids=["center", "sm", "ln"]
)
def test_fusion_keeps_the_work_count(f, same):
    """Fused or not, the same ops run on the same elements: a producer recomputed in two
    consumers that then fuse is computed once (common subexpressions), an op on a row's reduced
    value counts once per row. Layernorm's ``jnp.var`` computes the mean a second time, which
    the fused program computes once: less work."""
    x = _arr((64, 256), F32, seed=22)
    g, card = _graph(f, x), CardSpec()
    fused = compile_graph(g, card)
    unfused = schedule(dce(to_maps(g, card)), card)
    assert len(fused.stages) == 1 < len(unfused.stages)
    for attr in ("flops", "sfu_elem_ops"):
        got, want = getattr(fused.stages[0], attr), sum(getattr(s, attr) for s in unfused.stages)
        assert got == want if same else 0 < got < want, attr


def _mixed(a, b):
    return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(a.dtype)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_fp32_accumulating_matmul_stores_the_narrow_dtype(dtype, monkeypatch):
    # matmul(fp32) -> convert(fp16/bf16) is one matmul that rounds its fp32 accumulator once on
    # the way out, as the convert does: the same bits as the two stages, no fp32 tensor in
    # device memory
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((96, 320)), dtype)
    b = jnp.asarray(rng.standard_normal((320, 200)), dtype)
    got = np.asarray(spyre_jax.jit(_mixed)(a, b)).astype(np.float32)
    # against the CPU: fp32 sums in another order, then one rounding (half an ulp each way)
    want = np.asarray(jax.jit(_mixed)(a, b)).astype(np.float32)
    ulp = 2.0**-10 if dtype == jnp.float16 else 2.0**-7
    np.testing.assert_allclose(got, want, rtol=ulp, atol=ulp)
    import lowering.pipeline as pipeline

    monkeypatch.setattr(pipeline, "narrow_matmul", lambda g: g)  # the two-stage schedule
    two = np.asarray(spyre_jax.jit(lambda x, y: _mixed(x, y))(a, b)).astype(np.float32)
    np.testing.assert_array_equal(got, two)
    monkeypatch.undo()
    g = compile_graph(from_jaxpr(jax.make_jaxpr(_mixed)(a, b), name="mixed"), CardSpec())
    assert [s.kind for s in g.stages] == ["matmul"]
    assert {t.layout.dtype for t in g.tensors} == {np.dtype(dtype).name}


def test_an_fp32_product_read_elsewhere_stays_fp32():
    # the fp32 result is returned too: the convert stays a stage of its own
    def f(a, b):
        p = jnp.matmul(a, b, preferred_element_type=jnp.float32)
        return p, p.astype(jnp.float16)

    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.standard_normal((64, 128)), jnp.float16)
    b = jnp.asarray(rng.standard_normal((128, 64)), jnp.float16)
    got32, got16 = spyre_jax.jit(f)(a, b)
    want32, want16 = jax.jit(f)(a, b)
    # the fp16 result is our own fp32 product rounded; against XLA's, one fp16 ulp at most (the
    # schedule may split K into blocks, summed in another order than XLA's dot)
    np.testing.assert_array_equal(np.asarray(got16), np.asarray(got32).astype(np.float16))
    g16, w16 = np.asarray(got16), np.asarray(want16)
    assert (np.abs(g16.astype(np.float32) - w16) <= np.spacing(np.abs(w16))).all()
    assert_close(got32, want32)
    g = compile_graph(from_jaxpr(jax.make_jaxpr(f)(a, b), name="both"), CardSpec())
    assert "float32" in {t.layout.dtype for t in g.tensors}

"""Tests of the user-facing API: spyre_jax.jit, Lowered/Compiled, device arrays, memory, errors."""

from __future__ import annotations

import gc
import os
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import rng as _rng
from jax import lax

import spyre_jax
from spyre_jax import CardSpec

THIS_FILE = os.path.basename(__file__)


def _in_use() -> int:
    gc.collect()
    return spyre_jax.memory_stats()["bytes_in_use"]


def _aligned(nbytes: int, alignment: int = CardSpec().stick_bytes) -> int:
    return max(1, -(-nbytes // alignment)) * alignment


# ---------------------------------------------------------------------------------------------
# jit: pytrees, static arguments, the trace cache


def test_pytree_dict_and_tuple_in_tuple_and_dict_out():
    r = _rng()
    a, b, c, d = (r.standard_normal((4, 40)).astype(np.float32) for _ in range(4))

    @spyre_jax.jit
    def f(dct, tup):
        return {"s": dct["a"] + tup[0], "p": (dct["b"] * tup[1], tup[0] - 1.0)}

    out = f({"a": a, "b": b}, (c, d))
    assert set(out) == {"s", "p"} and isinstance(out["p"], tuple) and len(out["p"]) == 2
    for leaf in jax.tree_util.tree_leaves(out):
        assert isinstance(leaf, spyre_jax.Array)
    np.testing.assert_allclose(np.asarray(out["s"]), a + c, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out["p"][0]), b * d, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out["p"][1]), c - 1.0, rtol=1e-6)

    g = spyre_jax.jit(lambda x: (x * 2.0, {"neg": -x}))
    t = g(a)
    assert isinstance(t, tuple) and set(t[1]) == {"neg"}
    np.testing.assert_allclose(np.asarray(t[0]), a * 2.0, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(t[1]["neg"]), -a)


def test_static_argnums_compile_separately():
    f = spyre_jax.jit(lambda x, n: x * n + n, static_argnums=1)
    x = np.arange(24, dtype=np.float32).reshape(3, 8)
    np.testing.assert_array_equal(np.asarray(f(x, 2)), x * 2 + 2)
    np.testing.assert_array_equal(np.asarray(f(x, 3)), x * 3 + 3)
    assert f.trace_count == 2 and len(f._cache) == 2
    np.testing.assert_array_equal(np.asarray(f(x, 2)), x * 2 + 2)  # cached, still right
    assert f.trace_count == 2 and len(f._cache) == 2


def test_static_argnames_compile_separately():
    @spyre_jax.jit(static_argnames="mode")
    def f(x, *, mode):
        return x + 1.0 if mode == "add" else x * 5.0

    x = np.full((2, 64), 3.0, np.float16)
    np.testing.assert_array_equal(np.asarray(f(x, mode="add")), x + np.float16(1))
    np.testing.assert_array_equal(np.asarray(f(x, mode="mul")), x * np.float16(5))
    assert f.trace_count == 2 and len(f._cache) == 2
    f(x, mode="add")
    assert f.trace_count == 2


def test_no_retrace_same_signature_and_retrace_on_new_shape():
    f = spyre_jax.jit(lambda x, y: jnp.tanh(x) + y)
    r = _rng(1)
    x1, y1 = (
        r.standard_normal((8, 96)).astype(np.float32),
        r.standard_normal((8, 96)).astype(np.float32),
    )
    x2, y2 = x1 + 1, y1 - 1
    o1 = f(x1, y1)
    o2 = f(x2, y2)
    assert f.trace_count == 1 and len(f._cache) == 1
    # a device-resident Array of the same shape/dtype hits the same cache entry
    o3 = f(spyre_jax.device_put(x1), y1)
    assert f.trace_count == 1 and len(f._cache) == 1
    np.testing.assert_allclose(np.asarray(o1), np.tanh(x1) + y1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(o2), np.tanh(x2) + y2, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(o3), np.asarray(o1))
    # new shape -> trace again
    f(x1[:4], y1[:4])
    assert f.trace_count == 2 and len(f._cache) == 2
    # new dtype -> trace again
    f(x1.astype(np.float16), y1.astype(np.float16))
    assert f.trace_count == 3 and len(f._cache) == 3


def test_scalars_and_dynamic_kwargs():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    f = spyre_jax.jit(lambda x, s, *, k: x * s + k)
    # NumPy scalars are traced: new values reuse the compiled function
    np.testing.assert_array_equal(np.asarray(f(x, np.float32(2), k=np.float32(1))), x * 2 + 1)
    np.testing.assert_array_equal(np.asarray(f(x, np.float32(3), k=np.float32(-1))), x * 3 - 1)
    assert f.trace_count == 1 and len(f._cache) == 1
    # Python scalars are static leaves (as in eqx.filter_jit): one compile per value, results right
    g = spyre_jax.jit(lambda x, s, *, k: x * s + k)
    np.testing.assert_array_equal(np.asarray(g(x, 2.0, k=1.0)), x * 2 + 1)
    np.testing.assert_array_equal(np.asarray(g(x, 3.0, k=-1.0)), x * 3 - 1)
    np.testing.assert_array_equal(np.asarray(g(x, 2.0, k=1.0)), x * 2 + 1)
    assert g.trace_count == 2 and len(g._cache) == 2
    s = spyre_jax.jit(lambda x: x.sum())(x)  # rank-0 result
    assert isinstance(s, spyre_jax.Array) and s.shape == ()
    assert float(np.asarray(s)) == 66.0


def test_duplicate_and_passthrough_outputs_are_independent_arrays():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    a = spyre_jax.device_put(x)
    y1, y2 = spyre_jax.jit(lambda v: (v, v * 2.0))(a)
    z1, z2 = spyre_jax.jit(lambda v: (v + 1.0, v + 1.0))(a)
    y1.delete()
    z1.delete()
    np.testing.assert_array_equal(np.asarray(a), x)
    np.testing.assert_array_equal(np.asarray(y2), x * 2)
    np.testing.assert_array_equal(np.asarray(z2), x + 1)


# ---------------------------------------------------------------------------------------------
# lower / compile / cost_analysis


def test_lower_as_text_schedule_and_graph():
    x = np.ones((64, 128), np.float16)
    w = np.ones((128, 96), np.float16)
    lowered = spyre_jax.jit(lambda a, b: a @ b).lower(x, w)
    sched = lowered.as_text()
    assert "stage" in sched and "LOAD" in sched
    graph = lowered.as_text("graph")
    assert "matmul" in graph and "return" in graph
    assert graph != sched
    assert "LOAD" not in graph
    # the user's source line is recorded
    assert THIS_FILE in graph


def test_cost_analysis_matmul():
    m, k, n = 64, 256, 96
    x = np.ones((m, k), np.float16)
    w = np.ones((k, n), np.float16)
    compiled = spyre_jax.jit(lambda a, b: a @ b).lower(x, w).compile()
    cost = compiled.cost_analysis()
    for key in (
        "flops",
        "device_bytes",
        "scratchpad_peak_bytes",
        "padding_bytes",
        "cores_used",
        "sim_time_us",
    ):
        assert key in cost, key
    assert cost["flops"] == 2 * m * n * k
    logical = (m * k + k * n + m * n) * 2
    assert cost["device_bytes"] >= logical
    assert 0 < cost["scratchpad_peak_bytes"] <= CardSpec().scratchpad_usable_bytes
    assert 1 <= cost["cores_used"] <= CardSpec().num_cores
    assert cost["sim_time_us"] > 0
    assert cost["padding_bytes"] > 0  # 96 fp16 columns pad to 128 (two 64-element sticks)
    assert "LOAD" in compiled.as_text()


def test_cost_analysis_padding_and_cores():
    card = CardSpec()
    f = spyre_jax.jit(lambda x: x * 2.0)
    cost = f.lower(np.ones((100, 150), np.float16)).compile().cost_analysis()
    # 150 fp16 elements pad to 192 (3 sticks of 64): 42 padding elements per row, in and out
    assert cost["padding_bytes"] > 0
    assert cost["padding_bytes"] >= 100 * (192 - 150) * 2
    assert cost["scratchpad_peak_bytes"] <= card.scratchpad_usable_bytes

    big = f.lower(np.ones((1024, 1024), np.float16)).compile().cost_analysis()
    assert big["cores_used"] == 32
    assert big["padding_bytes"] == 0
    assert 0 < big["scratchpad_peak_bytes"] <= card.scratchpad_usable_bytes
    assert big["sim_time_us"] > cost["sim_time_us"] > 0
    assert big["device_bytes"] >= 2 * 1024 * 1024 * 2


def test_lower_then_compile_shares_the_cache():
    f = spyre_jax.jit(lambda x: x + 1.0)
    x = np.zeros((4, 64), np.float32)
    c = f.lower(x).compile()
    assert isinstance(c, spyre_jax.Compiled)
    np.testing.assert_array_equal(np.asarray(f(x)), x + 1)
    assert f.trace_count == 1 and len(f._cache) == 1


# ---------------------------------------------------------------------------------------------
# device arrays


@pytest.mark.parametrize(
    "dtype",
    [np.float16, ml_dtypes.bfloat16, np.float32, np.int32, np.bool_],
    ids=["float16", "bfloat16", "float32", "int32", "bool"],
)
def test_device_put_round_trip_exact(dtype):
    r = _rng(2)
    h = (r.standard_normal((5, 37)) * 100).astype(dtype)
    a = spyre_jax.device_put(h)
    assert isinstance(a, spyre_jax.Array)
    assert a.shape == (5, 37) and a.ndim == 2 and a.dtype == np.dtype(dtype)
    back = np.asarray(a)
    assert back.dtype == np.dtype(dtype) and back.shape == h.shape
    np.testing.assert_array_equal(back, h)
    # rank 0 and rank 1 too
    s = spyre_jax.device_put(h[0, 0])
    assert s.shape == () and s.ndim == 0
    np.testing.assert_array_equal(np.asarray(s), h[0, 0])
    v = spyre_jax.device_put(h[0])
    np.testing.assert_array_equal(np.asarray(v), h[0])


def test_results_are_arrays_and_chain():
    f = spyre_jax.jit(lambda x: x * 2.0)
    g = spyre_jax.jit(lambda x, y: x + y)
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    y = f(x)
    assert isinstance(y, spyre_jax.Array)
    assert y.block_until_ready() is y
    z = g(y, y)
    assert isinstance(z, spyre_jax.Array)
    np.testing.assert_array_equal(np.asarray(z), x * 4)
    # the input Array is not consumed by the call
    np.testing.assert_array_equal(np.asarray(y), x * 2)
    np.testing.assert_array_equal(np.asarray(f(z)), x * 8)


def test_delete_then_use_raises():
    a = spyre_jax.device_put(np.ones((3, 5), np.float32))
    assert not a.is_deleted()
    a.delete()
    assert a.is_deleted()
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(a)
    with pytest.raises(RuntimeError, match="deleted"):
        spyre_jax.jit(lambda x: x + 1)(a)
    with pytest.raises(RuntimeError, match="deleted"):
        a.block_until_ready()


def test_memory_stats_keys_and_device_put_delete_accounting():
    stats = spyre_jax.memory_stats()
    for key in (
        "bytes_in_use",
        "peak_bytes_in_use",
        "bytes_limit",
        "num_allocs",
        "largest_free_block",
    ):
        assert key in stats, key
    assert stats["bytes_limit"] == CardSpec().device_memory_usable_bytes
    before = _in_use()
    n0 = spyre_jax.memory_stats()["num_allocs"]
    a = spyre_jax.device_put(np.ones((100, 150), np.float16))
    grown = spyre_jax.memory_stats()
    assert grown["bytes_in_use"] - before == _aligned(a.layout.nbytes) == 100 * 192 * 2
    assert grown["peak_bytes_in_use"] >= grown["bytes_in_use"]
    assert grown["num_allocs"] == n0 + 1
    assert grown["largest_free_block"] <= grown["bytes_limit"] - grown["bytes_in_use"]
    a.delete()
    assert _in_use() == before


def test_garbage_collected_array_frees_memory():
    before = _in_use()
    a = spyre_jax.device_put(np.ones((64, 64), np.float32))
    assert _in_use() > before
    del a
    assert _in_use() == before


def test_jit_with_host_inputs_frees_temporaries():
    f = spyre_jax.jit(lambda x, w: (jnp.tanh(x @ w) * 2.0, x.sum(axis=1)))
    x = np.ones((100, 150), np.float16)
    w = np.ones((150, 70), np.float16)
    f(x, w)  # compile (constants, if any, live with the compiled function)
    before = _in_use()
    out = f(x, w)
    expected = sum(_aligned(o.layout.nbytes) for o in out)
    assert _in_use() - before == expected
    del out
    assert _in_use() == before


def test_devices():
    devs = spyre_jax.devices()
    assert len(devs) == 1
    stats = devs[0].memory_stats()
    assert "bytes_in_use" in stats and "bytes_limit" in stats


# ---------------------------------------------------------------------------------------------
# bad input


def _solve_fn(x):  # a linear-algebra decomposition: the card has no kernel for it
    return lax.linalg.triangular_solve(x[:, :8], x, left_side=True)


def _while_fn(x):  # the unsupported op inside a loop's body: the error names the body's line
    body = lambda c: (c[0] + 1, lax.linalg.triangular_solve(c[1][:, :8], c[1], left_side=True))  # noqa: E731
    return lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]


def _jnp_solve_fn(x):
    return jax.jit(lambda y: lax.linalg.triangular_solve(y[:, :8], y, left_side=True))(x)


def _fft_fn(x):
    return jnp.fft.fft(x).real


def _user_line(fn) -> str:
    return f"{THIS_FILE}:{fn.__code__.co_firstlineno + 1}"  # the function's first line


@pytest.mark.parametrize(
    "fn, prim",
    [(_solve_fn, "triangular_solve"), (_while_fn, "triangular_solve")],
    ids=["lax.linalg.triangular_solve", "lax.while_loop"],
)
def test_unsupported_primitive(fn, prim):
    x = np.ones((8, 128), np.float32)
    with pytest.raises(spyre_jax.UnsupportedPrimitiveError) as ei:
        spyre_jax.jit(fn)(x)
    assert isinstance(ei.value, NotImplementedError)
    msg = str(ei.value)
    assert f"'{prim}'" in msg
    assert "equation:" in msg and f"{prim}[" in msg
    assert _user_line(fn) in msg, msg


def test_unsupported_primitive_inside_nested_jit_names_user_line():
    x = np.ones((8, 128), np.float32)
    with pytest.raises(spyre_jax.UnsupportedPrimitiveError) as ei:
        spyre_jax.jit(_jnp_solve_fn)(x)
    msg = str(ei.value)
    assert "'triangular_solve'" in msg
    assert _user_line(_jnp_solve_fn) in msg, msg


def test_fft_error_names_user_line():
    x = np.ones((8, 128), np.float32)
    with pytest.raises((spyre_jax.UnsupportedPrimitiveError, TypeError)) as ei:
        spyre_jax.jit(_fft_fn)(x)
    assert _user_line(_fft_fn) in str(ei.value), str(ei.value)


def test_unsupported_dtype_inside_program_names_primitive_and_dtype():
    x = np.ones((8, 128), np.float32)
    with pytest.raises(TypeError) as ei:
        spyre_jax.jit(_fft_fn)(x)
    msg = str(ei.value)
    assert "'convert_element_type'" in msg and "complex64" in msg and "float32" in msg, msg
    assert "equation:" in msg and "fft[" in msg, msg


def test_float64_input_rejected():
    f = spyre_jax.jit(lambda x: x + 1)
    with pytest.raises(TypeError) as ei:
        f(np.ones((4, 4), np.float64))
    msg = str(ei.value)
    assert "float64" in msg and "float16" in msg and "bfloat16" in msg and "int32" in msg
    with pytest.raises(TypeError, match="float64"):
        spyre_jax.device_put(np.ones((4, 4), np.float64))


def test_complex_input_rejected():
    before = _in_use()
    with pytest.raises(TypeError, match="complex64"):
        spyre_jax.jit(lambda x: x + 1)(np.ones((4, 4), np.complex64))
    with pytest.raises(TypeError, match="complex64"):
        spyre_jax.device_put(np.ones((4, 4), np.complex64))
    assert _in_use() == before


def test_oom_too_big_for_device_memory():
    before = _in_use()
    live0 = spyre_jax.memory_stats()["num_live_allocs"]
    with pytest.raises(spyre_jax.DeviceOOMError) as ei:
        spyre_jax.jit(lambda: jnp.zeros((60000, 1000000), jnp.float32))()
    assert isinstance(ei.value, MemoryError)
    msg = str(ei.value)
    assert "240.00 GB" in msg and "240000000000" in msg and "112.00 GB" in msg
    assert _in_use() == before
    assert spyre_jax.memory_stats()["num_live_allocs"] == live0


def test_oom_big_output_keeps_inputs_and_accounting():
    x = spyre_jax.device_put(np.ones((60000,), np.float32))
    before = _in_use()
    with pytest.raises(spyre_jax.DeviceOOMError):
        spyre_jax.jit(lambda v: jnp.broadcast_to(v[:, None], (60000, 1000000)))(x)
    assert _in_use() == before
    np.testing.assert_array_equal(np.asarray(x), np.ones((60000,), np.float32))


def test_oom_outputs_together_too_big_rolls_back():
    # each output fits on its own (60 GB < 112 GB) but the two together do not
    before = _in_use()
    live0 = spyre_jax.memory_stats()["num_live_allocs"]
    f = spyre_jax.jit(
        lambda: (jnp.zeros((15000, 1000000), jnp.float32), jnp.ones((15000, 1000000), jnp.float32))
    )
    with pytest.raises(spyre_jax.DeviceOOMError, match="60.00 GB"):
        f()
    assert _in_use() == before
    assert spyre_jax.memory_stats()["num_live_allocs"] == live0
    # the device still works afterwards
    y = spyre_jax.jit(lambda x: x + 1.0)(np.zeros((2, 64), np.float32))
    np.testing.assert_array_equal(np.asarray(y), np.ones((2, 64), np.float32))


def test_int64_input_warns_and_narrows():
    f = spyre_jax.jit(lambda x: x * 3 + 1)
    h = np.arange(-50, 50, dtype=np.int64).reshape(4, 25)
    with pytest.warns(UserWarning, match="int64"):
        y = f(h)
    assert y.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(y), (h * 3 + 1).astype(np.int32))
    with pytest.warns(UserWarning, match="int64"):
        a = spyre_jax.device_put(h)
    assert a.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(a), h.astype(np.int32))


def test_int64_warning_points_at_caller():
    f = spyre_jax.jit(lambda x: x + 1)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        f(np.arange(8, dtype=np.int64))
    hits = [w for w in rec if "int64" in str(w.message)]
    assert len(hits) == 1
    assert os.path.basename(hits[0].filename) == THIS_FILE, hits[0].filename


def test_int64_warning_once_per_call_and_lower_points_at_caller():
    f = spyre_jax.jit(lambda x, y: x + y)
    h = np.arange(8, dtype=np.int64)
    for call in (lambda: f(h, h), lambda: f(h, h), lambda: f.lower(h, h)):  # traced, cached
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            call()
        hits = [w for w in rec if "int64" in str(w.message)]
        assert len(hits) == 1
        assert os.path.basename(hits[0].filename) == THIS_FILE, hits[0].filename
    with pytest.warns(UserWarning, match="int64"):
        y = f(h, h)
    np.testing.assert_array_equal(np.asarray(y), (2 * h).astype(np.int32))


# ---------------------------------------------------------------------------------------------
# figures and card options


def test_cost_analysis_counts_elementwise_flops():
    # as XLA's cost analysis: one flop per element per arithmetic op (here mul, add, tanh)
    x = np.ones((100, 150), np.float32)
    cost = spyre_jax.jit(lambda a: jnp.tanh(a * 2.0 + 1.0)).lower(x).compile().cost_analysis()
    assert cost["flops"] == 3 * 100 * 150


def test_card_change_recompiles():
    # regression: the per-signature cache ignored the card, so set_card reused old schedules
    f = spyre_jax.jit(lambda a: a + 1.0)
    x = np.ones((64, 256), np.float16)
    f(x)
    spyre_jax.set_card(CardSpec(scratchpad_usable_frac=0.25))
    try:
        f(x)
        assert f.trace_count == 2
    finally:
        spyre_jax.set_card(CardSpec())


def test_dl16_rounding_option():
    from device_model.numerics import round_to_dl16_np

    x = np.random.default_rng(3).standard_normal((64, 128)).astype(np.float32) * 3
    x16 = x.astype(np.float16)
    f = spyre_jax.jit(lambda a: a * 1.7)
    ieee = np.asarray(f(x16))
    spyre_jax.set_card(CardSpec(dl16_rounding=True))
    try:
        dl = np.asarray(spyre_jax.jit(lambda a: a * 1.7)(x16))
    finally:
        spyre_jax.set_card(CardSpec())
    # the weakly typed constant is fp16(1.7); the SFU multiplies in fp32
    exact = x16.astype(np.float32) * np.float32(np.float16(1.7))
    # IEEE store: round-to-nearest-even into fp16 (10 fraction bits)
    np.testing.assert_array_equal(ieee, exact.astype(np.float16))
    # DL16 store: 9 fraction bits, ties away from zero, then held in fp16 (exactly representable)
    np.testing.assert_array_equal(dl, round_to_dl16_np(exact).astype(np.float16))
    assert (dl != ieee).any()
    assert np.abs(dl.astype(np.float32) - exact).max() <= np.abs(exact).max() * 2.0**-10


def test_card_rejects_bad_dl16_flag():
    with pytest.raises(ValueError, match="dl16_rounding"):
        CardSpec(dl16_rounding=1)


def test_lower_from_shape_dtype_structs():
    # shapes alone compile (nothing materialized): the same schedule and figures as arrays give;
    # calling with them is refused, naming the way to their figures (regression: an IndexError
    # in the dot_general rule, the structs having been taken for static values)
    def mm(a, b):
        return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(jnp.float16)

    sa = jax.ShapeDtypeStruct((256, 512), jnp.float16)
    sb = jax.ShapeDtypeStruct((512, 128), jnp.float16)
    got = spyre_jax.jit(mm).lower(sa, sb).compile().cost_analysis()
    a, b = np.zeros((256, 512), np.float16), np.zeros((512, 128), np.float16)
    want = spyre_jax.jit(mm).lower(a, b).compile().cost_analysis()
    assert got["sim_time_us"] == want["sim_time_us"] and got["flops"] == 2 * 256 * 512 * 128
    with pytest.raises(TypeError, match="cost_analysis"):
        spyre_jax.jit(mm)(sa, sb)

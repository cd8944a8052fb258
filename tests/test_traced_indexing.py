"""Traced indexing (issue 30): dynamic_slice and dynamic_update_slice with start indices
computed on the card, clamped as JAX clamps them, against jax.jit on the CPU; a KV cache
updated in a decode loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import spyre_jax
from spyre_jax.tools.testing import assert_tree_close

X = np.arange(5 * 6 * 70, dtype=np.float32).reshape(5, 6, 70) / 100


def _same(f, *args):
    got = np.asarray(spyre_jax.jit(f)(*args))
    want = np.asarray(jax.jit(f)(*args))
    np.testing.assert_array_equal(got, want)  # data movement: exact


_starts = st.integers(-8, 12)


@settings(max_examples=12, deadline=None)
@given(i=_starts, j=_starts)
def test_dynamic_slice_clamps_like_jax(i, j):
    f = lambda x, i, j: lax.dynamic_slice(x, (i, j, 3), (2, 3, 40))  # noqa: E731
    _same(f, X, np.int32(i), np.int32(j))


@settings(max_examples=12, deadline=None)
@given(i=_starts, j=_starts)
def test_dynamic_update_slice_clamps_like_jax(i, j):
    u = -np.arange(2 * 3 * 40, dtype=np.float32).reshape(2, 3, 40)
    f = lambda x, u, i, j: lax.dynamic_update_slice(x, u, (i, j, 5))  # noqa: E731
    _same(f, X, u, np.int32(i), np.int32(j))


def test_indexing_by_a_traced_scalar_and_the_last_dim():
    _same(lambda x, i: x[i], X, np.int32(3))
    _same(lambda x, i: x[:, i], X, np.int32(-2))  # a negative index counts from the end
    _same(lambda x, i: lax.dynamic_slice_in_dim(x, i, 7, axis=2), X, np.int32(66))
    u = np.ones((5, 6, 2), np.float32)
    _same(lambda x, u, i: lax.dynamic_update_slice_in_dim(x, u, i, axis=2), X, u, np.int32(30))


def test_a_kv_cache_updated_in_a_decode_loop():
    # one head of attention over a cache that each step writes one position of
    S, D = 16, 64

    def decode(q0, wq, k_new, v_new):
        def step(i, c):
            kc, vc, q = c
            kc = lax.dynamic_update_slice(kc, k_new[i][None], (i, 0))
            vc = lax.dynamic_update_slice(vc, v_new[i][None], (i, 0))
            s = (kc @ q) / np.sqrt(D)
            s = jnp.where(jnp.arange(S) <= i, s, -jnp.inf)
            q = jnp.tanh(jax.nn.softmax(s) @ vc @ wq)
            return kc, vc, q

        init = (jnp.zeros((S, D)), jnp.zeros((S, D)), q0)
        return lax.fori_loop(0, 10, step, init)

    r = np.random.default_rng(0)
    args = (
        r.standard_normal(D).astype(np.float32),
        (r.standard_normal((D, D)) / 8).astype(np.float32),
        r.standard_normal((10, D)).astype(np.float32),
        r.standard_normal((10, D)).astype(np.float32),
    )
    got = spyre_jax.jit(decode)(*args)
    want = jax.jit(decode)(*args)
    assert_tree_close(got, want, k=64, chain=4)


def test_flip_along_any_dims():
    for dims in [(0,), (1,), (2,), (0, 2), (0, 1, 2)]:
        _same(lambda x, d=dims: jnp.flip(x, d), X)
    _same(jnp.flip, X[0, 0])


def test_map_and_associative_scan():
    x = X[0] - 2
    assert_tree_close(
        spyre_jax.jit(lambda x: lax.map(lambda r: jnp.sin(r) * 2, x))(x),
        jax.jit(lambda x: lax.map(lambda r: jnp.sin(r) * 2, x))(x),
    )
    for f in (
        lambda x: lax.associative_scan(jnp.add, x, axis=0),
        lambda x: lax.associative_scan(jnp.maximum, x, axis=1, reverse=True),
    ):
        assert_tree_close(spyre_jax.jit(f)(x), jax.jit(f)(x), k=70)


_SCATTERS = {
    "add": lambda x, i, v: x.at[i].add(v),
    "set": lambda x, i, v: x.at[i].set(v),  # a duplicate index: the last update wins, as on CPU
    "max": lambda x, i, v: x.at[i].max(v * 0.5),
    "min": lambda x, i, v: x.at[i].min(v - 20),
    "mul": lambda x, i, v: x.at[i].multiply(v / 10),
    "add_clip": lambda x, i, v: x.at[i].add(v, mode="clip"),
    "set_column": lambda x, i, v: x.at[:, i[0]].set(v[:, 0]),
    "add_element": lambda x, i, v: x.at[i[0], i[1]].add(3.0),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32], ids=["f32", "f16", "i32"])
@pytest.mark.parametrize("name", list(_SCATTERS))
def test_scatter_with_traced_indices(name, dtype):
    if dtype is np.int32 and name in ("mul", "max", "set_column", "add_element"):
        pytest.skip("covered in floating point")
    x = np.arange(30).reshape(5, 6).astype(dtype)
    i = np.array([1, 2, 1, 7, -1], np.int32)  # a duplicate, one past the end, one from the end
    v = (np.arange(30).reshape(5, 6) % 7).astype(dtype)
    f = _SCATTERS[name]
    got = np.asarray(spyre_jax.jit(f)(x, i, v))
    want = np.asarray(jax.jit(f)(x, i, v))
    if name == "mul":  # two updates on one row: multiplied in another order (one rounding)
        assert_tree_close(got, want, k=2)
    else:
        np.testing.assert_array_equal(got, want)


def test_scatter_into_a_buffer_carried_by_a_loop():
    def f(x):
        def body(i, acc):
            return acc.at[i % 4].add(x[i])

        return lax.fori_loop(0, 8, body, jnp.zeros((4, 70)))

    assert_tree_close(spyre_jax.jit(f)(X[0, :8]), jax.jit(f)(X[0, :8]), k=2)


@pytest.mark.parametrize("mode", [lax.GatherScatterMode.CLIP, lax.GatherScatterMode.FILL_OR_DROP])
def test_scatter_of_a_window_clamps_or_drops_it_whole(mode):
    # a window of two rows: its start clamped so it fits, or the whole window dropped
    dn = lax.ScatterDimensionNumbers(
        update_window_dims=(1, 2), inserted_window_dims=(), scatter_dims_to_operand_dims=(0,)
    )
    f = lambda x, v, i: lax.scatter(x, jnp.reshape(i, (1, 1)), v[None], dn, mode=mode)  # noqa: E731
    v = -np.ones((2, 70), np.float32)
    for start in (-1, 2, 4, 9):
        _same(f, X[0], v, np.int32(start))
    _same(lambda x, v: x.at[1:3].set(v), X[0], v)
    _same(lambda x, v: x.at[3:5, 10:20].add(v[:, :10]), X[0], v)


_GATHERS = {
    "take_along_axis_clip": lambda x, i: jnp.take_along_axis(x, i[:, :, None], axis=1, mode="clip"),
    "take_along_axis_fill": lambda x, i: jnp.take_along_axis(x, i[:, :, None], axis=1),
    "take_axis1": lambda x, i: jnp.take(x, i[0], axis=1),
    "take_last_axis_fill": lambda x, i: jnp.take(x, i[0], axis=2, mode="fill", fill_value=-1.0),
    "two_index_arrays": lambda x, i: x[i[0, 0], i[1]],
    "index_and_scalar": lambda x, i: x[:, i[0], 3],
}


@pytest.mark.parametrize("name", list(_GATHERS))
def test_general_gathers(name):
    i = np.random.default_rng(3).integers(-2, 7, (3, 4)).astype(np.int32)  # some out of range
    _same(_GATHERS[name], X[:3], i)


# ---------------------------------------------------------------------------------------------
# in-place updates of a loop's own buffers


def _cache_decode(q0, k_new):
    def step(i, c):
        kc, q = c
        kc = lax.dynamic_update_slice(kc, k_new[i][None], (i, 0))
        return kc, jnp.tanh(kc.sum(0) * 0.1 + q)

    return lax.fori_loop(0, 10, step, (jnp.zeros((64, 70)), q0))


def test_a_carried_cache_is_written_in_place(small_card):
    # a card whose host launches cost next to nothing: in place beats copying the cache whole
    small_card(host_launch_s=1e-9)
    r = np.random.default_rng(0)
    args = (
        r.standard_normal(70).astype(np.float32),
        r.standard_normal((10, 70)).astype(np.float32),
    )
    f = spyre_jax.jit(_cache_decode)
    assert_tree_close(f(*args), jax.jit(_cache_decode)(*args), k=64)
    low = f.lower(*args)
    assert "update_in_place" in low.as_text()
    with spyre_jax.profile(print_summary=False) as prof:
        np.asarray(f(*args)[0])
    writes = [s for s in prof.records if s.name.startswith("update in place")]
    assert len(writes) == 10
    assert all(s.nbytes == 3 * 128 for s in writes)  # a row of 70 fp32 (3 sticks), not 64 rows


def test_an_input_carried_and_written_in_place_is_left_unchanged(small_card):
    small_card(host_launch_s=1e-9)

    def f(c, rows):
        def step(i, c):
            return lax.dynamic_update_slice(c, rows[i][None], (i, 0))

        return lax.fori_loop(0, 3, step, c)

    c = spyre_jax.device_put(np.zeros((4, 70), np.float32))
    rows = np.ones((3, 70), np.float32)
    out = spyre_jax.jit(f)(c, rows)
    assert np.asarray(out)[:3].sum() == 3 * 70 and np.asarray(c).sum() == 0  # a copy was written


def test_an_update_whose_operand_is_read_after_is_not_in_place():
    def f(c, rows):
        def step(i, c):
            new = lax.dynamic_update_slice(c, rows[i][None], (i, 0))
            return new + c.sum() * 0.01  # the old value read after the update

        return lax.fori_loop(0, 3, step, c)

    args = (np.full((4, 70), 0.5, np.float32), np.ones((3, 70), np.float32))
    low = spyre_jax.jit(f).lower(*args)
    assert "update_in_place" not in low.as_text()
    assert_tree_close(spyre_jax.jit(f)(*args), jax.jit(f)(*args), k=280)


def test_stacked_caches_scanned_over_layers_are_written_in_place(monkeypatch, small_card):
    from lowering import control

    monkeypatch.setattr(control, "UNROLL_MAX_NODES", 0)  # the layers kept a loop
    small_card(host_launch_s=1e-9)

    # the decode pattern of scan-over-layers models: per-layer caches are stacked inputs of the
    # layer scan, each written at the position and returned as the stacked output
    def f(kc, x, w):
        def layer(h, xs):
            w_l, k_l = xs
            k_l = lax.dynamic_update_slice(k_l, (h @ w_l)[None], (3, 0))
            return jnp.tanh(h + k_l.sum(0) * 0.1), k_l

        def tok(i, c):
            h, kc = c
            return lax.scan(layer, h, (w, kc))

        return lax.fori_loop(0, 2, tok, (x, kc))

    r = np.random.default_rng(1)
    args = (
        np.zeros((2, 8, 64), np.float32),
        r.standard_normal(64).astype(np.float32),
        (r.standard_normal((2, 64, 64)) / 8).astype(np.float32),
    )
    assert_tree_close(spyre_jax.jit(f)(*args), jax.jit(f)(*args), k=64)
    text = spyre_jax.jit(f).lower(*args).as_text()
    assert text.count("update_in_place") == 1


def test_a_small_cache_stays_in_the_kernel_where_a_launch_costs_more(monkeypatch):
    from lowering import control

    monkeypatch.setattr(control, "UNROLL_MAX_NODES", 0)  # the loop kept a loop
    # the default card: copying a 64x70 cache whole (about 0.3 us) beats one more launch (70 us)
    r = np.random.default_rng(0)
    args = (
        r.standard_normal(70).astype(np.float32),
        r.standard_normal((10, 70)).astype(np.float32),
    )
    low = spyre_jax.jit(_cache_decode).lower(*args)
    assert "update_in_place" not in low.as_text()
    (note,) = [n for n in low.cost_analysis()["inlined"] if n["kind"] == "update"]
    assert note["decision"].startswith("in the kernel") and note["copy_us"] < note["launch_us"]
    assert_tree_close(spyre_jax.jit(_cache_decode)(*args), jax.jit(_cache_decode)(*args), k=64)

"""Traced indexing (issue 30): dynamic_slice and dynamic_update_slice with start indices
computed on the card, clamped as JAX clamps them, against jax.jit on the CPU; a KV cache
updated in a decode loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
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

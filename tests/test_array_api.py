"""``spyre_jax.Array`` as code that reads a ``jax.Array`` uses it, and ``jax.jit``'s keyword
surface on ``spyre_jax.jit`` (issue 32, items 3 and 4): operators, indexing and methods run on the
card and stay there, against the same on a ``jax.Array``; donation; the keywords.

Exact comparisons: each operator is one fp32/fp16/int op on the card, computed as XLA computes
it on the CPU (elementwise arithmetic rounds once per op either way), except the reductions and
the matmul, whose order of additions differs: 1e-6 relative.
"""

from __future__ import annotations

import operator
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spyre_jax
from spyre_jax import array_ops, memory_stats

X = np.arange(12, dtype=np.float32).reshape(3, 4) - 5
JX = jnp.asarray(X)


def _same(got, want, rtol=0.0):
    assert isinstance(got, spyre_jax.Array), type(got)
    g, w = np.asarray(got), np.asarray(want)
    assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
    np.testing.assert_allclose(g, w, rtol=rtol)


OPS = [
    operator.add,
    operator.sub,
    operator.mul,
    operator.truediv,
    operator.floordiv,
    operator.mod,
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
    operator.eq,
    operator.ne,
]


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.__name__)
def test_binary_operators_with_arrays_and_numbers(op):
    y = spyre_jax.device_put(X)
    _same(op(y, y), op(JX, JX))
    _same(op(y, 2.5), op(JX, 2.5))
    _same(op(3, y), op(3, JX))
    _same(op(y, X[::-1]), op(JX, X[::-1]))


def test_weak_types_follow_jax():
    h = spyre_jax.device_put(X.astype(np.float16))
    i = spyre_jax.device_put(np.arange(5, dtype=np.int32))
    b = spyre_jax.device_put(np.array([True, False]))
    _same(h + 1.5, jnp.asarray(X, np.float16) + 1.5)
    _same(i * 2.5, jnp.arange(5, dtype=np.int32) * 2.5)
    _same(i + 3, jnp.arange(5, dtype=np.int32) + 3)
    _same(b & True, jnp.array([True, False]) & True)
    _same(i << 2, jnp.arange(5, dtype=np.int32) << 2)


def test_a_number_is_an_argument_not_a_constant():
    y = spyre_jax.device_put(X)
    y + 1.0
    n = array_ops.kernel_count()
    _same(y + 7.0, JX + 7.0)
    assert array_ops.kernel_count() == n
    _same(y**2, JX**2)  # an integer power: integer_pow, its exponent static
    _same(2.0**y, 2.0**JX, rtol=1e-6)


def test_unary_matmul_and_transpose():
    y = spyre_jax.device_put(X)
    _same(-y, -JX)
    _same(abs(y), abs(JX))
    _same(+y, JX)
    _same(y @ y.T, JX @ JX.T, rtol=1e-6)
    _same(y.mT, JX.mT)
    _same(~spyre_jax.device_put(np.arange(3, dtype=np.int32)), ~jnp.arange(3, dtype=np.int32))


@pytest.mark.parametrize(
    "key",
    [1, -1, (1, 2), slice(1, None), (slice(None), slice(None, None, 2)), (None, Ellipsis, 1)],
    ids=repr,
)
def test_static_indexing(key):
    _same(spyre_jax.device_put(X)[key], JX[key])


def test_array_indexing():
    y = spyre_jax.device_put(X)
    _same(y[np.array([2, 0])], JX[np.array([2, 0])])
    _same(y[[0, 2], 1], JX[jnp.array([0, 2]), 1])
    _same(y[[0, 2], 1:], JX[jnp.array([0, 2]), 1:])  # an integer array and a slice: a window gather
    _same(y[1:, [2, 0]], JX[1:, jnp.array([2, 0])])
    _same(y[spyre_jax.device_put(np.array([1, 1], np.int32))], JX[jnp.array([1, 1])])


@pytest.mark.parametrize(
    "name,kw",
    [
        ("sum", {}),
        ("sum", {"axis": 0, "keepdims": True}),
        ("mean", {"axis": 1}),
        ("max", {"axis": -1}),
        ("min", {}),
        ("prod", {"axis": 0}),
        ("argmax", {"axis": 1}),
        ("argmin", {}),
        ("any", {}),
        ("all", {"axis": 0}),
        ("std", {}),
        ("var", {"axis": 1}),
        ("cumsum", {"axis": 1}),
        ("clip", {"min": -1.0, "max": 2.0}),
        ("round", {}),
        ("squeeze", {}),
        ("ravel", {}),
        ("swapaxes", {"axis1": 0, "axis2": 1}),
        ("sort", {"axis": 0}),
        ("argsort", {}),
    ],
)
def test_methods(name, kw):
    y = spyre_jax.device_put(X)
    _same(getattr(y, name)(**kw), getattr(JX, name)(**kw), rtol=1e-6)


def test_shape_methods_and_astype():
    y = spyre_jax.device_put(X)
    _same(y.reshape(4, 3), JX.reshape(4, 3))
    _same(y.reshape((2, 6)), JX.reshape((2, 6)))
    _same(y.transpose(), JX.transpose())
    _same(y.transpose(1, 0), JX.transpose(1, 0))
    _same(y.flatten(), JX.flatten())
    _same(y.astype(np.float16), JX.astype(np.float16))
    _same(y.astype(jnp.int32), JX.astype(jnp.int32))
    _same(y.dot(X.T), JX.dot(X.T), rtol=1e-6)
    _same(y.copy(), JX)


def test_host_reads_printing_pickling_and_iteration():
    y = spyre_jax.device_put(X)
    assert float(y.sum()) == float(JX.sum())
    assert int(y[0, 1]) == -4 and y[1, 2].item() == 1.0 and bool(y[2, 3] > 0)
    assert y.tolist() == X.tolist()
    assert f"{y.sum():.1f}" == f"{float(JX.sum()):.1f}"
    assert "spyre_jax.Array" in repr(y[0])
    assert [float(r.sum()) for r in y] == [float(r) for r in JX.sum(axis=1)]
    assert np.asarray(pickle.loads(pickle.dumps(y))).tolist() == X.tolist()
    got = jax.device_get({"a": y})["a"]
    assert isinstance(got, np.ndarray) and got.tolist() == X.tolist()
    assert y.block_until_ready() is y
    with pytest.raises(TypeError, match="unhashable"):
        hash(y)


def test_results_stay_on_the_card_and_jax_functions_take_arrays():
    y = spyre_jax.device_put(X)
    z = (y * 2 + 1).sum(axis=0)
    assert isinstance(z, spyre_jax.Array) and not z.is_deleted()
    assert isinstance(jnp.sin(y), jax.Array)  # a JAX function: on the CPU, a jax.Array
    np.testing.assert_allclose(np.asarray(jnp.sin(y)), np.sin(X), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.jit(lambda a: a * 2)(y)), X * 2)
    np.testing.assert_allclose(np.asarray(JX + y), X * 2)
    assert not isinstance(y, jax.Array)


def test_a_deleted_array_raises_jaxs_error():
    y = spyre_jax.device_put(X)
    y.delete()
    with pytest.raises(RuntimeError, match="Array has been deleted"):
        y + 1


# ---------------------------------------------------------------------------------------------
# jit keywords


def _step(p, g):
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)


def test_donated_arrays_are_deleted_and_their_memory_reused():
    p = {"w": spyre_jax.device_put(np.ones((64, 64), np.float32)), "b": spyre_jax.device_put(X)}
    g = {"w": np.full((64, 64), 2, np.float32), "b": X}
    addrs = {k: v.buffer.addr for k, v in p.items()}
    in_use = memory_stats()["bytes_in_use"]
    q = spyre_jax.jit(_step, donate_argnums=0)(p, g)
    assert all(v.is_deleted() for v in p.values())
    assert {k: v.buffer.addr for k, v in q.items()} == addrs  # the outputs took their regions
    assert memory_stats()["bytes_in_use"] == in_use
    np.testing.assert_allclose(np.asarray(q["w"]), 0.8)
    with pytest.raises(RuntimeError, match="Array has been deleted"):
        p["w"] + 1
    r = spyre_jax.jit(_step, donate_argnames="p")(g=g, p=q)
    assert q["w"].is_deleted() and not r["w"].is_deleted()
    np.testing.assert_allclose(np.asarray(r["b"]), X - 0.2 * X, rtol=1e-6)


def test_a_failed_call_donates_nothing():
    p = spyre_jax.device_put(X)
    f = spyre_jax.jit(lambda a, b: a @ b, donate_argnums=0)
    with pytest.raises(TypeError):
        f(p, np.ones((5, 5), np.float32))
    assert not p.is_deleted()


def test_keywords():
    f = spyre_jax.jit(lambda a, b: a * 2, keep_unused=True)
    _same(f(X, X), JX * 2)
    g = spyre_jax.jit(lambda a: a * 2, inline=True)
    assert "spyre_call" not in str(jax.make_jaxpr(lambda a: g(a) + 1)(X))
    assert "spyre_call" in str(jax.make_jaxpr(lambda a: spyre_jax.jit(lambda b: b * 2)(a))(X))
    with pytest.raises(TypeError, match="foo"):
        spyre_jax.jit(_step, foo=1)
    with pytest.raises(TypeError, match="in_shardings takes"):
        spyre_jax.jit(_step, in_shardings=object())

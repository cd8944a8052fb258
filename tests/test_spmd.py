"""``spyre_jax.jit(f, in_shardings=..., out_shardings=...)``: a function of global arrays
partitioned over a mesh of simulated cards (spyre_jax/spmd.py), against the same function
under ``jax.jit`` on the CPU.

Tolerances: fp32; each card computes its shard as one card computes the whole, and a split
contraction is summed across the cards in another order than one card's: 1e-5 relative and
absolute (the values are O(1)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import spyre_jax
from lowering.errors import LoweringError


@pytest.fixture
def mesh(monkeypatch):
    monkeypatch.setenv("SPYRE_NUM_CARDS", "4")
    return Mesh(np.array(spyre_jax.devices()).reshape(2, 2), ("dp", "tp"))


def _close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def _rand(*shape, scale=1.0, seed=0):
    return (np.random.default_rng([seed, *shape]).standard_normal(shape) * scale).astype(np.float32)


def _mlp(x, w1, w2):
    h = jax.nn.gelu(x @ w1)
    return jnp.tanh(h @ w2), jnp.mean(h**2)


def test_a_megatron_mlp_from_shardings_alone(mesh):
    """Batch over "dp", the first weight's columns and the second's rows over "tp": each card
    multiplies its blocks and one all-reduce over "tp" finishes the second matmul (and one over
    both axes the mean), as the hand-written shard_map would."""
    s = lambda *a: NamedSharding(mesh, P(*a))  # noqa: E731
    x, w1, w2 = _rand(8, 16), _rand(16, 32, scale=0.25), _rand(32, 16, scale=0.25)
    f = spyre_jax.jit(_mlp, in_shardings=(s("dp"), s(None, "tp"), s("tp", None)))
    _close(f(x, w1, w2), jax.jit(_mlp)(x, w1, w2))
    c = f.lower(x, w1, w2).compile()
    coll = c.cost_analysis()["collectives"]
    assert [(k["kind"], k["cards"]) for k in coll] == [("all_reduce", 2), ("all_reduce", 4)]
    assert coll[0]["bytes"] == 4 * 16 * 4  # this card's rows of the second matmul's output
    assert "one program per card" in c.as_text()


def _attention(x, wq, wk, wv):
    b, t, d = x.shape
    heads = 4

    def split(y):
        return y.reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3)

    q, k, v = split(x @ wq), split(x @ wk), split(x @ wv)
    p = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / 4.0, axis=-1)
    return (p @ v).transpose(0, 2, 1, 3).reshape(b, t, d)


def test_attention_split_by_batch_and_heads_moves_nothing(mesh):
    """Batch over "dp", the projections' columns (so the heads) over "tp": the reshapes carry
    the split to the heads, and no card needs another's data."""
    s = lambda *a: NamedSharding(mesh, P(*a))  # noqa: E731
    x = _rand(4, 8, 16)
    ws = [_rand(16, 16, scale=0.25, seed=i) for i in range(3)]
    f = spyre_jax.jit(_attention, in_shardings=(s("dp"), *[s(None, "tp")] * 3))
    _close(f(x, *ws), jax.jit(_attention)(x, *ws))
    assert f.lower(x, *ws).compile().cost_analysis()["collectives"] == []


def test_out_shardings_and_a_primitive_without_a_rule(mesh):
    """A sort has no partitioning rule: it runs on its gathered operand on every card; the
    result is then split as out_shardings asks."""
    s = lambda *a: NamedSharding(mesh, P(*a))  # noqa: E731
    x = _rand(8, 12)

    def f(x):
        return jnp.sort(x, axis=0) * 2.0

    sf = spyre_jax.jit(f, in_shardings=s("dp", "tp"), out_shardings=s(None, "tp"))
    _close(sf(x), np.sort(x, axis=0) * 2.0)
    kinds = [k["kind"] for k in sf.lower(x).compile().cost_analysis()["collectives"]]
    assert "all_gather" in kinds


@pytest.mark.parametrize(
    "spec",
    [P(), P("dp"), P(None, "tp"), P("dp", "tp"), P("tp", "dp"), P(None, ("dp",))],
    ids=str,
)
def test_broadcasts_reductions_and_reshapes_under_every_split(mesh, spec):
    def f(x, b):
        y = jnp.exp(x - x.max(axis=1, keepdims=True)) + b
        z = y.reshape(4, 2, 12).sum(axis=1)
        return z / z.sum(), jnp.min(y, axis=0), y.T @ x

    x, b = _rand(8, 12), _rand(12, seed=1)
    sf = spyre_jax.jit(f, in_shardings=(NamedSharding(mesh, spec), None))
    _close(sf(x, b), jax.jit(f)(x, b))


def test_a_gradient_of_a_sharded_function(mesh):
    """Under a transformation the derived programs (forward with residuals, backward) are
    compiled from the global function, on one card: the values are JAX's."""
    s = lambda *a: NamedSharding(mesh, P(*a))  # noqa: E731

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    w, x = _rand(16, 16, scale=0.25), _rand(8, 16)
    sl = spyre_jax.jit(loss, in_shardings=(s(None, "tp"), s("dp")))
    _close(jax.grad(sl)(w, x), jax.grad(loss)(w, x))


def test_a_sharding_constraint_inside_reshards(mesh):
    """Regression: with_sharding_constraint was bound inside the per-card program (refused)."""
    s = lambda *a: NamedSharding(mesh, P(*a))  # noqa: E731

    def f(x):
        return jax.lax.with_sharding_constraint(x * 2, s("tp")).sum(1)

    x = _rand(8, 4, 6)  # (jax.jit cannot constrain to spyre devices: the plain function)
    _close(spyre_jax.jit(f, in_shardings=s("dp", "tp"))(x), (x * 2).sum(1))


def test_bad_shardings(mesh):
    x = _rand(6, 4)
    f = lambda x: x * 2  # noqa: E731
    with pytest.raises(ValueError, match="does not split evenly"):
        spyre_jax.jit(f, in_shardings=NamedSharding(Mesh(mesh.devices.reshape(4), "a"), P("a")))(x)
    with pytest.raises(TypeError, match="NamedSharding"):
        spyre_jax.jit(f, in_shardings=jax.sharding.SingleDeviceSharding(jax.devices()[0]))(x)
    with pytest.raises(NotImplementedError, match="several mesh axes"):
        spyre_jax.jit(f, in_shardings=NamedSharding(mesh, P(("dp", "tp"))))(_rand(8, 4))
    with pytest.raises(ValueError, match="not a prefix"):
        s = NamedSharding(mesh, P())
        spyre_jax.jit(f, in_shardings=(s, s))(x)
    # regression: an out_shardings split that is not even was cut short, not refused
    with pytest.raises(ValueError, match="does not split evenly"):
        s = NamedSharding(mesh, P(None, "tp"))
        spyre_jax.jit(lambda x: x[:, :3], out_shardings=s)(_rand(8, 6))
    with pytest.raises(NotImplementedError, match="shard_map inside"):
        inner = jax.shard_map(lambda x: x * 2, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
        spyre_jax.jit(inner, in_shardings=NamedSharding(mesh, P("dp")))(_rand(8, 4))
    cpu = Mesh(np.array(jax.devices()[:1]), ("a",))
    with pytest.raises(LoweringError):
        spyre_jax.jit(f, in_shardings=NamedSharding(cpu, P("a")))(x)

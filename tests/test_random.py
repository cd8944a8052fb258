"""Random numbers on the card (issue 31): JAX's threefry keys and everything drawn from them,
bit-equal to ``jax.jit`` on the CPU, with and without ``jax_threefry_partitionable``; uint32
arithmetic; other PRNG implementations refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax import random as jr

import spyre_jax
from lowering.errors import PRNGKeyError
from lowering.jaxpr_common import key_impl

LOGITS = np.random.default_rng(0).standard_normal((4, 50)).astype(np.float32)

CASES = {
    "split": lambda k: jr.split(k, 5),
    "split_shape": lambda k: jr.split(k, (2, 3)),
    "fold_in": lambda k: jr.fold_in(k, 7),
    "key_data": lambda k: jr.key_data(jr.split(k)[1]),
    "bits": lambda k: jr.bits(k, (3, 5)),
    "uniform": lambda k: jr.uniform(k, (4, 33), minval=-2, maxval=3),
    "normal": lambda k: jr.normal(k, (8, 17)),
    "truncated_normal": lambda k: jr.truncated_normal(k, -1.5, 2.0, (6, 7)),
    "categorical": lambda k: jr.categorical(k, LOGITS),
    "categorical_shape": lambda k: jr.categorical(k, LOGITS[0], shape=(10,)),
    "bernoulli": lambda k: jr.bernoulli(k, 0.3, (5, 9)),
    "gumbel": lambda k: jr.gumbel(k, (4, 9)),
    "randint": lambda k: jr.randint(k, (5, 6), -10, 100),
    "choice": lambda k: jr.choice(k, 20, (5,), replace=False),
    "choice_p": lambda k: jr.choice(k, 20, (5,), p=jnp.arange(20.0) / 190.0),
    "permutation": lambda k: jr.permutation(k, 30),
    "permutation_rows": lambda k: jr.permutation(k, jnp.arange(12.0).reshape(4, 3), axis=0),
    "keys_through_fori_loop": lambda k: lax.fori_loop(
        0,
        3,
        lambda i, c: (jr.split(c[0])[0], c[1] + jr.normal(jr.split(c[0])[1], (4,))),
        (k, jnp.zeros(4)),
    ),
    "vmap_over_keys": lambda k: jax.vmap(lambda kk: jr.normal(kk, (3,)))(jr.split(k, 4)),
    "scan_over_keys": lambda k: lax.scan(
        lambda c, kk: (c + jr.uniform(kk, ()), None), 0.0, jr.split(k, 5)
    )[0],
    "dropout_mask": lambda k: jnp.where(jr.bernoulli(k, 0.9, (8, 16)), 1 / 0.9, 0.0),
}


def _data(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jr.key_data(x))
    return np.asarray(x)


def _bit_equal(got, want):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert jax.dtypes.issubdtype(g.dtype, jax.dtypes.prng_key) == jax.dtypes.issubdtype(
            w.dtype, jax.dtypes.prng_key
        )
        g, w = _data(g), _data(w)
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(
            np.atleast_1d(g).view(np.uint8), np.atleast_1d(w).view(np.uint8)
        )


@pytest.fixture(params=[True, False], ids=["partitionable", "classic"])
def partitionable(request):
    before = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", request.param)
    yield request.param
    jax.config.update("jax_threefry_partitionable", before)


@pytest.mark.parametrize("name", sorted(CASES))
def test_typed_keys_bit_equal(name, partitionable):
    f = CASES[name]
    _bit_equal(spyre_jax.jit(f)(jr.key(42)), jax.jit(f)(jr.key(42)))


@pytest.mark.parametrize("name", ["split", "fold_in", "normal", "categorical", "permutation"])
def test_raw_uint32_keys_bit_equal(name, partitionable):
    f = CASES[name]
    _bit_equal(spyre_jax.jit(f)(jr.PRNGKey(7)), jax.jit(f)(jr.PRNGKey(7)))


def test_keys_made_inside_from_a_traced_seed():
    def f(seed):
        k = jr.key(seed)
        return jr.normal(jr.fold_in(k, 3), (4,)), jr.key_data(k), jr.PRNGKey(seed)

    for seed in (0, 1, -5, 2**31 - 1):
        _bit_equal(spyre_jax.jit(f)(np.int32(seed)), jax.jit(f)(np.int32(seed)))


def test_a_key_result_is_a_jax_key_array():
    k2 = spyre_jax.jit(lambda k: jr.split(k)[1])(jr.key(3))
    assert jax.dtypes.issubdtype(k2.dtype, jax.dtypes.prng_key)
    # it feeds JAX and the card alike
    _bit_equal(spyre_jax.jit(lambda k: jr.normal(k, (3,)))(k2), jr.normal(k2, (3,)))


@settings(max_examples=5, deadline=None)  # a new shape is a new kernel: ~9 s each on CI
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 70), m=st.integers(1, 5))
def test_threefry_property(seed, n, m):
    f = lambda k: (jr.bits(k, (m, n)), jr.split(k, m))  # noqa: E731
    _bit_equal(spyre_jax.jit(f)(jr.key(seed)), jax.jit(f)(jr.key(seed)))


def test_threefry_runs_as_sfu_maps():
    low = spyre_jax.jit(lambda k: jr.bits(k, (64, 128))).lower(jr.key(0))
    assert low.kernel.stages and all(s.kind == "map" for s in low.kernel.stages)
    assert all(s.unit == "SFU" for s in low.kernel.stages)
    assert low.compile().cost_analysis()["compute_us"] > 0


def test_other_prng_implementations_are_refused():
    with pytest.raises(PRNGKeyError, match="'rbg'.*threefry2x32"):
        spyre_jax.jit(lambda k: jr.normal(k, (3,)))(jr.key(0, impl="rbg"))
    with pytest.raises(PRNGKeyError, match="'unsafe_rbg'") as e:
        spyre_jax.jit(lambda s: jr.normal(jr.key(s, impl="unsafe_rbg"), (3,)))(1)
    assert "test_random.py" in str(e.value)
    assert isinstance(e.value, spyre_jax.errors.PRNGKeyError) and isinstance(e.value, TypeError)


def test_key_impl_reads_the_pinned_jax():
    # the one private attribute the importer reads (a key dtype's implementation)
    assert key_impl(jr.key(0).dtype) is jax.extend.random.threefry_prng_impl
    assert key_impl(np.dtype(np.float32)) is None


def test_narrow_random_bits_are_refused_clearly():
    with pytest.raises(TypeError, match="uint16"):
        spyre_jax.jit(lambda k: jr.uniform(k, (4, 8), dtype=jnp.float16))(jr.key(0))


def test_an_unsupported_op_on_keys_names_it():
    with pytest.raises(Exception, match="on PRNG keys is not supported"):
        spyre_jax.jit(lambda k, i: jr.split(k, 4)[i % 3])(jr.key(0), np.arange(2))


# ---------------------------------------------------------------------------------------------
# uint32 arithmetic (the cipher's, and users')


U = np.random.default_rng(1).integers(0, 2**32, (4, 37), dtype=np.uint64).astype(np.uint32)
V = np.random.default_rng(2).integers(0, 2**32, (4, 37), dtype=np.uint64).astype(np.uint32)

UINT_CASES = {
    "arith": lambda a, b: (a + b, a * b, a - b, a // (b | 1), a % (b | 1)),
    "bits": lambda a, b: (a ^ b, a | b, a & b, ~a, (a << 13) | (a >> 19)),
    "shifts": lambda a, b: (a << (b % 32), lax.shift_right_logical(a, b % 35)),
    "compare": lambda a, b: (a < b, a >= b, jnp.maximum(a, b), jnp.where(a > b, a, b)),
    "convert": lambda a, b: (
        a.astype(jnp.float32),
        a.astype(jnp.int32).astype(jnp.uint32),
        (a.astype(jnp.float32) * 0.5).astype(jnp.uint32),
        (jnp.float32(-3.5) * a.astype(jnp.float32)).astype(jnp.uint32),
    ),
    "bitcast": lambda a, b: (
        lax.bitcast_convert_type(a, jnp.float32),
        lax.bitcast_convert_type(a, jnp.int32),
        lax.bitcast_convert_type((a >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1,
    ),
    "reduce": lambda a, b: (jnp.sum(a, 1), jnp.max(a, 1), jnp.min(a, 0), jnp.argmax(a, 1)),
    "scan_sort": lambda a, b: (jnp.cumsum(a, 1), jnp.sort(a), jnp.argsort(a, descending=True)),
}


@pytest.mark.parametrize("name", sorted(UINT_CASES))
def test_uint32_bit_equal(name):
    f = UINT_CASES[name]
    _bit_equal(spyre_jax.jit(f)(U, V), jax.jit(f)(U, V))


def test_float_to_int_saturates_as_xla_does():
    x = np.array([-1.5, 3.7, 4e9, 5e9, -3e9, np.nan, 2.0**31, 2.0**32, -(2.0**31)], np.float32)
    f = lambda a: (a.astype(jnp.uint32), a.astype(jnp.int32))  # noqa: E731
    _bit_equal(spyre_jax.jit(f)(x), jax.jit(f)(x))


def test_the_docs_examples_run():
    import pathlib
    import re

    page = pathlib.Path(__file__).parent.parent / "docs" / "ops.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    assert len(blocks) >= 2  # sorting's, random numbers'
    for code in blocks:
        exec(compile(code, str(page), "exec"), {})

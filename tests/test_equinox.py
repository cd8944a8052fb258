"""Equinox models compiled with spyre_jax.jit, checked against jax.jit on the host CPU."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spyre_jax
from spyre_jax.tools.testing import assert_close

DTYPES = [jnp.float32, jnp.float16]
DTYPE_IDS = ["f32", "f16"]


def _cast(tree, dt):
    return jax.tree_util.tree_map(lambda a: a.astype(dt) if eqx.is_inexact_array(a) else a, tree)


def _keys(seed: int, n: int):
    return jax.random.split(jax.random.PRNGKey(seed), n)


class Batched(eqx.Module):
    """vmap a per-example module over the leading (batch) axis."""

    inner: eqx.Module

    def __call__(self, x):
        return jax.vmap(self.inner)(x)


class SelfAttention(eqx.Module):
    mha: eqx.nn.MultiheadAttention

    def __call__(self, x):
        return self.mha(x, x, x)


class GPTBlock(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, width: int, heads: int, *, key, use_bias: bool = False):
        ka, km = jax.random.split(key)
        self.ln1 = eqx.nn.LayerNorm(width)
        self.attn = eqx.nn.MultiheadAttention(
            heads,
            width,
            use_query_bias=use_bias,
            use_key_bias=use_bias,
            use_value_bias=use_bias,
            use_output_bias=use_bias,
            key=ka,
        )
        self.ln2 = eqx.nn.LayerNorm(width)
        self.mlp = eqx.nn.MLP(width, width, 4 * width, 1, activation=jax.nn.gelu, key=km)

    def __call__(self, x):  # x: (seq, width)
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h)
        h = jax.vmap(self.ln2)(x)
        return x + jax.vmap(self.mlp)(h)


def _check(model, x, dt, *, k: int = 1, chain: int = 1, direct: bool = True):
    """spyre_jax.jit vs jax.jit, via partition/combine and (optionally) the module directly,
    with the oracle of ``spyre_jax.tools.testing`` (``k``: the longest reduction, ``chain``: the
    ops XLA's CPU path rounds one by one where the card keeps fp32)."""
    model = _cast(model, dt)
    if jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(dt)
    params, static = eqx.partition(model, eqx.is_array)

    def f(p, x):
        return eqx.combine(p, static)(x)

    ref = jax.jit(f)(params, x)
    out = spyre_jax.jit(f)(params, x)
    assert isinstance(out, spyre_jax.Array)
    outs = [out]
    if direct:  # non-array leaves (activation functions, ...) are static
        outs.append(spyre_jax.jit(lambda m, x: m(x))(model, x))
    for o in outs:
        assert np.all(np.isfinite(np.asarray(o).astype(np.float32)))
        assert_close(o, ref, k=k, chain=chain)


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "nobias"])
def test_linear_vmapped(dt, use_bias):
    kw, kx = _keys(0, 2)
    model = Batched(eqx.nn.Linear(96, 64, use_bias=use_bias, key=kw))
    _check(model, jax.random.normal(kx, (8, 96)), dt)


@pytest.mark.parametrize("dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("act", [jax.nn.gelu, jax.nn.relu], ids=["gelu", "relu"])
@pytest.mark.slow
def test_mlp(dt, act):
    kw, kx = _keys(1, 2)
    model = Batched(eqx.nn.MLP(64, 32, 128, 2, activation=act, key=kw))
    _check(model, jax.random.normal(kx, (8, 64)), dt)


@pytest.mark.parametrize("dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("norm", [eqx.nn.LayerNorm, eqx.nn.RMSNorm], ids=["layernorm", "rmsnorm"])
@pytest.mark.slow
def test_norms(dt, norm):
    (kx,) = _keys(2, 1)
    model = Batched(norm(128))
    _check(model, jax.random.normal(kx, (8, 128)) * 3.0 + 1.0, dt)


@pytest.mark.parametrize("dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.slow
def test_embedding_vmapped_over_token_ids(dt):
    kw, kx = _keys(3, 2)
    model = Batched(eqx.nn.Embedding(50, 64, key=kw))
    ids = jax.random.randint(kx, (12,), 0, 50, dtype=jnp.int32)
    _check(model, ids, dt)


@pytest.mark.parametrize("dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("seq, width", [(16, 64), (64, 128)], ids=["s16w64", "s64w128"])
@pytest.mark.slow
def test_multihead_attention(dt, seq, width):
    kw, kx = _keys(4, 2)
    model = SelfAttention(eqx.nn.MultiheadAttention(4, width, key=kw))
    _check(model, jax.random.normal(kx, (seq, width)), dt, direct=dt is jnp.float32)


def test_multihead_attention_module_passed_directly():
    """Python bool/float fields (Dropout's `inference` and `p`) must be static, not traced."""
    kw, kx = _keys(4, 2)
    model = SelfAttention(eqx.nn.MultiheadAttention(4, 64, key=kw))
    x = jax.random.normal(kx, (16, 64))
    ref = np.asarray(jax.jit(lambda x: model(x))(x))
    out = spyre_jax.jit(lambda m, x: m(x))(model, x)
    assert_close(out, ref)


@pytest.mark.parametrize("dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("seq, width", [(16, 64), (64, 128)], ids=["s16w64", "s64w128"])
@pytest.mark.slow
def test_gpt_block(dt, seq, width):
    kw, kx = _keys(5, 2)
    model = GPTBlock(width, 4, key=kw)
    _check(model, jax.random.normal(kx, (seq, width)), dt, direct=dt is jnp.float32)


@pytest.mark.parametrize("dt", DTYPES, ids=DTYPE_IDS)
@pytest.mark.slow
def test_odd_sizes_width100_seq65(dt):
    """Neither 100 nor 65 is a multiple of a stick (64 fp16 / 32 fp32 elements)."""
    kw, kl, kx = _keys(6, 3)
    x = jax.random.normal(kx, (65, 100))
    _check(GPTBlock(100, 4, key=kw, use_bias=True), x, dt, direct=False)
    _check(Batched(eqx.nn.Linear(100, 65, key=kl)), x, dt, direct=False)


def test_new_weights_same_shapes_do_not_retrace():
    k1, k2, kx = _keys(7, 3)
    params1, static = eqx.partition(Batched(eqx.nn.MLP(32, 16, 64, 1, key=k1)), eqx.is_array)
    params2, _ = eqx.partition(Batched(eqx.nn.MLP(32, 16, 64, 1, key=k2)), eqx.is_array)
    x = jax.random.normal(kx, (4, 32))

    def f(p, x):
        return eqx.combine(p, static)(x)

    g = spyre_jax.jit(f)
    for p in (params1, params2):
        ref = np.asarray(jax.jit(f)(p, x))
        assert_close(g(p, x), ref)
    assert g.trace_count == 1 and len(g._cache) == 1
    # device-resident parameters feed the same compiled function
    on_device = jax.tree_util.tree_map(spyre_jax.device_put, params1)
    assert_close(g(on_device, x), jax.jit(f)(params1, x))
    assert g.trace_count == 1

"""GPT-2 as an equinox module (small by default), random weights, for ``spyre_jax.jit``.

The architecture of Hugging Face's ``GPT2LMHeadModel``: learned token and position embeddings,
pre-LayerNorm blocks of causal multi-head attention and a 4x MLP with GPT-2's GELU (the tanh
approximation), a final LayerNorm and the LM head tied to the token embedding. Weights are drawn
from a ``jax.random`` key as GPT-2 initialises them (normal(0, 0.02); the residual projections
scaled by 1/sqrt(2 * layers); biases zero, LayerNorm scales one); nothing is downloaded.

>>> cfg = GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=100, n_positions=16)
>>> model = GPT2(cfg, key=jax.random.PRNGKey(0))
>>> forward(model, jnp.zeros((1, 8), jnp.int32)).shape
(1, 8, 100)

:func:`cast` turns every float array of the module to another dtype (``cast(model,
jnp.float16)``); :func:`forward` is a plain function of ``(model, ids)`` that works under
``jax.jit`` and ``spyre_jax.jit`` alike. LayerNorm statistics and the softmax are computed in
fp32 whatever the model's dtype (what fp16 and bf16 models do, and what torch's CPU kernels do
inside), and the results cast back to the model's dtype.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

__all__ = ["GPT2Config", "GPT2", "cast", "forward", "param_count"]


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """GPT-2 small by default (124M parameters with the tied head)."""

    n_layer: int = 12
    n_embd: int = 768
    n_head: int = 12
    vocab_size: int = 50257
    n_positions: int = 1024
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02


class LayerNorm(eqx.Module):
    weight: jax.Array
    bias: jax.Array
    eps: float = eqx.field(static=True)

    def __init__(self, width: int, eps: float):
        self.weight = jnp.ones((width,), jnp.float32)
        self.bias = jnp.zeros((width,), jnp.float32)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        mean = h.mean(-1, keepdims=True)
        var = jnp.square(h - mean).mean(-1, keepdims=True)
        h = (h - mean) * jax.lax.rsqrt(var + self.eps)
        return (h * self.weight.astype(jnp.float32) + self.bias.astype(jnp.float32)).astype(x.dtype)


class Linear(eqx.Module):
    """``x @ weight + bias``, weight ``(in, out)`` (GPT-2's Conv1D layout)."""

    weight: jax.Array
    bias: jax.Array

    def __init__(self, n_in: int, n_out: int, std: float, *, key: jax.Array):
        self.weight = std * jax.random.normal(key, (n_in, n_out), jnp.float32)
        self.bias = jnp.zeros((n_out,), jnp.float32)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.weight + self.bias


class Attention(eqx.Module):
    qkv: Linear
    proj: Linear
    n_head: int = eqx.field(static=True)

    def __init__(self, cfg: GPT2Config, *, key: jax.Array):
        k1, k2 = jax.random.split(key)
        d = cfg.n_embd
        self.qkv = Linear(d, 3 * d, cfg.init_std, key=k1)
        self.proj = Linear(d, d, cfg.init_std / math.sqrt(2 * cfg.n_layer), key=k2)
        self.n_head = cfg.n_head

    def __call__(self, x: jax.Array) -> jax.Array:  # x: (batch, seq, width)
        b, s, d = x.shape
        hd = d // self.n_head
        h = self.qkv(x)
        # slices, not jnp.split: spyre_jax has no lowering rule for lax's `split` primitive
        q, k, v = h[..., :d], h[..., d : 2 * d], h[..., 2 * d :]
        q, k, v = (t.reshape(b, s, self.n_head, hd).transpose(0, 2, 1, 3) for t in (q, k, v))
        scores = (q @ k.transpose(0, 1, 3, 2)).astype(jnp.float32) / math.sqrt(hd)
        causal = jnp.tril(jnp.ones((s, s), jnp.bool_))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        p = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        out = (p @ v).transpose(0, 2, 1, 3).reshape(b, s, d)
        return self.proj(out)


class MLP(eqx.Module):
    fc: Linear
    proj: Linear

    def __init__(self, cfg: GPT2Config, *, key: jax.Array):
        k1, k2 = jax.random.split(key)
        d = cfg.n_embd
        self.fc = Linear(d, 4 * d, cfg.init_std, key=k1)
        self.proj = Linear(4 * d, d, cfg.init_std / math.sqrt(2 * cfg.n_layer), key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.proj(jax.nn.gelu(self.fc(x), approximate=True))


class Block(eqx.Module):
    ln1: LayerNorm
    attn: Attention
    ln2: LayerNorm
    mlp: MLP

    def __init__(self, cfg: GPT2Config, *, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.ln1 = LayerNorm(cfg.n_embd, cfg.layer_norm_eps)
        self.attn = Attention(cfg, key=k1)
        self.ln2 = LayerNorm(cfg.n_embd, cfg.layer_norm_eps)
        self.mlp = MLP(cfg, key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT2(eqx.Module):
    """``model(ids)``: ids ``(batch, seq)`` int32 -> logits ``(batch, seq, vocab)``."""

    wte: jax.Array
    wpe: jax.Array
    blocks: tuple[Block, ...]
    ln_f: LayerNorm

    def __init__(self, cfg: GPT2Config, *, key: jax.Array):
        kt, kp, *kb = jax.random.split(key, 2 + cfg.n_layer)
        self.wte = cfg.init_std * jax.random.normal(kt, (cfg.vocab_size, cfg.n_embd), jnp.float32)
        self.wpe = cfg.init_std * jax.random.normal(kp, (cfg.n_positions, cfg.n_embd), jnp.float32)
        self.blocks = tuple(Block(cfg, key=k) for k in kb)
        self.ln_f = LayerNorm(cfg.n_embd, cfg.layer_norm_eps)

    def __call__(self, ids: jax.Array) -> jax.Array:
        s = ids.shape[-1]
        x = self.wte[ids] + self.wpe[:s]
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x) @ self.wte.T  # the LM head, tied to the token embedding


def forward(model: GPT2, ids: jax.Array) -> jax.Array:
    """Logits of ``ids`` (``(batch, seq)`` int32); jit it with ``jax.jit`` or ``spyre_jax.jit``."""
    return model(ids)


def cast(model: Any, dtype: Any) -> Any:
    """``model`` with every float array cast to ``dtype`` (``jnp.float16``, ``jnp.bfloat16``)."""
    return jax.tree_util.tree_map(
        lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, model
    )


def param_count(model: Any) -> int:
    """Parameters (array elements) of the module; the tied head counts once."""
    return sum(a.size for a in jax.tree_util.tree_leaves(model) if eqx.is_array(a))

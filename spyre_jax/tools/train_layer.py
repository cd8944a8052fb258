"""The Llama-style layer of ``spyre-jax bench train`` in JAX (shapes and weights shared with
the torch half, :mod:`spyre_jax.tools.bench_train_torch`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["FULL", "TINY", "layer", "layer_params"]

#: (width, MLP width, heads, KV heads, tokens): Llama-3.2-1B's layer at 128 tokens
FULL = (2048, 8192, 32, 8, 128)
TINY = (64, 128, 4, 2, 16)


def _rms(x: Any, g: Any) -> Any:
    x32 = x.astype(jnp.float32)
    n = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
    return n.astype(x.dtype) * g


def layer(p: dict[str, Any], x: Any, heads: int, kv_heads: int) -> Any:
    """One Llama-style decoder layer (no RoPE) over ``x`` ``[tokens, width]``."""
    t, d = x.shape
    hd = d // heads
    h = _rms(x, p["n1"])
    q = (h @ p["wq"]).reshape(t, heads, hd).transpose(1, 0, 2)
    k = (h @ p["wk"]).reshape(t, kv_heads, hd).transpose(1, 0, 2)
    v = (h @ p["wv"]).reshape(t, kv_heads, hd).transpose(1, 0, 2)
    k, v = (jnp.repeat(a, heads // kv_heads, axis=0) for a in (k, v))
    s = (q @ k.transpose(0, 2, 1)).astype(jnp.float32) / np.sqrt(hd)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    a = (jax.nn.softmax(s, axis=-1).astype(x.dtype) @ v).transpose(1, 0, 2).reshape(t, d)
    x = x + a @ p["wo"]
    h = _rms(x, p["n2"])
    return x + (jax.nn.silu(h @ p["wg"]) * (h @ p["wu"])) @ p["wd"]


def layer_params(d: int, f: int, kv_dim: int, dtype: Any, seed: int = 0) -> dict[str, Any]:
    r = np.random.default_rng(seed)

    def w(*s: int) -> np.ndarray:
        return (r.standard_normal(s) / np.sqrt(s[0])).astype(dtype)

    return {
        "n1": np.ones(d, dtype),
        "n2": np.ones(d, dtype),
        "wq": w(d, d),
        "wk": w(d, kv_dim),
        "wv": w(d, kv_dim),
        "wo": w(d, d),
        "wg": w(d, f),
        "wu": w(d, f),
        "wd": w(f, d),
    }


def best_seconds(fn: Callable[[], Any], reps: int) -> float:
    """The best of ``reps`` timed calls of ``fn`` (what it returns waited for)."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
    return best

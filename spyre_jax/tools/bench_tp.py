"""``spyre-jax bench tp``: tensor parallelism over simulated cards, run and timed.

A Llama-style decoder layer (RMSNorm, multi-head causal attention, SwiGLU MLP; fp16) written
Megatron-style with ``jax.shard_map`` over a mesh of ``spyre_jax.devices()``: q/k/v, gate and up
projections split by columns, the output and down projections by rows, one ``psum`` after the
attention and one after the MLP. Two parts, each over 1, 2, 4 and 8 cards:

* **run**: a small layer (width 256 by default) run functionally; its error against the same
  layer in fp32 on the CPU (``jax.jit``) and against one card, the simulated time with and
  without the collectives, and the wall time of the N cards' simulation;
* **estimate**: the same layer at Granite-3.3-8B's widths (hidden 4096, 32 heads,
  intermediate 12800) compiled from shapes alone (no weights), its simulated time per card.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import spyre_jax

__all__ = ["tp_layer", "layer_weights", "bench_tp", "format_tp"]


def _rms(x: jax.Array, w: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-5)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def tp_layer(heads: int, head_dim: int, axis: str | None) -> Callable[..., jax.Array]:
    """One decoder layer over ``heads`` local heads; ``axis``: the mesh axis its two
    all-reduces run over (None: one card, no collective)."""

    def reduce(v: jax.Array) -> jax.Array:
        return jax.lax.psum(v, axis) if axis is not None else v

    def layer(x: jax.Array, ln1: jax.Array, wq: jax.Array, wk: jax.Array, wv: jax.Array,
              wo: jax.Array, ln2: jax.Array, wg: jax.Array, wu: jax.Array,
              wd: jax.Array) -> jax.Array:  # fmt: skip
        s = x.shape[0]
        h = _rms(x, ln1)

        def split(w: jax.Array) -> jax.Array:
            return (h @ w).reshape(s, heads, head_dim).transpose(1, 0, 2)

        q, k, v = split(wq), split(wk), split(wv)
        scores = (q @ k.transpose(0, 2, 1)).astype(jnp.float32) / math.sqrt(head_dim)
        causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
        p = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1).astype(x.dtype)
        a = (p @ v).transpose(1, 0, 2).reshape(s, heads * head_dim)
        x = x + reduce(a @ wo)
        h = _rms(x, ln2)
        return x + reduce((jax.nn.silu(h @ wg) * (h @ wu)) @ wd)

    return layer


def _specs() -> tuple[Any, ...]:
    col, row = P(None, "tp"), P("tp", None)
    return (P(), P(), col, col, col, row, P(), col, col, row)


def layer_weights(
    seq: int, hidden: int, inter: int, dtype: Any = np.float16, seed: int = 0
) -> list[np.ndarray]:
    """Random inputs and weights of :func:`tp_layer` at its global sizes."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / math.sqrt(shape[0])).astype(dtype)

    ones = np.ones(hidden, dtype)
    return [
        rng.standard_normal((seq, hidden)).astype(dtype),
        ones, w(hidden, hidden), w(hidden, hidden), w(hidden, hidden), w(hidden, hidden),
        ones, w(hidden, inter), w(hidden, inter), w(inter, hidden),
    ]  # fmt: skip


def _sharded(tp: int, heads: int, head_dim: int) -> Callable[..., Any]:
    mesh = Mesh(np.array(spyre_jax.devices()[:tp]), ("tp",))
    return jax.shard_map(
        tp_layer(heads // tp, head_dim, "tp"), mesh=mesh, in_specs=_specs(), out_specs=P()
    )


def _run(
    tps: list[int], seq: int, hidden: int, heads: int, inter: int
) -> tuple[list[dict[str, Any]], float]:
    hd = hidden // heads
    args = layer_weights(seq, hidden, inter)
    ref = np.asarray(
        jax.jit(tp_layer(heads, hd, None))(*(a.astype(np.float32) for a in args)), np.float32
    )
    one = np.asarray(spyre_jax.jit(tp_layer(heads, hd, None))(*args), np.float32)
    scale = float(np.abs(ref).max())
    rows = []
    for tp in tps:
        f = spyre_jax.jit(_sharded(tp, heads, hd))
        c = f.lower(*args).compile()
        np.asarray(f(*args))  # the first run compiles the N cards' program
        t = time.perf_counter()
        got = np.asarray(f(*args), np.float32)
        wall = time.perf_counter() - t
        ca = c.cost_analysis()
        cos = float(np.dot(got.ravel(), ref.ravel()) / np.linalg.norm(got) / np.linalg.norm(ref))
        rows.append(
            {
                "part": "run",
                "tp": tp,
                "shape": f"seq {seq}, hidden {hidden}, inter {inter}",
                "max_err_vs_cpu": float(np.abs(got - ref).max()) / scale,
                "max_err_vs_one_card": float(np.abs(got - one).max()) / scale,
                "cosine": cos,
                "sim_us": ca["sim_time_us"],
                "sim_us_without_collectives": ca["sim_time_us_without_collectives"],
                "collective_us": ca["collective_us"],
                "overlap_us": ca["overlap_us"],
                "wall_s": wall,
                "sharded_over": c.sharded_over,
            }
        )
    return rows, float(np.abs(one - ref).max()) / scale


def _estimate(tps: list[int], seq: int, hidden: int, heads: int, inter: int) -> list[dict]:
    hd = hidden // heads
    shapes = [
        jax.ShapeDtypeStruct(s, jnp.float16)
        for s in [(seq, hidden), (hidden,), *[(hidden, hidden)] * 4, (hidden,),
                  (hidden, inter), (hidden, inter), (inter, hidden)]
    ]  # fmt: skip
    rows = []
    for tp in tps:
        t = time.perf_counter()
        ca = spyre_jax.jit(_sharded(tp, heads, hd)).lower(*shapes).compile().cost_analysis()
        rows.append(
            {
                "part": "estimate",
                "tp": tp,
                "shape": f"seq {seq}, hidden {hidden}, inter {inter}",
                "sim_us": ca["sim_time_us"],
                "sim_us_without_collectives": ca["sim_time_us_without_collectives"],
                "collective_us": ca["collective_us"],
                "overlap_us": ca["overlap_us"],
                "compile_s": time.perf_counter() - t,
            }
        )
    return rows


def bench_tp(
    *,
    tps: tuple[int, ...] = (1, 2, 4, 8),
    seq: int = 64,
    hidden: int = 256,
    heads: int = 8,
    inter: int = 512,
    estimate: bool = True,
) -> dict[str, Any]:
    """Both parts; ``SPYRE_NUM_CARDS`` is raised to the largest TP degree for the run."""
    old = os.environ.get("SPYRE_NUM_CARDS")
    os.environ["SPYRE_NUM_CARDS"] = str(max(max(tps), int(old or 1)))
    try:
        rows, one_err = _run(list(tps), seq, hidden, heads, inter)
        if estimate:
            rows += _estimate(list(tps), 128, 4096, 32, 12800)
    finally:
        if old is None:
            os.environ.pop("SPYRE_NUM_CARDS", None)
        else:
            os.environ["SPYRE_NUM_CARDS"] = old
    return {"jax_devices": len(jax.devices()), "rows": rows, "one_card_err_vs_cpu": one_err}


def format_tp(res: dict[str, Any]) -> str:
    """The rows as a table (a part's missing figures as ``-``)."""
    cols = [
        ("part", "part", "{}"),
        ("tp", "cards", "{}"),
        ("shape", "layer", "{}"),
        ("sim_us", "sim us", "{:.1f}"),
        ("sim_us_without_collectives", "w/o collectives", "{:.1f}"),
        ("collective_us", "collectives us", "{:.1f}"),
        ("overlap_us", "overlap us", "{:.1f}"),
        ("max_err_vs_cpu", "err vs CPU", "{:.2e}"),
        ("max_err_vs_one_card", "err vs 1 card", "{:.2e}"),
        ("wall_s", "wall s", "{:.3f}"),
    ]
    table = [[h for _, h, _ in cols]]
    for r in res["rows"]:
        table.append([f.format(r[k]) if k in r else "-" for k, _, f in cols])
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in table]
    one = res["one_card_err_vs_cpu"]
    return (
        "\n".join(lines)
        + f"\n(one card, no shard_map: err vs CPU {one:.2e}; JAX devices: {res['jax_devices']})"
    )

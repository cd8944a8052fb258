"""``spyre-jax bench schedules``: our matmul schedules against the external bound.

Each case is a matmul as JAX users write it for the card, in fp16 with fp32 accumulation
(``preferred_element_type=jnp.float32``, then ``astype(jnp.float16)``), compiled by
``spyre_jax.jit``. Nothing runs on the simulated card: the figures are the compiled schedule's
``cost_analysis()``. Per case:

- ``sim_us``: the simulated time of our schedule;
- ``bound_us``: the external bound of ``../shared/CARD.md``, max(minimal device traffic / 150
  GB/s, flops / 72.96 TFLOPS), and ``bound_ratio``, the schedule over it (the goal: 1.15 at
  most; IBM's compiler reaches 0.99, 1.14 and 1.25 on the three measured prefill shapes);
- ``unit``: the unit that bounds the schedule (the busiest: PE, load/store, ring, SFU);
- ``steps`` and ``cores``: the matmul stage's steps and the cores it uses.

The shapes: square (1024-4096), Granite-3.3-8B prefill of 512 (512 x 4096 x {1024, 4096, 12800,
14336}), decode (1, 16 and 64 rows x 4096 x {4096, 12800}), attention's batched matmuls (32
heads of 128, 512 queries: scores Q K^T and the weighted sum P V; one decode query over 2048
keys), and GPT-2 small's and Llama-3.2-1B's projections.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import spyre_jax

from .bench_calibrate import run_named

__all__ = ["CASES", "GOAL", "bench_schedules", "format_schedules"]

#: the issue's goal for every case: the schedule within this factor of the bound
GOAL = 1.15


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(jnp.float16)


def _scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """Attention scores per head, ``Q K^T`` ([heads, queries, d] x [heads, keys, d])."""
    s = jnp.einsum("hqd,hkd->hqk", q, k, preferred_element_type=jnp.float32)
    return s.astype(jnp.float16)


def _weighted(p: jax.Array, v: jax.Array) -> jax.Array:
    """Attention's weighted sum per head, ``P V`` ([heads, queries, keys] x [heads, keys, d])."""
    o = jnp.einsum("hqk,hkd->hqd", p, v, preferred_element_type=jnp.float32)
    return o.astype(jnp.float16)


def _mm(m: int, k: int, n: int) -> tuple[Callable[..., Any], tuple[tuple[int, ...], ...]]:
    return _matmul, ((m, k), (k, n))


#: name -> (function, argument shapes (fp16), family)
CASES: dict[str, tuple[Callable[..., Any], tuple[tuple[int, ...], ...], str]] = {
    **{f"square-{s}": (*_mm(s, s, s), "square") for s in (1024, 2048, 4096)},
    **{
        f"prefill-512x4096x{n}": (*_mm(512, 4096, n), "prefill") for n in (1024, 4096, 12800, 14336)
    },
    **{
        f"decode-{m}x4096x{n}": (*_mm(m, 4096, n), "decode")
        for m in (1, 16, 64)
        for n in (4096, 12800)
    },
    "attn-scores-32x512x128x512": (_scores, ((32, 512, 128), (32, 512, 128)), "attention"),
    "attn-weighted-32x512x512x128": (_weighted, ((32, 512, 512), (32, 512, 128)), "attention"),
    "attn-decode-scores-32x1x128x2048": (_scores, ((32, 1, 128), (32, 2048, 128)), "attention"),
    "gpt2-128x768x2304": (*_mm(128, 768, 2304), "gpt2"),
    "gpt2-128x768x3072": (*_mm(128, 768, 3072), "gpt2"),
    "gpt2-128x3072x768": (*_mm(128, 3072, 768), "gpt2"),
    "llama1b-512x2048x8192": (*_mm(512, 2048, 8192), "llama-3.2-1b"),
    "llama1b-512x8192x2048": (*_mm(512, 8192, 2048), "llama-3.2-1b"),
}


def run_case(name: str) -> dict[str, Any]:
    """One case, compiled (not run): the figures :func:`bench_schedules` reports."""
    fn, shapes, family = CASES[name]
    args = [jnp.zeros(s, jnp.float16) for s in shapes]
    cost = spyre_jax.jit(fn).lower(*args).compile().cost_analysis()
    mm = [s for s in cost["stages"] if s["kind"] == "matmul"]
    ratio = float(cost["bound_ratio"])
    return {
        "family": family,
        "shapes": [list(s) for s in shapes],
        "sim_us": float(cost["sim_time_us"]),
        "bound_us": float(cost["bound_us"]),
        "bound_ratio": ratio,
        "within_goal": ratio <= GOAL,
        "unit": cost["bound"],
        "stages": int(cost["num_stages"]),
        "steps": sum(int(s["steps"]) for s in mm),
        "cores": max((int(s["cores_used"]) for s in mm), default=0),
        "device_bytes": float(cost["device_bytes"]),
        "min_device_bytes": float(cost["min_device_bytes"]),
    }


def bench_schedules(names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Every case of :data:`CASES` (or ``names``), one after another."""
    return run_named("schedules", CASES, run_case, names)


def format_schedules(res: dict[str, dict[str, Any]]) -> str:
    """A table of :func:`bench_schedules`'s result, the worst ratio last."""
    head = f"{'case':<36}{'sim us':>10}{'bound us':>10}{'ratio':>8}{'steps':>7}  unit"
    lines = [head]
    for name, r in res.items():
        lines.append(
            f"{name:<36}{r['sim_us']:>10.1f}{r['bound_us']:>10.1f}{r['bound_ratio']:>8.3f}"
            f"{r['steps']:>7}  {r['unit']}{'' if r['within_goal'] else '  (over the goal)'}"
        )
    if res:
        worst = max(res, key=lambda n: res[n]["bound_ratio"])
        lines.append(f"worst: {worst} at {res[worst]['bound_ratio']:.3f} (goal {GOAL})")
    return "\n".join(lines)

"""``spyre-jax bench calibrate``: the timing model against every published kernel measurement.

Each case of ``../shared/CARD.md``'s "Published measurements" with a kernel-level time runs here
as JAX users write it, compiled by ``spyre_jax.jit`` in fp16 (matmuls accumulate in fp32,
``preferred_element_type``, and store fp16). The cases are the 4096 x 2048 softmax and the three
Granite prefill matmuls, 512 x 4096 x {1024, 4096, 12800}. Reported per case:

- the simulated time of our schedule (``cost_analysis()["sim_time_us"]``);
- the time measured on the card, and the model over it;
- the external bound (``bound_us``: minimal device traffic at the measured 150 GB/s, or the flops
  at the sustained 72.96 TFLOPS), and the schedule over it (``bound_ratio``);
- the unit that bounds the schedule.

The softmax has two published figures: 261 us in a spot check of that kernel and 390 us in
torch-spyre's reference database. The ratio follows the spot check, a direct measurement of this
kernel whose memory traffic fits the card's measured bandwidth (32 MiB at about 130 GB/s). The
database figure is reported beside it (``measured_alt_us``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import spyre_jax

__all__ = ["CASES", "bench_calibrate", "format_calibrate"]


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(jnp.float16)


def _softmax(x: jax.Array) -> jax.Array:
    return jax.nn.softmax(x, axis=-1)


#: name -> (function, argument shapes, measured us, another published figure or None, source)
CASES: dict[str, tuple[Callable[..., Any], tuple[tuple[int, ...], ...], float, Any, str]] = {
    "softmax-4096x2048": (
        _softmax,
        ((4096, 2048),),
        261.0,
        390.0,
        "torch-spyre compiler/cost_model.md (spot check; 390 us in its reference database)",
    ),
    "matmul-512x4096x1024": (
        _matmul,
        ((512, 4096), (4096, 1024)),
        90.0,
        None,
        "Granite KV projection, prefill 512: torch-spyre fork PR artifacts (June 2026)",
    ),
    "matmul-512x4096x4096": (
        _matmul,
        ((512, 4096), (4096, 4096)),
        318.0,
        None,
        "Granite Q/O projection, prefill 512: same",
    ),
    "matmul-512x4096x12800": (
        _matmul,
        ((512, 4096), (4096, 12800)),
        1020.0,
        None,
        "Granite MLP projection, prefill 512: same",
    ),
}


def run_case(name: str) -> dict[str, Any]:
    """One case: the figures :func:`bench_calibrate` reports."""
    fn, shapes, measured, alt, source = CASES[name]
    args = [jax.ShapeDtypeStruct(s, jnp.float16) for s in shapes]  # shapes only: no values
    cost = spyre_jax.jit(fn).lower(*args).compile().cost_analysis()
    model = float(cost["sim_time_us"])
    return {
        "model_us": model,
        "measured_us": measured,
        "measured_alt_us": alt,
        "model_over_measured": model / measured,
        "within_15pct": abs(model / measured - 1) <= 0.15,
        "bound_us": float(cost["bound_us"]),
        "bound_ratio": float(cost["bound_ratio"]),
        "measured_over_bound": measured / float(cost["bound_us"]),
        "bound_unit": cost["bound"],
        "source": source,
    }


def run_named(
    what: str,
    cases: dict[str, Any],
    run: Callable[[str], dict[str, Any]],
    names: list[str] | None,
) -> dict[str, dict[str, Any]]:
    """``run`` over the cases ``names`` (default: all of ``cases``), one after another; an
    unknown name raises ValueError naming the known ones, before any case runs."""
    todo = names or list(cases)
    for name in todo:
        if name not in cases:
            raise ValueError(f"bench {what}: unknown case {name!r}; known: {', '.join(cases)}")
    return {name: run(name) for name in todo}


def bench_calibrate(names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Every case of :data:`CASES` (or ``names``), one after another."""
    return run_named("calibrate", CASES, run_case, names)


def format_calibrate(res: dict[str, dict[str, Any]]) -> str:
    """A table of :func:`bench_calibrate`'s result."""
    head = f"{'case':<24}{'model us':>10}{'measured':>10}{'ratio':>8}{'bound us':>10}"
    head += f"{'sched/bound':>13}{'card/bound':>12}  unit"
    lines = [head]
    for name, r in res.items():
        lines.append(
            f"{name:<24}{r['model_us']:>10.1f}{r['measured_us']:>10.1f}"
            f"{r['model_over_measured']:>8.2f}{r['bound_us']:>10.1f}{r['bound_ratio']:>13.2f}"
            f"{r['measured_over_bound']:>12.2f}  {r['bound_unit']}"
        )
    return "\n".join(lines)

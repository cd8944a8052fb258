"""Every kernel-time measurement of ``../shared/CARD.md``, as a case the timing model runs.

Each case is the kernel as a JAX user writes it, compiled for the card (fp16; matmuls accumulate
in fp32 and store fp16), with the time the card took: the *device kernel time*, the better of the
two stacks where CARD.md gives both (the card's capability, not one compiler's). Cases are
grouped in families (pointwise, reduction, matmul, batched matmul, core scaling, rates) for the
error statistics of ``spyre-jax bench calibrate``.

What CARD.md measures but this table leaves out, and why, is :data:`EXCLUDED`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["Case", "CASES", "EXCLUDED"]

F16 = jnp.float16
_PERF = "perf-suite report, June-July 2026 (CARD.md 'Per-op kernel times', secondary)"
_NOTES = "calibration notes, 2026-06/07 (CARD.md 'Measured rates', secondary)"
_FORK = "torch-spyre fork PR artifacts, June 2026 (CARD.md, secondary)"


@dataclass(frozen=True)
class Case:
    """One measurement: ``fn`` on fp16 arrays of ``shapes`` (on ``cores`` cores: None for all)
    took ``measured_us`` on the card. ``figures``: each stack's figure, where CARD.md gives
    several; ``derived``: how a figure or shape was derived from CARD.md's words; ``apart``:
    why the model is not held to it."""

    family: str
    fn: Callable[..., Any]
    shapes: tuple[tuple[int, ...], ...]
    measured_us: float
    source: str
    figures: dict[str, float] = field(default_factory=dict)
    cores: int | None = None
    derived: str = ""
    #: why the model is not held to this measurement (the case is then not counted in its
    #: family's statistics), or ""
    apart: str = ""


def _mm(a: Any, b: Any) -> Any:
    return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(F16)


def _softmax(x: Any) -> Any:
    return jax.nn.softmax(x, axis=-1)


def _rmsnorm(x: Any, w: Any) -> Any:
    """Llama's RMSNorm: fp32 statistics, the result back in fp16, times the weight."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return y.astype(F16) * w


def _rms_stats(x: Any) -> Any:
    x32 = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)


def _gelu(x: Any) -> Any:
    return jax.nn.gelu(x)


def _broadcast_rows(x: Any) -> Any:
    return jnp.broadcast_to(x, (4096, x.shape[-1]))


def _neg(x: Any) -> Any:
    return -x


_GELU_SHAPE = ((1024, 1024),)
_GELU_DERIVED = (
    "CARD.md gives no shape; 40.5 us at the notes' gelu rate of 100 GB/s is 4.05 MB moved: "
    "1 Mi fp16 elements read and written"
)
#: a rate measurement as a kernel time: a 32 MiB fp16 tensor at the published rate
_RATE_SHAPE = (4096, 4096)
_RATE_BYTES = 4096 * 4096 * 2


def _at(rate_gbs: float, nbytes: float) -> float:
    return nbytes / (rate_gbs * 1e9) * 1e6


CASES: dict[str, Case] = {
    # ---- pointwise: one read stream per operand, one write stream
    "add-1x512x4096": Case(
        "pointwise", jnp.add, ((1, 512, 4096),) * 2, 117.0, _PERF, {"new": 127, "sendnn": 117}
    ),
    "add-4x1x4096": Case(
        "pointwise", jnp.add, ((4, 1, 4096),) * 2, 1.0, _PERF, {"new": 1, "sendnn": 1}
    ),
    # ---- reductions along the last (stick) dimension
    "softmax-1x512x4096": Case(
        "reduction", _softmax, ((1, 512, 4096),), 95.0, _PERF, {"new": 101, "sendnn": 95}
    ),
    "softmax-4x1x4096": Case(
        "reduction", _softmax, ((4, 1, 4096),), 6.0, _PERF, {"new": 6, "sendnn": 6}
    ),
    "softmax-4096x2048": Case(
        "reduction",
        _softmax,
        ((4096, 2048),),
        390.0,
        "torch-spyre compiler/cost_model.md (public): 390 us in its reference database, 261 us "
        "in one spot check",
        {"reference database": 390, "spot check": 261},
        derived="the sources disagree; the model follows the database: its 86 GB/s agrees with "
        "the [1,512,4096] softmax of the perf suite (88 GB/s), the spot check's 129 GB/s with "
        "no other reduction",
    ),
    "rmsnorm-stats-1x512x4096": Case(
        "reduction",
        _rms_stats,
        ((1, 512, 4096),),
        60.0,
        _PERF,
        {"sendnn": 60},
        derived="the first of sendnn's two RMSNorm kernels: the mean of squares of each row",
    ),
    "rmsnorm-1x512x4096": Case(
        "reduction",
        _rmsnorm,
        ((1, 512, 4096), (4096,)),
        121.0,
        _PERF,
        {"new": 221, "sendnn": 121},
        derived="sendnn ran it as two kernels, 60 + 61 us",
        apart="both stacks read the input twice (sendnn in two kernels); our schedule fuses "
        "the statistics and the scaling into one pass over the row, a choice the measurement "
        "does not time (its statistics kernel is the case above)",
    ),
    # ---- matmuls: decode (batch 4) and prefill (512 tokens) at Granite-3.3-8B's widths
    **{
        f"matmul-{m}x4096x{n}": Case(
            "matmul",
            _mm,
            ((m, 4096), (4096, n)),
            float(min(new, old)),
            src,
            {"new": new, "sendnn": old},
        )
        for m, n, new, old, src in (
            (4, 4096, 214, 233, _PERF),
            (4, 1024, 56, 62, _PERF),
            (4, 12800, 721, 846, _PERF),
            (512, 1024, 90, 106, _FORK),
            (512, 4096, 318, 358, _FORK),
            (512, 12800, 1020, 959, _FORK),
        )
    },
    # ---- batched matmuls, the batch dimension outermost in every operand (our layouts)
    **{
        f"bmm-{b}x1024x2048x1024": Case(
            "batched matmul", _mm, ((b, 1024, 2048), (b, 2048, 1024)), float(us), _NOTES
        )
        for b, us in ((1, 148), (2, 228), (4, 458), (8, 917))
    },
    # ---- how many cores a kernel's memory traffic can use
    "gelu-1024x1024-32cores": Case(
        "core scaling", _gelu, _GELU_SHAPE, 40.5, _NOTES, derived=_GELU_DERIVED
    ),
    "gelu-1024x1024-2cores": Case(
        "core scaling", _gelu, _GELU_SHAPE, 40.5, _NOTES, cores=2, derived=_GELU_DERIVED
    ),
    "gelu-1024x1024-1core": Case(
        "core scaling", _gelu, _GELU_SHAPE, 60.3, _NOTES, cores=1, derived=_GELU_DERIVED
    ),
    # ---- device-memory rates by the mix of reads and writes (a 32 MiB tensor at each rate)
    "write-only-4096x4096": Case(
        "rates",
        _broadcast_rows,
        ((1, 4096),),
        _at(132.5, _RATE_BYTES),
        _NOTES,
        derived="32 MiB written at 132.5 GB/s, the middle of the notes' 125-140",
    ),
    "neg-4096x4096": Case(
        "rates",
        _neg,
        (_RATE_SHAPE,),
        _at(104, 2 * _RATE_BYTES),
        _NOTES,
        derived="32 MiB read and 32 MiB written at the notes' 104 GB/s for neg",
    ),
}

#: CARD.md's measurements this table leaves out: (what, figure, why)
EXCLUDED: list[tuple[str, str, str]] = [
    (
        "batched matmul, the compiler's default layout, B = 2 / 4 / 8 and one core B = 4",
        "961 / 3792 / 7459 us; 21,322 us",
        "a layout our schedules never choose: the batch dimension is outermost in every "
        "operand, and the table holds the card's time for that layout",
    ),
    (
        "on-chip ring: a uniform shift of 4.06 / 8.13 / 16.25 MB; an all-to-all of 13.1 MB",
        "75.3 / 89.8 / 124.8 us; 362 us",
        "a stand-alone data-movement kernel no JAX or torch op lowers to; the model's ring is "
        "the operand forwarding inside a kernel (ring_fixed_s: torch-spyre's fitted 5 ns a "
        "step, not the notes' 58 us; ring_bytes_per_cycle on the busiest link, shifts and "
        "all-to-all patterns alike), which the published matmuls (forwarding every step) "
        "bear out",
    ),
    (
        "copy bandwidth by cores; a reduction's read bandwidth by cores (relative)",
        "41 / 112 / 100 GB/s on 1 / 4 / 32 cores; 0.11 ... 0.54",
        "rates without a kernel shape or time, and at odds with the gelu cases (a gelu on one "
        "core moved 70 GB/s, a copy on one core 41): the gelu cases stand for core scaling",
    ),
    (
        "device memory read only; broadcast; cross-row reduction (torch-spyre's fit)",
        "150 / 118 / 113 GB/s",
        "fitted rates of another model: the read rate is the model's memory_bw_one_way as "
        "published; the others have no kernel time of their own",
    ),
    (
        "Granite MLP block (6.96 / 5.75 ms), a decoder layer (12.0-14.7 ms) and the 40-layer "
        "prefill (387-392 ms) at 512 tokens",
        "ms",
        "several kernels end to end: `spyre-jax estimate`'s figures, not one kernel's",
    ),
    (
        "launch of one op on the graph path; host launch of a compiled kernel; first and next "
        "token of Granite 3.3 8B",
        "5.519 ms; 0.07 ms; 969 / 865 ms",
        "host-side and end-to-end times (the host_launch_s parameter takes the 0.07 ms)",
    ),
    (
        "torch-spyre's cost model predicts the softmax at 320 us and matmuls 22-31% low",
        "-",
        "predictions of another model, not measurements",
    ),
]

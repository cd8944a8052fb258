"""``spyre-jax bench loops``: what loops cost the simulator, measured side by side in one run.

* ``iteration``: the wall time of one iteration of a scan whose body is one transformer-style
  layer (kept as a loop), against one call of ``spyre_jax.jit(layer)`` already compiled: the
  ratio is the host program's overhead per iteration.
* ``while_10k``: a ``while_loop`` of 10,000 iterations (a counter): its wall time, iterations per
  second, and how many records a profile of it keeps (the first iterations step by step, the
  rest as one ``loop_summary`` span: ``device_model.hostprog.TRACE_ITERATIONS``).
* ``compile``: the cold first call (trace, compile, load, build the card program, run) of a
  model of stacked layers scanned over, at 4 and at 32 layers (fresh function objects; the loop
  kept a loop at both lengths, where the compiler would unroll the short one); the ratio shows
  that a scan compiles one layer.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import spyre_jax
from lowering import control

__all__ = ["bench_loops", "format_loops"]

D = 256


def _layer(h: Any, wb: Any) -> tuple[Any, None]:
    w1, w2, g = wb
    x = h * lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-5) * g
    return h + jax.nn.gelu(x @ w1) @ w2, None


def _weights(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r = np.random.default_rng(seed)
    w1 = (r.standard_normal((n, D, 2 * D)) / np.sqrt(D)).astype(np.float16)
    w2 = (r.standard_normal((n, 2 * D, D)) / np.sqrt(2 * D)).astype(np.float16)
    return w1, w2, np.ones((n, D), np.float16)


def _model() -> Any:
    return lambda x, w1, w2, g: lax.scan(_layer, x, (w1, w2, g))[0]


@contextlib.contextmanager
def _looped() -> Iterator[None]:
    """Scans kept loops (never unrolled by the compiler's choice) inside the block."""
    saved = control.UNROLL_MAX_NODES
    control.UNROLL_MAX_NODES = 0
    try:
        yield
    finally:
        control.UNROLL_MAX_NODES = saved


def _iteration(reps: int) -> dict[str, Any]:
    x = np.random.default_rng(1).standard_normal((32, D)).astype(np.float16)
    n = 16
    w1, w2, g = _weights(n)
    with _looped():
        looped = spyre_jax.jit(_model())
        np.asarray(looped(x, w1, w2, g))  # compile and warm
        one = spyre_jax.jit(lambda h, a, b, c: _layer(h, (a, b, c))[0])
        args1 = [spyre_jax.device_put(a) for a in (x, w1[0], w2[0], g[0])]
        argsn = [spyre_jax.device_put(a) for a in (x, w1, w2, g)]
        np.asarray(one(*args1))
        loop_t, call_t = [], []
        for _ in range(reps):  # interleaved: the loop, then as many single calls
            t0 = time.perf_counter()
            np.asarray(looped(*argsn))
            loop_t.append((time.perf_counter() - t0) / n)
            t0 = time.perf_counter()
            for _ in range(n):
                y = one(*args1)
            np.asarray(y)
            call_t.append((time.perf_counter() - t0) / n)
    it, call = min(loop_t), min(call_t)
    return {"layers": n, "iteration_s": it, "call_s": call, "ratio": it / call}


def _while_10k() -> dict[str, Any]:
    f = spyre_jax.jit(
        lambda x: lax.while_loop(
            lambda c: c[0] < 10_000, lambda c: (c[0] + 1, c[1] * 1.0001), (0, x)
        )
    )
    x = np.ones(8, np.float32)
    np.asarray(f(x)[1])  # compile (and run once)
    with spyre_jax.profile(print_summary=False) as prof:
        t0 = time.perf_counter()
        n, y = f(x)
        np.asarray(y)
        wall = time.perf_counter() - t0
    kinds: dict[str, int] = {}
    for r in prof.records:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    return {
        "iterations": int(np.asarray(n)),
        "wall_s": wall,
        "iterations_per_s": 10_000 / wall,
        "trace_records": len(prof.records),
        "trace_kinds": kinds,
        "sim_time_us": prof.summary["total_s"] * 1e6,
    }


def _compile(layers: tuple[int, ...]) -> dict[str, Any]:
    """Per layer count, the first call's wall time: trace, lower, compile, load, build the card
    program and run it once (a new function object each time: nothing of ours is cached)."""
    x = np.zeros((32, D), np.float16)
    out: dict[str, Any] = {}
    with _looped():  # the loop kept a loop at every length: like with like
        for n in layers:
            args = [spyre_jax.device_put(a) for a in (x, *_weights(n))]
            f = spyre_jax.jit(_model())
            t0 = time.perf_counter()
            np.asarray(f(*args))
            out[f"layers_{n}_s"] = time.perf_counter() - t0
            c = next(iter(f._cache.values()))
            out[f"layers_{n}_kernels"] = len(c.program.kernels()) if c.program else 1
    a, b = layers[0], layers[-1]
    out["ratio"] = out[f"layers_{b}_s"] / out[f"layers_{a}_s"]
    return out


def bench_loops(reps: int | None = None) -> dict[str, Any]:
    """The three measurements of the module's docstring, in one run."""
    _compile((2,))  # warm the importer and the pipeline once: the figures compare like with like
    return {
        "compile": _compile((4, 32)),
        "iteration": _iteration(reps or 5),
        "while_10k": _while_10k(),
    }


def format_loops(r: dict[str, Any]) -> str:
    c, it, w = r["compile"], r["iteration"], r["while_10k"]
    return "\n".join(
        [
            *(
                f"cold compile, scan over {n} layers {c[f'layers_{n}_s']:.2f} s "
                f"({c[f'layers_{n}_kernels']} kernels)"
                for n in (4, 32)
            ),
            f"compile ratio 32/4 layers {c['ratio']:.2f}",
            f"one loop iteration {it['iteration_s'] * 1e3:.3f} ms, one cached call of the layer "
            f"{it['call_s'] * 1e3:.3f} ms: ratio {it['ratio']:.2f}",
            f"while loop of {w['iterations']} iterations: {w['wall_s']:.2f} s "
            f"({w['iterations_per_s']:.0f} per s), {w['trace_records']} trace records "
            f"{w['trace_kinds']}, simulated {w['sim_time_us'] / 1e3:.2f} ms",
        ]
    )

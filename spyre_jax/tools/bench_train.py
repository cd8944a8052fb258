"""``spyre-jax bench train``: a Llama-style layer's forward and backward on the card, both
frontends, fp16 and fp32, measured side by side with the CPU in one run.

Per frontend and dtype, for one training step of the loss ``mean(layer(x)**2)`` over the
layer's weights (RMSNorm, grouped attention without RoPE, causal softmax, SwiGLU MLP: the
shapes of a Llama-3.2-1B layer by default, ``--tiny`` for a small one):

* ``fwd_us``, ``bwd_us``: simulated time on the card of the forward program (with the residuals
  it saves) and of the backward program: JAX's ``jax.grad(spyre_jax.jit(loss))`` launches the two
  (``spyre_jax.transforms``); torch's ``torch.compile(..., backend="spyre")`` compiles
  AOTAutograd's forward and backward graphs;
* ``saved_mb``: the saved activations (the residuals the forward returns for the backward);
* ``compile_s``: the cold first step (trace, compile both programs, run);
* ``wall_ms``, ``cpu_ms``, ``wall_over_cpu``: a warm step's wall time (the simulation) beside
  the same step on the CPU (``jax.jit(jax.grad(loss))``; torch eager), the best of ``reps``;
* ``grad_err``: the largest error of a weight's gradient, relative to that gradient's largest
  magnitude, against an fp32 CPU run; ``cpu_grad_err`` the same of the CPU's own step in the
  row's dtype (what the dtype alone costs).

And the host overhead of a warm ``jax.grad(spyre_f)`` of a small function (a 64x32 tanh layer,
where the simulation's own work is small) beside ``jax.grad(jax.jit(f))`` on the CPU, interleaved,
the best of ``5 * reps`` rounds of 20 calls each, with the compiles of the second call (0).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import spyre_jax
from spyre_jax import transforms

from .bench_models import format_table
from .bench_train_torch import torch_case
from .train_layer import FULL, TINY, best_seconds, layer, layer_params

__all__ = ["bench_train", "format_train", "layer", "layer_params", "FULL", "TINY"]


def _grad_err(got: dict[str, Any], want: dict[str, Any]) -> float:
    errs = []
    for k, w in want.items():
        w = np.asarray(w, np.float32)
        g = np.asarray(got[k], np.float32)
        errs.append(float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30)))
    return max(errs)


def _jax_case(shape: tuple[int, ...], dtype: Any, reps: int) -> dict[str, Any]:
    d, f, heads, kvh, t = shape
    p = layer_params(d, f, d // heads * kvh, dtype)
    x = (np.random.default_rng(1).standard_normal((t, d)) * 0.5).astype(dtype)

    def loss(p: Any, x: Any) -> Any:
        y = layer(p, x, heads, kvh).astype(jnp.float32)
        return jnp.mean(y * y)

    grad = jax.grad(spyre_jax.jit(loss))
    t0 = time.perf_counter()
    jax.block_until_ready(grad(p, x))
    compile_s = time.perf_counter() - t0
    transforms.reset_stats()
    with spyre_jax.profile(print_summary=False) as prof:
        g = grad(p, x)
    runs = [r for r in prof.records if r.kind == "run_kernel"]
    fwd = sum(r.end - r.start for r in runs if not r.name.endswith("_transpose"))
    bwd = sum(r.end - r.start for r in runs if r.name.endswith("_transpose"))
    saved = transforms.stats()["residual_bytes"]
    wall = best_seconds(lambda: grad(p, x), reps)
    cpu_grad = jax.jit(jax.grad(loss))
    jax.block_until_ready(cpu_grad(p, x))
    cpu = best_seconds(lambda: cpu_grad(p, x), reps)
    p32 = {k: np.asarray(v, np.float32) for k, v in p.items()}
    ref = jax.jit(jax.grad(loss))(p32, np.asarray(x, np.float32))
    return {
        "fwd_us": fwd * 1e6,
        "bwd_us": bwd * 1e6,
        "kernels": len(runs),
        "saved_mb": saved / 1e6,
        "compile_s": compile_s,
        "wall_ms": wall * 1e3,
        "cpu_ms": cpu * 1e3,
        "wall_over_cpu": wall / cpu,
        "grad_err": _grad_err(g, ref),
        "cpu_grad_err": _grad_err(cpu_grad(p, x), ref),
        "cpu_primitives": sum(prof.cpu_primitives.values()),
    }


def grad_overhead(reps: int = 5) -> dict[str, Any]:
    """A warm ``jax.grad(spyre_jax.jit(f))`` against ``jax.grad(jax.jit(f))`` on the CPU."""
    r = np.random.default_rng(0)
    w = r.standard_normal((64, 32)).astype(np.float32)
    x = r.standard_normal((16, 64)).astype(np.float32)

    def f(w: Any, x: Any) -> Any:
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    gs, gj = jax.grad(spyre_jax.jit(f)), jax.grad(jax.jit(f))
    jax.block_until_ready((gs(w, x), gj(w, x)))
    transforms.reset_stats()
    jax.block_until_ready(gs(w, x))
    compiles = transforms.stats()["compiles"]
    best = {"spyre": float("inf"), "cpu": float("inf")}
    for _ in range(reps):
        for k, g in (("spyre", gs), ("cpu", gj)):
            t = time.perf_counter()
            for _ in range(20):
                jax.block_until_ready(g(w, x))
            best[k] = min(best[k], (time.perf_counter() - t) / 20)
    return {
        "spyre_ms": best["spyre"] * 1e3,
        "cpu_ms": best["cpu"] * 1e3,
        "ratio": best["spyre"] / best["cpu"],
        "second_call_compiles": compiles,
    }


def bench_train(*, reps: int = 3, tiny: bool = False) -> dict[str, Any]:
    """Both frontends, fp16 and fp32: one row each (an ``error`` where a case failed)."""
    shape = TINY if tiny else FULL
    res: dict[str, Any] = {}
    for frontend, case in (("jax", _jax_case), ("torch", torch_case)):
        for dt in (np.float16, np.float32):
            name = f"{frontend} {np.dtype(dt).name}"
            try:
                res[name] = case(shape, dt, reps)
            except Exception as e:  # noqa: BLE001 - a failed case is a row of the table
                res[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return {
        "shape": dict(zip(("width", "mlp", "heads", "kv_heads", "tokens"), shape, strict=True)),
        "rows": res,
        "grad_overhead": grad_overhead(5 * reps),
    }


def format_train(r: dict[str, Any]) -> str:
    cols = (
        ("fwd us", "fwd_us", "{:.1f}"),
        ("bwd us", "bwd_us", "{:.1f}"),
        ("saved MB", "saved_mb", "{:.2f}"),
        ("compile s", "compile_s", "{:.1f}"),
        ("wall ms", "wall_ms", "{:.1f}"),
        ("cpu ms", "cpu_ms", "{:.2f}"),
        ("wall/cpu", "wall_over_cpu", "{:.1f}"),
        ("grad err", "grad_err", "{:.1e}"),
        ("cpu err", "cpu_grad_err", "{:.1e}"),
    )
    s = r["shape"]
    head = (
        f"Llama-style layer: width {s['width']}, MLP {s['mlp']}, {s['heads']} heads "
        f"({s['kv_heads']} KV), {s['tokens']} tokens; one training step"
    )
    o = r["grad_overhead"]
    tail = (
        f"warm jax.grad(spyre_f) {o['spyre_ms']:.2f} ms vs jax.grad(jax.jit(f)) "
        f"{o['cpu_ms']:.2f} ms: {o['ratio']:.2f}x; second call compiled "
        f"{o['second_call_compiles']}"
    )
    return head + "\n" + format_table(r["rows"], cols, width=11) + "\n" + tail

"""The ``spyre-jax demo`` command: an equinox transformer block through ``spyre_jax.jit`` and a
transformers GPT-2 through ``torch.compile(backend="spyre")``, with the card's figures beside the
CPU references. :func:`demo_block` and :func:`gpt2_small` are also the models of
:mod:`spyre_jax.tools.bench`.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch

import spyre_jax
from device_model.trace import format_summary
from torch_bridge import backend as tb

__all__ = ["DEFAULT_TRACE", "demo_block", "gpt2_small", "run_demo", "run_torch_demo"]

#: where ``spyre-jax demo`` writes its Chrome trace unless ``--trace PATH`` says otherwise: the
#: system's temporary directory, so that a run in a checkout leaves nothing in it
DEFAULT_TRACE = os.path.join(tempfile.gettempdir(), "spyre-demo-trace.json")


def demo_block(
    seq: int = 128, width: int = 256, heads: int = 4, dtype: str = "float16", seed: int = 0
) -> tuple[Callable, Any, np.ndarray]:
    """An equinox GPT-style block with random weights: ``(fn, params, x)``; ``fn(params, x)``."""

    class Block(eqx.Module):
        ln1: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        ln2: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP

        def __init__(self, key: jax.Array):
            k1, k2 = jax.random.split(key)
            self.ln1 = eqx.nn.LayerNorm(width)
            self.ln2 = eqx.nn.LayerNorm(width)
            self.attn = eqx.nn.MultiheadAttention(heads, width, key=k1)
            self.mlp = eqx.nn.MLP(width, width, 4 * width, 1, activation=jax.nn.gelu, key=k2)

        def __call__(self, x: jax.Array) -> jax.Array:
            h = jax.vmap(self.ln1)(x)
            x = x + self.attn(h, h, h)
            h = jax.vmap(self.ln2)(x)
            return x + jax.vmap(self.mlp)(h)

    k0, k1 = jax.random.split(jax.random.PRNGKey(seed))
    blk = Block(k0)
    dt = jnp.dtype(dtype)
    blk = jax.tree_util.tree_map(lambda a: a.astype(dt) if eqx.is_inexact_array(a) else a, blk)
    params, static = eqx.partition(blk, eqx.is_array)
    x = np.asarray(jax.random.normal(k1, (seq, width))).astype(dt)

    def block_fn(p: Any, x: Any) -> Any:
        return eqx.combine(p, static)(x)

    return block_fn, params, x


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)  # pragma: no cover


def run_demo(out: Any = None, trace: str | None = DEFAULT_TRACE) -> dict[str, Any]:
    """Compile the demo block onto the card, run it, print the figures beside ``jax.jit``;
    write a Chrome trace of one launch (host arguments in, the kernel, the result out) to
    ``trace`` (:data:`DEFAULT_TRACE` unless given; None writes none) and print its path."""
    out = sys.stdout if out is None else out
    fn, params, x = demo_block()
    t0 = time.perf_counter()
    f = spyre_jax.jit(fn)
    y = np.asarray(f(params, x)).astype(np.float32)
    cold = time.perf_counter() - t0
    ref = np.asarray(jax.jit(fn)(params, x)).astype(np.float32)
    err = float(np.abs(y - ref).max())
    scale = float(np.abs(ref).max())
    ca = f.lower(params, x).compile().cost_analysis()
    rows = [
        ("model", "equinox GPT-style block: seq 128, width 256, 4 heads, fp16, random weights"),
        ("max |spyre - jax.jit(cpu)|", f"{err:.3g}  (output max |y| = {scale:.3g})"),
        ("simulated time on the card", f"{ca['sim_time_us']:.1f} us"),
        ("  compute / memory (summed)", f"{ca['compute_us']:.1f} us / {ca['memory_us']:.1f} us"),
        ("cores used", f"{ca['cores_used']} of {spyre_jax.CardSpec().num_cores}"),
        (
            "scratchpad peak (fullest core)",
            f"{_fmt_bytes(ca['scratchpad_peak_bytes'])} of "
            f"{_fmt_bytes(ca['scratchpad_usable_bytes'])}"
            " usable",
        ),
        ("padding waste in device memory", _fmt_bytes(ca["padding_bytes"])),
        ("device-memory traffic", _fmt_bytes(ca["device_bytes"])),
        ("ring traffic", _fmt_bytes(ca["ring_bytes"])),
        ("stages (tiled loops) in the kernel", str(ca["num_stages"])),
        ("flops", f"{ca['flops'] / 1e6:.1f} MFLOP"),
        ("cold compile + first run (wall)", f"{cold:.2f} s"),
    ]
    prof = None
    if trace:
        with spyre_jax.profile(trace, print_summary=False) as prof:
            np.asarray(f(params, x))
        rows.append(("trace of one launch (Perfetto)", str(prof.path.resolve())))
    w = max(len(r[0]) for r in rows)
    print("spyre-jax demo: a transformer block on the simulated Spyre card", file=out)
    for k, v in rows:
        print(f"  {k:<{w}}  {v}", file=out)
    if prof is not None:
        print("  " + format_summary(prof.summary).replace("\n", "\n  "), file=out)
    res = {"max_abs_err": err, "cost": ca, "cold_s": cold, "trace": trace}
    res["torch"] = run_torch_demo(out)
    return res


def gpt2_small(seed: int = 0, dtype: str = "float16") -> tuple[Any, Any]:
    """A GPT-2 built from a small config with random weights (nothing is downloaded):
    2 layers, width 128, 4 heads, vocabulary 512, 64 positions; ``(model, input_ids)``."""
    # transformers is imported here, not at the top: it takes seconds, and only the demo and
    # ``bench torch`` use it
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=2,
        n_embd=128,
        n_head=4,
        vocab_size=512,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(cfg).eval().to(getattr(torch, dtype))
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(seed))
    return model, ids


def run_torch_demo(out: Any = None) -> dict[str, Any]:
    """The demo's PyTorch part: GPT-2 (small config, fp16) through ``torch.compile(backend=
    "spyre")``, beside eager CPU, with the same figures as the JAX part."""
    out = sys.stdout if out is None else out
    model, ids = gpt2_small()
    tb.reset_fallback_stats()
    with torch.no_grad():
        t0 = time.perf_counter()
        compiled = torch.compile(model, backend="spyre")
        got = compiled(ids)[0].float()
        cold = time.perf_counter() - t0
        t1 = time.perf_counter()
        want = model(ids)[0].float()
        eager = time.perf_counter() - t1
        t2 = time.perf_counter()
        compiled(ids)
        warm = time.perf_counter() - t2
    costs = [k.cost_analysis() for k in tb.compiled_kernels()]
    err = float((got - want).abs().max())
    card = spyre_jax.CardSpec()
    rows = [
        ("model", "transformers GPT-2, 2 layers, width 128, 4 heads, seq 64, fp16, random"),
        (
            "max |spyre - torch eager(cpu)|",
            f"{err:.3g}  (logits max |y| = {float(want.abs().max()):.3g})",
        ),
        ("card kernels / CPU fallbacks", f"{len(costs)} / {sum(tb.fallback_stats().values())}"),
        ("simulated time on the card", f"{sum(c['sim_time_us'] for c in costs):.1f} us"),
        ("cores used", f"{max(c['cores_used'] for c in costs)} of {card.num_cores}"),
        (
            "scratchpad peak (fullest core)",
            _fmt_bytes(max(c["scratchpad_peak_bytes"] for c in costs)),
        ),
        ("padding waste in device memory", _fmt_bytes(sum(c["padding_bytes"] for c in costs))),
        ("device-memory traffic", _fmt_bytes(sum(c["device_bytes"] for c in costs))),
        ("compile + first run (wall)", f"{cold:.2f} s"),
        ("simulation vs eager CPU (wall)", f"{warm * 1e3:.1f} ms vs {eager * 1e3:.1f} ms"),
    ]
    w = max(len(r[0]) for r in rows)
    print('spyre-jax demo, PyTorch part: torch.compile(backend="spyre")', file=out)
    for k, v in rows:
        print(f"  {k:<{w}}  {v}", file=out)
    return {
        "max_abs_err": err,
        "kernels": len(costs),
        "fallbacks": tb.fallback_stats(),
        "sim_time_us": sum(c["sim_time_us"] for c in costs),
        "cold_s": cold,
    }

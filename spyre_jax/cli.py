"""``spyre-jax`` / ``python -m spyre_jax``: the demo and the benchmarks."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "main",
    "demo_block",
    "gpt2_small",
    "run_demo",
    "run_torch_demo",
    "bench_sim",
    "bench_launch",
    "bench_softmax",
    "bench_torch",
]

#: the published measurement the timing model is calibrated against (CARD.md: torch-spyre
#: ``compiler/cost_model.md``, a 4096 x 2048 fp16 softmax on 32 cores)
SOFTMAX_MEASURED_US = 261.0


def demo_block(
    seq: int = 128, width: int = 256, heads: int = 4, dtype: str = "float16", seed: int = 0
) -> tuple[Callable, Any, np.ndarray]:
    """An equinox GPT-style block with random weights: ``(fn, params, x)``; ``fn(params, x)``."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

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


def run_demo(out: Any = None, trace: str | None = "spyre-demo-trace.json") -> dict[str, Any]:
    """Compile the demo block onto the card, run it, print the figures beside ``jax.jit``;
    write a Chrome trace of one launch (host arguments in, the kernel, the result out)."""
    out = sys.stdout if out is None else out
    import jax

    import spyre_jax

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
        from device_model.trace import format_summary

        print("  " + format_summary(prof.summary).replace("\n", "\n  "), file=out)
    res = {"max_abs_err": err, "cost": ca, "cold_s": cold, "trace": trace}
    res["torch"] = run_torch_demo(out)
    return res


def gpt2_small(seed: int = 0, dtype: str = "float16") -> tuple[Any, Any]:
    """A GPT-2 built from a small config with random weights (nothing is downloaded):
    2 layers, width 128, 4 heads, vocabulary 512, 64 positions; ``(model, input_ids)``."""
    import torch
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
    import torch

    import spyre_jax
    from torch_bridge import backend as tb

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


def _time(fn: Callable[[], Any], reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench_sim(reps: int = 5) -> dict[str, dict[str, float]]:
    """Wall time of the card simulation vs ``jax.jit`` on CPU, same function, same run."""
    import jax
    import jax.numpy as jnp

    import spyre_jax

    out: dict[str, dict[str, float]] = {}
    rng = np.random.default_rng(0)
    a = rng.standard_normal((1024, 1024)).astype(np.float16)
    b = rng.standard_normal((1024, 1024)).astype(np.float16)
    fn, params, x = demo_block()
    cases: dict[str, tuple[Callable, tuple]] = {
        "matmul_1024": (lambda a, b: jnp.matmul(a, b), (a, b)),
        "demo_block": (fn, (params, x)),
    }
    for name, (f, args) in cases.items():
        sf = spyre_jax.jit(f)
        dev_args = jax.tree_util.tree_map(spyre_jax.device_put, args)
        t0 = time.perf_counter()
        sf(*dev_args).block_until_ready()
        cold = time.perf_counter() - t0
        jf = jax.jit(f)
        sim = _time(lambda sf=sf, dev_args=dev_args: sf(*dev_args).block_until_ready(), reps)
        nat = _time(lambda jf=jf, args=args: jax.block_until_ready(jf(*args)), reps)
        out[name] = {"sim_s": sim, "native_s": nat, "ratio": sim / nat, "cold_compile_s": cold}
    return out


def bench_launch(calls: int = 2000, reps: int = 5) -> dict[str, float]:
    """Host-side cost of one launch of an already compiled function, beside ``jax.jit`` dispatch.

    Ours: everything a call does (flatten the arguments, find the compiled function, check for
    races, allocate the outputs, build and submit the recipe's steps on the current stream, wrap
    the results) except simulating the kernel body: the card program is replaced, for the
    measurement only, by one that returns precomputed output buffers. JAX's: the per-call time of
    ``jax.jit`` of the same trivial function on a device-resident array (asynchronous dispatch).
    """
    import jax
    import jax.numpy as jnp

    import spyre_jax

    def fn(x: Any) -> Any:
        return x + 1

    f = spyre_jax.jit(fn)
    x = spyre_jax.device_put(np.ones((8, 128), np.float16))
    f(x).block_until_ready()
    (comp,) = f._cache.values()
    real = comp._runner
    precomputed = real(x._buffer())
    jax.block_until_ready(precomputed)
    comp._runner = lambda *bufs: precomputed

    def per_call(call: Callable[[], Any]) -> float:
        for _ in range(200):
            call()
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            for _ in range(calls):
                call()
            best = min(best, (time.perf_counter() - t) / calls)
        return best

    try:
        ours = per_call(lambda: f(x))
    finally:
        comp._runner = real
    jf = jax.jit(fn)
    xj = jnp.ones((8, 128), jnp.float16)
    jax.block_until_ready(jf(xj))
    theirs = per_call(lambda: jf(xj))
    jax.block_until_ready(jf(xj))
    return {"launch_us": ours * 1e6, "jax_dispatch_us": theirs * 1e6, "ratio": ours / theirs}


def bench_softmax() -> dict[str, Any]:
    """The timing model's figure for the published 4096 x 2048 fp16 softmax, beside the card's."""
    import jax

    import spyre_jax

    x = np.zeros((4096, 2048), np.float16)
    c = spyre_jax.jit(lambda x: jax.nn.softmax(x, axis=-1)).lower(x).compile().cost_analysis()
    us = c["sim_time_us"]
    return {
        "model_us": us,
        "measured_us": SOFTMAX_MEASURED_US,
        "ratio": us / SOFTMAX_MEASURED_US,
        "bound": c["bound"],
        "stages": c["num_stages"],
        "device_bytes": c["device_bytes"],
    }


def bench_torch(reps: int = 3) -> dict[str, dict[str, Any]]:
    """GPT-2, Llama and BERT (small configs, random weights, fp32, 32 tokens) through
    ``torch.compile(backend="spyre")``: compile time, simulated time on the card, card kernels,
    CPU fallbacks, and the wall time of the simulation beside eager CPU in the same run."""
    import torch
    import transformers
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

    from torch_bridge import backend as tb

    transformers.logging.set_verbosity_error()
    gpt2, _ = gpt2_small(dtype="float32")
    torch.manual_seed(0)
    llama = LlamaForCausalLM(
        LlamaConfig(
            num_hidden_layers=2,
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=256,
            vocab_size=512,
            max_position_embeddings=64,
            bos_token_id=0,
            eos_token_id=0,
        )
    ).eval()
    bert = BertModel(
        BertConfig(
            num_hidden_layers=2,
            hidden_size=128,
            num_attention_heads=4,
            intermediate_size=256,
            vocab_size=512,
            max_position_embeddings=64,
        )
    ).eval()
    ids = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(0))
    res: dict[str, dict[str, Any]] = {}
    for name, model in (("gpt2", gpt2), ("llama", llama), ("bert", bert)):
        torch._dynamo.reset()
        tb.reset_fallback_stats()
        with torch.no_grad():
            t0 = time.perf_counter()
            c = torch.compile(model, backend="spyre")
            got = c(ids)[0]
            compile_s = time.perf_counter() - t0
            want = model(ids)[0]
            sim = _time(lambda c=c: c(ids), reps)
            eager = _time(lambda m=model: m(ids), reps)
        costs = [k.cost_analysis() for k in tb.compiled_kernels()]
        res[name] = {
            "compile_s": compile_s,
            "sim_time_us": sum(k["sim_time_us"] for k in costs),
            "kernels": len(costs),
            "fallbacks": sum(tb.fallback_stats().values()),
            "max_abs_err": float((got - want).abs().max()),
            "sim_s": sim,
            "eager_s": eager,
            "ratio": sim / eager,
        }
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "coverage":
        from .coverage import main_coverage

        return main_coverage(argv[1:])
    p = argparse.ArgumentParser(prog="spyre-jax", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("coverage", help="op coverage: coverage torch|jax [--json] [--limit N]")
    pd = sub.add_parser("demo", help="run the transformer-block demo on the simulated card")
    pd.add_argument(
        "--trace", default="spyre-demo-trace.json", help="where to write the Chrome trace"
    )
    pb = sub.add_parser("bench", help="benchmarks")
    pb.add_argument("which", choices=["sim", "launch", "softmax", "torch"])
    pb.add_argument("--json", action="store_true", help="print one JSON object")
    pb.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    if args.cmd == "demo":
        run_demo(trace=args.trace)
        return 0
    if args.cmd == "bench" and args.which != "sim":
        if args.which == "torch":
            out = bench_torch(reps=args.reps)
        elif args.which == "launch":
            out = bench_launch(reps=args.reps)
        else:
            out = bench_softmax()
        if args.json:
            print(json.dumps(out))
        else:
            for k, v in out.items():
                print(f"{k:<16} {v:.3f}" if isinstance(v, float) else f"{k:<16} {v}")
        return 0
    if args.cmd == "bench":
        res = bench_sim(args.reps)
        if args.json:
            print(json.dumps(res))
        else:
            for k, v in res.items():
                print(
                    f"{k:<12} sim {v['sim_s'] * 1e3:8.2f} ms  native {v['native_s'] * 1e3:8.2f} ms"
                    f"  ratio {v['ratio']:6.2f}  cold {v['cold_compile_s']:.2f} s"
                )
        return 0
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

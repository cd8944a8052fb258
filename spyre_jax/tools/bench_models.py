"""``spyre-jax bench models``: real model configurations through ``torch.compile(backend="spyre")``
and ``spyre_jax.jit``.

Each torch model is built from its ``transformers`` configuration with random weights (nothing is
downloaded), run once in fp32 on the CPU (the reference) and once in fp16 through the spyre
backend, each in a fresh subprocess so that its peak host memory is its own. ``gpt2-small-eqx`` is
GPT-2 small as an equinox module (:mod:`spyre_jax.tools.eqx_gpt2`, random weights), run in fp32
through ``jax.jit`` on the CPU (the reference; its "eager" time is a second, compiled call) and in
fp16 through ``spyre_jax.jit`` with its weights put in device memory first (as the torch models'
weights are constants copied in when their kernel loads). ``vit-base`` (ViT-base/16) and
``resnet-50`` are vision models from ``ViTConfig`` and ``ResNetConfig`` with ImageNet heads (1000
classes), fed one random 224x224 image (fp32 on the CPU, fp16 on the card; ``seq`` does not apply):
their "prefill" is the whole forward pass and their "logits" the class scores. Reported per model:
parameters, cold compile seconds (``cold_compile_s``: the first call, all included; ``compile_s``:
that minus a warm call's time, the compile alone), simulated prefill time (the sum of the card
kernels' simulated times), the simulation's wall time of a second call beside eager CPU's (fp32)
and their ratio, the scratchpad peak, the device-memory peak, the host peak RSS (of the whole
process: the fp32 reference included), the host memory the simulation added while it compiled and
ran (``sim_host_added_bytes``: the peak over the start, from the kernel's peak-RSS record, after
a one-layer narrow model of the same family went the same way first: ``runtime_warmup_bytes`` is
the runtime's fixed cost that leaves out),
``host_over_model``: the model's fp16 bytes plus that, over the model's fp16 bytes, and
``host_over_goal``: the same over ``1.5 x model + activations`` (``activation_bytes``: the
device-memory peak less the weights there), the goal of the real-size issue; CPU fallbacks, and
the cosine similarity and max error of the logits against the fp32 reference.

A model that fails (a ``TilingError`` today for the largest ones) is reported with its error
instead of figures; the others still run. ``--layers N`` shortens every model to N layers (full
widths and vocabularies; a ResNet to at most N blocks a stage), ``--tiny`` shrinks widths too
(for tests; the vision models' images to 32x32, the ResNet to its first two stages)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch

import spyre_jax
from device_model import program
from device_model.runtime import runtime
from torch_bridge import backend as tb
from torch_bridge import kernels as tk

from . import eqx_gpt2

__all__ = ["MODELS", "JAX_MODELS", "bench_models", "format_models", "format_table", "run_one"]


def _gpt2(layers: int | None, tiny: bool) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    kw: dict[str, Any] = {"n_layer": layers or 12}
    if tiny:
        kw.update(n_embd=64, n_head=2, vocab_size=1000, n_positions=256)
    return GPT2LMHeadModel(GPT2Config(**kw))


def _bert(layers: int | None, tiny: bool) -> Any:
    from transformers import BertConfig, BertModel

    kw: dict[str, Any] = {"num_hidden_layers": layers or 12}
    if tiny:
        kw.update(hidden_size=64, num_attention_heads=2, intermediate_size=128, vocab_size=1000)
    return BertModel(BertConfig(**kw))


#: the tiny widths of a grouped-query causal LM (tests)
_TINY_GQA: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
)


def _causal_lm(
    family: str, full: dict[str, Any], layers: int, tiny: dict[str, Any] | None = None
) -> Callable[[int | None, bool], Any]:
    """A builder(layers, tiny) of transformers' ``<family>ForCausalLM`` from its config at the
    ``full`` widths (``layers`` by default), random weights; the tiny widths with ``tiny``."""

    def build(n: int | None, small: bool) -> Any:
        import transformers

        kw = dict(full, num_hidden_layers=n or layers)
        if small:
            kw.update(_TINY_GQA, **(tiny or {}))
        config = getattr(transformers, f"{family}Config")(**kw)
        return getattr(transformers, f"{family}ForCausalLM")(config)

    return build


llama_1b = _causal_lm(
    "Llama",
    dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        max_position_embeddings=2048,
    ),
    16,
    {"head_dim": 16},
)
_granite_8b = _causal_lm(
    "Granite",
    dict(
        hidden_size=4096,
        intermediate_size=12800,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=49159,
        max_position_embeddings=4096,
    ),
    2,
)


def _vit(layers: int | None, tiny: bool) -> Any:
    """ViT-base/16 at 224x224 with an ImageNet head (1000 classes), random weights."""
    from transformers import ViTConfig, ViTForImageClassification

    kw: dict[str, Any] = {"num_hidden_layers": layers or 12, "num_labels": 1000}
    if tiny:
        kw.update(
            hidden_size=64,
            num_attention_heads=4,
            intermediate_size=128,
            image_size=IMAGE_SIZES["vit-base"][1],
            patch_size=8,
            num_labels=10,
        )
    return ViTForImageClassification(ViTConfig(**kw))


def _resnet(layers: int | None, tiny: bool) -> Any:
    """ResNet-50 (bottleneck blocks, depths 3-4-6-3) with an ImageNet head, random weights;
    ``layers`` caps every stage's depth at that many blocks; ``tiny`` keeps the first two stages,
    narrowed."""
    from transformers import ResNetConfig, ResNetForImageClassification

    depths = [min(d, layers or d) for d in (3, 4, 6, 3)]
    kw: dict[str, Any] = dict(
        layer_type="bottleneck",
        depths=depths,
        hidden_sizes=[256, 512, 1024, 2048],
        embedding_size=64,
        num_labels=1000,
    )
    if tiny:
        kw.update(depths=depths[:2], hidden_sizes=[32, 64], embedding_size=16, num_labels=10)
    return ResNetForImageClassification(ResNetConfig(**kw))


#: the vision models' square input images, (full, tiny) pixels a side; the others take tokens
IMAGE_SIZES: dict[str, tuple[int, int]] = {"vit-base": (224, 32), "resnet-50": (224, 32)}

#: name -> builder(layers, tiny); Granite-3.3-8B is truncated to 2 layers by default
MODELS: dict[str, Callable[[int | None, bool], Any]] = {
    "gpt2-small": _gpt2,
    "bert-base": _bert,
    "llama-3.2-1b": llama_1b,
    "granite-3.3-8b-2l": _granite_8b,
    "vit-base": _vit,
    "resnet-50": _resnet,
}


def _example(name: str, model: Any, seq: int, tiny: bool) -> torch.Tensor:
    """The model's input at batch 1: ``seq`` random token ids, or a random fp32 image of
    :data:`IMAGE_SIZES` (its tiny size with ``tiny``) for a vision model."""
    gen = torch.Generator().manual_seed(0)
    if name in IMAGE_SIZES:
        side = IMAGE_SIZES[name][1 if tiny else 0]
        return torch.randn(1, model.config.num_channels, side, side, generator=gen)
    return torch.randint(0, model.config.vocab_size, (1, seq), generator=gen)


def _depth(config: Any) -> int:
    """Transformer layers, or a ResNet's residual blocks."""
    return int(getattr(config, "num_hidden_layers", None) or sum(config.depths))


def _gpt2_eqx(layers: int | None, tiny: bool) -> tuple[eqx_gpt2.GPT2, eqx_gpt2.GPT2Config]:
    kw: dict[str, Any] = {"n_layer": layers or 12}
    if tiny:
        kw.update(n_embd=64, n_head=2, vocab_size=1000, n_positions=256)
    cfg = eqx_gpt2.GPT2Config(**kw)
    return eqx_gpt2.GPT2(cfg, key=jax.random.PRNGKey(0)), cfg


#: name -> builder(layers, tiny) -> (equinox module, config); run through ``spyre_jax.jit``
JAX_MODELS: dict[str, Callable[[int | None, bool], Any]] = {"gpt2-small-eqx": _gpt2_eqx}


def _logits(out: Any) -> torch.Tensor:
    """The logits as the model returned them (their dtype: a wider copy inside the measured
    block would count as the simulation's memory)."""
    t = out.logits if hasattr(out, "logits") else out[0]
    return t.detach()


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _rss_now() -> int:
    with open("/proc/self/statm") as fh:  # Linux: pages
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int | None:
    """The kernel's record of this process's peak resident memory since it was last reset
    (``VmHWM``), or None where there is none (not Linux)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    """Reset the kernel's peak-RSS record to the current RSS (Linux: ``clear_refs`` 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


class _PeakRSS:
    """The peak resident memory while the block runs, above what it was when it began: what the
    simulation adds to the host. Exact where the kernel keeps the peak and lets it be reset
    (Linux's ``VmHWM``); otherwise sampled every 20 ms by a thread (which can miss a short peak
    taken while another thread holds the GIL)."""

    def __enter__(self) -> _PeakRSS:
        import gc
        import threading

        gc.collect()
        self.base = self.peak = _rss_now()
        self.before = _rss_bytes()  # the process's peak so far: a reset below forgets it
        self._exact = _reset_hwm() and _hwm_bytes() is not None
        self._stop = threading.Event()

        def sample() -> None:
            while not self._stop.wait(0.02):
                self.peak = max(self.peak, _rss_now())

        self._t = threading.Thread(target=sample, daemon=True)
        if not self._exact:
            self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._exact:
            self.peak = max(self.peak, _hwm_bytes() or 0)
            return
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss_now())

    @property
    def added(self) -> int:
        return self.peak - self.base


def run_one(name: str, *, layers: int | None, tiny: bool, seq: int, reps: int) -> dict[str, Any]:
    """One model, in this process: the figures :func:`bench_models` reports."""
    if name in JAX_MODELS:
        return _run_one_jax(name, layers=layers, tiny=tiny, seq=seq, reps=reps)
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = MODELS[name](layers, tiny).eval()
    ids = _example(name, model, seq, tiny)
    params = sum(p.numel() for p in model.parameters())
    res: dict[str, Any] = {"params": params, "layers": _depth(model.config)}
    with torch.no_grad():
        want = _logits(model(ids))
        t = time.perf_counter()
        for _ in range(reps):
            model(ids)
        res["eager_cpu_s"] = (time.perf_counter() - t) / reps
        model = model.half()
        ids = ids.half() if ids.is_floating_point() else ids  # an image goes in as fp16
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        res["runtime_warmup_bytes"] = _warm_up(lambda: _warm_torch(name, seq))
        tb.reset_fallback_stats()
        compiled = torch.compile(model, backend="spyre", dynamic=False)
        with _PeakRSS() as mem:
            t = time.perf_counter()
            got = _logits(compiled(ids))
            res["cold_compile_s"] = time.perf_counter() - t
            t = time.perf_counter()
            for _ in range(reps):
                compiled(ids)
            res["sim_wall_s"] = (time.perf_counter() - t) / reps
    costs = [k.cost_analysis() for k in tb.compiled_kernels()]
    res.update(_memory(model_bytes, mem.added, tk.resident_stats()["bytes"]))
    g, w = got.double().flatten(), want.double().flatten()
    res.update(
        sim_prefill_us=sum(c["sim_time_us"] for c in costs),
        # weights re-laid out once for their matmuls (a convolution's kernel), not per call
        weight_layouts_us=sum(c.get("weight_layouts_us", 0.0) for c in costs),
        kernels=len(costs),
        scratchpad_peak_bytes=max((c["scratchpad_peak_bytes"] for c in costs), default=0),
        device_memory_peak_bytes=runtime().memory.stats()["peak_bytes_in_use"],
        host_peak_rss_bytes=max(_rss_bytes(), mem.before),
        fallbacks=sum(tb.fallback_stats().values()),
        cosine=float(torch.dot(g, w) / (g.norm() * w.norm())),
        max_abs_err=float((g - w).abs().max()),
        logits_abs_max=float(w.abs().max()),
    )
    res["sim_over_eager"] = res["sim_wall_s"] / res["eager_cpu_s"]
    res["compile_s"] = res["cold_compile_s"] - res["sim_wall_s"]
    return res


def _warm_torch(name: str, seq: int) -> None:
    model = MODELS[name](1, True).eval().half()
    ids = _example(name, model, seq, True)
    ids = ids.half() if ids.is_floating_point() else ids
    with torch.no_grad():
        torch.compile(model, backend="spyre", dynamic=False)(ids)


def _warm_jax(name: str, seq: int) -> None:
    model, cfg = JAX_MODELS[name](1, True)
    ids = jnp.zeros((1, seq), jnp.int32)
    np.asarray(spyre_jax.jit(eqx_gpt2.forward)(eqx_gpt2.cast(model, jnp.float16), ids))


def _warm_up(run: Callable[[], None]) -> int:
    """Run a one-layer, narrow model of the same family through the same path first, then forget
    it (its kernels, Dynamo's graphs, XLA's programs): what stays is the runtime's own fixed
    cost (XLA's compiler and libraries paged in, thread pools), the same for every model. The
    host memory figures below are then the model's. Returns that fixed cost in bytes."""
    import gc

    before = _rss_now()
    run()
    torch._dynamo.reset()
    jax.clear_caches()
    gc.collect()
    program.release_free_memory()
    return _rss_now() - before


def _memory(model_bytes: int, added: int, weights_on_card: int) -> dict[str, Any]:
    """The model's own bytes (fp16 weights), what the simulation added to the host's resident
    memory while it compiled and ran (device memory's payloads, activations, compiled programs)
    and the host's total over the model's bytes; the activations (the device-memory peak less
    the weights there) and the goal ``1.5 x model + activations`` with the host over it."""
    peak = runtime().memory.stats()["peak_bytes_in_use"]
    activations = max(0, peak - weights_on_card)
    bound = 1.5 * model_bytes + activations
    return {
        "model_bytes": model_bytes,
        "sim_host_added_bytes": added,
        "host_over_model": (model_bytes + added) / model_bytes,
        "activation_bytes": activations,
        "host_over_goal": (model_bytes + added) / bound,
    }


def _run_one_jax(
    name: str, *, layers: int | None, tiny: bool, seq: int, reps: int
) -> dict[str, Any]:
    """An equinox model: fp32 ``jax.jit`` on the CPU vs fp16 ``spyre_jax.jit``, the same figures."""
    model, cfg = JAX_MODELS[name](layers, tiny)
    ids = jax.random.randint(jax.random.PRNGKey(0), (1, seq), 0, cfg.vocab_size, jnp.int32)
    res: dict[str, Any] = {"params": eqx_gpt2.param_count(model), "layers": cfg.n_layer}
    ref = jax.jit(eqx_gpt2.forward)
    want = np.asarray(ref(model, ids), dtype=np.float64)  # XLA's compile, then the reference
    t = time.perf_counter()
    for _ in range(reps):
        np.asarray(ref(model, ids))
    res["eager_cpu_s"] = (time.perf_counter() - t) / reps
    half = eqx_gpt2.cast(model, jnp.float16)
    del model
    model_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(half) if eqx.is_array(a))
    res["runtime_warmup_bytes"] = _warm_up(lambda: _warm_jax(name, seq))
    f = spyre_jax.jit(eqx_gpt2.forward)
    with _PeakRSS() as mem:
        t = time.perf_counter()
        on_card = jax.tree_util.tree_map(
            lambda a: spyre_jax.device_put(a) if eqx.is_array(a) else a, half
        )
        del half  # the weights now live on the card only
        compiled = f.lower(on_card, ids).compile()  # cached: the call below does not retrace
        got = np.asarray(f(on_card, ids))  # widened below, outside the measured block
        res["cold_compile_s"] = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(reps):
            np.asarray(f(on_card, ids))
        res["sim_wall_s"] = (time.perf_counter() - t) / reps
    # the host copy of the weights was freed once they were on the card: count them once
    res.update(_memory(model_bytes, max(0, mem.added), model_bytes))
    cost = compiled.cost_analysis()
    g, w = got.astype(np.float64).ravel(), want.ravel()
    res.update(
        sim_prefill_us=cost["sim_time_us"],
        kernels=1,
        scratchpad_peak_bytes=cost["scratchpad_peak_bytes"],
        device_memory_peak_bytes=runtime().memory.stats()["peak_bytes_in_use"],
        host_peak_rss_bytes=max(_rss_bytes(), mem.before),
        fallbacks=0,  # spyre_jax.jit has no CPU fallback: a primitive with no rule raises
        cosine=float(g @ w / (np.linalg.norm(g) * np.linalg.norm(w))),
        max_abs_err=float(np.abs(g - w).max()),
        logits_abs_max=float(np.abs(w).max()),
    )
    res["sim_over_eager"] = res["sim_wall_s"] / res["eager_cpu_s"]
    res["compile_s"] = res["cold_compile_s"] - res["sim_wall_s"]
    return res


def bench_models(
    names: list[str] | None = None,
    *,
    layers: int | None = None,
    tiny: bool = False,
    seq: int = 128,
    reps: int = 1,
    timeout_s: float = 3600.0,
) -> dict[str, dict[str, Any]]:
    """Every model of :data:`MODELS` and :data:`JAX_MODELS` (or ``names``), each in a fresh
    subprocess."""
    known = [*MODELS, *JAX_MODELS]
    out: dict[str, dict[str, Any]] = {}
    for name in names or known:
        if name not in known:
            raise ValueError(f"bench models: unknown model {name!r}; known: {', '.join(known)}")
        cmd = [sys.executable, "-m", "spyre_jax.tools.bench_models", name, str(seq), str(reps)]
        cmd += [str(layers or 0), "1" if tiny else "0"]
        t = time.perf_counter()
        try:
            p = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout_s, env=dict(os.environ)
            )
        except subprocess.TimeoutExpired:
            out[name] = {"error": f"timed out after {timeout_s:.0f} s"}
            continue
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not lines:
            out[name] = {"error": _error_line(p.stderr), "wall_s": time.perf_counter() - t}
        else:
            out[name] = json.loads(lines[-1])
    return out


def _error_line(stderr: str) -> str:
    """The exception line of a failed run's stderr (Dynamo appends hints after it)."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Failed")) and " " not in head:
            return ln[:300]
    return (lines or ["(no output)"])[-1][:300]


def format_models(res: dict[str, dict[str, Any]]) -> str:
    """A table of :func:`bench_models`' result."""
    cols = (
        ("params", "params", "{:,.0f}"),
        ("1st call s", "cold_compile_s", "{:.1f}"),
        ("compile s", "compile_s", "{:.1f}"),
        ("prefill us", "sim_prefill_us", "{:.0f}"),
        ("sim s", "sim_wall_s", "{:.2f}"),
        ("eager s", "eager_cpu_s", "{:.3f}"),
        ("ratio", "sim_over_eager", "{:.1f}"),
        ("scratchpad", "scratchpad_peak_bytes", "{:,.0f}"),
        ("device mem", "device_memory_peak_bytes", "{:,.0f}"),
        ("host RSS", "host_peak_rss_bytes", "{:,.0f}"),
        ("host/model", "host_over_model", "{:.2f}"),
        ("host/goal", "host_over_goal", "{:.2f}"),
        ("fallbacks", "fallbacks", "{}"),
        ("cosine", "cosine", "{:.5f}"),
        ("max err", "max_abs_err", "{:.3g}"),
    )
    return format_table(res, cols)


def format_table(
    res: dict[str, dict[str, Any]], cols: tuple[tuple[str, str, str], ...], width: int = 14
) -> str:
    """One row per model: ``cols`` are (heading, key, format); a failed model shows its error."""
    lines = ["model".ljust(20) + "".join(h.rjust(width) for h, _, _ in cols)]
    for name, r in res.items():
        if "error" in r:
            lines.append(f"{name:<20}  error: {r['error']}")
            continue
        lines.append(f"{name:<20}" + "".join(f.format(r[k]).rjust(width) for _, k, f in cols))
    return "\n".join(lines)


if __name__ == "__main__":  # one model in a subprocess: prints its figures as one JSON line
    _name, _seq, _reps, _layers, _tiny = sys.argv[1:6]
    _res = run_one(
        _name, layers=int(_layers) or None, tiny=_tiny == "1", seq=int(_seq), reps=int(_reps)
    )
    print(json.dumps({k: (float(v) if isinstance(v, np.floating) else v) for k, v in _res.items()}))

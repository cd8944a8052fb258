"""Real model configurations end to end, fp16/bf16 on the card against fp32 on the CPU.

The models of ``spyre-jax bench models`` (``spyre_jax.tools.bench_models``: GPT-2 small,
BERT-base, Llama-3.2-1B, Granite-3.3-8B, all from their ``transformers`` configurations with
random weights) and GPT-2 small as an equinox module (``spyre_jax.tools.eqx_gpt2``), shortened
for CI: FULL widths, heads and vocabularies (GPT-2's 50257-row and Llama's 128256-row tied LM
heads, Granite's 4096-wide attention with 8 KV heads and 12800-wide MLP), one layer each, a
32-token prompt. The benchmark runs the full depths (``spyre-jax bench models``).

Each model runs once in fp32 on the CPU (the reference) and once in fp16 or bf16 on the card:
through ``torch.compile(backend="spyre", fullgraph=True)`` (one Dynamo graph, so no Python-level
graph break runs anything eagerly on the CPU either), eagerly on the ``spyre`` device, or
through ``spyre_jax.jit``. A CPU fallback is an error (``SpyreFallbackWarning`` raised, and the
counters checked). The figure of merit is the cosine similarity of the logits in float64:

- fp16 (11 significant bits, unit roundoff u = 2^-11 ~ 4.9e-4): every stored intermediate is
  rounded once, the card computes in fp32 in between. Measured cosines are 0.99999+; 0.999
  (the issue's bar) leaves a wide margin.
- bf16 (8 significant bits, u = 2^-8 ~ 3.9e-3, 8x fp16's): with relative rms error e of the
  logits (orthogonal to them), cosine ~ 1 - e^2 / 2, so 0.999 allows e up to ~4.5%. One rounding
  is ~u/sqrt(3) ~ 0.23% rms; a one-layer model's few dozen roundings in a chain, growing like
  sqrt(n), stay near 1%. Measured 0.99997 (GPT-2 small, vocab 50257); 0.999 holds and is kept.

Durations on a 2-core CPU (``--durations=0``) are noted at each test; the file's total is what
the CI budget is sized for, so prompts are short and layers few.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import spyre_jax
import torch_bridge.device as dev
from spyre_jax.tools import eqx_gpt2
from spyre_jax.tools.bench_models import MODELS
from torch_bridge import backend as tb

pytestmark = pytest.mark.filterwarnings("error::torch_bridge.errors.SpyreFallbackWarning")

SEQ = 32
MIN_COSINE = 0.999


@pytest.fixture(autouse=True)
def _release() -> Iterator[None]:
    # each model's weights (hundreds of MB to GBs, host and simulated device memory) and its
    # compiled kernel go before the next model is built
    torch._dynamo.reset()
    tb.reset_fallback_stats()
    dev.reset_stats()
    yield
    torch._dynamo.reset()
    tb.reset_fallback_stats()
    gc.collect()


def _build(name: str) -> tuple[Any, torch.Tensor]:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = MODELS[name](1, False).eval()
    ids = torch.randint(
        0, model.config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0)
    )
    return model, ids


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]


def _compare(got: Any, want: Any) -> tuple[float, float]:
    """Cosine similarity (float64) and max abs error of two logit arrays; both finite."""
    g = torch.as_tensor(np.asarray(got, dtype=np.float64)).flatten()
    w = torch.as_tensor(np.asarray(want, dtype=np.float64)).flatten()
    assert g.shape == w.shape
    assert torch.isfinite(g).all(), "non-finite logits on the card"
    cos = float(torch.dot(g, w) / (g.norm() * w.norm()))
    err = float((g - w).abs().max())
    print(f"cosine {cos:.7f}  max abs err {err:.4g}  logits abs max {float(w.abs().max()):.4g}")
    return cos, err


def _compiled_vs_fp32(name: str, dtype: torch.dtype) -> None:
    model, ids = _build(name)
    with torch.no_grad():
        want = _logits(model(ids)).double()
        model = model.to(dtype)  # model.half() for fp16
        compiled = torch.compile(model, backend="spyre", dynamic=False, fullgraph=True)
        got = _logits(compiled(ids))
    assert got.dtype == dtype and got.shape == want.shape
    assert tb.fallback_stats() == {}, tb.fallback_stats()
    stats = tb.compile_stats()
    assert stats["graphs"] == 1 and stats["kernels"] == 1, stats  # the whole model: one kernel
    (kernel,) = tb.compiled_kernels()
    assert kernel.cost_analysis()["sim_time_us"] > 0
    cos, _ = _compare(got.float().numpy(), want.numpy())
    assert cos >= MIN_COSINE, cos


# ---------------------------------------------------------------------------------------------
# torch.compile(backend="spyre"), fp16 (model.half())


@pytest.mark.slow
def test_gpt2_small_fp16():
    # 12 heads x 64, 768 wide, vocab 50257 tied LM head; ~14 s here
    _compiled_vs_fp32("gpt2-small", torch.float16)


def test_bert_base_fp16():
    # 768 wide, 12 heads, intermediate 3072, vocab 30522 (embeddings; the output is the hidden
    # state); ~5 s here
    _compiled_vs_fp32("bert-base", torch.float16)


@pytest.mark.slow
def test_llama_3_2_1b_fp16():
    # 2048 wide, 32 heads x 64 with 8 KV heads (GQA), intermediate 8192, RoPE theta 5e5, vocab
    # 128256 tied to the embedding: the LM head (128256 x 2048) dominates; ~25 s here
    _compiled_vs_fp32("llama-3.2-1b", torch.float16)


@pytest.mark.slow
def test_granite_3_3_8b_one_layer_fp16():
    # Granite-3.3-8B at full width (4096, 32 heads x 128, 8 KV heads, intermediate 12800, vocab
    # 49159) truncated to ONE layer, not the benchmark's two: one layer already holds every op
    # and every shape of the model (~600M parameters here, 1.2 GB of fp16 on the card); a second
    # identical layer reuses the first one's stage programs, so it tests nothing new, and would
    # add ~200M parameters (0.8 GB of fp32 host memory for the reference, ~3 s to initialise,
    # ~2 s of simulation). ~26 s here (builds ~5-10 s of it: initialising 600M random weights)
    _compiled_vs_fp32("granite-3.3-8b-2l", torch.float16)


# ---------------------------------------------------------------------------------------------
# bf16 (model.to(torch.bfloat16)), on the spyre device


@pytest.mark.slow
def test_gpt2_small_bf16_on_the_spyre_device():
    # model.to("spyre"): weights in the card's device memory, every op a one-op graph on the
    # card (no torch.compile); bf16, the dtype most checkpoints ship in. ~10 s here
    model, ids = _build("gpt2-small")
    with torch.no_grad():
        want = _logits(model(ids)).double()
        model = model.to(torch.bfloat16).to("spyre")
        got = _logits(model(ids.to("spyre")))
    assert got.device.type == "spyre" and got.dtype == torch.bfloat16
    assert dev.fallback_stats() == {}, dev.fallback_stats()
    assert dev.eager_stats()["cpu_fallbacks"] == 0
    cos, _ = _compare(got.cpu().float().numpy(), want.numpy())
    assert cos >= MIN_COSINE, cos


# ---------------------------------------------------------------------------------------------
# equinox through spyre_jax.jit, fp16


@pytest.mark.slow
def test_gpt2_small_equinox_fp16():
    # GPT-2 small as an equinox module, fp32 jax.jit on the CPU vs fp16 spyre_jax.jit; ~15 s here
    cfg = eqx_gpt2.GPT2Config(n_layer=1)
    model = eqx_gpt2.GPT2(cfg, key=jax.random.PRNGKey(0))
    ids = jax.random.randint(jax.random.PRNGKey(1), (1, SEQ), 0, cfg.vocab_size, jnp.int32)
    want = np.asarray(jax.jit(eqx_gpt2.forward)(model, ids))
    half = eqx_gpt2.cast(model, jnp.float16)
    del model
    f = spyre_jax.jit(eqx_gpt2.forward)
    got = f(half, ids)
    assert isinstance(got, spyre_jax.Array)
    assert got.shape == (1, SEQ, cfg.vocab_size) and got.dtype == jnp.float16
    assert f.trace_count == 1
    cos, _ = _compare(np.asarray(got).astype(np.float32), want)
    assert cos >= MIN_COSINE, cos

"""Graphs of symbolic sizes through ``torch.compile(backend="spyre")``: a static kernel per size.

Dynamo makes a size symbolic when it changes between calls (a serving loop), with
``dynamic=True`` or ``torch._dynamo.mark_dynamic``; the backend then gets ``SymInt`` inputs.
``torch_bridge.dynamic.DynamicGraph`` specializes such a graph to each concrete size it is
called with and caches the kernel.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spyre_jax.tools.testing import assert_close
from torch_bridge import backend as tb
from torch_bridge.dynamic import DynamicGraph, is_dynamic

# fp32 on the card: fp32 products and sums, in another order than the CPU's; the oracle's
# one-op fp32 tolerance (spyre_jax.tools.testing) holds


def _dynamic_graphs() -> list[DynamicGraph]:
    return [g for r in tb._dynamic if (g := r()) is not None]


def _attention(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # sizes used as numbers too: the mean over rows, a view by the row count, positions
    q = x @ w
    s = F.softmax(q @ x.transpose(0, 1) / x.shape[-1] ** 0.5, dim=-1)
    pos = torch.arange(x.shape[0], dtype=x.dtype)[:, None]
    y = (s @ x + pos).view(x.shape[0] * 2, -1)
    return y - y.mean(dim=0, keepdim=True)


@pytest.mark.slow
def test_dynamic_true_compiles_one_kernel_per_size_and_reuses_it():
    torch._dynamo.reset()
    tb.reset_fallback_stats()
    w = torch.randn(64, 64) / 8
    f = torch.compile(_attention, backend="spyre", dynamic=True)
    with torch.no_grad():
        for n in (5, 9, 5, 17, 9):
            x = torch.randn(n, 64)
            assert_close(f(x, w), _attention(x, w))
    graphs = _dynamic_graphs()
    assert len(graphs) == 1 and is_dynamic(graphs[0].gm)
    assert graphs[0].compiles == 3  # 5, 9 and 17: the repeated sizes reuse their kernels
    assert tb.fallback_stats() == {}


def test_a_size_that_changes_between_calls_becomes_symbolic():
    torch._dynamo.reset()
    tb.reset_fallback_stats()
    w = torch.randn(64, 64) / 8
    f = torch.compile(_attention, backend="spyre")  # Dynamo's default: dynamic on a change
    with torch.no_grad():
        for n in (4, 6, 8):
            x = torch.randn(n, 64)
            assert_close(f(x, w), _attention(x, w))
    assert len(_dynamic_graphs()) == 1


def test_mark_dynamic_on_a_spyre_tensor():
    torch._dynamo.reset()
    w = torch.randn(64, 64) / 8

    def f(x):
        return torch.tanh(x @ w.to(x.device)).sum(dim=0)

    g = torch.compile(f, backend="spyre")
    with torch.no_grad():
        for n in (3, 7):
            x = torch.randn(n, 64)
            xs = x.to("spyre")
            torch._dynamo.mark_dynamic(xs, 0)
            got = g(xs)
            assert got.device.type == "spyre"
            assert_close(got, f(x))


def tiny_causal_lm(kind: str = "llama"):
    """A one-layer causal LM of width 64 from ``transformers`` (random weights): ``llama``,
    ``qwen2`` or ``gpt2``; with fresh Dynamo and backend counters."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch._dynamo.reset()
    tb.reset_fallback_stats()
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=300)
        return transformers.GPT2LMHeadModel(cfg).eval()
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
    )
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()


def generate_counting_compiles(model, lengths: tuple[int, ...], seed: int, **kw) -> list[int]:
    """Greedy decoding of a prompt of each length, eagerly on the CPU and then with
    ``model.forward`` compiled for the card: the tokens must be equal; the graphs each prompt
    compiled."""
    gen = torch.Generator().manual_seed(seed)
    kw = dict(do_sample=False, **kw)
    counts = []
    with torch.no_grad():
        prompts = [torch.randint(0, 300, (1, n), generator=gen) for n in lengths]
        want = [model.generate(p, **kw) for p in prompts]
        model.forward = torch.compile(model.forward, backend="spyre")
        for p, w in zip(prompts, want, strict=True):
            before = tb.compile_stats()["graphs"]
            assert torch.equal(model.generate(p, **kw), w)
            counts.append(tb.compile_stats()["graphs"] - before)
    return counts


@pytest.mark.slow
def test_generate_with_the_dynamic_cache_gives_eager_tokens():
    # regression: the second decode step failed with "graph input sym_size_int_1 is not a
    # tensor" (Dynamo marks the KV length dynamic)
    model = tiny_causal_lm()
    ids = torch.randint(0, 300, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=5, do_sample=False)
        model.forward = torch.compile(model.forward, backend="spyre")
        got = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, want), (got, want)
    assert _dynamic_graphs(), "the decode steps never reached a graph of symbolic sizes"
    assert tb.fallback_stats() == {}


@pytest.mark.slow
def test_a_second_prompt_length_compiles_at_most_two_kernels():
    # the static KV cache: a prompt of a new length needs its prefill kernel and, since the
    # cache is sized prompt + new tokens, the decode kernel of that cache; nothing per step
    model = tiny_causal_lm()
    kw = dict(max_new_tokens=6, cache_implementation="static")
    counts = generate_counting_compiles(model, (7, 11), seed=2, **kw)
    assert counts[0] == 2 and counts[1] <= 2, counts
    assert tb.fallback_stats() == {}


def test_random_ops_are_not_folded_into_constants():
    # arithmetic on the sizes folds into constants; a random draw of a size-only shape must not
    # (each call draws anew)
    torch._dynamo.reset()

    def f(x):
        return x + torch.rand(x.shape[0], x.shape[1])

    g = torch.compile(f, backend="spyre", dynamic=True)
    x = torch.zeros(5, 64)
    with torch.no_grad():
        a, b = g(x), g(x)
    assert a.shape == (5, 64) and not torch.equal(a, b)
    assert float(a.min()) >= 0.0 and float(a.max()) < 1.0

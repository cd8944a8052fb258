"""Compiled graphs of symbolic sizes padded to size buckets (``torch_bridge.padded``).

One kernel serves every size in a bucket (64 up to 64, then powers of two). The padding is
masked wherever an op would mix it into a result: reductions, softmax, contractions, ``cat`` at
runtime offsets, slices counted from the runtime end. Each case is compared with eager CPU at
sizes inside and across buckets.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_dynamic_shapes import generate_counting_compiles, tiny_causal_lm

from spyre_jax.tools.testing import assert_close, assert_tree_close
from torch_bridge import backend as tb
from torch_bridge.dynamic import DynamicGraph

# fp32 on the card: fp32 products and sums in another order than the CPU's; the oracle's
# one-op fp32 tolerance (spyre_jax.tools.testing) holds


def _graphs() -> list[DynamicGraph]:
    return [g for r in tb._dynamic if (g := r()) is not None]


def _mixing(x: torch.Tensor, w: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # every op that mixes positions along the dynamic length n (x: (n, 64), kv: (m, 64))
    keys = torch.cat([kv, x], dim=0)  # a padded piece first: the new rows at a runtime offset
    att = F.softmax(x @ keys.T / 8.0, dim=-1)  # softmax over n + m padded keys
    ctx = att @ keys  # contraction over the padded keys
    pooled = (x @ w).sum(dim=0) + x.amax(dim=0) - x.amin(dim=0)
    stats = x.mean(dim=0) + x.var(dim=0) + torch.logsumexp(x, dim=0)
    last = ctx[-1] + x[-2:].sum(dim=0) + ctx[:, :3].sum()
    return ctx * 0.5, pooled + stats + last, (x > 0).any(dim=0) & (x < 2).all(dim=0)


def _check(f, x, w, kv) -> None:
    got = f(x, w, kv)
    want = _mixing(x, w, kv)
    assert_tree_close(got, want)


@pytest.fixture
def mixing():
    torch._dynamo.reset()
    tb.reset_fallback_stats()
    return torch.compile(_mixing, backend="spyre", dynamic=True)


@pytest.mark.slow
def test_one_kernel_per_bucket_and_masked_results(mixing):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=gen) / 8
    with torch.no_grad():
        for n, m in ((5, 3), (9, 20), (33, 7), (60, 2), (65, 3), (100, 27), (5, 3)):
            x = torch.randn(n, 64, generator=gen)
            kv = torch.randn(m, 64, generator=gen)
            _check(mixing, x, w, kv)
    (g,) = _graphs()
    assert g.bucketed is True, g.reason
    # buckets (n, m): (64, 64) for the first four calls, then (128, 64); the repeat reuses
    # (sizes equal to each other, to 64 or to 1 would be specialized by Dynamo: none here)
    assert g.compiles == 2
    assert g.padded_calls == 7
    assert tb.fallback_stats() == {}


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(n=st.integers(2, 150), m=st.integers(2, 40), seed=st.integers(0, 2**16))
@pytest.mark.slow
def test_masking_property_any_sizes(mixing, n, m, seed):
    # any sizes inside any bucket give the CPU's results: padding never leaks into a result
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 64, generator=gen) / 8
    with torch.no_grad():
        _check(mixing, torch.randn(n, 64, generator=gen), w, torch.randn(m, 64, generator=gen))


def test_padding_is_counted_in_cost_analysis():
    torch._dynamo.reset()
    tb.reset_fallback_stats()
    w = torch.randn(64, 64) / 8

    def f(x):
        return (x * 2.0) @ w

    g = torch.compile(f, backend="spyre", dynamic=True)
    with torch.no_grad():
        x = torch.randn(5, 64)
        assert_close(g(x), f(x))
    (dyn,) = _graphs()
    cost = dyn.cost_analysis()
    # x is padded from 5 to 64 rows on the way in and the result cropped on the way out
    assert cost["padding_bytes"] == 2 * (64 - 5) * 64 * 4
    # the product's and the scaling's work on the 59 padded rows
    assert cost["padding_flops"] == 2 * (64 - 5) * 64 * 64 + (64 - 5) * 64
    assert cost["bucket"][0] == 64 and "sim_time_us" in cost
    assert dyn.padding_bytes == cost["padding_bytes"]


def test_a_view_that_interleaves_padding_runs_per_exact_size():
    # (n, 64) viewed as (2n, 32) puts the 64-wide rows' halves on separate rows: with dynamic=True
    # the width is symbolic too, and no bucket layout keeps the padding at the end; the graph
    # falls back to a kernel per size and says why
    torch._dynamo.reset()
    tb.reset_fallback_stats()

    def f(x):
        return x.view(x.shape[0] * 2, -1).softmax(dim=0)

    g = torch.compile(f, backend="spyre", dynamic=True)
    with torch.no_grad():
        for n in (3, 6):
            x = torch.randn(n, 64)
            assert_close(g(x), f(x))
    (dyn,) = _graphs()
    assert dyn.bucketed is False and "view" in dyn.reason
    assert dyn.compiles == 2


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
@pytest.mark.slow
def test_generate_64_tokens_with_the_dynamic_cache(kind):
    # greedy decoding through torch.compile with transformers' default (dynamic) KV cache: the
    # tokens of eager CPU; decode steps share one kernel per bucket of the KV length, and a
    # second prompt of another length compiles at most two new graphs
    model = tiny_causal_lm(kind)
    counts = generate_counting_compiles(model, (7, 11), seed=1, max_new_tokens=64)
    assert counts[1] <= 2, counts
    graphs = _graphs()
    assert graphs and all(g.bucketed for g in graphs), [g.reason for g in graphs]
    assert sum(g.padded_calls for g in graphs) >= 2 * 63
    assert tb.fallback_stats() == {}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
@pytest.mark.slow
def test_generate_64_tokens_with_the_static_cache(kind):
    model = tiny_causal_lm(kind)
    generate_counting_compiles(
        model, (9,), seed=3, max_new_tokens=64, cache_implementation="static"
    )
    assert tb.fallback_stats() == {}

"""Size buckets for eager one-op kernels (torch_bridge.buckets): a dimension that keeps changing
runs padded to its bucket, one kernel per bucket, and the padding never changes a result."""

from __future__ import annotations

import pytest
import torch

import spyre_jax  # noqa: F401  (the device)
from torch_bridge import buckets, eager


@pytest.fixture(autouse=True)
def _fresh():
    buckets.reset()
    yield
    buckets.reset()


def _compiles() -> int:
    return eager.stats()["compiles"]


def test_the_bucket_rule():
    assert [buckets.bucket(n) for n in (1, 9, 64, 65, 100, 128, 129, 1000)] == [
        64,
        64,
        64,
        128,
        128,
        128,
        256,
        1024,
    ]


def test_a_growing_dimension_compiles_once_per_bucket():
    g = torch.Generator().manual_seed(0)
    before = _compiles()
    for n in range(20, 90, 3):  # 24 sizes over two buckets (64, 128)
        x = torch.randn(2, 3, n, generator=g)
        y = torch.randn(2, 1, n, generator=g)
        got = (x.to("spyre") * y.to("spyre")).cpu()
        torch.testing.assert_close(got, x * y)
    assert _compiles() - before <= 3  # the first size exactly, then buckets 64 and 128


@pytest.mark.parametrize(
    "op",
    [
        lambda t: torch.softmax(t, -1),
        lambda t: torch.log_softmax(t, -1),
        lambda t: t.sum(-1),
        lambda t: t.amax(-1),
        lambda t: t.mean(-1),  # counts its elements: runs at its exact sizes
        lambda t: (t > 0).all(-1),
        lambda t: t.argmax(-1),
    ],
    ids=["softmax", "log_softmax", "sum", "amax", "mean", "all", "argmax"],
)
def test_reductions_over_a_padded_dimension_see_only_real_elements(op):
    g = torch.Generator().manual_seed(1)
    for n in (9, 10, 17, 33):
        x = torch.randn(4, n, generator=g) - 0.5
        got = op(x.to("spyre")).cpu()
        want = op(x)
        if want.dtype.is_floating_point:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got, want)


def test_attention_over_a_growing_kv_cache_matches_the_cpu():
    """Decode: one query against n keys (q @ k^T pads n; attn @ v contracts over it)."""
    g = torch.Generator().manual_seed(2)
    before = _compiles()
    for n in range(5, 40, 2):
        q = torch.randn(4, 1, 16, generator=g)
        k = torch.randn(4, n, 16, generator=g)
        v = torch.randn(4, n, 16, generator=g)
        qs, ks, vs = q.to("spyre"), k.to("spyre"), v.to("spyre")
        s = torch.bmm(qs, ks.transpose(1, 2))
        p = torch.softmax(s, -1)
        got = torch.bmm(p, vs).cpu()
        want = torch.bmm(torch.softmax(torch.bmm(q, k.transpose(1, 2)), -1), v)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert _compiles() - before <= 6  # 3 ops: exactly once, then on bucket 64


def test_an_op_whose_result_padding_would_change_runs_exact():
    for n in (9, 11, 13):
        x = torch.randn(3, n)
        got = torch.cumsum(x.to("spyre"), -1).cpu()
        torch.testing.assert_close(got, torch.cumsum(x, -1), rtol=1e-5, atol=1e-5)

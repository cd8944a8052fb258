"""Writes into a slice of a spyre tensor stay on the card (torch_bridge.view_writes): copy_,
fill_ and in-place ops into ``x[..., a:b]`` give torch's values, and the tensor's contents stay
a result on the card (no host round trip, which ran the lazy trace up to there)."""

from __future__ import annotations

import pytest
import torch

from torch_bridge import storage as st


def _pair(shape=(2, 3, 40), seed=0):
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(shape, generator=g)
    return c, (c.to("spyre") * 1.0)  # a launch's result: pending on the card


def _on_card(t: torch.Tensor) -> bool:
    return st.region(t).pending is not None


@pytest.mark.parametrize(
    "index",
    [
        (..., slice(-1, None)),
        (slice(None), slice(1, 3)),
        (slice(1, 2),),
        (slice(None), slice(None), slice(5, 17)),
    ],
)
def test_fill_and_copy_into_a_slice(index):
    c, s = _pair()
    c[index] = 0
    s[index] = 0
    assert _on_card(s)
    torch.testing.assert_close(s.cpu(), c)
    c, s = _pair()
    v = torch.arange(c[index].shape[-1], dtype=torch.float32)
    c[index] = v  # broadcast over the leading dims
    s[index] = v.to("spyre") * 1.0
    assert _on_card(s)
    torch.testing.assert_close(s.cpu(), c)


def test_a_copy_of_another_dtype_converts_as_torch_does():
    c, s = _pair()
    ci, si = (c * 10).to(torch.int32), (s * 10).to(torch.int32)
    ci[:, 1:2] = c[:, :1] * 7.9  # a conversion: through the host, as before
    si[:, 1:2] = s[:, :1] * 7.9
    torch.testing.assert_close(si.cpu(), ci)
    cb, sb = c > 0, s > 0
    cb[..., -1:] = False
    sb[..., -1:] = False
    assert _on_card(sb)
    torch.testing.assert_close(sb.cpu(), cb)


def test_in_place_ops_into_a_slice():
    c, s = _pair()
    c[:, 1:].masked_fill_(c[:, 1:] > 0.5, -1.0)
    s[:, 1:].masked_fill_(s[:, 1:] > 0.5, -1.0)
    c[..., 3:9].mul_(2)
    s[..., 3:9].mul_(2)
    assert _on_card(s)
    torch.testing.assert_close(s.cpu(), c)


def test_other_views_take_the_host_path_and_stay_right():
    c, s = _pair()
    c.transpose(1, 2)[:, 2:4] = 3.0
    s.transpose(1, 2)[:, 2:4] = 3.0
    c[:, 1:2, 4:6] = -2.0  # two dims sliced
    s[:, 1:2, 4:6] = -2.0
    c[..., ::2] = 1.0  # a step
    s[..., ::2] = 1.0
    torch.testing.assert_close(s.cpu(), c)


def test_top_p_warper_stays_on_the_card():
    from transformers.generation.logits_process import TopPLogitsWarper

    c, s = _pair((1, 300))
    ids = torch.zeros(1, 4, dtype=torch.long)
    want = TopPLogitsWarper(0.9)(ids, c.clone())
    got = TopPLogitsWarper(0.9)(ids.to("spyre"), s)
    assert _on_card(got)
    torch.testing.assert_close(got.cpu(), want)


def test_a_view_of_a_base_given_new_storage_and_a_fill_out_of_range():
    c, s = _pair()
    v = s[:, 1:2]
    s.data = torch.zeros(2, 3, 40).to("spyre") * 1.0  # v still sees the old storage
    v[...] = 5.0
    assert float(s.sum().cpu()) == 0.0
    assert float(v.sum().cpu()) == 5.0 * v.numel()
    h = s.half()[:, 1:]
    with pytest.raises(RuntimeError, match="overflow"):
        torch.zeros(3, dtype=torch.float16)[1:].fill_(1e6)  # torch's own error ...
    with pytest.raises(RuntimeError, match="overflow"):
        h.fill_(1e6)  # ... on the card too


def test_sparse_tensors_are_refused_with_a_type_error_naming_the_op():
    # regression (coverage torch): a sparse tensor moved to spyre reached PyTorch's dispatcher
    # (NotImplementedError for SparseCsrspyre), and a sparse result crashed in copy_()
    from torch_bridge.errors import UnsupportedLayoutError

    csr = torch.eye(3).to_sparse_csr().to("spyre")
    with pytest.raises(UnsupportedLayoutError, match="sparse"):
        torch.sparse.mm(csr, torch.ones(3, 2).to("spyre"))
    with pytest.raises(UnsupportedLayoutError, match="_to_sparse"):
        torch.ones(3, 3).to("spyre").to_sparse()

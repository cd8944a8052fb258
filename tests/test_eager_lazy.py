"""Eager ops on ``spyre`` tensors without waiting for the card: results stay card arrays until
the host needs their bytes, and the host never writes bytes a kernel in flight still reads."""

from __future__ import annotations

import torch

import spyre_jax  # noqa: F401  (the device)
from torch_bridge import eager, storage


def test_a_chain_of_eager_ops_stays_on_the_card_until_the_host_reads_it():
    x = torch.randn(64, 64)
    a = x.to("spyre")
    b = (a * 2 + 1).relu()
    c = b @ a
    assert storage.region(c).pending is not None  # nothing waited for it
    assert storage.region(b).pending is not None
    want = ((x * 2 + 1).relu()) @ x
    torch.testing.assert_close(c.cpu(), want, rtol=1e-5, atol=1e-4)
    assert storage.region(c).pending is None  # the host read it: it has torch's bytes now
    torch.testing.assert_close(b.cpu(), (x * 2 + 1).relu())


def test_a_host_write_waits_for_kernels_reading_the_bytes():
    x = torch.randn(256, 256)
    a = x.to("spyre")
    b = a @ a  # reads a's host bytes
    a.fill_(7.0)  # the host writes them: the read above finishes first
    a.add_(1.0)
    torch.testing.assert_close(b.cpu(), x @ x, rtol=1e-5, atol=1e-3)
    assert bool((a.cpu() == 8.0).all())
    assert not storage.region(a).readers


def test_pending_results_of_every_dtype_convert_as_torch_expects():
    x = torch.arange(12).reshape(3, 4)
    a = x.to("spyre")
    s = a * 3  # int64 on torch's side, int32 on the card
    m = a > 5
    h = (a.half() / 4).to(torch.bfloat16)
    assert s.dtype == torch.int64 and m.dtype == torch.bool and h.dtype == torch.bfloat16
    assert torch.equal(s.cpu(), x * 3)
    assert torch.equal(m.cpu(), x > 5)
    torch.testing.assert_close(h.cpu(), (x.half() / 4).to(torch.bfloat16))
    # views of pending results: a reshape, a transpose, a slice
    y = torch.randn(4, 6).to("spyre") + 0
    torch.testing.assert_close((y.view(6, 4) + 1).cpu(), y.cpu().view(6, 4) + 1)
    torch.testing.assert_close((y.t() * 2).cpu(), y.cpu().t() * 2)
    torch.testing.assert_close((y[1:3, 2:] - 1).cpu(), y.cpu()[1:3, 2:] - 1)


def test_synchronize_waits_for_everything_in_flight():
    a = torch.randn(128, 128).to("spyre")
    outs = [a @ a for _ in range(4)]
    torch.spyre.synchronize()
    assert all(
        storage.region(o).pending is None or storage.region(o).pending[0].is_ready() for o in outs
    )


def test_numbers_of_any_value_share_one_kernel_on_the_fast_path():
    a = torch.randn(8, 8).to("spyre")
    a + 0.5
    before = eager.stats()["compiles"]
    for v in (1.5, 2.5, 3.5):
        torch.testing.assert_close((a + v).cpu(), a.cpu() + v)
    torch.testing.assert_close(torch.add(a, 2.0, alpha=3).cpu(), a.cpu() + 6.0)
    assert eager.stats()["compiles"] - before <= 1  # the alpha= call (kwargs: the general path)

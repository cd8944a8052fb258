"""Eager ops on ``spyre`` tensors without waiting for the card: results stay card arrays until
the host needs their bytes, and the host never writes bytes a kernel in flight still reads."""

from __future__ import annotations

import torch

import spyre_jax  # noqa: F401  (the device)
from spyre_jax.tools.testing import assert_close
from torch_bridge import eager, storage


def test_a_chain_of_eager_ops_stays_on_the_card_until_the_host_reads_it():
    x = torch.randn(64, 64)
    a = x.to("spyre")
    b = (a * 2 + 1).relu()
    c = b @ a
    assert storage.region(c).pending is not None  # nothing waited for it
    assert storage.region(b).pending is not None
    want = ((x * 2 + 1).relu()) @ x
    assert_close(c.cpu(), want)
    assert storage.region(c).pending is None  # the host read it: it has torch's bytes now
    torch.testing.assert_close(b.cpu(), (x * 2 + 1).relu())


def test_a_host_write_waits_for_kernels_reading_the_bytes():
    x = torch.randn(256, 256)
    a = x.to("spyre")
    b = a @ a  # reads a's host bytes
    a.fill_(7.0)  # the host writes them: the read above finishes first
    a.add_(1.0)
    assert_close(b.cpu(), x @ x)
    assert bool((a.cpu() == 8.0).all())
    assert not storage.region(a).buf.has_readers()


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
        storage.region(o).pending is None or storage.region(o).card_value().is_ready() for o in outs
    )


def test_numbers_of_any_value_share_one_kernel_on_the_fast_path():
    a = torch.randn(8, 8).to("spyre")
    a + 0.5
    before = eager.stats()["compiles"]
    for v in (1.5, 2.5, 3.5):
        torch.testing.assert_close((a + v).cpu(), a.cpu() + v)
    torch.testing.assert_close(torch.add(a, 2.0, alpha=3).cpu(), a.cpu() + 6.0)
    assert eager.stats()["compiles"] - before <= 1  # the alpha= call (kwargs: the general path)


def test_a_strided_operand_is_gathered_inside_the_kernel_that_reads_it(monkeypatch):
    from torch_bridge import relayout

    w0, x0 = torch.randn(96, 128), torch.randn(8, 128)
    w, x = w0.to("spyre"), x0.to("spyre")
    calls = []
    gather = relayout.gather_view  # a gather run as a program of its own
    monkeypatch.setattr(relayout, "gather_view", lambda *a: calls.append(a) or gather(*a))
    for _ in range(3):  # the geometry's first use is a host copy; later ones fold into the kernel
        y = x @ w.t()
        z = (x * 2).t() + 1  # a view of a pending result
    assert_close(y.cpu(), x0 @ w0.t())
    torch.testing.assert_close(z.cpu(), (x0 * 2).t() + 1)
    assert not calls  # no separate gather program ran
    plans = [p for p in eager._plans.values() if p.compiled is not None and p.compiled.variants]
    assert plans


def test_a_result_laid_out_by_strides_is_read_without_the_host_waiting():
    x = torch.randn(64, 128)
    a = x.to("spyre")
    for i in range(3):
        r = a.t() * 2  # torch keeps the input's order: strides (1, 128)
        assert r.stride() == (1, 128)
        s = r[:, 1:] + 1  # a strided, offset view of the pending result
        # gathered on the card, not via the host (but for the geometry's first use)
        assert i == 0 or storage.region(r).pending is not None
    torch.testing.assert_close(s.cpu(), x.t()[:, 1:] * 2 + 1)


def test_whole_tensor_copies_and_in_place_results_stay_on_the_card():
    x = torch.randn(64, 64)
    a = x.to("spyre")
    b = torch.empty(64, 64, device="spyre")
    b.copy_(a * 2)
    assert storage.region(b).pending is not None  # took the result as it is
    b.add_(1.0)  # computed on the card, written back without the host
    assert storage.region(b).pending is not None
    v = b.view(4096)  # another view of the same storage sees the new values
    torch.testing.assert_close(v.cpu(), (x * 2 + 1).reshape(4096))
    b[0].copy_(a[1] * 3)  # a part of the storage: through the host, still right
    want = x * 2 + 1
    want[0] = x[1] * 3
    torch.testing.assert_close(b.cpu(), want)
    c = b[1:].clone()
    b.copy_(c.new_zeros(64, 64) + 5)  # the old bytes' readers are unaffected
    torch.testing.assert_close(c.cpu(), want[1:])
    assert bool((b.cpu() == 5).all())

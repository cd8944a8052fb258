"""No crash for a missing kernel: an ATen op on the ``spyre`` device runs on the card, or on the
CPU with a ``SpyreFallbackWarning`` counted in ``fallback_stats()``; never ends in PyTorch's
dispatcher ``NotImplementedError`` (``torch_bridge.overrideable``: the ``*_overrideable`` hooks
of convolution and fused attention; ``torch_bridge.host_kernels``: the RNN cells the CPU has no
kernel for; ``torch_bridge.device``: ``.to("cpu", non_blocking=True)`` and ``record_stream``).

The sweep runs a deterministic sample of PyTorch's OpInfo database on the device and fails on
any dispatcher error; other errors (the card's dtype refusals, PyTorch's own argument checks)
are allowed and listed by :func:`_sweep`."""

from __future__ import annotations

import math
import sys
import types
import unittest
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import torch_rand
from torch.utils._pytree import tree_map

from lowering.from_fx import RULES
from spyre_jax.tools.testing import assert_close
from torch_bridge import device as dev
from torch_bridge import overrideable
from torch_bridge.errors import SpyreFallbackWarning

aten = torch.ops.aten
D = "spyre"


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch_rand(shape, seed=seed)


def _on_device(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``fn()``'s result and the ops its ``SpyreFallbackWarning``s name; every warning is
    counted once in ``fallback_stats()`` (which starts from zero)."""
    dev.reset_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    named = [str(w.message).split()[3] for w in caught if w.category is SpyreFallbackWarning]
    stats = dev.fallback_stats()
    assert sum(stats.values()) == len(named), (stats, named)
    assert {n: named.count(n) for n in named} == stats
    return out, named


def _close(got: Any, want: Any, k: int = 1, chain: int = 1) -> None:
    gl = got if isinstance(got, tuple | list) else [got]
    wl = want if isinstance(want, tuple | list) else [want]
    assert len(gl) == len(wl)
    for g, w in zip(gl, wl, strict=True):
        assert g.device.type == D
        assert_close(g, w, k=k, chain=chain)


# ---------------------------------------------------------------------------------------------
# the functional ops of a small CNN against the CPU

_CONV = aten.convolution.default
_CASES: dict[str, tuple[Callable[..., Any], list[tuple[int, ...]], str | None]] = {
    # name: (fn, input shapes, the op that falls back when the lowering has no rule for it)
    "conv1d": (lambda x, w: F.conv1d(x, w, padding=1), [(2, 3, 8), (4, 3, 3)], "convolution"),
    "conv2d": (
        lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1),
        [(2, 3, 7, 7), (4, 3, 3, 3), (4,)],
        "convolution",
    ),
    "conv2d_groups": (
        lambda x, w: F.conv2d(x, w, groups=2),
        [(1, 4, 5, 5), (6, 2, 3, 3)],
        "convolution",
    ),
    "conv3d": (lambda x, w: F.conv3d(x, w), [(1, 2, 4, 4, 4), (3, 2, 2, 2, 2)], "convolution"),
    "conv_transpose1d": (
        lambda x, w: F.conv_transpose1d(x, w, stride=2),
        [(1, 2, 5), (2, 3, 3)],
        "convolution",
    ),
    "conv_transpose2d": (
        lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, output_padding=1),
        [(2, 3, 4, 4), (3, 2, 3, 3), (2,)],
        "convolution",
    ),
    "_convolution": (
        lambda x, w: aten._convolution(
            x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, False, False, False, False
        ),
        [(1, 2, 5, 5), (3, 2, 3, 3)],
        "convolution",
    ),
    "max_pool2d": (lambda x: F.max_pool2d(x, 2), [(2, 3, 6, 6)], None),
    "avg_pool2d": (lambda x: F.avg_pool2d(x, 3, stride=2, padding=1), [(2, 3, 6, 6)], None),
    "batch_norm_train": (
        lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
        [(4, 3, 5, 5), (3,), (3,)],
        None,
    ),
    "batch_norm_eval": (
        lambda x, m, v: F.batch_norm(x, m, v.abs() + 0.5, training=False),
        [(4, 3, 5, 5), (3,), (3,)],
        None,
    ),
    "interpolate_nearest": (lambda x: F.interpolate(x, scale_factor=2), [(1, 2, 3, 3)], None),
    "interpolate_bilinear": (
        lambda x: F.interpolate(x, size=(5, 7), mode="bilinear", align_corners=False),
        [(1, 2, 3, 3)],
        None,
    ),
}


@pytest.mark.parametrize("name", list(_CASES))
def test_cnn_op_on_device_matches_cpu(name):
    fn, shapes, falls = _CASES[name]
    args = [_rand(*s, seed=i) for i, s in enumerate(shapes)]
    want = fn(*args)
    got, named = _on_device(lambda: fn(*[a.to(D) for a in args]))
    _close(got, want, k=64, chain=2)
    if falls is not None and getattr(aten, falls).default not in RULES:
        assert f"aten.{falls}.default" in named  # the CPU, with the warning and the count
    assert not any("overrideable" in n for n in named)


def test_conv_crash_regression():
    """The issue's crash: ``NotImplementedError: convolution_overrideable not implemented``."""
    x, w = _rand(1, 2, 5, 5), _rand(3, 2, 3, 3, seed=1)
    got, _ = _on_device(lambda: F.conv2d(x.to(D), w.to(D)))
    _close(got, F.conv2d(x, w), k=18)
    if _CONV not in RULES:
        assert dev.fallback_stats() == {"aten.convolution.default": 1}
    assert overrideable.holes() == []


def test_overrideable_out_overloads():
    x, w = _rand(1, 2, 5, 5), _rand(3, 2, 3, 3, seed=1)
    out = torch.empty(0, device=D)
    args = ([1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    r = aten.convolution_overrideable.out(x.to(D), w.to(D), None, *args, out=out)
    assert r is out
    _close(out, F.conv2d(x, w), k=18)


def _small_cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, padding=1),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.ConvTranspose2d(4, 2, 2, stride=2),
        torch.nn.AvgPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(2 * 3 * 3, 3),
    )


def test_small_cnn_forward_and_backward():
    """A small CNN trained one step on the device: the same loss and gradients as the CPU, the
    convolutions' backward (``convolution_backward_overrideable``) on the CPU too."""
    x = _rand(2, 2, 6, 6)
    cpu = _small_cnn()
    loss = cpu(x).square().mean()
    loss.backward()
    spy = _small_cnn().to(D)

    def step() -> torch.Tensor:
        out = spy(x.to(D)).square().mean()
        out.backward()
        return out

    got, named = _on_device(step)
    assert_close(got, loss, k=100, chain=8)
    for (n, p), q in zip(spy.named_parameters(), cpu.parameters(), strict=True):
        assert p.grad is not None and p.grad.device.type == D, n
        assert_close(p.grad, q.grad, k=100, chain=8, err_msg=n)
    if aten.convolution_backward.default not in RULES:
        assert "aten.convolution_backward.default" in named


# ---------------------------------------------------------------------------------------------
# RNNs: the fused cells PyTorch picks off the CPU, which the CPU has no kernel for


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "LSTMCell", "GRUCell"])
def test_rnn_fused_cells_fall_back(kind):
    torch.manual_seed(0)
    cpu = getattr(torch.nn, kind)(3, 4)
    torch.manual_seed(0)
    spy = getattr(torch.nn, kind)(3, 4).to(D)
    x = _rand(5, 2, 3) if "Cell" not in kind else _rand(2, 3)
    want = cpu(x)
    want = want[0] if isinstance(want, tuple) else want
    want.square().sum().backward()

    def run() -> torch.Tensor:
        out = spy(x.to(D))
        out = out[0] if isinstance(out, tuple) else out
        out.square().sum().backward()
        return out

    got, named = _on_device(run)
    _close(got, want, k=8, chain=12)
    for p, q in zip(spy.parameters(), cpu.parameters(), strict=True):
        assert_close(p.grad, q.grad, k=10, chain=24)
    cell = "lstm" if "LSTM" in kind else "gru"
    assert f"aten._thnn_fused_{cell}_cell.default" in named
    back = "_backward_impl" if cell == "lstm" else "_backward"
    assert f"aten._thnn_fused_{cell}_cell{back}.default" in named


# ---------------------------------------------------------------------------------------------
# data movement: .to("cpu", non_blocking=True), record_stream


def test_to_cpu_non_blocking():
    """``_to_copy`` of a spyre tensor with ``non_blocking=True`` allocated its CPU result in
    pinned memory: ``NotImplementedError`` (no pinned-memory allocator in the device's hooks)."""
    x = _rand(3, 4)
    s = x.to(D)
    got = s.to("cpu", non_blocking=True)
    assert got.device.type == "cpu" and torch.equal(got, x) and not got.is_pinned()
    assert torch.equal(s.to("cpu", torch.float16, non_blocking=True), x.half())
    assert torch.equal(s.to(D, non_blocking=True).cpu(), x)
    assert torch.equal(s.half().cpu(), x.half())
    assert torch.equal(s.t().contiguous().cpu(), x.t().contiguous())
    assert torch.equal(s.to("cpu", memory_format=torch.contiguous_format), x)


def test_record_stream():
    x = torch.ones(3, device=D)
    x.record_stream(torch.Stream(D))
    assert torch.equal((x + 1).cpu(), torch.full((3,), 2.0))


# ---------------------------------------------------------------------------------------------
# fused attention's hooks


def _attention(q, k, v, bias, causal):  # noqa: ANN001, ANN202 - the reference on the CPU
    a = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + bias
    if causal:
        keep = torch.ones(a.shape[-2], a.shape[-1], dtype=torch.bool).tril()
        a = a.masked_fill(~keep, float("-inf"))
    return a.softmax(-1) @ v


@pytest.mark.parametrize("rank,causal", [(4, False), (3, True)])
def test_fused_attention_overrideable(rank, causal):
    lead = (2, 2) if rank == 4 else (3,)
    ts = [_rand(*lead, n, 4, seed=i) for i, n in enumerate((3, 5, 5))]
    bias = _rand(*lead[-1:], 1, 5, seed=3)  # broadcast over the queries
    ref = [t.clone().requires_grad_(True) for t in (*ts, bias)]
    want = _attention(*ref, causal)
    want.sum().backward()
    spy = [t.to(D).requires_grad_(True) for t in (*ts, bias)]

    def run() -> torch.Tensor:
        out = aten._scaled_dot_product_fused_attention_overrideable(*spy, is_causal=causal)
        out[0].sum().backward()
        return out

    got, named = _on_device(run)
    assert got[1].shape == (*(lead if rank == 4 else (1, *lead)), 3)  # the log-sum-exp
    _close(got[0], want, k=5, chain=4)
    for s, r in zip(spy, ref, strict=True):
        assert_close(s.grad, r.grad, k=5, chain=6)
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in named


def test_decomposition_with_other_results_is_not_compiled():
    """Torch's decomposition of ``_scaled_dot_product_flash_attention_for_cpu`` returns the
    attention weights for the log-sum-exp; compiled for the card it crashed (a result of the
    wrong rank). The eager path now runs such an op on the CPU."""
    q, k, v = (_rand(1, 2, 3, 4, seed=i) for i in range(3))
    want = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    got, named = _on_device(
        lambda: aten._scaled_dot_product_flash_attention_for_cpu(q.to(D), k.to(D), v.to(D))
    )
    _close(got, want)
    assert named == ["aten._scaled_dot_product_flash_attention_for_cpu.default"]


# ---------------------------------------------------------------------------------------------
# a sweep of PyTorch's OpInfo database

#: OpInfo names with one of these draw random numbers (no deterministic sample to compare) or
#: make sparse tensors (no spyre layout)
_SKIP_WORDS = ("rand", "normal", "bernoulli", "dropout", "uniform", "multinomial", "sparse")


def _op_db() -> list[Any]:
    """PyTorch's OpInfos by name; ``torch.testing._internal`` imports ``expecttest``, a
    test-only package: a stand-in when it is missing (the OpInfo tables use none of it)."""
    if "expecttest" not in sys.modules:
        try:
            import expecttest  # noqa: F401
        except ImportError:
            stub = types.ModuleType("expecttest")
            stub.TestCase = unittest.TestCase  # type: ignore[attr-defined]
            sys.modules["expecttest"] = stub
    from torch.testing._internal.common_methods_invocations import op_db

    return sorted(op_db, key=lambda o: (o.name, o.variant_test_name))


def _sweep_ops() -> list[Any]:
    """The OpInfos with float32 samples on the CPU, not random, not sparse."""
    keep = []
    for op in _op_db():
        if any(w in op.name for w in _SKIP_WORDS) or torch.float32 not in op.dtypes:
            continue
        keep.append(op)
    return keep


def _is_dispatcher_error(text: str) -> bool:
    """An error of PyTorch's dispatcher (no kernel for the op), as :func:`_sweep` books it."""
    return text.startswith("NotImplementedError") or "Could not run 'aten::" in text


def _sweep(ops: list[Any], samples: int) -> dict[str, str]:
    """Run up to ``samples`` float32 samples of each op on the device; the first error of
    each op (``"Type: message"``), by op name. A sample the CPU rejects too is left out."""
    errors: dict[str, str] = {}

    def put(v: Any) -> Any:
        return v.to(D) if isinstance(v, torch.Tensor) else v

    for op in ops:
        name = f"{op.name}.{op.variant_test_name}".rstrip(".")
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                got = list(op.sample_inputs("cpu", torch.float32))[:samples]
            except Exception:  # noqa: BLE001 - a sample maker that fails on this build
                continue
            for s in got:
                try:
                    op.op(s.input, *s.args, **s.kwargs)
                except Exception:  # noqa: BLE001 - the CPU refuses this sample too
                    continue
                inp, args, kwargs = tree_map(put, (s.input, s.args, s.kwargs))
                try:
                    op.op(inp, *args, **kwargs)
                except Exception as e:  # noqa: BLE001 - every error is booked
                    errors.setdefault(name, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    return errors


def _check_sweep(ops: list[Any], samples: int) -> None:
    errors = _sweep(ops, samples)
    for name, why in sorted(errors.items()):  # shown with -s, and on a failure
        print(f"{name}: {why}")
    holes = {n: e for n, e in errors.items() if _is_dispatcher_error(e)}
    assert not holes, holes


#: the quick sweep takes every fourth OpInfo (about 160 ops), in chunks for the workers
_QUICK_STEP = 4
_CHUNKS = 6


def test_sweep_selection_is_broad():
    ops = _sweep_ops()[::_QUICK_STEP]
    assert 150 <= len(ops) <= 260, len(ops)
    assert len({o.name for o in ops}) > 140


@pytest.mark.parametrize("chunk", range(_CHUNKS))
def test_opinfo_sweep_no_dispatcher_errors(chunk):
    """A quarter of the OpInfos (float32, one sample each)."""
    ops = _sweep_ops()[::_QUICK_STEP][chunk::_CHUNKS]
    _check_sweep(ops, samples=1)


def test_opinfo_sweep_convolutions():
    """The convolution OpInfos, which all crashed before (``convolution_overrideable``)."""
    ops = [o for o in _sweep_ops() if "conv" in o.name and "nn.functional" in o.name]
    assert len(ops) >= 6
    _check_sweep(ops, samples=2)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", range(_CHUNKS))
def test_opinfo_sweep_all_ops(chunk):
    """The three quarters of the OpInfos the quick tier's sweep leaves out, float32, one sample
    each (two samples of every OpInfo took about 1000 s of CI's 2-core time)."""
    rest = [o for i, o in enumerate(_sweep_ops()) if i % _QUICK_STEP]
    _check_sweep(rest[chunk::_CHUNKS], samples=1)

"""Ops named in issue 31 on both torch paths: ``adaptive_max_pool1d`` / ``2d`` (with and without
indices), ``batch_norm`` in training and evaluation mode, ``F.interpolate`` bilinear, bicubic and
trilinear, and ``index_put`` (boolean masks) / ``index_copy`` / ``index_add`` (rank-0 tensors).

Each runs through ``torch.compile(backend="spyre")`` and on the eager ``spyre`` device against
torch eager on the CPU (the oracle's per-dtype tolerance, ``spyre_jax.tools.testing.
assert_tree_close``), with no CPU fallback: none counted by the backend's ``fallback_stats()``, none
by the device's (a ``SpyreFallbackWarning`` is an error here), and on the device nothing
computed on the host either (``eager_stats()["host_factories"]``: a one-op kernel with an empty
result runs there, which ``native_batch_norm`` in evaluation mode did before it had a kernel of
its own)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from spyre_jax.tools.testing import assert_tree_close
from torch_bridge import backend as tb
from torch_bridge import device as dev
from torch_bridge.errors import SpyreFallbackWarning

aten = torch.ops.aten
F32, F16 = torch.float32, torch.float16


def _x(shape: tuple[int, ...], dtype: torch.dtype = F32, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _to_spyre(v: Any) -> Any:
    return v.to("spyre") if isinstance(v, torch.Tensor) else v


def _to_cpu(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        assert v.device.type == "spyre", v.device
        return v.cpu()
    return v


def run_compiled(fn: Callable[..., Any], *xs: Any) -> Any:
    """``fn`` through ``torch.compile(backend="spyre")`` (strict: an op with no rule raises)."""
    torch._dynamo.reset()
    tb.reset_fallback_stats()
    with torch.no_grad():
        got = torch.compile(fn, backend="spyre", options={"strict": True})(*xs)
    assert tb.fallback_stats() == {}, tb.fallback_stats()
    return got


def run_eager(fn: Callable[..., Any], *xs: Any) -> Any:
    """``fn`` on the spyre device (its inputs moved there); the results back on the CPU. No op
    may fall back to the CPU, nor run on the host."""
    dev.reset_stats()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", SpyreFallbackWarning)
        got = fn(*tree_map(_to_spyre, xs))
    stats = dev.eager_stats()
    assert stats["cpu_fallbacks"] == 0 and dev.fallback_stats() == {}, dev.fallback_stats()
    assert stats["host_factories"] == 0, stats
    assert stats["launches"] > 0, stats
    return tree_map(_to_cpu, got)


def _both(fn: Callable[..., Any], *xs: Any, **kw: Any) -> None:
    """Both paths against torch eager on the CPU."""
    want = fn(*xs)
    assert_tree_close(run_compiled(fn, *xs), want, err_msg="compiled", **kw)
    assert_tree_close(run_eager(fn, *xs), want, err_msg="eager", **kw)


# ---------------------------------------------------------------------------------------------
# adaptive max pooling


_POOLS = [
    ("2d_uneven_indices", lambda x: F.adaptive_max_pool2d(x, (3, 5), True), (2, 3, 8, 9)),
    ("2d_even", lambda x: F.adaptive_max_pool2d(x, (4, 3)), (3, 8, 9)),
    ("2d_larger_out", lambda x: F.adaptive_max_pool2d(x, (6, 7), True), (1, 2, 4, 5)),
    ("1d_indices", lambda x: F.adaptive_max_pool1d(x, 4, True), (2, 3, 10)),
    ("1d_unbatched", lambda x: F.adaptive_max_pool1d(x, 3), (3, 10)),
]


@pytest.mark.parametrize(("fn", "shape"), [p[1:] for p in _POOLS], ids=[p[0] for p in _POOLS])
def test_adaptive_max_pool(fn: Callable[..., Any], shape: tuple[int, ...]) -> None:
    _both(fn, _x(shape))


def test_adaptive_max_pool_fp16_ties_and_nan() -> None:
    """Small integers (many ties: the first maximum's index, as torch's CPU kernel) and NaNs
    (a NaN wins: the last one of the window)."""
    x = torch.randint(0, 3, (2, 3, 6, 7), generator=torch.Generator().manual_seed(1)).half()
    fn = lambda t: F.adaptive_max_pool2d(t, (4, 3), True)  # noqa: E731
    _both(fn, x)
    x = x.float()
    x[0, 0, 1, 1] = x[0, 0, 2, 2] = x[1, 2, 5, 6] = float("nan")
    want, got = fn(x), run_eager(fn, x)
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0].isnan(), want[0].isnan())


# ---------------------------------------------------------------------------------------------
# batch norm


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("shape", [(4, 3, 5, 5), (6, 3)], ids=["4d", "2d"])
def test_batch_norm_training_eager(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Training statistics on the device: the output and the running statistics moved (the
    variance unbiased), as on the CPU; without running statistics too."""
    C = shape[1]
    x, w, b = _x(shape, dtype), _x((C,), dtype, 1), _x((C,), dtype, 2)
    rm, rv = _x((C,), dtype, 3), (_x((C,), F32, 4).abs() + 0.5).to(dtype)

    def fn(x: Any, w: Any, b: Any, rm: Any, rv: Any) -> Any:
        y = F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.2, eps=1e-5)
        return y, rm, rv

    want = fn(x, w, b, rm.clone(), rv.clone())
    assert_tree_close(
        run_eager(fn, x, w, b, rm, rv), want, k=shape[0] * (x.numel() // shape[0] // C)
    )
    no_stats = lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True)  # noqa: E731
    assert_tree_close(run_eager(no_stats, x, w, b), no_stats(x, w, b), k=x.numel() // C)


def test_batch_norm_eval_eager_and_native_results() -> None:
    """Evaluation mode on the card (not on the host), and ``native_batch_norm``'s three results
    in both modes (the saved statistics; empty in evaluation mode)."""
    x, w, b = _x((4, 3, 5)), _x((3,), F32, 1), _x((3,), F32, 2)
    rm, rv = _x((3,), F32, 3), _x((3,), F32, 4).abs() + 0.5
    ev = lambda x, w, b, rm, rv: F.batch_norm(x, rm, rv, w, b, eps=1e-3)  # noqa: E731
    assert_tree_close(run_eager(ev, x, w, b, rm, rv), ev(x, w, b, rm, rv))
    for training in (True, False):

        def nat(x: Any, w: Any, b: Any, rm: Any, rv: Any, t: bool = training) -> Any:
            return aten.native_batch_norm(x, w, b, rm, rv, t, 0.1, 1e-5)

        want = nat(x, w, b, rm.clone(), rv.clone())
        assert_tree_close(run_eager(nat, x, w, b, rm.clone(), rv.clone()), want, k=20)


def test_batch_norm_module_training_both_paths() -> None:
    """``nn.BatchNorm2d`` in training mode: compiled (functionalized statistics) and on the
    device, the output and the buffers as the CPU module leaves them."""
    x = _x((4, 3, 6, 6))
    ref = torch.nn.BatchNorm2d(3, momentum=0.3)
    torch.nn.init.normal_(ref.weight)
    want = ref(x).detach()
    for path in ("compiled", "eager"):
        m = torch.nn.BatchNorm2d(3, momentum=0.3)
        with torch.no_grad():
            m.weight.copy_(ref.weight)
        if path == "compiled":
            got = run_compiled(m, x)
        else:
            m = m.to("spyre")
            got = run_eager(m, x)
        assert_tree_close(got, want, k=144, err_msg=path)
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            assert_tree_close(getattr(m, name).cpu(), getattr(ref, name), k=144, err_msg=name)


# ---------------------------------------------------------------------------------------------
# interpolation


_INTERP = [
    ("bilinear_x2", dict(mode="bilinear", scale_factor=2), (2, 3, 8, 8)),
    (
        "bilinear_size_corners",
        dict(mode="bilinear", size=(5, 11), align_corners=True),
        (1, 2, 6, 7),
    ),
    ("bilinear_down", dict(mode="bilinear", scale_factor=0.6), (1, 2, 10, 9)),
    ("bicubic_x1.5", dict(mode="bicubic", scale_factor=1.5), (1, 3, 6, 6)),
    ("bicubic_corners", dict(mode="bicubic", size=(5, 7), align_corners=True), (2, 1, 4, 6)),
    ("trilinear_x2", dict(mode="trilinear", scale_factor=2), (1, 2, 3, 4, 4)),
]


#: the second bicubic case (about 6 s: a compile of its own on each path) is in the slow tier
_INTERP_PARAMS = [
    pytest.param(*p[1:], id=p[0], marks=[pytest.mark.slow] if p[0] == "bicubic_corners" else [])
    for p in _INTERP
]


@pytest.mark.parametrize(("kw", "shape"), _INTERP_PARAMS)
def test_interpolate(kw: dict[str, Any], shape: tuple[int, ...]) -> None:
    fn = lambda x: F.interpolate(x, **kw)  # noqa: E731
    k = 16 if kw["mode"] == "bicubic" else 8  # terms (and weights) per output element
    _both(fn, _x(shape), k=k)


def test_interpolate_fp16_eager() -> None:
    x = _x((1, 2, 6, 6), F16)
    for mode in ("bilinear", "bicubic"):
        fn = lambda t, m=mode: F.interpolate(t, scale_factor=2, mode=m)  # noqa: E731
        assert_tree_close(run_eager(fn, x), fn(x), k=16, err_msg=mode)


# ---------------------------------------------------------------------------------------------
# index_put with boolean masks; index_copy / index_add on rank-0 tensors


_MASK = torch.tensor([True, True, False, True, False])
_MASK2 = _x((4, 6), seed=9) > 0


def _setitem_mask(x: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[m] = v  # index_put_ on the device, index_put when compiled
    return y


_PUTS = [
    (
        "mask_row_values_broadcast",
        lambda x, m, v: x.index_put((m,), v),
        lambda: (_x((5, 5)), _MASK, _x((5,), seed=1)),
    ),
    (
        "mask_value_per_row_accumulate",
        lambda x, m, v: x.index_put((m,), v, accumulate=True),
        lambda: (_x((5, 5)), _MASK, _x((3, 5), seed=1)),
    ),
    (
        "mask_none_false_accumulate",
        lambda x, m, v: x.index_put((m,), v, accumulate=True),
        lambda: (_x((5, 5)), torch.zeros(5, dtype=torch.bool), _x((5,), seed=1)),
    ),
    (
        "mask_2d_after_none_per_element",
        lambda x, m, v: aten.index_put(x, [None, m], v),
        lambda: (_x((2, 4, 6, 3)), _MASK2, _x((2, int(_MASK2.sum()), 3), seed=1)),
    ),
    ("setitem_mask_per_row", _setitem_mask, lambda: (_x((5, 4)), _MASK, _x((3, 4), seed=1))),
    (
        "index_copy_rank0",
        lambda x, i, v: torch.index_copy(x, 0, i, v),
        lambda: (torch.tensor(1.5), torch.tensor([0]), torch.tensor(-3.0)),
    ),
    (
        "index_add_rank0_alpha",
        lambda x, i, v: torch.index_add(x, 0, i, v, alpha=2),
        lambda: (torch.tensor(1.5), torch.tensor([0]), torch.tensor(-3.0)),
    ),
]


@pytest.mark.parametrize(("fn", "inputs"), [p[1:] for p in _PUTS], ids=[p[0] for p in _PUTS])
def test_index_puts(fn: Callable[..., Any], inputs: Callable[[], tuple]) -> None:
    _both(fn, *inputs(), k=2)


def test_index_put_mask_fp16_eager() -> None:
    x, v = _x((5, 5), F16), _x((3, 5), F16, 1)
    fn = lambda x, m, v: x.index_put((m,), v, accumulate=True)  # noqa: E731
    assert_tree_close(run_eager(fn, x, _MASK, v), fn(x, _MASK, v), k=2)

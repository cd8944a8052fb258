"""torch FX rules: pooling and batch norm (``max_pool2d_with_indices``, ``avg_pool2d``,
``_adaptive_avg_pool2d``, ``adaptive_max_pool2d``, ``_native_batch_norm_legit*``), from
windowed reductions (:func:`lowering.conv_ops.window_reduce`: strided slices merged
elementwise) and maps.

``ceil_mode`` adds the high padding the last window needs (a window that would start in the
padding only is dropped, as torch drops it); the average's divisor is computed per output
position at lowering time (``count_include_pad`` counts the explicit padding, never the
overhang of ``ceil_mode``; ``divisor_override`` replaces it). Max pooling's indices are the
flat ``h * W + w`` of the first maximum in the window (NaN wins, as torch's max does). They
register into :data:`lowering.fx_common.RULES` when ``lowering.from_fx`` imports this module.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import conv_ops, torch_import
from .builder import Builder, Lit
from .fx_common import bcast, convert, result, rule, take
from .graph import Var
from .torch_import import torch

aten = torch.ops.aten


def _pair(v: Any, n: int = 2) -> tuple[int, ...]:
    v = [v] if isinstance(v, int) else list(v)
    return tuple(int(x) for x in (v * n if len(v) == 1 else v))


def _out_size(size: int, k: int, s: int, p: int, d: int, ceil: bool) -> int:
    """torch's pooled size (``ceil_mode``: the last window kept if it starts before the end of
    the input and its left padding)."""
    span = size + 2 * p - d * (k - 1) - 1
    out = (-(-span // s) if ceil else span // s) + 1
    if ceil and (out - 1) * s >= size + p:
        out -= 1
    return out


def _geometry(x: Var, kernel: Any, stride: Any, padding: Any, dilation: Any, ceil: bool) -> tuple:
    """(kernel, stride, padding, dilation, output sizes, pad config) of a 2-D pooling."""
    k = _pair(kernel)
    s = _pair(stride) if stride else k
    p, d = _pair(padding), _pair(dilation)
    H, W = x.shape[-2:]
    out = tuple(
        _out_size(n, *a, ceil) for n, a in zip((H, W), zip(k, s, p, d, strict=True), strict=True)
    )
    cfg = [(0, 0, 0)] * (len(x.shape) - 2)
    for n, kk, ss, pp, dd, o in zip((H, W), k, s, p, d, out, strict=True):
        hi = max(pp, (o - 1) * ss + dd * (kk - 1) + 1 - n - pp)
        cfg.append((pp, hi, 0))
    return k, s, p, d, out, cfg


@rule(aten.max_pool2d_with_indices.default)
def _max_pool2d(
    b: Builder,
    node: torch.fx.Node,
    x: Var,
    kernel: Any,
    stride: Any = (),
    padding: Any = 0,
    dilation: Any = 1,
    ceil_mode: bool = False,
) -> tuple[Var, Var]:
    shape, dt = result(node)
    k, s, p, d, (OH, OW), cfg = _geometry(x, kernel, stride, padding, dilation, ceil_mode)
    lead = x.shape[:-2]
    W = x.shape[-1]
    xp = b.pad(x, Lit(float("-inf"), dt), cfg)
    best: Var | None = None
    idx: Var | None = None
    for kh in range(k[0]):
        for kw in range(k[1]):
            h0, w0 = kh * d[0], kw * d[1]
            lim = (*lead, h0 + (OH - 1) * s[0] + 1, w0 + (OW - 1) * s[1] + 1)
            part = b.emit(
                "slice",
                [xp],
                shape,
                dt,
                starts=(*([0] * len(lead)), h0, w0),
                limits=lim,
                strides=(*([1] * len(lead)), s[0], s[1]),
            )
            hh = np.arange(OH)[:, None] * s[0] - p[0] + h0
            ww = np.arange(OW)[None, :] * s[1] - p[1] + w0
            at = bcast(b, b.const((hh * W + ww).astype(np.int32), "int32"), shape)
            if best is None:
                best, idx = part, at
                continue
            gt = b.elementwise("gt", [part, best], shape, "bool")
            nan = b.elementwise(
                "and",
                [
                    b.elementwise("ne", [part, part], shape, "bool"),
                    b.elementwise("eq", [best, best], shape, "bool"),
                ],
                shape,
                "bool",
            )
            take = b.elementwise("or", [gt, nan], shape, "bool")
            best = b.elementwise("select_n", [take, best, part], shape, dt)
            idx = b.elementwise("select_n", [take, idx, at], shape, "int32")
    assert best is not None and idx is not None
    return best, idx


@rule(aten.avg_pool2d.default)
def _avg_pool2d(
    b: Builder,
    node: torch.fx.Node,
    x: Var,
    kernel: Any,
    stride: Any = (),
    padding: Any = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
) -> Var:
    shape, dt = result(node)
    k, s, p, d, (OH, OW), cfg = _geometry(x, kernel, stride, padding, 1, ceil_mode)
    H, W = x.shape[-2:]
    xf = convert(b, x, "float32")
    total = conv_ops.window_reduce(
        b,
        xf,
        "add",
        0.0,
        window=(*[1] * (len(x.shape) - 2), *k),
        strides=(*[1] * (len(x.shape) - 2), *s),
        dilation=(1,) * len(x.shape),
        padding=cfg,
        out_shape=shape,
    )
    if divisor_override:
        div = np.full((OH, OW), float(divisor_override), np.float32)
    else:

        def count(n: int, o: int, kk: int, ss: int, pp: int) -> np.ndarray:
            start = np.arange(o) * ss - pp
            end = np.minimum(start + kk, n + pp)  # the padding counts, the overhang never
            if not count_include_pad:
                return np.minimum(end, n) - np.maximum(start, 0)
            return end - start

        div = count(H, OH, k[0], s[0], p[0])[:, None] * count(W, OW, k[1], s[1], p[1])[None, :]
        div = div.astype(np.float32)
    avg = b.elementwise("div", [total, bcast(b, b.const(div, "float32"), shape)], shape, "float32")
    return convert(b, avg, dt)


def _adaptive_axis(b: Builder, x: Var, axis: int, out: int) -> Var:
    """The mean over torch's adaptive windows along ``axis``: ``[floor(i n / o), ceil((i + 1)
    n / o))`` for each output ``i``."""
    n = x.shape[axis]
    if n % out == 0 and n // out > 0:
        k = n // out
        sh = list(x.shape)
        sh[axis : axis + 1] = [out, k]
        r = b.emit(
            "reduce",
            [b.reshape(x, tuple(sh))],
            tuple(s for j, s in enumerate(sh) if j != axis + 1),
            x.dtype,
            kind="sum",
            axes=(axis + 1,),
        )
        return b.elementwise("div", [r, Lit(float(k), x.dtype)], r.shape, x.dtype)
    pieces = []
    for i in range(out):
        lo, hi = (i * n) // out, -(-((i + 1) * n) // out)
        sl = b.slice_dim(x, axis, lo, hi)
        sh = tuple(1 if j == axis else s for j, s in enumerate(x.shape))
        r = b.reshape(
            b.emit(
                "reduce",
                [sl],
                tuple(s for j, s in enumerate(x.shape) if j != axis),
                x.dtype,
                kind="sum",
                axes=(axis,),
            ),
            sh,
        )
        pieces.append(b.elementwise("div", [r, Lit(float(hi - lo), x.dtype)], sh, x.dtype))
    return b.concat(pieces, axis)


@rule(aten._adaptive_avg_pool2d.default)
def _adaptive_avg_pool2d(b: Builder, node: torch.fx.Node, x: Var, output_size: Any) -> Var:
    """Separable: the mean over each window's rows, then over its columns (a window is a
    rectangle, so the mean of the row means is its mean)."""
    shape, dt = result(node)
    oh, ow = _pair(output_size)
    r = len(x.shape)
    y = _adaptive_axis(b, convert(b, x, "float32"), r - 2, oh)
    y = _adaptive_axis(b, y, r - 1, ow)
    return convert(b, y, dt)


def _windows(n: int, out: int) -> list[tuple[int, int]]:
    """torch's adaptive windows ``[floor(i n / o), ceil((i + 1) n / o))`` of each output ``i``."""
    return [((i * n) // out, -(-((i + 1) * n) // out)) for i in range(out)]


def _max_axis(b: Builder, x: Var, at: Var, axis: int, out: int) -> tuple[Var, Var]:
    """The maximum over the adaptive windows along ``axis`` and the index ``at`` holds where
    it is (torch's CPU kernel: the first maximum, a NaN wins and the last NaN is kept).
    Step ``k`` compares the ``k``-th element of every window at once (a window shorter than
    the longest repeats its last element, which changes nothing)."""
    n = x.shape[axis]
    wins = _windows(n, out)
    longest = max(hi - lo for lo, hi in wins)
    shape = tuple(out if j == axis else s for j, s in enumerate(x.shape))
    uniform = n % out == 0
    best: Var | None = None
    idx: Var | None = None
    for k in range(longest):
        if uniform:  # windows n / out apart: one strided slice
            step, r = n // out, len(x.shape)
            lim = tuple(k + (out - 1) * step + 1 if j == axis else s for j, s in enumerate(x.shape))
            cut = {
                "starts": tuple(k if j == axis else 0 for j in range(r)),
                "limits": lim,
                "strides": tuple(step if j == axis else 1 for j in range(r)),
            }
            part = b.emit("slice", [x], shape, x.dtype, **cut)
            pat = b.emit("slice", [at], shape, at.dtype, **cut)
        else:
            rows = np.array([min(lo + k, hi - 1) for lo, hi in wins], np.int32)
            pos = b.const(rows, "int32")
            part, pat = take(b, x, axis, pos), take(b, at, axis, pos)
        if best is None:
            best, idx = part, pat
            continue
        take_it = b.elementwise(
            "or",
            [
                b.elementwise("gt", [part, best], shape, "bool"),
                b.elementwise("ne", [part, part], shape, "bool"),
            ],
            shape,
            "bool",
        )
        best = b.elementwise("select_n", [take_it, best, part], shape, x.dtype)
        idx = b.elementwise("select_n", [take_it, idx, pat], shape, "int32")
    assert best is not None and idx is not None
    return best, idx


@rule(aten.adaptive_max_pool2d.default)
def _adaptive_max_pool2d(
    b: Builder, node: torch.fx.Node, x: Var, output_size: Any
) -> tuple[Var, Var]:
    """Separable, as torch's CPU kernel scans each window row by row: the maximum of each row
    of the window (and its column), then the first row holding the maximum of those (a NaN:
    the last row holding one, at its last NaN). The index is the flat ``h * W + w``."""
    shape, dt = result(node)
    oh, ow = _pair(output_size)
    r = len(x.shape)
    H, W = x.shape[-2:]
    flat = np.arange(H * W, dtype=np.int32).reshape(H, W)
    at = bcast(b, b.const(flat, "int32"), x.shape)
    y, at = _max_axis(b, convert(b, x, dt), at, r - 1, ow)
    y, at = _max_axis(b, y, at, r - 2, oh)
    return y, at


def _per_channel(b: Builder, v: Var | None, x: Var, value: float) -> Var | Lit:
    """A per-channel vector ``[C]`` broadcast over ``x`` ``[N, C, ...]`` (fp32), or ``value``."""
    if v is None:
        return Lit(value, "float32")
    sh = (1, v.shape[0], *([1] * (len(x.shape) - 2)))
    return bcast(b, b.reshape(convert(b, v, "float32"), sh), x.shape)


def _normalize(
    b: Builder, x: Var, mean: Var, rstd: Var, w: Var | None, bias: Var | None, dt: str
) -> Var:
    xf = convert(b, x, "float32")
    y = b.elementwise(
        "mul", [b.elementwise("sub", [xf, mean], x.shape, "float32"), rstd], x.shape, "float32"
    )
    y = b.elementwise("mul", [y, _per_channel(b, w, x, 1.0)], x.shape, "float32")
    y = b.elementwise("add", [y, _per_channel(b, bias, x, 0.0)], x.shape, "float32")
    return convert(b, y, dt)


@rule(aten._native_batch_norm_legit_no_training.default)
def _batch_norm_eval(
    b: Builder,
    node: torch.fx.Node,
    x: Var,
    w: Var | None,
    bias: Var | None,
    running_mean: Var,
    running_var: Var,
    momentum: float,
    eps: float,
) -> tuple[Var, Var, Var]:
    """Eval mode: the running statistics normalize (the two saved statistics are empty)."""
    shape, dt = result(node)
    mean = _per_channel(b, running_mean, x, 0.0)
    var = _per_channel(b, running_var, x, 1.0)
    rstd = b.elementwise(
        "rsqrt",
        [b.elementwise("add", [var, Lit(float(eps), "float32")], shape, "float32")],
        shape,
        "float32",
    )
    empty = b.full((0,), 0, "float32")
    return _normalize(b, x, mean, rstd, w, bias, dt), empty, empty


def _batch_stats(b: Builder, x: Var, eps: float) -> tuple[Var, Var, Var, Var]:
    """Train mode's statistics over every dim but the channels: mean, biased variance, rstd
    (each ``[C]``) and how many elements each has."""
    axes = tuple(d for d in range(len(x.shape)) if d != 1)
    n = math.prod(x.shape[d] for d in axes)
    xf = convert(b, x, "float32")
    C = x.shape[1]
    s = b.emit("reduce", [xf], (C,), "float32", kind="sum", axes=axes)
    mean = b.elementwise("div", [s, Lit(float(n), "float32")], (C,), "float32")
    cen = b.elementwise("sub", [xf, _per_channel(b, mean, x, 0.0)], x.shape, "float32")
    sq = b.emit(
        "reduce",
        [b.elementwise("mul", [cen, cen], x.shape, "float32")],
        (C,),
        "float32",
        kind="sum",
        axes=axes,
    )
    var = b.elementwise("div", [sq, Lit(float(n), "float32")], (C,), "float32")
    rstd = b.elementwise(
        "rsqrt",
        [b.elementwise("add", [var, Lit(float(eps), "float32")], (C,), "float32")],
        (C,),
        "float32",
    )
    return mean, var, rstd, b.full((), n, "float32")


@rule(aten._native_batch_norm_legit.no_stats)
def _batch_norm_train_no_stats(
    b: Builder,
    node: torch.fx.Node,
    x: Var,
    w: Var | None,
    bias: Var | None,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[Var, Var, Var]:
    """Train mode without running statistics: normalized by the batch's own; the batch mean
    and rstd returned (what backward saves)."""
    shape, dt = result(node)
    mean, _, rstd, _ = _batch_stats(b, x, eps)
    out = _normalize(
        b, x, _per_channel(b, mean, x, 0.0), _per_channel(b, rstd, x, 1.0), w, bias, dt
    )
    return out, mean, rstd


@rule(aten._native_batch_norm_legit_functional.default)
def _batch_norm_train(
    b: Builder,
    node: torch.fx.Node,
    x: Var,
    w: Var | None,
    bias: Var | None,
    running_mean: Var,
    running_var: Var,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[Var, Var, Var, Var, Var]:
    """Train mode with running statistics (functionalized): the output, the batch mean and
    rstd, and the running statistics moved by ``momentum`` (the variance unbiased)."""
    shape, dt = result(node)
    mean, var, rstd, _ = _batch_stats(b, x, eps)
    out = _normalize(
        b, x, _per_channel(b, mean, x, 0.0), _per_channel(b, rstd, x, 1.0), w, bias, dt
    )
    n = math.prod(x.shape[d] for d in range(len(x.shape)) if d != 1)
    C = x.shape[1]
    m = float(momentum)
    unbiased = b.elementwise("mul", [var, Lit(n / max(n - 1, 1), "float32")], (C,), "float32")

    def moved(old: Var, new: Var) -> Var:
        o = convert(b, old, "float32")
        keep = b.elementwise("mul", [o, Lit(1.0 - m, "float32")], (C,), "float32")
        step = b.elementwise("mul", [new, Lit(m, "float32")], (C,), "float32")
        return convert(b, b.elementwise("add", [keep, step], (C,), "float32"), old.dtype)

    return out, mean, rstd, moved(running_mean, mean), moved(running_var, unbiased)


torch_import.finish(__name__)  # see lowering.torch_import

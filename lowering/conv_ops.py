"""Convolutions from the graph IR's ops, for both importers: a GEMM of input patches and the
kernel on the PE.

A convolution of one group is a ``conv`` node (an implicit GEMM, :mod:`lowering.tile_conv`):
the input taken channels-last (the channels on the stick dim), the kernel as ``[KH * KW, C,
O]``; the PE reads each tile's patches from a window of the input in scratchpad, the padding
written as the window's zero halo by the load unit. Only padding beyond the kernel's extent and
the interior padding of an input dilation (a transposed convolution) are stored (a pad). A 1x1
convolution of stride 1 is a plain matmul of the channels-last input.

The rest gather the patches explicitly (an im2col: written to device memory once, ``taps``
times the input, and read once by the matmul): an input of few channels (an image's 3:
:data:`FEW_CHANNELS`) read in windows that do not overlap (a ViT's patch embedding: the patches
are a re-layout of the input, and channels-last each PE step would multiply 3 useful channels of
a 64-element stick) is taken channels-first, its width on the sticks, and its patches gathered
as ``[C * taps, N * OH * OW]`` for ``kernel @ patches``; a grouped convolution's
channels-last patches ``[N, OH, OW, taps, C]`` (one strided slice per kernel tap, concatenated;
where the stride equals the kernel and nothing overlaps, a ViT's patch embedding, a reshape and
a transpose) feed a batched matmul, the groups its batch (``[G, M, taps * C/G] x [G, taps * C/G,
O/G]``). A depthwise convolution (one channel per group, one output each) is a windowed
multiply-add on the SFUs instead (:func:`_conv_depthwise`). A ``conv`` node whose smallest
window does not fit the scratchpad is lowered the same way by the ``unfuse`` pass
(:func:`explicit`). The products accumulate in fp32 and round once to the output dtype, as the
card's matmuls do.

1-D convolutions are 2-D ones of height 1. 3-D convolutions are refused (LoweringError).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from .builder import Builder, Lit
from .errors import LoweringError
from .graph import Node, Var

__all__ = ["conv", "window_reduce", "explicit", "FEW_CHANNELS"]

#: below this many input channels (an image's 3) the patches are gathered channels-first, the
#: output's width on the sticks: channels-last, a stick would hold 3 useful elements of 64 (a
#: choice of the lowering, not a figure of the card)
FEW_CHANNELS = 16


def _strided(
    b: Builder, x: Var, starts: Sequence[int], counts: Sequence[int], strides: Sequence[int]
) -> Var:
    """``counts[j]`` elements of ``x`` along each dim ``j``, from ``starts[j]`` every
    ``strides[j]``: a kernel tap's (or a window offset's) view of the input."""
    limits = tuple(s + (n - 1) * st + 1 for s, n, st in zip(starts, counts, strides, strict=True))
    return b.emit(
        "slice",
        [x],
        tuple(counts),
        x.dtype,
        starts=tuple(starts),
        limits=limits,
        strides=tuple(strides),
    )


def _pad(
    b: Builder, x: Var, spatial: Sequence[tuple[int, int, int]], before: int, after: int
) -> Var:
    """``x`` zero-padded along its spatial dims (``(low, high, interior)`` each), which follow
    ``before`` dims and precede ``after`` dims; ``x`` itself when there is nothing to pad."""
    if all(c == (0, 0, 0) for c in spatial):
        return x
    return b.pad(x, Lit(0, x.dtype), [(0, 0, 0)] * before + list(spatial) + [(0, 0, 0)] * after)


def _dilated(
    padding: Sequence[tuple[int, int]], lhs_dilation: Sequence[int]
) -> list[tuple[int, int, int]]:
    """The spatial pad config of a convolution's padding and input dilation."""
    return [(lo, hi, ld - 1) for (lo, hi), ld in zip(padding, lhs_dilation, strict=True)]


def _conv_few_channels(
    b: Builder, x: Var, w: Var, k: tuple[int, int], s: tuple[int, int], d: tuple[int, int], dt: str
) -> Var:
    """A convolution of few input channels (one group) on the padded ``x`` ``[N, C, Hp, Wp]``:
    the patches as ``[C * taps, N * OH * OW]`` (each tap a strided slice, the width on the
    sticks), the kernel ``[O, C * taps]`` (its natural order), one matmul giving ``[O, M]``."""
    N, C, Hp, Wp = x.shape
    Co = w.shape[0]
    (KH, KW), (sh, sw), (dh, dw) = k, s, d
    OH, OW = (Hp - (KH - 1) * dh - 1) // sh + 1, (Wp - (KW - 1) * dw - 1) // sw + 1
    M = N * OH * OW
    xc = b.transpose(x, (1, 0, 2, 3))  # [C, N, Hp, Wp]: the width stays on the sticks
    pieces = []
    for kh in range(KH):
        for kw in range(KW):
            sl = _strided(b, xc, (0, 0, kh * dh, kw * dw), (C, N, OH, OW), (1, 1, sh, sw))
            pieces.append(b.reshape(sl, (C, 1, M)))
    rhs = b.reshape(b.concat(pieces, 1), (1, C * KH * KW, M))
    lhs = b.reshape(w, (1, Co, C * KH * KW))
    if lhs.dtype != rhs.dtype:
        lhs = b.emit("convert", [lhs], lhs.shape, rhs.dtype, dtype=rhs.dtype)
    prod = b.emit("matmul", [lhs, rhs], (1, Co, M), dt, dtype=dt)
    return b.transpose(b.reshape(prod, (Co, N, OH, OW)), (1, 0, 2, 3))


def _taps(b: Builder, xl: Var, k: tuple[int, int], s: tuple[int, int], d: tuple[int, int]) -> Var:
    """The patches of the padded channels-last input ``xl`` ``[N, Hp, Wp, C]``: ``[N, OH, OW,
    KH * KW, C]`` (taps in row-major kernel order)."""
    N, Hp, Wp, C = xl.shape
    (KH, KW), (sh, sw), (dh, dw) = k, s, d
    OH, OW = (Hp - (KH - 1) * dh - 1) // sh + 1, (Wp - (KW - 1) * dw - 1) // sw + 1
    if (dh, dw) == (1, 1) and (sh, sw) == (KH, KW):  # non-overlapping patches: a re-layout
        crop = b.slice_dim(b.slice_dim(xl, 1, 0, OH * KH), 2, 0, OW * KW)
        six = b.reshape(crop, (N, OH, KH, OW, KW, C))
        return b.reshape(b.transpose(six, (0, 1, 3, 2, 4, 5)), (N, OH, OW, KH * KW, C))
    pieces = []
    for kh in range(KH):
        for kw in range(KW):
            sl = _strided(b, xl, (0, kh * dh, kw * dw, 0), (N, OH, OW, C), (1, sh, sw, 1))
            pieces.append(b.reshape(sl, (N, OH, OW, 1, C)))
    return b.concat(pieces, 3)


def _conv_depthwise(
    b: Builder,
    x: Var,
    w: Var,
    k: tuple[int, int],
    s: tuple[int, int],
    d: tuple[int, int],
    dt: str,
) -> Var:
    """A depthwise convolution (one input channel per group, one output per group) on the
    padded ``x`` ``[N, C, Hp, Wp]`` as a windowed multiply-add on the SFUs: for each kernel tap
    the strided slice it reads times that tap's per-channel weight, summed in fp32 and rounded
    once to ``dt`` (one fused map, the slices views of the input: no patches stored). On the PE
    each channel would be a matmul of one output column in a 64-wide stick."""
    N, C, Hp, Wp = x.shape
    (KH, KW), (sh, sw), (dh, dw) = k, s, d
    OH, OW = (Hp - (KH - 1) * dh - 1) // sh + 1, (Wp - (KW - 1) * dw - 1) // sw + 1
    shape = (N, C, OH, OW)
    acc: Var | None = None
    for kh in range(KH):
        for kw in range(KW):
            part = _strided(b, x, (0, 0, kh * dh, kw * dw), shape, (1, 1, sh, sw))
            tap = b.reshape(b.slice_dim(b.slice_dim(w, 2, kh, kh + 1), 3, kw, kw + 1), (C,))
            wt = b.emit("broadcast", [tap], shape, tap.dtype, shape=shape, dims=(1,))
            f32 = [
                v
                if v.dtype == "float32"
                else b.emit("convert", [v], shape, "float32", dtype="float32")
                for v in (part, wt)
            ]
            prod = b.elementwise("mul", f32, shape, "float32")
            acc = prod if acc is None else b.elementwise("add", [acc, prod], shape, "float32")
    assert acc is not None
    return acc if dt == "float32" else b.emit("convert", [acc], shape, dt, dtype=dt)


def _conv_implicit(
    b: Builder,
    xl: Var,
    w: Var,
    k: tuple[int, int],
    s: tuple[int, int],
    d: tuple[int, int],
    padding: Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int],
    dt: str,
) -> Var:
    """One group's convolution as a ``conv`` node on the channels-last ``xl`` ``[N, H, W,
    C]`` and the kernel ``w`` ``[O, C, KH, KW]``: ``[N, O, OH, OW]``. Padding up to the kernel's
    extent is the window's halo; an input dilation's interior padding and padding beyond the
    extent are stored first (a pad)."""
    N, C = xl.shape[0], xl.shape[3]
    Co = w.shape[0]
    ext = [(kk - 1) * dd for kk, dd in zip(k, d, strict=True)]
    if any(ld != 1 for ld in lhs_dilation):  # a transposed convolution: the pad stored
        cfg = _dilated(padding, lhs_dilation)
        halo = ((0, 0), (0, 0))
    else:
        pads = list(zip(padding, ext, strict=True))
        cfg = [(max(0, lo - e), max(0, hi - e), 0) for (lo, hi), e in pads]
        halo = tuple((min(lo, e), min(hi, e)) for (lo, hi), e in pads)
    xl = _pad(b, xl, cfg, 1, 1)
    wk = b.reshape(b.transpose(w, (2, 3, 1, 0)), (k[0] * k[1], C, Co))  # [taps, C, O]
    if wk.dtype != xl.dtype:
        wk = b.emit("convert", [wk], wk.shape, xl.dtype, dtype=xl.dtype)
    H, W = xl.shape[1:3]
    OH, OW = (
        (n + lo + hi - e - 1) // st + 1
        for n, (lo, hi), e, st in zip((H, W), halo, ext, s, strict=True)
    )
    out = b.emit(
        "conv",
        [xl, wk],
        (N, OH * OW, Co),
        dt,
        dtype=dt,
        kernel=tuple(k),
        strides=tuple(s),
        dilation=tuple(d),
        padding=halo,
    )
    return b.transpose(b.reshape(out, (N, OH, OW, Co)), (0, 3, 1, 2))


def _channels_last(b: Builder, x: Var) -> bool:
    """Whether ``x`` ``[N, C, H, W]`` is the transpose of a channels-last value (a program
    written NHWC): its channels are on the sticks already, and packing column taps would read
    each stick of it once per tap."""
    for n in reversed(b.nodes):
        if x in n.outputs:
            return n.op == "transpose" and n.params.perm == (0, 3, 1, 2)
    return False


def _conv_packed(
    b: Builder,
    x: Var,
    w: Var,
    s: tuple[int, int],
    padding: Sequence[tuple[int, int]],
    d: tuple[int, int],
    dt: str,
) -> Var:
    """A convolution of few input channels with overlapping windows (a CNN's stem: 7x7/2 on
    an image's 3 channels) as an implicit GEMM over its kernel rows only: the ``KW`` column taps
    are packed into the channels first, ``x'[n, h, ow, kw * C + c] = x[n, c, h, ow * sw + kw *
    dw]`` (one strided slice per column tap, the width padded), so a stick holds ``KW * C``
    useful channels (21 of 64) instead of ``C`` (3) and the PE multiplies 7 times fewer padded
    ones; the kernel ``[O, C, KH, KW]`` is read as ``[O, KW * C, KH, 1]``."""
    N, C, H, W = x.shape
    Co, _, KH, KW = w.shape
    (pl, pr), (sw, dw) = padding[1], (s[1], d[1])
    x = _pad(b, x, [(0, 0, 0), (pl, pr, 0)], 2, 0)
    Wp = x.shape[3]
    OW = (Wp - (KW - 1) * dw - 1) // sw + 1
    cols = []
    for kw in range(KW):
        sl = _strided(b, x, (0, 0, 0, kw * dw), (N, C, H, OW), (1, 1, 1, sw))
        cols.append(b.reshape(sl, (N, 1, C, H, OW)))
    packed = b.reshape(b.concat(cols, 1), (N, KW * C, H, OW))  # channel kw * C + c
    xl = b.transpose(packed, (0, 2, 3, 1))  # [N, H, OW, KW * C]
    wp = b.reshape(b.transpose(w, (0, 3, 1, 2)), (Co, KW * C, KH, 1))
    pads = (tuple(padding[0]), (0, 0))
    return _conv_implicit(b, xl, wp, (KH, 1), (s[0], 1), (d[0], 1), pads, (1, 1), dt)


def explicit(n: Node) -> tuple[list[Node], list[tuple[Var, np.ndarray]]]:
    """A ``conv`` node as an explicit im2col (its halo padded in device memory, the patches
    concatenated, one matmul): the nodes and the constants they read; the last node gives the
    ``conv`` node's own output. For a convolution no window of which fits the scratchpad."""
    b = Builder()
    b.source = n.source
    xl, wk = n.inputs[:2]
    p = n.params
    T, C, Co = wk.shape
    xl = _pad(b, xl, [(lo, hi, 0) for lo, hi in p.padding], 1, 1)
    patches = _taps(b, xl, p.kernel, p.strides, p.dilation)  # [N, OH, OW, T, C]
    M = math.prod(patches.shape[:3])
    lhs = b.reshape(patches, (1, M, T * C))
    rhs = b.reshape(wk, (1, T * C, Co))
    prod = b.emit("matmul", [lhs, rhs], (1, M, Co), p.dtype, dtype=p.dtype)
    b.emit("reshape", [prod], n.out.shape, p.dtype, shape=n.out.shape)
    last = b.nodes[-1]
    b.nodes[-1] = Node(last.op, last.inputs, n.outputs, last.params, last.source)
    return b.nodes, b.consts


def conv(
    b: Builder,
    x: Var,
    w: Var,
    *,
    strides: Sequence[int],
    padding: Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int],
    rhs_dilation: Sequence[int],
    groups: int,
    out_dtype: str,
) -> Var:
    """``lax.conv_general_dilated`` on ``x`` ``[N, C, *S]`` and ``w`` ``[O, C / groups, *K]``
    (1 or 2 spatial dims) -> ``[N, O, *OS]`` in ``out_dtype``. ``padding`` per spatial dim
    (low, high), non-negative."""
    nsp = len(x.shape) - 2
    if nsp not in (1, 2):
        raise LoweringError(
            f"spyre: {nsp}-D convolution is not supported on the card (1-D and 2-D are)"
        )
    if any(lo < 0 or hi < 0 for lo, hi in padding):
        raise LoweringError(f"spyre: negative convolution padding {list(padding)}")
    if nsp == 1:  # a 1-D convolution: a 2-D one of height 1
        x = b.reshape(x, (x.shape[0], x.shape[1], 1, x.shape[2]))
        w = b.reshape(w, (w.shape[0], w.shape[1], 1, w.shape[2]))
        strides, padding = (1, *strides), ((0, 0), *padding)
        lhs_dilation, rhs_dilation = (1, *lhs_dilation), (1, *rhs_dilation)
    N, C = x.shape[:2]
    Co, Cg, KH, KW = w.shape
    G = groups
    if C != G * Cg or Co % G:
        raise LoweringError(
            f"spyre: convolution of {C} input channels by a kernel of {Cg} per group in {G} "
            f"groups and {Co} outputs"
        )
    Og, T = Co // G, KH * KW
    # non-overlapping windows (a ViT's patch embedding): the explicit patches are a re-layout
    disjoint = all(
        s >= (kk - 1) * d + 1 for s, kk, d in zip(strides, (KH, KW), rhs_dilation, strict=True)
    )
    if G == C and Cg == 1 and Co == C:  # depthwise: a windowed multiply-add on the SFUs
        x = _pad(b, x, _dilated(padding, lhs_dilation), 2, 0)
        out = _conv_depthwise(b, x, w, (KH, KW), tuple(strides), tuple(rhs_dilation), out_dtype)
        return b.reshape(out, (N, Co, out.shape[3])) if nsp == 1 else out
    if G == 1 and C < FEW_CHANNELS and disjoint:
        x = _pad(b, x, _dilated(padding, lhs_dilation), 2, 0)
        out = _conv_few_channels(b, x, w, (KH, KW), tuple(strides), tuple(rhs_dilation), out_dtype)
        return b.reshape(out, (N, Co, out.shape[3])) if nsp == 1 else out
    if (
        G == 1
        and C < FEW_CHANNELS
        and KW > 1
        and all(ld == 1 for ld in lhs_dilation)
        and not _channels_last(b, x)
    ):
        out = _conv_packed(b, x, w, tuple(strides), padding, tuple(rhs_dilation), out_dtype)
        return b.reshape(out, (N, Co, out.shape[3])) if nsp == 1 else out
    xl = b.transpose(x, (0, 2, 3, 1))
    k, st, rd = (KH, KW), tuple(strides), tuple(rhs_dilation)
    if G == 1 and (T > 1 or st != (1, 1) or any(lo or hi for lo, hi in padding)):
        out = _conv_implicit(b, xl, w, k, st, rd, padding, lhs_dilation, out_dtype)
        return b.reshape(out, (N, Co, out.shape[3])) if nsp == 1 else out
    xl = _pad(b, xl, _dilated(padding, lhs_dilation), 1, 1)
    patches = _taps(b, xl, k, st, rd)  # [N, OH, OW, T, C]
    OH, OW = patches.shape[1:3]
    M = N * OH * OW
    if G == 1:
        lhs = b.reshape(patches, (1, M, T * C))
    else:
        grouped = b.reshape(patches, (M, T, G, Cg))
        lhs = b.reshape(b.transpose(grouped, (2, 0, 1, 3)), (G, M, T * Cg))
    wg = b.reshape(w, (G, Og, Cg, KH, KW))
    rhs = b.reshape(b.transpose(wg, (0, 3, 4, 2, 1)), (G, T * Cg, Og))
    if rhs.dtype != lhs.dtype:
        rhs = b.emit("convert", [rhs], rhs.shape, lhs.dtype, dtype=lhs.dtype)
    prod = b.emit("matmul", [lhs, rhs], (G, M, Og), out_dtype, dtype=out_dtype)
    out = b.reshape(b.transpose(prod, (1, 0, 2)), (N, OH, OW, Co)) if G > 1 else prod
    out = b.transpose(b.reshape(out, (N, OH, OW, Co)), (0, 3, 1, 2))
    if nsp == 1:
        out = b.reshape(out, (N, Co, OW))
    assert math.prod(out.shape) == N * Co * OH * OW
    return out


def window_reduce(
    b: Builder,
    x: Var,
    fn: str,
    fill: float | int,
    *,
    window: Sequence[int],
    strides: Sequence[int],
    dilation: Sequence[int],
    padding: Sequence[tuple[int, int, int]],
    out_shape: tuple[int, ...],
) -> Var:
    """A windowed reduction (``lax.reduce_window``, pooling): ``x`` padded with ``fill``
    (``padding``: ``(low, high, 0)`` per dim), and for each offset in the window the strided
    slice it reads, merged by the elementwise ``fn`` (one fused map on the SFUs)."""
    dt = x.dtype
    xp = b.pad(x, Lit(fill, dt), list(padding)) if any(lo or hi for lo, hi, _ in padding) else x
    acc: Var | None = None
    for offs in itertools.product(*(range(w) for w in window)):
        starts = tuple(o * d for o, d in zip(offs, dilation, strict=True))
        if math.prod(out_shape) == 0:
            part = b.full(out_shape, fill, dt)
        else:
            part = _strided(b, xp, starts, out_shape, strides)
        acc = part if acc is None else b.elementwise(fn, [acc, part], out_shape, dt)
    return acc if acc is not None else b.full(out_shape, fill, dt)

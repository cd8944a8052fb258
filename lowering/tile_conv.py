"""Tiling of ``conv`` nodes: a 2-D convolution as an implicit GEMM on the PE, its input windows
in scratchpad.

The input is channels-last ``[N, H, W, C]`` (the channels on the sticks), the kernel ``[taps, C,
O]`` and the output ``[N, OH * OW, O]``. A tile is ``r`` whole output rows of one image by ``tn``
output channels; its lhs block is the window of input rows and columns those rows read
(``(r - 1) * stride + (KH - 1) * dilation + 1`` rows of the padded width), read with an
overlapping step of ``r * stride`` rows and a negative origin where the padding lies: the load
unit writes the halo as zeros (:attr:`~device_model.kernel.Operand.pad_value`), so the padding is
never stored in device memory. The PE reads the window's patches in place
(:class:`~device_model.steps.ConvWindow`): no patch matrix is written to device memory, and the
input is read about once (the halo rows twice) rather than ``taps`` times, as an explicit
im2col would. The channels are the K loop, split in whole sticks when a window of all of them
does not fit, the rhs block ``[taps, tc, tn]`` then one stick-block of every tap. A fused
epilogue (a batch norm, a ReLU, a residual add: :func:`lowering.matmul_passes.fuse_epilogue`)
runs on each output block on its way to the store, as a matmul's does.

The tilings that fit in whole blocks (``r`` dividing OH, ``tn`` and ``tc`` whole sticks dividing
theirs) are ranked by the matmul's estimator and the best few timed by the timing model
(:func:`lowering.tile_matmul.pick_tiling`). A convolution whose smallest window does not fit
(an image thousands of pixels wide) has no tiling here: the ``unfuse`` pass asks
:func:`conv_fits` first and lowers it as an explicit im2col (:func:`lowering.conv_ops.explicit`).
"""

from __future__ import annotations

import math
from itertools import product

from device_model.card import CardSpec
from device_model.kernel import Operand, Stage
from device_model.steps import ConvWindow, MatmulStep

from . import tiling
from .errors import TilingError
from .graph import Node
from .tile_matmul import epilogue_blocks, pick_tiling

__all__ = ["plan_conv", "conv_fits"]


def _conv_stage(
    ctx: tiling.TilingContext, n: Node, r: int, tn: int, tno: int, tc: int, m_inner: bool
) -> Stage:
    """The stage of one tiling: ``r`` output rows, ``tn`` (accumulator) / ``tno`` (output)
    channels, ``tc`` input channels per K step (``tc`` = C: the whole K, one step)."""
    x, w = n.inputs[:2]
    p = n.params
    lx, lw, lo = ctx.layout(x), ctx.layout(w), ctx.layout(n.out)
    N, _, _, C = x.shape
    T, Co = w.shape[0], w.shape[2]
    OH, OW = p.out_hw(*x.shape[1:3])
    win = ConvWindow(p.kernel, p.strides, p.dilation, r, OW)
    rows, cols = win.extent
    (pt, _), (pl, _) = p.padding
    Np = lw.device_shape[2]
    whole_k = tc == C
    tcp = lx.device_shape[3] if whole_k else tc
    grid = (N, -(-OH // r), Np // tn, C // tc)
    lhs = Operand(
        ctx.name(x),
        (1, rows, cols, tcp),
        (0, 1, -1, -1 if whole_k else 3),
        "lhs",
        origin=(0, -pt, -pl, 0),
        step=(1, r * p.strides[0], cols, tcp),
        pad_value=0.0,
    )
    rhs = Operand(ctx.name(w), (T, tc, tn), (-1, -1 if whole_k else 3, 2), "rhs")
    out = Operand(ctx.name(n.out), (1, r * OW, tno), (0, 1, 2), "out")
    ep = epilogue_blocks(ctx, n, r * OW, tno)
    steps = -(-(grid[0] * grid[1] * grid[2]) // ctx.ncores) * grid[3]
    slots = 2 if steps > 1 else 1
    scratch = ctx.sp_plan(
        [
            ("lhs", lhs.block, lx.dtype, slots),
            ("rhs", rhs.block, lw.dtype, slots),
            ("acc", (1, r * OW, tn), "float32", 1),
            ("out", out.block, lo.dtype, slots),
        ]
        + [
            (op.sp, op.block, lay.dtype, slots)
            for op, lay in zip(ep.operands, ep.layouts, strict=True)
        ]
    )
    tabs = tiling.step_tables(
        grid,
        [lhs, rhs, *ep.operands, out],
        [lx, lw, *ep.layouts, lo],
        ctx.ncores,
        reduce_axis=3,
        tile_order=(0, 2, 1) if m_inner else None,
        last_only=frozenset(range(2, 2 + len(ep.operands))),
    )
    sfu = flops = 0
    if ep.body is not None:
        sfu, flops = tiling.map_work(ep.body, ctx.card)
    step = MatmulStep(
        k_logical=T * C, out_dtype=p.dtype, window=win, epilogue=ep.body, acc_slot=ep.slot
    )
    return Stage(
        name=f"s{len(ctx.stages)}",
        grid=grid,
        reduce_axis=3,
        inputs=(lhs, rhs, *ep.operands),
        output=out,
        scratch=scratch,
        step=step,
        **tabs,
        flops=2 * N * OH * OW * Co * T * C + flops,
        sfu_elem_ops=sfu,
        source=n.source,
    )


def _candidates(ctx: tiling.TilingContext, n: Node, dry: bool) -> list:
    """Every whole-block tiling that fits, with the estimator's time (the matmul's, with the
    window's bytes for the lhs): ``(estimate s, steps, r, (tn, tno), tc, m_inner)``. With
    ``dry``, stops at the first that fits."""
    x, w = n.inputs[:2]
    p = n.params
    lx, lw, lo = ctx.layout(x), ctx.layout(w), ctx.layout(n.out)
    N, _, _, C = x.shape
    T = w.shape[0]
    OH, OW = p.out_hw(*x.shape[1:3])
    card = ctx.card
    Np, No = lw.device_shape[2], lo.device_shape[2]
    q = math.lcm(lw.elems_per_stick, lo.elems_per_stick)
    tn_c = [(t, t) for t in tiling.divisors(math.gcd(Np, No)) if t % q == 0]
    if (Np, No) not in tn_c:
        tn_c.append((Np, No))
    split_c = lx.device_shape[3] == C and C % lx.elems_per_stick == 0
    tc_c = tiling.stick_blocks(C, lx.elems_per_stick) if split_c else [C]
    out = []
    ep_items: dict[tuple[int, int], list[tuple[tuple[int, ...], str]]] = {}
    for r, (tn, tno), tc in product(tiling.divisors(OH), tn_c, tc_c):
        rows, cols = ConvWindow(p.kernel, p.strides, p.dilation, r, OW).extent
        tcp = lx.device_shape[3] if tc == C else tc
        gm, gn, gk = OH // r, Np // tn, C // tc
        ntiles = N * gm * gn
        steps = -(-ntiles // ctx.ncores) * gk
        slots = 2 if steps > 1 else 1
        if (r, tno) not in ep_items:  # an epilogue's operands, in blocks of the output's
            ep_items[r, tno] = epilogue_blocks(ctx, n, r * OW, tno).plan_items()
        plan = (
            ctx.plan_bytes([((1, rows, cols, tcp), lx.dtype), ((T, tc, tn), lw.dtype)], slots)
            + ctx.plan_bytes([((1, r * OW, tno), lo.dtype)] + ep_items[r, tno], slots)
            + ctx.plan_bytes([((1, r * OW, tn), "float32")], 1)
        )
        if plan > ctx.cap:
            continue
        if dry:
            return [None]
        per = min(ntiles, ctx.ncores)
        comp = 2 * r * OW * tn * T * tcp / card.pe_flops_sustained_per_core
        win_b, rhs_b = rows * cols * tcp * lx.itemsize, T * tc * tn * lw.itemsize
        for m_inner in (False, True) if gm > 1 else (False,):
            ga = gm if m_inner else gn
            shared = min(per, ga)
            other = min(per, max(1, -(-per // ga)))
            ua, ub = (shared, other) if m_inner else (other, shared)
            load = (ua * win_b + ub * rhs_b) / card.memory_bw_one_way
            store = per * r * OW * tno * lo.itemsize / card.memory_bw_one_way
            est = tiling.pipelined_estimate(load, comp, store, gk, steps // gk)
            out.append((est, steps, r, (tn, tno), tc, m_inner))
    return out


def plan_conv(ctx: tiling.TilingContext, n: Node) -> list[Stage]:
    """A ``conv`` node's stage: the fastest whole-block tiling the timing model finds among
    the estimator's best. TilingError when even one output row's window does not fit (the
    ``unfuse`` pass lowers such a convolution explicitly first)."""
    cands = _candidates(ctx, n, dry=False)
    if not cands:
        x, w = n.inputs[:2]
        raise TilingError(
            f"spyre: convolution of {list(x.shape)} by {list(w.shape)}: no window of its input "
            f"fits the usable scratchpad ({ctx.cap} B per core)"
            + (f"\n  at: {n.source}" if n.source else "")
        )

    def build(r: int, tn: int, tno: int, tc: int, m_inner: bool) -> Stage:
        return _conv_stage(ctx, n, r, tn, tno, tc, m_inner)

    stage, _ = pick_tiling(ctx, cands, build)
    return [stage]


def conv_fits(n: Node, card: CardSpec) -> bool:
    """Whether the ``conv`` node ``n`` has a tiling on ``card`` (a dry run: nothing is built)."""

    def dry(ctx: tiling.TilingContext, m: Node) -> None:
        if not _candidates(ctx, m, dry=True):
            raise TilingError("no window fits")

    return tiling.fits(card, n, dry)

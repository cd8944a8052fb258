"""Tiling of matmul nodes: ``[B, M, K] x [B, K, N]`` (or an NT rhs ``[B, N, K]``) with a fused
epilogue (an SFU map on each output block) or prologue (an SFU map on each lhs block).

Whole blocks first: M rows dividing M, N and K in whole sticks dividing them; the estimator
ranks every tiling that fits and the timing model times its best few (:func:`pick_tiling`).
When none fits, ragged blocks along M, N and K (K split across steps with fp32 partial sums;
a last K block past K is masked), single-buffered as a last resort. A fused matmul must fit in
whole blocks: the ``unfuse`` pass (:mod:`lowering.unfuse`) splits one that does not, asking
:func:`fits_whole` first.
"""

from __future__ import annotations

import math
from itertools import product
from typing import Any

import numpy as np

from device_model.card import CardSpec
from device_model.kernel import Operand, Stage
from device_model.layout import DTYPES, TensorLayout, np_dtype
from device_model.ops import (
    MapBody,
)
from device_model.steps import MatmulStep
from device_model.timing import stage_cost

from . import tiling
from .errors import TilingError
from .graph import Node, Var, matmul_inputs

__all__ = [
    "plan_matmul",
    "fits_whole",
    "matmul_stage",
    "epilogue_blocks",
    "prologue_blocks",
    "pick_tiling",
]


#: how many of the estimator's best matmul tilings the timing model ranks (see pick_tiling)
MATMUL_RANKED = 6


#: simulated times this close (relative) count as a tie, won by the tiling of fewer steps
MATMUL_TIE = 0.01


#: ... or this close in absolute terms (s): for a tiny matmul, a step less matters more to the
#: simulation's speed than a fraction of a microsecond on the card
MATMUL_TIE_S = 0.2e-6


def pick_tiling(
    ctx: tiling.TilingContext,
    cands: list[tuple[float, int, int, tuple[int, int], int, bool]],
    build: Any,
) -> tuple[Stage, tuple[int, int, int, int, bool]]:
    """The matmul tiling to use. The estimator's best few (``MATMUL_RANKED``), and the two of
    fewest steps among those it puts near the best, are built and timed by the timing model
    itself, which sees what the estimate does not (blocks shared by the cores of a step and
    multicast over the ring, stores draining behind later steps, the read/write mix). The
    fastest wins; near ties (``MATMUL_TIE``, ``MATMUL_TIE_S``) go to the fewer steps.

    ``cands``: ``(estimate s, steps, tm, (tn, output tn), tk, m_inner)`` per tiling that fits;
    ``build(tm, tn, tno, tk, m_inner)`` makes its stage. Returns the stage and its tiling."""
    ranked = sorted(cands, key=lambda c: (c[0], c[1]))
    # the estimator's best, and the fewest-step tilings it puts near them
    near = [c for c in ranked if c[0] <= ranked[0][0] * (1 + 3 * MATMUL_TIE) + 3 * MATMUL_TIE_S]
    shortlist = list(dict.fromkeys(ranked[:MATMUL_RANKED] + sorted(near, key=lambda c: c[1])[:2]))
    dtypes = ctx.dtypes()
    timed = []
    for _, steps, tm, (tn, tno), tk, m_inner in shortlist:
        st = build(tm, tn, tno, tk, m_inner)
        choice = (tm, tn, tno, tk, m_inner)
        timed.append((stage_cost(st, dtypes, ctx.card)["time_s"], steps, st, choice))
    fastest = min(c[0] for c in timed)
    # within a tie of the fastest, the fewest steps (a shorter simulation, about the same time)
    tie = max(fastest * MATMUL_TIE, MATMUL_TIE_S)
    best = min((c for c in timed if c[0] <= fastest + tie), key=lambda c: c[1])
    return best[2], best[3]


#: the tiling picked for a matmul signature (its layouts, parameters, epilogue operands' layouts
#: and the card): the identical layers of a model are searched once. At most this many, then
#: the cache starts over
MATMUL_CHOICES = 4096


_matmul_choices: dict[Any, tuple[int, int, int, int, bool]] = {}


def _matmul_key(ctx: tiling.TilingContext, n: Node) -> Any:
    """What a matmul's tiling depends on, hashable; None when a parameter is not."""
    key = (
        tuple(ctx.layout(v) for v in n.inputs),
        ctx.layout(n.out),
        n.params,
        ctx.card,
        ctx.cap,
        ctx.ncores,
    )
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _whole_blocks(ctx: tiling.TilingContext, n: Node) -> tuple[list, list, list, tuple[int, ...]]:
    """A matmul's whole-block candidates: M rows dividing M, (rhs/accumulator N, output N)
    pairs and K blocks in whole sticks, and the padded extents (rhs N, lhs K, rhs K, out N)."""
    a, b = n.inputs[:2]
    la, lb, lo = ctx.layout(a), ctx.layout(b), ctx.layout(n.out)
    _, M, K = a.shape
    rhs_t = n.params.rhs_t
    Kp, No = la.device_shape[2], lo.device_shape[2]
    Kr = lb.device_shape[2] if rhs_t else K  # the rhs block's K when it is the whole K
    if rhs_t:
        # an NT rhs [B, N, Kr]: N in rows dividing N, whole output sticks (or the whole N: the
        # accumulator spans N, the output block its padded N); K split in whole sticks of both
        Np = N = n.out.shape[2]
        tn_c = [(t, t) for t in tiling.divisors(N) if t % lo.elems_per_stick == 0 and t < N]
        tn_c.append((N, No))
        qk = math.lcm(la.elems_per_stick, lb.elems_per_stick)
        tk_c = tiling.stick_blocks(K, qk) if Kp == K == Kr else [K]
    else:
        # N tiles: whole sticks of both the rhs and the output. When their dtypes pad N to
        # different extents (fp16 rhs, fp32 output: 150 -> 192 vs 160) no such tile divides
        # both, and N is one tile: the rhs block and the accumulator span the rhs's padded N,
        # the output block its own (the PE result is cropped, or zero-padded, to it).
        Np = lb.device_shape[2]
        q = math.lcm(lb.elems_per_stick, lo.elems_per_stick)
        tn_c = [(t, t) for t in tiling.divisors(math.gcd(Np, No)) if t % q == 0]
        if (Np, No) not in tn_c:
            tn_c.append((Np, No))
        tk_c = tiling.stick_blocks(K, la.elems_per_stick) if Kp == K else [K]
    tm_c = tiling.divisors(M)
    return tm_c, tn_c, tk_c, (Np, Kp, Kr, No)


def _matmul_stage_whole(ctx: tiling.TilingContext, n: Node, dry: bool = False) -> Stage | None:
    """A matmul's stage in whole blocks (M rows dividing M, N and K in whole sticks dividing
    them), the estimator's best few timed by the timing model (:func:`pick_tiling`); the
    search is done once per signature. TilingError when none fits; with ``dry``, None as soon
    as one tiling fits (nothing is estimated or built)."""
    key = _matmul_key(ctx, n)
    known = _matmul_choices.get(key) if key is not None else None
    a, b = n.inputs[:2]
    la, lb, lo = ctx.layout(a), ctx.layout(b), ctx.layout(n.out)
    B, M, K = a.shape
    rhs_t = n.params.rhs_t
    tm_c, tn_c, tk_c, (Np, Kp, Kr, No) = _whole_blocks(ctx, n)
    card = ctx.card
    if known is not None:  # an identical matmul was tiled before: build its tiling
        tm_c, tn_c, tk_c = [known[0]], [(known[1], known[2])], [known[3]]
    cands_all: list[tuple[float, int, int, tuple[int, int], int, bool]] = []
    ep_items: dict[tuple[int, int], list[tuple[tuple[int, ...], str]]] = {}
    pro_items_of: dict[tuple[int, int], list[tuple[tuple[int, ...], str]]] = {}
    pro_body = n.params.prologue.body if n.params.prologue is not None else None
    # a prologue's SFU time per lhs element (its tiles pass the SFUs before the PE)
    pro_s = 0.0
    if pro_body is not None:
        sfu_rate = card.sfu_elems_per_cycle * card.corelets_per_core * card.clock_hz
        pro_s = tiling.map_work(pro_body, card)[0] / max(1, math.prod(pro_body.space)) / sfu_rate
    for tm, (tn, tno), tk in product(tm_c, tn_c, tk_c):
        gm, gn, gk = M // tm, Np // tn, K // tk
        ntiles = B * gm * gn
        steps = -(-ntiles // ctx.ncores) * gk
        slots = 2 if steps > 1 else 1
        tkp, tkr = (Kp, Kr) if tk == K else (tk, tk)
        rblk = (1, tn, tkr) if rhs_t else (1, tk, tn)
        if (tm, tno) not in ep_items:  # an epilogue's operands, in blocks of the output's
            ep_items[tm, tno] = epilogue_blocks(ctx, n, tm, tno).plan_items()
        if (tm, tk) not in pro_items_of:  # a prologue's operands, in blocks of the lhs's
            pro_items_of[tm, tk] = prologue_blocks(ctx, n, tm, None if tk == K else tk).plan_items()
        pro_items = pro_items_of[tm, tk]
        pro_bytes = sum(math.prod(b) * np_dtype(dt).itemsize for b, dt in pro_items)
        plan = (
            ctx.plan_bytes([((1, tm, tkp), la.dtype), (rblk, lb.dtype)] + pro_items, slots)
            + ctx.plan_bytes([((1, tm, tno), lo.dtype)] + ep_items[tm, tno], slots)
            + ctx.plan_bytes([((1, tm, tn), "float32")], 1)
        )
        if plan > ctx.cap:
            continue
        if dry:  # the question is only whether one fits
            return None
        per_step_tiles = min(ntiles, ctx.ncores)
        comp = 2 * tm * tn * tkp / card.pe_flops_sustained_per_core + tm * tkp * pro_s
        # the tiles of a step: N fastest (one lhs block shared, multicast) or, when M splits,
        # M fastest (one rhs block shared: the rhs is read once, the lhs once per round)
        for m_inner in (False, True) if gm > 1 else (False,):
            ga = gm if m_inner else gn
            shared = min(per_step_tiles, ga)  # blocks of the operand that varies fastest
            other = min(per_step_tiles, max(1, -(-per_step_tiles // ga)))
            uniq_a, uniq_b = (shared, other) if m_inner else (other, shared)
            bw = card.memory_bw_one_way
            load = (
                uniq_a * (tm * tkp * la.itemsize + pro_bytes) + uniq_b * tkr * tn * lb.itemsize
            ) / bw
            # a round's stores drain over the next round's K steps; the last round's at the end
            store = per_step_tiles * tm * tno * lo.itemsize / bw
            est = tiling.pipelined_estimate(load, comp, store, gk, steps // gk)
            cands_all.append((est, steps, tm, (tn, tno), tk, m_inner))
    if not cands_all:
        raise TilingError(
            f"spyre: matmul {a.shape}x{b.shape} cannot be tiled into the usable scratchpad "
            f"({ctx.cap} B per core)" + (f"\n  at: {n.source}" if n.source else "")
        )

    def build(tm: int, tn: int, tno: int, tk: int, m_inner: bool) -> Stage:
        gm, gn, gk = M // tm, Np // tn, K // tk
        grid = (B, gm, gn, gk)
        if gk > 1:
            lhs = Operand(ctx.name(a), (1, tm, tk), (0, 1, 3), "lhs")
            if rhs_t:
                rhs = Operand(ctx.name(b), (1, tn, tk), (0, 2, 3), "rhs")
            else:
                rhs = Operand(ctx.name(b), (1, tk, tn), (0, 3, 2), "rhs")
        else:
            lhs = Operand(ctx.name(a), (1, tm, Kp), (0, 1, -1), "lhs")
            if rhs_t:
                rhs = Operand(ctx.name(b), (1, tn, Kr), (0, 2, -1), "rhs")
            else:
                rhs = Operand(ctx.name(b), (1, K, tn), (0, -1, 2), "rhs")
        out = Operand(ctx.name(n.out), (1, tm, tno), (0, 1, 2), "out")
        steps = -(-(B * gm * gn) // ctx.ncores) * gk
        slots = 2 if steps > 1 else 1
        order = (0, 2, 1) if m_inner else None
        return matmul_stage(
            ctx, n, grid, (lhs, rhs, out), (la, lb, lo), slots, (1, tm, tn), tile_order=order
        )

    if known is not None:
        return build(*known)
    stage, choice = pick_tiling(ctx, cands_all, build)
    if key is not None:
        if len(_matmul_choices) >= MATMUL_CHOICES:
            _matmul_choices.clear()
        _matmul_choices[key] = choice
    return stage


def _matmul_general(ctx: tiling.TilingContext, n: Node, tier: tiling.Tier) -> Stage:
    """A matmul in ragged blocks: M in rows, N in whole sticks, K split across steps in whole
    lhs sticks (fp32 partial sums carried in the accumulator; a last K block past K is
    masked). Single-buffered when nothing else fits."""
    a, b = n.inputs[:2]
    la, lb, lo = ctx.layout(a), ctx.layout(b), ctx.layout(n.out)
    B, M, K = a.shape
    N = n.out.shape[2]
    rhs_t = n.params.rhs_t
    Kp, No = la.device_shape[2], lo.device_shape[2]
    if rhs_t:
        # an NT rhs [B, N, Kr]: N blocks in rows (whole output sticks; the last one may reach
        # past N: its output columns are masked), K blocks in whole sticks of both operands
        Np, Kr = N, lb.device_shape[2]
        q, qk = lo.elems_per_stick, math.lcm(la.elems_per_stick, lb.elems_per_stick)
    else:
        Np, Kr = lb.device_shape[2], K
        q, qk = math.lcm(lb.elems_per_stick, lo.elems_per_stick), la.elems_per_stick
    card = ctx.card
    al = lambda x: -(-x // card.stick_bytes) * card.stick_bytes  # noqa: E731
    tm_c = np.asarray([M] + tiling.ragged_blocks(M, 1), np.int64)
    tn_c = np.asarray([0] + tiling.ragged_blocks(N, q), np.int64)  # 0: the whole N
    tk_c = np.asarray([0] + tiling.ragged_blocks(K, qk), np.int64)  # 0: the whole K
    TM, TN, TK = (x.reshape(-1) for x in np.meshgrid(tm_c, tn_c, tk_c, indexing="ij"))
    wn, wk = TN == 0, TK == 0
    gm = -(-M // TM)
    gn = np.where(wn, 1, -(-N // np.maximum(TN, 1)))
    gk = np.where(wk, 1, -(-K // np.maximum(TK, 1)))
    tn_r = np.where(wn, Np, TN)  # the rhs block's (and the accumulator's) N
    tn_o = np.where(wn, No, TN)
    tkp = np.where(wk, Kp, TK)  # the lhs block's K
    tkr = np.where(wk, Kr, TK)  # the rhs block's K
    ntiles = B * gm * gn
    steps = -(-ntiles // ctx.ncores) * gk
    alv = np.vectorize(al, otypes=[np.int64])
    best = None
    for single in (False, True) if tier is tiling.Tier.SINGLE else (False,):
        slots = np.where(single | (steps > 1), np.where(single, 1, 2), 1)
        plan = (
            alv(TM * tkp * la.itemsize) * slots
            + alv(tkr * tn_r * lb.itemsize) * slots
            + alv(TM * tn_o * lo.itemsize) * slots
            + alv(TM * tn_r * 4)
        )
        ok = plan <= ctx.cap
        if not ok.any():
            continue
        per = np.minimum(ntiles, ctx.ncores)
        uniq_a = np.minimum(per, np.maximum(1, -(-per // gn)))
        uniq_b = np.minimum(per, gn)
        load = (uniq_a * TM * tkp * la.itemsize + uniq_b * tkr * tn_r * lb.itemsize) / (
            card.memory_bw_one_way
        )
        comp = 2 * TM * tn_r * tkp / card.pe_flops_sustained_per_core
        over = 0.0 if not single else 1.0
        est = load + (steps - 1) * (np.maximum(load, comp) + over * np.minimum(load, comp))
        est = est + comp + steps * tiling.STEP_OVERHEAD_S
        est = np.where(ok, est, np.inf)
        fastest = est.min()
        near = np.flatnonzero(est <= 1.1 * fastest)
        pick = near[np.lexsort((est[near], steps[near]))[0]]
        best = (int(TM[pick]), int(TN[pick]), int(TK[pick]), single)
        break
    if best is None:  # even blocks of one stick do not fit: about this much
        raise tiling.NoFit(
            al(la.elems_per_stick * la.itemsize)
            + al(lb.elems_per_stick * q * lb.itemsize)
            + al(q * lo.itemsize)
            + al(q * 4)
        )
    tm, tn, tk, single = best
    whole_n, whole_k = tn == 0, tk == 0
    gm = -(-M // tm)
    gn = 1 if whole_n else -(-N // tn)
    gk = 1 if whole_k else -(-K // tk)
    grid = (B, gm, gn, gk)
    tn_r, tn_o = (Np, No) if whole_n else (tn, tn)
    if whole_k:
        lhs = Operand(ctx.name(a), (1, tm, Kp), (0, 1, -1), "lhs")
        rblk, rdims = ((1, tn_r, Kr), (0, 2, -1)) if rhs_t else ((1, K, tn_r), (0, -1, 2))
    else:
        lhs = Operand(ctx.name(a), (1, tm, tk), (0, 1, 3), "lhs")
        rblk, rdims = ((1, tn_r, tk), (0, 2, 3)) if rhs_t else ((1, tk, tn_r), (0, 3, 2))
    rhs = Operand(ctx.name(b), rblk, rdims, "rhs")
    out = Operand(ctx.name(n.out), (1, tm, tn_o), (0, 1, 2), "out")
    steps = -(-(B * gm * gn) // ctx.ncores) * gk
    slots = 1 if single else (2 if steps > 1 else 1)
    return matmul_stage(ctx, n, grid, (lhs, rhs, out), (la, lb, lo), slots, (1, tm, tn_r))


def plan_matmul(ctx: tiling.TilingContext, n: Node) -> list[Stage]:
    """A matmul node's stage, from the first tier that fits. A fused matmul (an epilogue or a
    prologue) has whole blocks only: the unfuse pass has split the ones that do not fit."""
    fused = n.params.prologue is not None or n.params.epilogue is not None
    what = f"matmul {n.inputs[0].shape}x{n.inputs[1].shape}" + (
        " with its fused epilogue or prologue (the unfuse pass splits one that does not fit)"
        if fused
        else ""
    )
    tiers = (tiling.Tier.WHOLE,) if fused else tiling.TIERS
    return tiling.plan_node(ctx, n, what, _matmul_stage_whole, _matmul_general, tiers)


def fits_whole(n: Node, card: CardSpec) -> bool:
    """Whether the matmul node ``n`` (with its fused epilogue or prologue) has a tiling in
    whole blocks on ``card`` (a dry run of the search: no stage is built). The unfuse pass
    asks this of every fused matmul."""
    return tiling.fits(card, n, lambda ctx, n: _matmul_stage_whole(ctx, n, dry=True))


class FusedMap:
    """A map fused into a matmul stage, in blocks: its operands besides the matmul's own tile
    (read in windows of their views), their layouts, and its body with each view made local to
    its block. :func:`epilogue_blocks`: on the output blocks; :func:`prologue_blocks`: on the
    lhs blocks."""

    def __init__(
        self,
        ctx: tiling.TilingContext,
        body: MapBody | None,
        slot: int,
        inputs: tuple[Var, ...],
        bl: dict[int, int | None],
        prefix: str,
        grid_axes: tuple[int, ...],
    ):
        """``body`` reads the matmul's tile as its input ``slot`` and ``inputs`` as the others,
        in blocks ``bl`` of its space dims; space dim g is the stage grid's axis
        ``grid_axes[g]``."""
        self.operands: list[Operand] = []
        self.layouts: list[TensorLayout] = []
        self.body: MapBody | None = None
        self.slot = slot
        if body is None:
            return
        views = list(body.views)
        for i, v in enumerate(inputs):
            j = i if i < slot else i + 1
            lay = ctx.layout(v)
            blk, gd, org, stp, local = tiling.window(lay, body.views[j], body.space, bl)
            gd = tuple(grid_axes[d] if d >= 0 else d for d in gd)
            self.operands.append(Operand(ctx.name(v), blk, gd, f"{prefix}{i}", org, stp))
            self.layouts.append(lay)
            views[j] = local
        self.body = MapBody(body.space, tuple(views), body.program, "", (), body.out_dtype)

    def plan_items(self) -> list[tuple[tuple[int, ...], str]]:
        """The scratchpad blocks of its operands (one buffer each)."""
        return [(op.block, lay.dtype) for op, lay in zip(self.operands, self.layouts, strict=True)]


def epilogue_blocks(ctx: tiling.TilingContext, n: Node, tm: int, tno: int) -> FusedMap:
    """A matmul node's epilogue for output blocks ``[1, tm, tno]``: its operands are the node's
    inputs past the rhs (a prologue's come after them)."""
    ep = n.params.epilogue
    extras = matmul_inputs(n)[2]
    bl: dict[int, int | None] = {0: 1, 1: tm, 2: tno}
    body, slot = (ep.body, ep.slot) if ep is not None else (None, 0)
    return FusedMap(ctx, body, slot, extras, bl, "e", (0, 1, 2))


def prologue_blocks(ctx: tiling.TilingContext, n: Node, tm: int, tk: int | None) -> FusedMap:
    """A matmul node's prologue for lhs blocks ``[1, tm, tk]`` (``tk`` None: the whole K, one
    block): its operands are the node's last inputs, a block of each loaded with the lhs's on
    every step; the lhs's K is the grid's axis 3."""
    pro = n.params.prologue
    extras = matmul_inputs(n)[3]
    bl: dict[int, int | None] = {0: 1, 1: tm, 2: tk}
    body, slot = (pro.body, pro.slot) if pro is not None else (None, 0)
    return FusedMap(ctx, body, slot, extras, bl, "p", (0, 1, 3))


def _resident(ctx: tiling.TilingContext, name: str) -> bool:
    """``name`` is a constant of the kernel, or a view of one (laid out once, when loaded)."""
    base = dict(ctx.aliases)
    while ctx.decls[name].role == "view" and name in base:
        name = base[name]
    return ctx.decls[name].role == "const"


def nt_form(ctx: tiling.TilingContext, n: Node, rhs: str, out_dtype: str) -> tuple[str, int]:
    """The card's form of an NT product ``[B, M, K] x [B, N, K]`` (both operands sticked on
    K; the PE takes input 2 sticked on N) and the bytes its restickify reads and writes per
    call (``relayout_bw``): a constant rhs is laid out once (``"resident"``, 0); else the
    cheaper of the rhs restickified (``"rhs"``: ``N x K`` read and written) and the product
    swapped (``"swap"``: ``rhs @ lhs^T``, the lhs restickified to ``[K, M]`` and the ``[N, M]``
    product back to ``[M, N]``; a decode step's few rows make it the cheap one)."""
    if _resident(ctx, rhs):
        return "resident", 0
    (B, M, K), N = n.inputs[0].shape, n.out.shape[2]
    a, b = (DTYPES[v.dtype] for v in n.inputs[:2])
    o = DTYPES[out_dtype]
    sb = ctx.card.stick_bytes

    def moved(rows: int, cols: int, size: int) -> int:
        # a [rows, cols] matrix read as stored (sticks along cols) and written sticked on rows
        return B * (rows * _pad(cols, sb // size) + cols * _pad(rows, sb // size)) * size

    forms = {"rhs": moved(N, K, b), "swap": moved(M, K, a) + moved(N, M, o)}
    form = min(forms, key=lambda f: (forms[f], f))
    return form, forms[form]


def _pad(x: int, per_stick: int) -> int:
    return -(-x // per_stick) * per_stick


def matmul_stage(
    ctx: tiling.TilingContext,
    n: Node,
    grid: tuple[int, ...],
    operands: tuple[Operand, Operand, Operand],
    layouts: tuple[TensorLayout, TensorLayout, TensorLayout],
    slots: int,
    acc_block: tuple[int, ...],
    tile_order: tuple[int, ...] | None = None,
) -> Stage:
    """The matmul stage over ``grid`` (axis 3 is K) for operand blocks already chosen: the
    scratchpad plan (lhs, rhs, an fp32 accumulator of ``acc_block``, out, and an epilogue's
    operands), the tables, the flops. Shared by the whole-block and the general tilers."""
    lhs, rhs, out = operands
    la, lb, lo = layouts
    B, M, K = n.inputs[0].shape  # [B, M, K] x [B, K, N] (or [B, N, K]: rhs_t)
    rhs_t = n.params.rhs_t
    N = n.out.shape[2]
    # an NT rhs in N blocks that do not divide N: the last block's rows past N load as NaN
    n_mask = N if rhs_t and N % rhs.block[1] else 0
    ep = epilogue_blocks(ctx, n, out.block[1], out.block[2])
    pro = prologue_blocks(ctx, n, lhs.block[1], lhs.block[2] if lhs.grid_dims[2] >= 0 else None)
    scratch = ctx.sp_plan(
        [
            ("lhs", lhs.block, la.dtype, slots),
            ("rhs", rhs.block, lb.dtype, slots),
            ("acc", acc_block, "float32", 1),
            ("out", out.block, lo.dtype, slots),
        ]
        + [
            (op.sp, op.block, lay.dtype, slots)
            for op, lay in zip(ep.operands + pro.operands, ep.layouts + pro.layouts, strict=True)
        ]
    )
    tabs = tiling.step_tables(
        grid,
        [lhs, rhs, *ep.operands, *pro.operands, out],
        [la, lb, *ep.layouts, *pro.layouts, lo],
        ctx.ncores,
        reduce_axis=3,
        tile_order=tile_order,
        last_only=frozenset(range(2, 2 + len(ep.operands))),
    )
    sfu = flops = pro_sfu = 0
    if ep.body is not None:
        sfu, flops = tiling.map_work(ep.body, ctx.card)
    if pro.body is not None:
        # the SFUs run it once over the lhs per N block (each block's K loop loads the lhs);
        # its flops count once, as the unfused map's did
        pro_sfu, pro_flops = tiling.map_work(pro.body, ctx.card)
        sfu += pro_sfu * grid[2]
        flops += pro_flops
    form, moved = nt_form(ctx, n, rhs.tensor, lo.dtype) if rhs_t else ("", 0)
    step = MatmulStep(
        k_logical=K,
        out_dtype=n.params.dtype,
        rhs_t=rhs_t,
        nt_form=form,
        relayout_bytes=moved,
        n_logical=n_mask,
        epilogue=ep.body,
        acc_slot=ep.slot,
        prologue=pro.body,
        lhs_slot=pro.slot,
        prologue_sfu=pro_sfu,
    )
    return Stage(
        name=f"s{len(ctx.stages)}",
        grid=grid,
        reduce_axis=3,
        inputs=(lhs, rhs, *ep.operands, *pro.operands),
        output=out,
        scratch=scratch,
        step=step,
        **tabs,
        flops=2 * B * M * N * K + flops,
        sfu_elem_ops=sfu,
        source=n.source,
    )

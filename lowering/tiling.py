"""What the tiler's stage builders share: the tiling context (the card's figures, the tensors
declared so far), the choice of block sizes, the scratchpad plans and the work division tables
(loads, ring forwards, stores per step and core). :mod:`lowering.schedule` builds the stages
with them; :mod:`lowering.tile_map` and :mod:`lowering.tile_moves` hold the general tilings
(ragged blocks, windows, split reductions) used when no tiling in whole blocks fits.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from device_model.card import CardSpec
from device_model.kernel import Operand, SpBuf, Stage, TensorDecl, operand_grid
from device_model.layout import DTYPES, TensorLayout, layout_for
from device_model.ops import (
    ROW_REDUCTIONS,
    TRANSCENDENTAL,
    InputView,
    MapBody,
)
from device_model.steps import MatmulStep

from .errors import TilingError
from .graph import Node, Var, matmul_inputs


def _align(n: int, a: int) -> int:
    """``n`` rounded up to a multiple of ``a`` (the card's stick size)."""
    return -(-n // a) * a


def _divisors(n: int) -> list[int]:
    out = set()
    for i in range(1, int(math.isqrt(n)) + 1):
        if n % i == 0:
            out.add(i)
            out.add(n // i)
    return sorted(out)


def _cands(extent: int, quantum: int) -> list[int]:
    """Block sizes for a dim: divisors of ``extent`` that are multiples of ``quantum``."""
    return [d for d in _divisors(extent) if d % quantum == 0] or [extent]


class _Ctx:
    def __init__(self, card: CardSpec):
        self.card = card
        self.cap = card.scratchpad_usable_bytes
        self.ncores = card.num_cores
        self.decls: dict[str, TensorDecl] = {}
        self.aliases: list[tuple[str, str]] = []
        self.stages: list[Stage] = []
        self.names: dict[int, str] = {}
        self.counter = 0

    def name(self, v: Var) -> str:
        return self.names[v.id]

    def plan_bytes(self, blocks: list[tuple[tuple[int, ...], str]], slots: int) -> int:
        return _plan_bytes(blocks, slots, self.card.stick_bytes)

    def sp_plan(self, bufs: list[tuple[str, tuple[int, ...], str, int]]) -> tuple[SpBuf, ...]:
        return _sp_plan(bufs, self.card.stick_bytes)

    def layout(self, v: Var) -> TensorLayout:
        return self.decls[self.name(v)].layout

    def dtypes(self) -> dict[str, str]:
        """Each declared tensor's dtype, by name (what the timing model reads)."""
        return {nm: d.layout.dtype for nm, d in self.decls.items()}

    def declare(self, v: Var, role: str, name: str | None = None) -> str:
        if v.id in self.names:
            return self.names[v.id]
        nm = name or f"t{len(self.names)}"
        self.names[v.id] = nm
        self.decls[nm] = TensorDecl(nm, layout_for(v.shape, v.dtype, self.card.stick_bytes), role)
        return nm

    def mark(self) -> int:
        """A mark to :meth:`rollback` to: the views declared so far."""
        return len(self.aliases)

    def rollback(self, mark: int) -> None:
        """Forget the views declared since ``mark`` (a tiling attempt that did not fit)."""
        for view, _ in self.aliases[mark:]:
            del self.decls[view]
        del self.aliases[mark:]

    def view(self, base: str, shape: tuple[int, ...], dtype: str) -> str:
        nm = f"{base}_v{len(self.aliases)}"
        self.decls[nm] = TensorDecl(nm, layout_for(shape, dtype, self.card.stick_bytes), "view")
        self.aliases.append((nm, base))
        return nm


def _choose(
    extents: list[int],
    cands: list[list[int]],
    plan_bytes: Callable[[list[int], bool], int],
    cap: int,
    ncores: int,
    what: str,
    source: str,
) -> list[int]:
    """Blocks per dim: enough tiles for the cores, the largest that fit (outer dims first)."""
    blocks = [max(c) for c in cands]

    def tiles(bl: list[int]) -> int:
        return math.prod(e // b for e, b in zip(extents, bl, strict=True))

    for d in range(len(extents)):
        if tiles(blocks) >= ncores:
            break
        need = -(-ncores // tiles(blocks))
        # largest block along d that still gives `need` more tiles (else the smallest block)
        ok = [b for b in cands[d] if extents[d] // b >= need]
        blocks[d] = max(ok) if ok else min(cands[d])
    while plan_bytes(blocks, tiles(blocks) > ncores) > cap:
        for d in range(len(extents)):
            smaller = [b for b in cands[d] if b < blocks[d]]
            if smaller:
                blocks[d] = max(smaller)
                break
        else:
            need = plan_bytes(blocks, tiles(blocks) > ncores)
            raise TilingError(
                f"spyre: {what} cannot be tiled into the usable scratchpad ({cap} B per core): "
                f"the smallest tiling needs {need} B" + (f"\n  at: {source}" if source else "")
            )
    return blocks


def _tables(
    grid: tuple[int, ...],
    operands: list[Operand],
    layouts: list[TensorLayout],
    ncores: int,
    reduce_axis: int = -1,
    store_every: bool = False,
    reverse: bool = False,
    tile_order: tuple[int, ...] | None = None,
    last_only: frozenset[int] = frozenset(),
) -> dict[str, tuple]:
    """Build loads/ring/stores/first/last for ``operands`` (the last is the output), as the
    :class:`~device_model.kernel.Stage` keywords.

    Tiles (the grid without ``reduce_axis``) are dealt to the cores in order, tile ``p`` to core
    ``p % ncores`` at step group ``p // ncores``: tiles are numbered row-major over the grid's
    axes, or over ``tile_order`` (grid axes, slowest first; a matmul deals M fastest so that
    the cores of a step share one rhs block). Each group runs the ``reduce_axis`` blocks in
    order (``reverse``: last first) over consecutive steps. The output is stored after the last
    of them (``store_every``: after each). A block several cores need in one step is loaded by
    the first of them and forwarded over the ring; a window that lies wholly outside its tensor
    is not loaded (-1). Inputs in ``last_only`` (indices) are loaded only on the last
    ``reduce_axis`` step of each tile (a matmul epilogue's operands: read once, at the end).
    """
    par_axes = [a for a in range(len(grid)) if a != reduce_axis]
    par_grid = [grid[a] for a in par_axes]
    ntiles = math.prod(par_grid)
    nk = grid[reduce_axis] if reduce_axis >= 0 else 1
    psteps = -(-ntiles // ncores)
    T = psteps * nk
    srow = np.repeat(np.arange(psteps), nk)
    kk = np.tile(np.arange(nk), psteps)
    p = srow[:, None] * ncores + np.arange(ncores)[None, :]  # [T, C]
    valid = p < ntiles
    pc = np.where(valid, p, 0)
    coords: dict[int, np.ndarray] = {}
    if par_grid:
        order = list(tile_order) if tile_order is not None else par_axes
        if sorted(order) != par_axes:
            raise ValueError(f"tile_order {tile_order} is not a permutation of axes {par_axes}")
        un = np.unravel_index(pc, [grid[a] for a in order])
        for i, a in enumerate(order):
            coords[a] = np.asarray(un[i], np.int64)
    if reduce_axis >= 0:
        kc = (nk - 1 - kk) if reverse else kk
        coords[reduce_axis] = np.broadcast_to(kc[:, None], (T, ncores)).astype(np.int64)
    zero = np.zeros((T, ncores), np.int64)

    def block_ids(op: Operand, lay: TensorLayout) -> np.ndarray:
        dev = lay.device_shape
        og = operand_grid(op, dev)
        idx = np.zeros((T, ncores), np.int64)
        ok = valid.copy()
        for d, g in enumerate(op.grid_dims):
            cd = coords.get(g, zero) if g >= 0 else zero
            start = op.origins[d] + cd * op.steps[d]
            ok &= (cd < og[d]) & (start < dev[d]) & (start + op.block[d] > 0)
            idx = idx * og[d] + np.clip(cd, 0, og[d] - 1)
        return np.where(ok, idx, -1)

    nin = len(operands) - 1
    loads = np.full((T, nin, ncores), -1, np.int64)
    ring = np.full((T, nin, ncores), -1, np.int64)
    cores = np.arange(ncores)
    lastk = kk == nk - 1
    for i, (op, lay) in enumerate(zip(operands[:-1], layouts[:-1], strict=True)):
        b = block_ids(op, lay)
        if i in last_only:
            b = np.where(lastk[:, None], b, -1)
        for t0 in range(0, T, 2048):  # the owner of each block: the first core holding it
            bb = b[t0 : t0 + 2048]
            owner = np.argmax(bb[:, :, None] == bb[:, None, :], axis=2)
            have = bb >= 0
            loads[t0 : t0 + 2048, i] = np.where(have & (owner == cores), bb, -1)
            ring[t0 : t0 + 2048, i] = np.where(have & (owner != cores), owner, -1)
    ob = block_ids(operands[-1], layouts[-1])
    stores = ob if store_every else np.where(lastk[:, None], ob, -1)
    lt = loads.tolist()
    rt = ring.tolist()
    return {
        "loads": tuple(tuple(tuple(r) for r in step) for step in lt),
        "ring": tuple(tuple(tuple(r) for r in step) for step in rt),
        "stores": tuple(tuple(r) for r in stores.tolist()),
        "first": tuple(bool(x) for x in kk == 0),
        "last": tuple(bool(x) for x in lastk),
    }


def _sp_plan(bufs: list[tuple[str, tuple[int, ...], str, int]], stick: int) -> tuple[SpBuf, ...]:
    """Lay the buffers out one after another, each slot a whole number of sticks."""
    out, off = [], 0
    for name, block, dtype, slots in bufs:
        sb = _align(math.prod(block) * DTYPES[dtype], stick)
        out.append(SpBuf(name, off, sb, slots, tuple(block), dtype))
        off += sb * slots
    return tuple(out)


def _plan_bytes(blocks: list[tuple[tuple[int, ...], str]], slots: int, stick: int) -> int:
    """Scratchpad bytes of buffers for ``blocks``, ``slots`` each, each slot whole sticks."""
    return sum(_align(math.prod(b) * DTYPES[d], stick) * slots for b, d in blocks)


#: map-program ops that move or retype data and do no arithmetic (no flops)
_MOVES = frozenset({"const", "copy", "convert", "select_n"})


def _op_extents(body: MapBody) -> list[int]:
    """Per program op, the elements it computes: the product of the space dims its result varies
    along (an op on a row's reduced value, or on a broadcast input, runs once per row)."""
    dims: list[frozenset[int]] = [
        frozenset(g for j, g in enumerate(v.dims) if g >= 0 and not v.bcast[j]) for v in body.views
    ]
    out = []
    for op, args, param, _ in body.program:
        d = frozenset().union(*(dims[a] for a in args)) if args else frozenset()
        if op in ROW_REDUCTIONS:
            d = d - set(param)
        dims.append(d)
        out.append(math.prod(body.space[g] for g in d))
    return out


def _map_work(body: MapBody, card: CardSpec) -> tuple[int, int]:
    """(SFU element-ops, flops) of a map body over its whole space.

    SFU: one pass per element of each op (``sfu_ops_per_elem_transcendental`` for
    transcendental ones; an in-program reduction reads every element of its input once) and one
    per element for the final reduction. Flops as XLA's cost analysis counts them: one per
    element per arithmetic op (moves, converts and selects count none); an in-program reduction
    counts one per element reduced.
    """
    sfu = flops = 0
    full = math.prod(body.space)
    for (op, _args, param, _), n in zip(body.program, _op_extents(body), strict=True):
        if op == "const":
            continue
        if op in ROW_REDUCTIONS:
            n *= math.prod(body.space[a] for a in param)
        sfu += n * (card.sfu_ops_per_elem_transcendental if op in TRANSCENDENTAL else 1)
        if op not in _MOVES:
            flops += n
    if body.reduce:
        sfu += full
        flops += full
    return sfu, flops


def _describe(body: MapBody) -> str:
    ops = [p[0] for p in body.program if p[0] != "const"]
    return ",".join(ops[:6]) + (f" then {body.reduce}" if body.reduce else "")


#: the tiler's guess at a step's fixed cost when it ranks matmul tilings (a tie-breaker that
#: favours fewer steps; a heuristic of the tiler, not a figure of the card or the timing model)
_STEP_OVERHEAD_S = 1e-7


class _NoFit(Exception):
    """No tiling of this shape fits; ``need``: the bytes the smallest one needs."""

    def __init__(self, need: int):
        super().__init__(need)
        self.need = need


def _ragged_cands(extent: int, quantum: int) -> list[int]:
    """Block sizes below ``extent`` for a dim cut in blocks of ``quantum`` that need not divide
    it: the extent in ``n`` balanced blocks (n = 2, 3, ...; sparser for large n) and the exact
    divisors, largest first. The whole dim is not among them (the caller's None)."""
    units = -(-extent // quantum)
    if units <= 1:
        return []
    out: set[int] = set()
    n = 2
    while n <= units:
        out.add(-(-units // n) * quantum)
        n = n + 1 if n < 48 else max(n + 1, int(n * 1.08))
    for d in _divisors(units):
        out.add(d * quantum)
    return sorted((b for b in out if b < extent), reverse=True)


def _choose_general(
    extents: dict[int, int],
    cands: dict[int, list[int]],
    par: list[int],
    seq: list[int],
    plan: Callable[[dict[int, int | None], bool], int],
    cap: int,
    ncores: int,
) -> dict[int, int | None]:
    """Blocks per dim (None: the whole dim): parallel dims ``par`` cut until the tiles cover the
    cores (outer dims first), then every dim shrunk, outer parallel dims first and the
    sequential dims ``seq`` last, until ``plan(blocks, several_steps)`` fits ``cap``."""
    bl: dict[int, int | None] = {g: None for g in (*par, *seq)}

    def count(g: int) -> int:
        b = bl[g]
        return 1 if b is None else -(-extents[g] // b)

    def steps() -> int:
        tiles = math.prod(count(g) for g in par)
        return -(-tiles // ncores) * math.prod(count(g) for g in seq)

    for g in par:
        tiles = math.prod(count(h) for h in par)
        if tiles >= ncores:
            break
        need = -(-ncores // tiles)
        ok = [b for b in cands[g] if -(-extents[g] // b) >= need]
        if ok:
            bl[g] = max(ok)
        elif cands[g]:
            bl[g] = min(cands[g])
    order = [*par, *seq]
    while (need := plan(bl, steps() > 1)) > cap:
        for g in order:
            cur = bl[g]
            smaller = [b for b in cands[g] if cur is None or b < cur]
            if smaller:
                bl[g] = max(smaller)
                break
        else:
            raise _NoFit(need)
    return bl


def _window(
    lay: TensorLayout, view: InputView, space: tuple[int, ...], bl: dict[int, int | None]
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...], InputView]:
    """How an input is read in blocks for the space blocks ``bl``: (block, grid_dims, origin,
    step, the view of a block). Each input dim is a window of the elements the view reads:
    stick dims start at a whole stick (the view's start within the block is the remainder); a
    dim tiled along space dim g advances by ``bl[g] * stride`` per tile. A rank-0 tensor (a
    fill value) is its one stick, the same block for every step."""
    if not lay.shape:
        return lay.device_shape, (-1,), (0,), lay.device_shape, view
    blk, gd, org, stp, starts = [], [], [], [], []
    r = len(lay.shape)
    for j in range(r):
        g, st, sd, bc = view.dims[j], view.starts[j], view.strides[j], view.bcast[j]
        q = lay.elems_per_stick if j == r - 1 else 1
        o = (st // q) * q
        loc = st - o
        if g < 0 or bc:
            b, grid_dim, step = _align(loc + 1, q), -1, None
        elif bl.get(g) is None:
            b, grid_dim, step = _align(loc + (space[g] - 1) * sd + 1, q), -1, None
        else:
            bg = bl[g]
            b, grid_dim, step = _align(loc + (bg - 1) * sd + 1, q), g, bg * sd
        blk.append(b)
        gd.append(grid_dim)
        org.append(o)
        stp.append(b if step is None else step)
        starts.append(loc)
    local = InputView(view.dims, tuple(starts), view.strides, view.bcast)
    return tuple(blk), tuple(gd), tuple(org), tuple(stp), local


class FusedMap:
    """A map fused into a matmul stage, in blocks: its operands besides the matmul's own tile
    (read in windows of their views), their layouts, and its body with each view made local to
    its block. :func:`epilogue_blocks`: on the output blocks; :func:`prologue_blocks`: on the
    lhs blocks."""

    def __init__(
        self,
        ctx: _Ctx,
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
            blk, gd, org, stp, local = _window(lay, body.views[j], body.space, bl)
            gd = tuple(grid_axes[d] if d >= 0 else d for d in gd)
            self.operands.append(Operand(ctx.name(v), blk, gd, f"{prefix}{i}", org, stp))
            self.layouts.append(lay)
            views[j] = local
        self.body = MapBody(body.space, tuple(views), body.program, "", (), body.out_dtype)

    def plan_items(self) -> list[tuple[tuple[int, ...], str]]:
        """The scratchpad blocks of its operands (one buffer each)."""
        return [(op.block, lay.dtype) for op, lay in zip(self.operands, self.layouts, strict=True)]


def epilogue_blocks(ctx: _Ctx, n: Node, tm: int, tno: int) -> FusedMap:
    """A matmul node's epilogue for output blocks ``[1, tm, tno]``: its operands are the node's
    inputs past the rhs (a prologue's come after them)."""
    ep = n.params.epilogue
    extras = matmul_inputs(n)[2]
    bl: dict[int, int | None] = {0: 1, 1: tm, 2: tno}
    body, slot = (ep.body, ep.slot) if ep is not None else (None, 0)
    return FusedMap(ctx, body, slot, extras, bl, "e", (0, 1, 2))


def prologue_blocks(ctx: _Ctx, n: Node, tm: int, tk: int | None) -> FusedMap:
    """A matmul node's prologue for lhs blocks ``[1, tm, tk]`` (``tk`` None: the whole K, one
    block): its operands are the node's last inputs, a block of each loaded with the lhs's on
    every step; the lhs's K is the grid's axis 3."""
    pro = n.params.prologue
    extras = matmul_inputs(n)[3]
    bl: dict[int, int | None] = {0: 1, 1: tm, 2: tk}
    body, slot = (pro.body, pro.slot) if pro is not None else (None, 0)
    return FusedMap(ctx, body, slot, extras, bl, "p", (0, 1, 3))


def matmul_stage(
    ctx: _Ctx,
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
    tabs = _tables(
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
        sfu, flops = _map_work(ep.body, ctx.card)
    if pro.body is not None:
        # the SFUs run it once over the lhs per N block (each block's K loop loads the lhs);
        # its flops count once, as the unfused map's did
        pro_sfu, pro_flops = _map_work(pro.body, ctx.card)
        sfu += pro_sfu * grid[2]
        flops += pro_flops
    step = MatmulStep(
        k_logical=K,
        out_dtype=n.params.dtype,
        rhs_t=rhs_t,
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

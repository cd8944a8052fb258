"""What the tilers share: the tiling context (:class:`TilingContext`: the card's figures, the
tensors declared so far), the tiers every tiler tries in order (:class:`Tier`,
:func:`first_fit`), the choice of block sizes (:func:`choose_blocks` for whole blocks,
:func:`choose_general_blocks` for ragged ones), the scratchpad plans and the work division
tables (loads, ring forwards, stores per step and core: :func:`step_tables`).

There is one tiler per op kind (:mod:`lowering.tile_map`, :mod:`lowering.tile_matmul`,
:mod:`lowering.tile_gather`, :mod:`lowering.tile_reshape`, :mod:`lowering.tile_concat`), each
with a ``plan_*(ctx, node) -> list[Stage]`` that :mod:`lowering.schedule` calls through its
``PLANNERS`` table. This module's names are their public interface; no tiler imports another's
private names.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any

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
from device_model.steps import ConcatStep, GatherStep, ReshapeStep

from .errors import TilingError
from .graph import Node, Var


def align(n: int, a: int) -> int:
    """``n`` rounded up to a multiple of ``a`` (the card's stick size)."""
    return -(-n // a) * a


def divisors(n: int) -> list[int]:
    out = set()
    for i in range(1, int(math.isqrt(n)) + 1):
        if n % i == 0:
            out.add(i)
            out.add(n // i)
    return sorted(out)


def stick_blocks(extent: int, quantum: int) -> list[int]:
    """Block sizes for a dim: divisors of ``extent`` that are multiples of ``quantum``."""
    return [d for d in divisors(extent) if d % quantum == 0] or [extent]


class TilingContext:
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

    def mark(self) -> tuple[int, int]:
        """A mark to :meth:`rollback` to: the views and tensors declared so far."""
        return len(self.aliases), len(self.decls)

    def rollback(self, mark: tuple[int, int]) -> None:
        """Forget the views and temps declared since ``mark`` (a tiling attempt that did not
        fit)."""
        na, nd = mark
        for view, _ in self.aliases[na:]:
            self.decls.pop(view, None)
        del self.aliases[na:]
        for nm in list(self.decls)[nd:]:
            del self.decls[nm]

    def view(self, base: str, shape: tuple[int, ...], dtype: str) -> str:
        nm = f"{base}_v{len(self.aliases)}"
        self.decls[nm] = TensorDecl(nm, layout_for(shape, dtype, self.card.stick_bytes), "view")
        self.aliases.append((nm, base))
        return nm


def choose_blocks(
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


def step_tables(
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
        sb = align(math.prod(block) * DTYPES[dtype], stick)
        out.append(SpBuf(name, off, sb, slots, tuple(block), dtype))
        off += sb * slots
    return tuple(out)


def _plan_bytes(blocks: list[tuple[tuple[int, ...], str]], slots: int, stick: int) -> int:
    """Scratchpad bytes of buffers for ``blocks``, ``slots`` each, each slot whole sticks."""
    return sum(align(math.prod(b) * DTYPES[d], stick) * slots for b, d in blocks)


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


def map_work(body: MapBody, card: CardSpec) -> tuple[int, int]:
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


def describe(body: MapBody) -> str:
    ops = [p[0] for p in body.program if p[0] != "const"]
    return ",".join(ops[:6]) + (f" then {body.reduce}" if body.reduce else "")


#: the tiler's guess at a step's fixed cost when it ranks matmul tilings (a tie-breaker that
#: favours fewer steps; a heuristic of the tiler, not a figure of the card or the timing model)
STEP_OVERHEAD_S = 1e-7


def pipelined_estimate(load: float, comp: float, store: float, gk: int, rounds: int) -> float:
    """The tiler's estimate of a K-looped stage of ``rounds`` rounds of ``gk`` steps: the first
    step's loads, then each step the slower of its compute and the next loads, a round's stores
    draining over the next round's K steps and the last round's at the end, plus the fixed cost
    of every step (:data:`STEP_OVERHEAD_S`)."""
    return (
        load
        + gk * max(load, comp)
        + (rounds - 1) * gk * max(load + store / gk, comp)
        + store
        + rounds * gk * STEP_OVERHEAD_S
    )


class NoFit(TilingError):
    """No tiling of this shape fits; ``need``: the bytes the smallest one needs."""

    def __init__(self, need: int):
        super().__init__(f"the smallest tiling needs {need} B")
        self.need = need


class Tier(enum.Enum):
    """The kinds of tiling a tiler tries, in order (:func:`first_fit`)."""

    #: blocks that divide every dim, in whole sticks; reduced rows whole in a block
    WHOLE = "whole sticks"
    #: any dim cut in blocks that need not divide it (the last one ragged), inputs read
    #: through windows, a reduction or a matmul's K split across steps; double-buffered
    RAGGED = "ragged blocks"
    #: the same, single-buffered (one slot per buffer: a step's loads wait for the compute)
    #: where double buffering does not fit
    SINGLE = "single buffering"


#: every tier, in the order a tiler tries them
TIERS = tuple(Tier)


def plan_node(
    ctx: TilingContext,
    n: Node,
    what: str,
    whole: Callable[[TilingContext, Node], Any],
    general: Callable[[TilingContext, Node, Tier], Any],
    tiers: tuple[Tier, ...] = TIERS,
) -> list[Stage]:
    """:func:`first_fit` for the node ``n``: ``whole(ctx, n)`` for whole blocks,
    ``general(ctx, n, tier)`` past them (each a stage or a list of stages)."""

    def listed(x: Any) -> list[Stage]:
        return x if isinstance(x, list) else [x]

    return first_fit(
        ctx,
        what,
        n.source,
        lambda: listed(whole(ctx, n)),
        lambda tier: listed(general(ctx, n, tier)),
        tiers,
    )


def fits(card: CardSpec, n: Node, dry_run: Callable[[TilingContext, Node], Any]) -> bool:
    """Whether ``dry_run(ctx, n)`` (a tiler's choice of blocks, building nothing) finds a
    tiling for the node ``n`` alone on ``card`` (its inputs and outputs declared as temps)."""
    ctx = TilingContext(card)
    for v in (*n.inputs, *n.outputs):
        ctx.declare(v, "temp")
    try:
        dry_run(ctx, n)
    except TilingError:
        return False
    return True


def double_or_single(tier: Tier, choose: Callable[[bool], Any]) -> tuple[Any, bool]:
    """``choose(single)``'s choice double-buffered, or, in the :attr:`Tier.SINGLE` tier when
    that does not fit, single-buffered; and whether it is single. NoFit when neither fits."""
    try:
        return choose(False), False
    except NoFit:
        if tier is not Tier.SINGLE:
            raise
    return choose(True), True


def slots_for(single: bool, multi: bool) -> int:
    """Slots per buffer: two when a stage runs several steps (double buffering), one when it
    runs one or is single-buffered."""
    return 1 if single else (2 if multi else 1)


def first_fit(
    ctx: TilingContext,
    what: str,
    source: str,
    whole: Callable[[], list[Stage]],
    general: Callable[[Tier], list[Stage]],
    tiers: tuple[Tier, ...] = TIERS,
) -> list[Stage]:
    """The stages of the first tier whose tiling fits, for each of ``tiers`` in order:
    ``whole()`` for :attr:`Tier.WHOLE`, ``general(tier)`` for the others. A tier that does not
    fit (TilingError) leaves the context as it found it (its views and temps forgotten). When
    none fits, a TilingError naming ``what``, the usable scratchpad, what the smallest tiling
    needs and the user's line ``source``."""
    needs: list[int] = []
    first: TilingError | None = None
    for tier in tiers:
        mark = ctx.mark()
        try:
            return whole() if tier is Tier.WHOLE else general(tier)
        except TilingError as err:
            ctx.rollback(mark)
            first = first or err
            if isinstance(err, NoFit):
                needs.append(err.need)
    need = f": the smallest tiling needs {min(needs)} B" if needs else ""
    tried = ", ".join(t.value for t in tiers)
    raise TilingError(
        f"spyre: {what} cannot be tiled into the usable scratchpad ({ctx.cap} B per core)"
        f"{need} (tried {tried})" + (f"\n  at: {source}" if source else "")
    ) from first


def ragged_blocks(extent: int, quantum: int) -> list[int]:
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
    for d in divisors(units):
        out.add(d * quantum)
    return sorted((b for b in out if b < extent), reverse=True)


def choose_general_blocks(
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
            raise NoFit(need)
    return bl


def window(
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
            b, grid_dim, step = align(loc + 1, q), -1, None
        elif bl.get(g) is None:
            b, grid_dim, step = align(loc + (space[g] - 1) * sd + 1, q), -1, None
        else:
            bg = bl[g]
            b, grid_dim, step = align(loc + (bg - 1) * sd + 1, q), g, bg * sd
        blk.append(b)
        gd.append(grid_dim)
        org.append(o)
        stp.append(b if step is None else step)
        starts.append(loc)
    local = InputView(view.dims, tuple(starts), view.strides, view.bcast)
    return tuple(blk), tuple(gd), tuple(org), tuple(stp), local


def lsu_stage(
    ctx: TilingContext,
    name: str,
    grid: tuple[int, ...],
    inputs: tuple[Operand, ...],
    out: Operand,
    lays: list[TensorLayout],
    scratch: Any,
    step: ReshapeStep | ConcatStep | GatherStep,
    source: str,
) -> Stage:
    """A data-movement stage (a reshape, concat or gather ``step``: the LSU moves the inputs'
    blocks, or the rows they index, into ``out``'s) over ``grid``, with its scratchpad plan and
    step tables (``lays``: the inputs' layouts, then the output's)."""
    tabs = step_tables(grid, [*inputs, out], lays, ctx.ncores)
    return Stage(
        name=name,
        grid=grid,
        inputs=inputs,
        output=out,
        scratch=scratch,
        step=step,
        **tabs,
        source=source,
    )


def one_input_stage(
    ctx: TilingContext,
    name: str,
    grid: tuple[int, ...],
    operands: tuple[Operand, Operand],
    lays: tuple[TensorLayout, TensorLayout],
    dtypes: tuple[str, str],
    slots: int,
    step: ReshapeStep | GatherStep,
    source: str,
) -> Stage:
    """An LSU stage of one input (a re-layout's rows, a gather's indices): ``operands`` (the
    input, the output) each through a buffer of ``slots`` slots of its dtype in ``dtypes``."""
    iop, out = operands
    scratch = ctx.sp_plan(
        [(iop.sp, iop.block, dtypes[0], slots), (out.sp, out.block, dtypes[1], slots)]
    )
    return lsu_stage(ctx, name, grid, (iop,), out, list(lays), scratch, step, source)

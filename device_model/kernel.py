"""The schedule IR: what the card executes.

A :class:`Kernel` is one device-compute operation: the device-memory tensors it touches and a
sequence of :class:`Stage` s. A stage is a tiled loop distributed over the cores. Every stage has
the same anatomy, which is the card's: for each *step*, each core's load/store unit loads whole
stick blocks of its input tensors from device memory into explicit scratchpad buffers (or receives
them from another core over the ring, when several cores need the same block in the same step),
the core's PEs or SFUs compute on scratchpad buffers only, and the load/store unit stores the
output block back. Input and output buffers have two slots when a stage has more than one step
(double buffering: step t+1's loads go to the other slot while step t computes).

Work division is data, computed by the tiler and kept here as tables over (step, core):

* ``loads[t][i][c]``: block index of input ``i`` that core ``c`` loads from device memory at step
  ``t`` (-1: none),
* ``ring[t][i][c]``: the core that forwards input ``i``'s block to core ``c`` over the ring at step
  ``t`` (-1: none); the source loads that block in the same step,
* ``stores[t][c]``: block index of the output that core ``c`` stores after step ``t`` (-1: none).

Block indices are row-major over the operand's block grid (:func:`operand_grid`). Block ``i``
along a device dim covers the elements ``[origin + i * step, origin + i * step + block)`` of that
dim (by default ``origin = 0`` and ``step = block``: consecutive blocks). A block may reach past
the tensor's device extent (a *ragged* edge block, or a window that starts before element 0): a
load copies the part inside the tensor and fills the rest of the slot with all-ones bytes (it
reads as uninitialized scratchpad: NaN), a store writes only the part inside the tensor. Windows
(``origin``/``step`` other than the default) let a stage read a slice, a strided slice or a
shifted part of an input (concatenation) in blocks; outputs are always consecutive blocks.

A stage with a sequential ``reduce_axis`` (matmul's K, a long reduction split across steps)
visits the same output block over several consecutive steps, accumulating in a scratchpad
accumulator; ``first``/``last`` flag those steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .layout import DTYPES, TensorLayout
from .steps import (
    STEP_KINDS,
    ConcatStep,
    GatherStep,
    MapStep,
    MatmulStep,
    ReshapeStep,
    SortStep,
    Step,
    TakeStep,
)

__all__ = [
    "TensorDecl",
    "Operand",
    "SpBuf",
    "Stage",
    "Kernel",
    "ScheduleError",
    "check_kernel",
    "step_reads",
    "format_kernel",
    "blocks_of",
    "operand_grid",
    "block_window",
    "resolve_aliases",
]


class ScheduleError(ValueError):
    """A schedule that breaks an invariant of the schedule IR (raised by :func:`check_kernel`)."""


@dataclass(frozen=True, slots=True)
class TensorDecl:
    """A device-memory tensor a kernel touches. role: input, output, temp or const."""

    name: str
    layout: TensorLayout
    role: str


@dataclass(frozen=True, slots=True)
class SpBuf:
    """A scratchpad buffer: same offset on every core, ``slots`` copies of ``slot_bytes`` each."""

    name: str
    offset: int
    slot_bytes: int
    slots: int
    block: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.slots

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True, slots=True)
class Operand:
    """One device tensor read or written in blocks by a stage.

    ``grid_dims[d]`` is the grid axis that indexes the block along device dim ``d``, or -1 when
    one block (block 0) serves every tile. ``sp`` names the scratchpad buffer the block goes
    through. ``origin``/``step`` (per device dim; empty: 0 and ``block``) place block ``i`` at
    the elements ``[origin + i * step, origin + i * step + block)`` of the dim (see the module
    docstring: windows and ragged edge blocks). ``pad_value``: what the part of a block outside
    the tensor reads as; None leaves the scratchpad's uninitialized bytes there (NaN), a number
    is written by the load unit (the zero halo of a convolution's input window).
    """

    tensor: str
    block: tuple[int, ...]
    grid_dims: tuple[int, ...]
    sp: str
    origin: tuple[int, ...] = ()
    step: tuple[int, ...] = ()
    pad_value: float | None = None

    @property
    def origins(self) -> tuple[int, ...]:
        return self.origin or (0,) * len(self.block)

    @property
    def steps(self) -> tuple[int, ...]:
        return self.step or self.block

    @property
    def windowed(self) -> bool:
        """Blocks other than consecutive ones from element 0."""
        return self.origins != (0,) * len(self.block) or self.steps != self.block


def blocks_of(device_shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    """The block grid of a tensor in consecutive blocks: how many blocks along each device dim
    (the last one ragged when a block does not divide the dim)."""
    return tuple(max(1, -(-d // b)) for d, b in zip(device_shape, block, strict=True))


def operand_grid(op: Operand, device_shape: tuple[int, ...]) -> tuple[int, ...]:
    """How many blocks an operand's windows make along each device dim: every block that starts
    before the dim's end (at least one)."""
    return tuple(
        max(1, -(-(d - o) // s)) for d, o, s in zip(device_shape, op.origins, op.steps, strict=True)
    )


def block_window(
    op: Operand, device_shape: tuple[int, ...], index: int
) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
    """Where block ``index`` (row-major over :func:`operand_grid`) of an operand lies: the
    slices of the device tensor inside it, and where they land in the block (the rest of the
    block lies outside the tensor). IndexError for an index past the grid."""
    grid = operand_grid(op, device_shape)
    n = math.prod(grid)
    if not 0 <= index < n:
        raise IndexError(f"block {index} out of range for {n} blocks of {op.block}")
    rest = index
    coord = []
    for g in reversed(grid):
        coord.append(rest % g)
        rest //= g
    coord.reverse()
    src, dst = [], []
    for c, d, o, s, b in zip(coord, device_shape, op.origins, op.steps, op.block, strict=True):
        start = o + c * s
        lo, hi = max(start, 0), min(start + b, d)
        hi = max(hi, lo)
        src.append(slice(lo, hi))
        dst.append(slice(lo - start, hi - start))
    return tuple(src), tuple(dst)


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    """One tiled loop of a kernel, built with keywords.

    ``step`` is what every core's units do on their scratchpad tiles at each step (one of the
    per-kind classes of :mod:`device_model.steps`); the stage's ``kind`` (map, matmul, gather,
    reshape or concat) and ``unit`` follow from its class. ``loads``/``ring``/``stores``/
    ``first``/``last`` are the step tables of the module docstring; ``reduce_axis`` the grid
    axis run in sequence into one output block (-1: none).
    """

    name: str
    grid: tuple[int, ...]
    inputs: tuple[Operand, ...]
    output: Operand
    scratch: tuple[SpBuf, ...]
    step: Step
    loads: tuple[tuple[tuple[int, ...], ...], ...]
    ring: tuple[tuple[tuple[int, ...], ...], ...]
    stores: tuple[tuple[int, ...], ...]
    first: tuple[bool, ...]
    last: tuple[bool, ...]
    reduce_axis: int = -1
    flops: int = 0
    sfu_elem_ops: int = 0
    source: str = ""

    @property
    def kind(self) -> str:
        """map, matmul, gather, reshape or concat: the step's kind."""
        return self.step.kind

    @property
    def unit(self) -> str:
        """The unit that runs the step: PE, SFU or LSU (the load/store unit)."""
        return self.step.unit

    @property
    def steps(self) -> int:
        return len(self.stores)

    @property
    def sp_peak_bytes(self) -> int:
        return max((b.end for b in self.scratch), default=0)

    def sp(self, name: str) -> SpBuf:
        for b in self.scratch:
            if b.name == name:
                return b
        raise KeyError(name)


@dataclass(frozen=True, slots=True)
class Kernel:
    """One device-compute operation: tensors, stages in order, and which tensors are outputs.

    It records the figures of the card it was scheduled for (keyword-only, no defaults: a
    kernel is always for one card): ``num_cores`` (the tables have one entry per core),
    ``sp_capacity`` (usable scratchpad bytes per core), ``stick_bytes`` (every layout's stick
    and the scratchpad buffers' alignment) and ``dl16`` (``CardSpec.dl16_rounding``).
    """

    name: str
    tensors: tuple[TensorDecl, ...]
    stages: tuple[Stage, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    aliases: tuple[tuple[str, str], ...] = ()  # (view, base): a free reshape of a tensor
    num_cores: int = field(kw_only=True)
    sp_capacity: int = field(kw_only=True)
    stick_bytes: int = field(kw_only=True)
    dl16: bool = field(default=False, kw_only=True)  # stores of fp16/bf16 round through DL16
    #: the host values of the const tensors, by name (copied in once per compiled function)
    consts: tuple[tuple[str, Any], ...] = field(default=(), compare=False, hash=False)
    stats: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def tensor(self, name: str) -> TensorDecl:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


def resolve_aliases(k: Kernel, env: dict[str, Any]) -> None:
    """Fill ``env`` (tensor name -> device buffer) in place with every view or base of a tensor
    already there: a view and its base are the same buffer, reshaped (NumPy or JAX arrays)."""
    decls = {t.name: t for t in k.tensors}
    changed = True
    while changed:
        changed = False
        for view, base in k.aliases:
            for have, want in ((base, view), (view, base)):
                if have in env and want not in env:
                    env[want] = env[have].reshape(decls[want].layout.device_shape)
                    changed = True


# --------------------------------------------------------------------------------------------
# checker


def check_kernel(k: Kernel) -> None:
    """Check the schedule IR's invariants; raise :class:`ScheduleError` naming the stage."""
    names = {t.name: t for t in k.tensors}
    if len(names) != len(k.tensors):
        raise ScheduleError(f"kernel {k.name}: duplicate tensor names")
    alias_of = dict(k.aliases)
    # inputs, constants and tensors without elements (nothing to write) hold their values
    written: set[str] = (
        set(k.inputs)
        | {t.name for t in k.tensors if t.role == "const"}
        | {t.name for t in k.tensors if t.layout.shape and math.prod(t.layout.shape) == 0}
    )
    for _ in range(2):
        for view, base in k.aliases:
            if base in written or view in written:
                written.update((view, base))
    for view, base in k.aliases:
        if view not in names or base not in names:
            raise ScheduleError(f"kernel {k.name}: alias {view} -> {base} names unknown tensors")
    for t in k.tensors:
        if t.layout.stick_bytes != k.stick_bytes:
            raise ScheduleError(
                f"kernel {k.name}: tensor {t.name} is laid out in {t.layout.stick_bytes}-byte "
                f"sticks, the card's are {k.stick_bytes} bytes"
            )
    for s in k.stages:
        where = f"kernel {k.name}, stage {s.name} ({s.kind})"
        try:
            _check_stage(s, names, k.num_cores, k.sp_capacity, k.stick_bytes)
        except ScheduleError as e:
            raise ScheduleError(f"{where}: {e}\n{format_stage(s, names, max_steps=2)}") from None
        for name in (*(op.tensor for op in s.inputs), *step_reads(s.step)):
            base = alias_of.get(name, name)
            if name not in written and base not in written:
                raise ScheduleError(f"{where}: reads {name} before any stage writes it")
        written.add(s.output.tensor)
        for _ in range(2):
            for view, base in k.aliases:
                if base in written or view in written:
                    written.update((view, base))
    for o in k.outputs:
        if o not in written and alias_of.get(o, o) not in written:
            raise ScheduleError(f"kernel {k.name}: output {o} is never written")


def step_reads(step: Step) -> tuple[str, ...]:
    """The tensors a step reads from device memory besides its stage's operands (a gather's
    table, whose rows it loads by index)."""
    return (step.table,) if isinstance(step, GatherStep) else ()


def _check_map(s: Stage, names: dict[str, TensorDecl]) -> None:
    st = s.step
    if len(st.body.views) != len(s.inputs):
        raise ScheduleError(
            f"map body reads {len(st.body.views)} inputs, the stage {len(s.inputs)}"
        )
    if len(st.space_block) != len(st.body.space):
        raise ScheduleError(f"space block {list(st.space_block)} does not match {st.body.space}")
    if (st.split is None) != (s.reduce_axis < 0):
        raise ScheduleError("a map runs steps in sequence (reduce_axis) iff its reduction is split")
    if st.split is not None:
        if not st.body.reduce:
            raise ScheduleError("a split reduction without a reduction")
        if st.split.nk != s.grid[s.reduce_axis]:
            raise ScheduleError(
                f"split reduction in {st.split.nk} blocks over {s.grid[s.reduce_axis]} steps"
            )


def _check_matmul(s: Stage, names: dict[str, TensorDecl]) -> None:
    st = s.step
    ep = len(st.epilogue.views) - 1 if st.epilogue is not None else 0
    want = 2 + ep + st.prologue_inputs
    if len(s.inputs) != want:
        raise ScheduleError(
            f"a matmul with {ep} epilogue and {st.prologue_inputs} prologue inputs reads "
            f"{want} operands, the stage {len(s.inputs)}"
        )
    if s.reduce_axis < 0:
        raise ScheduleError("a matmul runs its K blocks in sequence: it needs a reduce_axis")
    if st.nt_form not in ("", "rhs", "swap", "resident") or bool(st.nt_form) != st.rhs_t:
        raise ScheduleError(
            f"an NT product names the card's form of it (rhs, swap, resident), and only an "
            f"NT product: rhs_t={st.rhs_t}, nt_form={st.nt_form!r}"
        )
    if st.relayout_bytes < 0 or (st.relayout_bytes and st.nt_form not in ("rhs", "swap")):
        raise ScheduleError(f"restickify bytes {st.relayout_bytes} for form {st.nt_form!r}")
    if st.window is not None:
        _check_window(s, st.window)


def _check_window(s: Stage, win: Any) -> None:
    """A convolution's blocks: a window ``[1, rows_in, cols_in, tc]`` its taps fit in, an rhs
    ``[taps, tc, tn]`` of as many channels, an output block of the window's pixels."""
    lhs, rhs = s.inputs[0].block, s.inputs[1].block
    if s.step.prologue is not None or len(lhs) != 4:
        raise ScheduleError("a convolution's matmul reads a 4-D window and fuses no prologue")
    rows, cols = win.extent
    if lhs[0] != 1 or lhs[1] < rows or lhs[2] < cols:
        raise ScheduleError(f"window block {list(lhs)} does not hold {rows}x{cols} input pixels")
    if len(rhs) != 3 or rhs[0] != win.taps or rhs[1] > lhs[3]:
        raise ScheduleError(f"a convolution's rhs block {list(rhs)} is not [taps, tc, tn]")
    if s.output.block[1] != win.rows * win.cols:
        raise ScheduleError(f"output block {list(s.output.block)} is not the window's pixels")


def _check_gather(s: Stage, names: dict[str, TensorDecl]) -> None:
    st = s.step
    if len(s.inputs) != 1:
        raise ScheduleError(f"a gather reads one index operand, not {len(s.inputs)}")
    if st.table not in names:
        raise ScheduleError(f"gather names unknown table {st.table}")
    if names[st.table].layout.shape[:1] != (st.num_rows,):
        raise ScheduleError(f"gather of {st.num_rows} rows from {names[st.table].layout.shape}")


def _check_move(s: Stage, names: dict[str, TensorDecl]) -> None:
    st = s.step
    n = len(st.sizes) if isinstance(st, ConcatStep) else 1
    if len(s.inputs) != n:
        raise ScheduleError(f"a {s.kind} of {n} inputs has {len(s.inputs)} operands")


def _check_sort(s: Stage, names: dict[str, TensorDecl]) -> None:
    st = s.step
    if not s.inputs:
        raise ScheduleError("a sort reads at least one key operand")
    if not 0 < st.k <= st.n:
        raise ScheduleError(f"a sort keeps the first {st.k} of rows of {st.n}")
    if names[s.output.tensor].layout.dtype != "int32":
        raise ScheduleError("a sort stores int32 indices")


def _check_take(s: Stage, names: dict[str, TensorDecl]) -> None:
    if len(s.inputs) != 2:
        raise ScheduleError(f"a take reads a tensor and its indices, not {len(s.inputs)} operands")
    if names[s.inputs[1].tensor].layout.dtype != "int32":
        raise ScheduleError("a take's indices are int32")


#: the kernel checker's per-kind checks of a stage's step (beside the checks every stage gets)
_STEP_CHECKS = {
    MapStep: _check_map,
    MatmulStep: _check_matmul,
    GatherStep: _check_gather,
    ReshapeStep: _check_move,
    ConcatStep: _check_move,
    SortStep: _check_sort,
    TakeStep: _check_take,
}


def _check_stage(s: Stage, names: dict[str, TensorDecl], ncores: int, cap: int, stick: int) -> None:
    check = _STEP_CHECKS.get(type(s.step))
    if check is None:
        raise ScheduleError(
            f"step {type(s.step).__name__} is none of the stage kinds {sorted(STEP_KINDS)}"
        )
    if s.reduce_axis >= len(s.grid) or (s.reduce_axis < 0 and s.step.combine != "plain"):
        raise ScheduleError(f"reduce_axis {s.reduce_axis} does not fit grid {list(s.grid)}")
    check(s, names)
    bufs = sorted(s.scratch, key=lambda b: b.offset)
    for a, b in zip(bufs, bufs[1:], strict=False):
        if a.end > b.offset:
            raise ScheduleError(f"scratchpad buffers {a.name} and {b.name} overlap")
    for b in bufs:
        if b.offset % stick or b.slot_bytes % stick:
            raise ScheduleError(f"scratchpad buffer {b.name} is not aligned to {stick}-byte sticks")
        need = math.prod(b.block) * DTYPES[b.dtype]
        if need > b.slot_bytes:
            raise ScheduleError(f"scratchpad buffer {b.name} holds {b.slot_bytes} B < {need} B")
    if s.sp_peak_bytes > cap:
        raise ScheduleError(f"scratchpad plan {s.sp_peak_bytes} B exceeds usable {cap} B")
    ops = (*s.inputs, s.output)
    nblocks = []
    for k, op in enumerate(ops):
        is_out = k == len(ops) - 1
        if op.tensor not in names:
            raise ScheduleError(f"operand names unknown tensor {op.tensor}")
        dev = names[op.tensor].layout.device_shape
        if len(op.block) != len(dev) or len(op.grid_dims) != len(dev):
            raise ScheduleError(f"operand {op.tensor}: block rank does not match {dev}")
        if len(op.origins) != len(dev) or len(op.steps) != len(dev):
            raise ScheduleError(f"operand {op.tensor}: origin/step rank does not match {dev}")
        if is_out and op.windowed:
            raise ScheduleError(f"output {op.tensor}: outputs are stored in consecutive blocks")
        grid = operand_grid(op, dev)
        for d, b, g, st, n in zip(dev, op.block, op.grid_dims, op.steps, grid, strict=True):
            if b <= 0 or st <= 0:
                raise ScheduleError(f"operand {op.tensor}: block {op.block} does not tile {dev}")
            if g >= len(s.grid):
                raise ScheduleError(f"operand {op.tensor}: grid axis {g} does not match {dev}")
            if is_out and g >= 0 and n != s.grid[g]:
                raise ScheduleError(f"operand {op.tensor}: grid axis {g} does not match {dev}")
            if is_out and g < 0 and b != d:
                raise ScheduleError(f"operand {op.tensor}: untiled dim must be a full block")
        if op.sp not in {b.name for b in s.scratch}:
            raise ScheduleError(f"operand {op.tensor} names unknown scratchpad buffer {op.sp}")
        buf = s.sp(op.sp)
        if tuple(buf.block) != tuple(op.block):
            raise ScheduleError(
                f"operand {op.tensor}: block {op.block} differs from buffer {buf.name}'s "
                f"{buf.block}"
            )
        nblocks.append(math.prod(grid))
    T = s.steps
    if not (len(s.loads) == len(s.ring) == len(s.first) == len(s.last) == T):
        raise ScheduleError("step tables have different lengths")
    if T == 0:
        raise ScheduleError("a stage without steps")
    nin = len(s.inputs)
    try:
        loads = np.asarray(s.loads, np.int64).reshape(T, nin, -1 if nin else ncores)
        ring = np.asarray(s.ring, np.int64).reshape(T, nin, -1 if nin else ncores)
        stores = np.asarray(s.stores, np.int64)
    except ValueError:
        raise ScheduleError("table row is not one entry per core") from None
    if nin and (loads.shape[2] != ncores or ring.shape[2] != ncores):
        raise ScheduleError("step 0: table row is not one entry per core")
    if stores.ndim != 2 or stores.shape[1] != ncores:
        raise ScheduleError("step 0: store row is not one entry per core")
    for i in range(nin):
        bad = np.argwhere(loads[:, i] >= nblocks[i])
        if len(bad):
            t, c = bad[0]
            raise ScheduleError(f"step {t} core {c}: block {loads[t, i, c]} out of range")
        src = ring[:, i]
        both = np.argwhere((src >= 0) & (loads[:, i] >= 0))
        if len(both):
            t, c = both[0]
            raise ScheduleError(f"step {t} core {c}: both loads and receives")
        recv = np.argwhere(src >= 0)
        if len(recv):
            tt, cc = recv[:, 0], recv[:, 1]
            ss = src[tt, cc]
            ok = (ss < ncores) & (loads[tt, i, np.clip(ss, 0, ncores - 1)] >= 0)
            if not ok.all():
                j = int(np.flatnonzero(~ok)[0])
                raise ScheduleError(
                    f"step {tt[j]} core {cc[j]}: ring source {ss[j]} loads nothing this step"
                )
    bad = np.argwhere(stores >= nblocks[-1])
    if len(bad):
        t, c = bad[0]
        raise ScheduleError(f"step {t} core {c}: store block {stores[t, c]} out of range")
    flat = stores[stores >= 0]
    uniq, counts = np.unique(flat, return_counts=True)
    if (counts > 1).any():
        raise ScheduleError(f"output block {uniq[counts > 1][0]} is stored twice")
    if len(uniq) != nblocks[-1]:
        raise ScheduleError(f"stores cover {len(uniq)} of {nblocks[-1]} output blocks")


# --------------------------------------------------------------------------------------------
# printer


def _fmt_step(s: Stage) -> list[str]:
    head, *rest = str(s.step).split("\n")
    return [f"      {s.unit:<3} {s.kind} {_short(head)}", *rest]


def _short(p: Any, limit: int = 160) -> str:
    s = repr(p) if not isinstance(p, str) else p
    return s if len(s) <= limit else s[: limit - 3] + "..."


def format_stage(s: Stage, names: dict[str, TensorDecl], max_steps: int = 2) -> str:
    """Readable text of one stage: buffers, body and the first steps' per-core programs."""
    lines = [
        f"  stage {s.name}: {s.kind} grid={list(s.grid)} steps={s.steps}"
        + (f" reduce_axis={s.reduce_axis}" if s.reduce_axis >= 0 else "")
        + (f"   # {s.source}" if s.source else "")
    ]
    for b in s.scratch:
        lines.append(
            f"    sp {b.name:<8} @0x{b.offset:06x} {b.slots}x{b.slot_bytes}B "
            f"{b.dtype}{list(b.block)}"
        )
    for op in s.inputs:
        win = f" origin={list(op.origins)} step={list(op.steps)}" if op.windowed else ""
        win += f" pad_value={op.pad_value}" if op.pad_value is not None else ""
        lines.append(
            f"    in  {op.tensor} block={list(op.block)} grid_dims={list(op.grid_dims)}{win}"
        )
    op = s.output
    lines.append(f"    out {op.tensor} block={list(op.block)} grid_dims={list(op.grid_dims)}")
    lines.append("    body:")
    lines.extend(_fmt_step(s))
    ncores = len(s.stores[0]) if s.stores else 0
    for t in range(min(s.steps, max_steps)):
        lines.append(
            f"    step {t}:" + (" first" if s.first[t] else "") + (" last" if s.last[t] else "")
        )
        for c in range(ncores):
            parts = []
            for i, op in enumerate(s.inputs):
                if s.loads[t][i][c] >= 0:
                    parts.append(f"LOAD {op.tensor}#{s.loads[t][i][c]}->{op.sp}")
                elif s.ring[t][i][c] >= 0:
                    parts.append(f"RING {op.tensor}<-core{s.ring[t][i][c]}")
            if s.stores[t][c] >= 0:
                parts.append(f"STORE {s.output.sp}->{s.output.tensor}#{s.stores[t][c]}")
            if parts or c < 2:
                lines.append(f"      core {c:2d}: " + ("; ".join(parts) if parts else "idle"))
    if s.steps > max_steps:
        lines.append(f"    ... {s.steps - max_steps} more steps")
    return "\n".join(lines)


def format_kernel(k: Kernel, max_steps: int = 2) -> str:
    """The whole kernel as text (what ``Lowered.as_text()`` shows)."""
    names = {t.name: t for t in k.tensors}
    lines = [
        f"kernel {k.name} cores={k.num_cores} scratchpad_usable={k.sp_capacity}B "
        f"stick={k.stick_bytes}B"
    ]
    for t in k.tensors:
        lines.append(f"  {t.role:<6} {t.name}: {t.layout}")
    for view, base in k.aliases:
        lines.append(f"  alias  {view} = view of {base}")
    for s in k.stages:
        lines.append(format_stage(s, names, max_steps))
    lines.append(f"  outputs: {', '.join(k.outputs)}")
    return "\n".join(lines)

"""The schedule IR's step bodies: what a stage's units do at every step, one frozen class per
stage kind.

A :class:`~device_model.kernel.Stage` holds one step; its kind (``map``, ``matmul``, ``gather``,
``reshape``, ``concat``, ``sort``, ``take``) and the unit that runs it (``PE``, ``SFU``, the
load/store unit ``LSU``) follow from the step's class (:data:`STEP_KINDS`). ``combine`` says how a
stage's steps combine: ``plain`` (every step computes and stores its own output block), ``acc`` (a K
loop or a split reduction accumulates in scratchpad; the last step of a block rounds and stores) or
``carry`` (a split cumulative reduction: every block is stored, a carry passes between them). Their
semantics are written once in :mod:`device_model.ops` and :mod:`device_model.matmul_ops`; the kernel
checker (:func:`device_model.kernel.check_kernel`) checks each kind's step against its stage, and
both executors dispatch on the step's class.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from .ops import MapBody

__all__ = [
    "ConvWindow",
    "MapStep",
    "MatmulStep",
    "GatherStep",
    "ReshapeStep",
    "ConcatStep",
    "SplitReduce",
    "SortStep",
    "TakeStep",
    "Step",
    "STEP_KINDS",
]


@dataclass(frozen=True, slots=True)
class ConvWindow:
    """How a convolution's PE step reads its lhs (an implicit GEMM): the lhs block is a window
    ``[1, rows_in, cols_in, tc]`` of the channels-last input (its halo written as zeros by the
    load unit), and the PE takes from it, for each kernel tap ``(kh, kw)`` in row-major order,
    the strided ``[rows, cols]`` grid of positions ``(i * strides[0] + kh * dilation[0], j *
    strides[1] + kw * dilation[1])``: the patches ``[rows * cols, taps * tc]`` of ``rows`` output
    rows of ``cols`` pixels, never stored. The rhs block is ``[taps, tc, tn]``."""

    kernel: tuple[int, int]
    strides: tuple[int, int]
    dilation: tuple[int, int]
    rows: int
    cols: int

    @property
    def taps(self) -> int:
        return self.kernel[0] * self.kernel[1]

    @property
    def extent(self) -> tuple[int, int]:
        """The input rows and columns a block's window spans."""
        return tuple(
            (n - 1) * s + (k - 1) * d + 1
            for n, s, k, d in zip(
                (self.rows, self.cols), self.strides, self.kernel, self.dilation, strict=True
            )
        )

    def __str__(self) -> str:
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.strides, self.dilation
        return (
            f"windows {kh}x{kw} stride {sh}x{sw} dilation {dh}x{dw} -> "
            f"{self.rows}x{self.cols} pixels"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class MatmulStep:
    """PE program: ``acc[m, n] += sum_k lhs[m, k] * rhs[k, n]`` in fp32; rounded at the end.
    ``rhs_t``: rhs tiles are ``[tn, tk]`` (``rhs[n, k]``: an NT GEMM). ``n_logical`` > 0: output
    columns from it on are zeroed (an NT rhs's last N block reaches past its rows: NaN).

    ``epilogue``: an elementwise map the SFUs run on the rounded product on its way to the store
    (a bias, an activation, a residual add, a convert), over the output block's space
    ``[B, M, N]``. Its input ``acc_slot`` is the product (``out_dtype``); the others are the
    stage's inputs after lhs and rhs, in order, each loaded on the last K step of its block. The
    stored dtype is then the epilogue's. The results are those of the unfused matmul and map.

    ``prologue``: an elementwise map the SFUs run on each lhs tile on its way to the PE (the
    per-element part of a norm whose row statistic an earlier stage stored), over the lhs's
    space ``[B, M, K]``. Its input ``lhs_slot`` is the lhs tile; the others are the stage's
    last inputs, in order, each loaded with the lhs tile of its step. The PE then multiplies
    the prologue's result, rounded to its dtype as the unfused map's store rounds it: the
    results are those of the unfused map and matmul. ``prologue_sfu``: its SFU element-ops
    over its whole space (one pass; the timing model's per-tile cost).

    ``window``: a convolution (:class:`ConvWindow`): the lhs block is a window of the input
    and the PE reads its patches in place; ``k_logical`` is then taps x input channels.

    ``nt_form``: how the card meets an NT product (``rhs_t``), whose rhs is sticked on K where
    the PE takes input 2 sticked on N (CARD.md, SuperDSC): ``"rhs"``, the rhs restickified;
    ``"swap"``, the product computed as ``rhs @ lhs^T`` (the lhs restickified, the product
    restickified back); ``"resident"``, a constant rhs laid out once when it is loaded.
    ``relayout_bytes``: the bytes that form's restickify reads and writes on every call (the
    timing model charges them at ``relayout_bw``; the simulation reads the rhs in place, the
    same numbers)."""

    kind: ClassVar[str] = "matmul"
    unit: ClassVar[str] = "PE"
    combine: ClassVar[str] = "acc"

    k_logical: int
    out_dtype: str
    rhs_t: bool = False
    n_logical: int = 0
    epilogue: MapBody | None = None
    acc_slot: int = 0
    prologue: MapBody | None = None
    lhs_slot: int = 0
    prologue_sfu: int = 0
    window: ConvWindow | None = None
    nt_form: str = ""
    relayout_bytes: int = 0

    @property
    def prologue_inputs(self) -> int:
        """How many of the stage's inputs (its last ones) are the prologue's, the lhs aside."""
        return len(self.prologue.views) - 1 if self.prologue is not None else 0

    def split_inputs(self, inputs: Sequence[Any]) -> tuple[Any, Any, tuple, tuple]:
        """A stage's inputs as (lhs, rhs, the epilogue's, the prologue's): the stage's inputs
        are ``(lhs, rhs, *epilogue inputs, *prologue inputs)``."""
        cut = len(inputs) - self.prologue_inputs
        return inputs[0], inputs[1], tuple(inputs[2:cut]), tuple(inputs[cut:])

    @property
    def stored_dtype(self) -> str:
        """The dtype of the stored output block."""
        return self.epilogue.out_dtype if self.epilogue is not None else self.out_dtype

    def __str__(self) -> str:
        rhs = "rhs^T" if self.rhs_t else "rhs"
        nm = f", N={self.n_logical} masked" if self.n_logical else ""
        ep = ""
        if self.epilogue is not None:
            ep = f"; epilogue (product = in{self.acc_slot}): {self.epilogue}"
        pro = ""
        if self.prologue is not None:
            pro = f"lhs = prologue (lhs = in{self.lhs_slot}): {self.prologue}; "
        lhs = f"patches(lhs: {self.window})" if self.window is not None else "lhs"
        nt = ""
        if self.nt_form:
            nt = f", restickify {self.nt_form}: {self.relayout_bytes} B"
        return (
            f"{pro}acc += {lhs} @ {rhs} (fp32, K={self.k_logical}{nm}{nt}); "
            f"last: acc -> {self.out_dtype}" + ep
        )

    def tk(self, rhs_block: tuple[int, ...]) -> int:
        """The logical K of an rhs block (a whole-K NT block spans the stick-padded K; a
        convolution's ``[taps, tc, tn]`` block holds taps x tc)."""
        if self.window is not None:
            return rhs_block[0] * rhs_block[1]
        return min(rhs_block[-1], self.k_logical) if self.rhs_t else rhs_block[-2]

    def pe_block(
        self, lhs_block: tuple[int, ...], rhs_block: tuple[int, ...]
    ) -> tuple[int, int, int]:
        """The PE's ``(tm, tk, tn)`` of a step on these blocks (a convolution's patches: its
        output pixels by taps x the window's channels, stick-padded as loaded)."""
        if self.window is not None:
            w = self.window
            return w.rows * w.cols, w.taps * lhs_block[3], rhs_block[2]
        return lhs_block[1], lhs_block[2], rhs_block[1] if self.rhs_t else rhs_block[2]


@dataclass(frozen=True, slots=True, kw_only=True)
class GatherStep:
    """Load-unit program: rows ``table[idx[i]]`` fetched by index from device memory.

    mode "clip" clamps indices into range; "fill" gives ``fill_value`` for out-of-range rows
    (when None: NaN for floats, 0 for integers).
    """

    kind: ClassVar[str] = "gather"
    unit: ClassVar[str] = "LSU"
    combine: ClassVar[str] = "plain"

    table: str
    num_rows: int
    mode: str
    fill_value: float | int | None = None

    def __str__(self) -> str:
        return f"indirect load rows of {self.table} (V={self.num_rows}, mode={self.mode})"


@dataclass(frozen=True, slots=True, kw_only=True)
class ReshapeStep:
    """Data movement: rows of length ``l_in`` regrouped into rows of length ``l_out``."""

    kind: ClassVar[str] = "reshape"
    unit: ClassVar[str] = "LSU"
    combine: ClassVar[str] = "plain"

    l_in: int
    l_out: int

    def __str__(self) -> str:
        return f"regroup rows {self.l_in} -> {self.l_out}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ConcatStep:
    """Data movement: the inputs' blocks joined along ``axis`` (logical sizes ``sizes``).

    With ``tile`` 0 every block holds the whole ``axis`` of each input, and the output block is
    their concatenation. With ``tile`` > 0 the output is tiled along ``axis`` too, ``tile``
    elements per block: output block ``k`` (its coordinate along ``axis`` in the output's block
    grid ``out_grid``) covers positions ``[k * tile, (k + 1) * tile)``; input ``i`` starts at
    ``offsets[i]`` in the output, and its block (a window of the input, see
    :class:`~device_model.kernel.Operand`) holds output position ``k * tile + j`` at index
    ``local[i] + j`` along ``axis``. Each output position takes the input whose range holds it;
    positions no input covers (stick padding) are 0.
    """

    kind: ClassVar[str] = "concat"
    unit: ClassVar[str] = "LSU"
    combine: ClassVar[str] = "plain"

    axis: int
    sizes: tuple[int, ...]
    tile: int = 0
    offsets: tuple[int, ...] = ()
    local: tuple[int, ...] = ()
    out_grid: tuple[int, ...] = ()

    def __str__(self) -> str:
        t = f", tiles of {self.tile} at offsets {list(self.offsets)}" if self.tile else ""
        return f"concatenate along {self.axis} sizes {list(self.sizes)}{t}"


@dataclass(frozen=True, slots=True, kw_only=True)
class SplitReduce:
    """A map's final reduction split across the steps of its stage (the stage's
    ``reduce_axis``): along space dim ``axis`` each step brings ``block`` of the ``extent``
    elements reduced, the ``nk`` blocks in order (``reverse``: the last block first, for
    ``cumsum_rev``). Elements of the last block past ``extent`` are masked out (they are the
    identity of the reduction). The running result is kept in the compute type in scratchpad
    accumulators: ``acc`` (and ``acci``, the index, for argmax/argmin); for cumsum ``acc`` is
    the carry, the running total at the block's edge, and every block of the output is stored.
    """

    axis: int
    block: int
    extent: int
    nk: int
    reverse: bool = False

    def __str__(self) -> str:
        rev = " reversed" if self.reverse else ""
        return f"split axis {self.axis}: {self.nk} blocks of {self.block} of {self.extent}{rev}"


@dataclass(frozen=True, slots=True, kw_only=True)
class MapStep:
    """SFU program: the fused map ``body`` over one block of its space (``space_block``).

    With ``split`` the map's final reduction runs across the stage's ``reduce_axis`` steps
    (:class:`SplitReduce`): the stage accumulates (``acc``), or carries a running total between
    stored blocks for a cumulative reduction (``carry``).
    """

    kind: ClassVar[str] = "map"
    unit: ClassVar[str] = "SFU"

    body: MapBody
    space_block: tuple[int, ...]
    split: SplitReduce | None = None

    @property
    def combine(self) -> str:  # type: ignore[override]
        if self.split is None:
            return "plain"
        red = self.body.reduction
        return "carry" if red is not None and red.scan else "acc"

    def __str__(self) -> str:
        s = f"block={list(self.space_block)} {self.body}"
        return s + (f"\n          {self.split}" if self.split is not None else "")


@dataclass(frozen=True, slots=True, kw_only=True)
class SortStep:
    """SFU program: each row of the block (the stage's inputs: ``num_keys`` keys, the first the
    most significant, each ``[rows, n]``) sorted by a bitonic network carrying each element's
    index; the first ``k`` indices (int32) of the order stored (:mod:`device_model.sorting`:
    ``order``, ``descending``, ties by index)."""

    kind: ClassVar[str] = "sort"
    unit: ClassVar[str] = "SFU"
    combine: ClassVar[str] = "plain"

    n: int
    k: int
    descending: bool = False
    order: str = "nan_last"

    def __str__(self) -> str:
        d = " descending" if self.descending else ""
        return f"bitonic argsort rows of {self.n}{d} ({self.order}), first {self.k}"


@dataclass(frozen=True, slots=True, kw_only=True)
class TakeStep:
    """SFU program: ``out[r, j] = x[r, idx[r, j]]`` within each row of the block (the stage's
    inputs: ``x`` ``[rows, n]``, ``idx`` int32 ``[rows, m]``), an indexed read per element of
    the scratchpad; ``mode`` clip clamps the indices into ``[0, n)``, fill gives
    ``fill_value`` (None: NaN for floats, 0 for integers) for those out of range."""

    kind: ClassVar[str] = "take"
    unit: ClassVar[str] = "SFU"
    combine: ClassVar[str] = "plain"

    n: int
    mode: str = "clip"
    fill_value: float | int | None = None

    def __str__(self) -> str:
        return f"take along rows of {self.n} by index (mode={self.mode})"


#: a stage's step: one of the per-kind classes
Step = MapStep | MatmulStep | GatherStep | ReshapeStep | ConcatStep | SortStep | TakeStep

#: the step class of each stage kind
STEP_KINDS: dict[str, type] = {
    cls.kind: cls
    for cls in (MapStep, MatmulStep, GatherStep, ReshapeStep, ConcatStep, SortStep, TakeStep)
}

"""The typed parameters of the graph IR's ops: one frozen, hashable dataclass per op.

A :class:`~lowering.graph.Node` carries an instance of its op's class (:data:`PARAMS` maps
each op to it); :func:`~lowering.graph.check_graph` checks that it is one and that each field
is well-formed (:meth:`Params.check`), the way torch.fx's lint checks its opcodes. The
importers build them from keywords (:func:`make_params`, through ``Builder.emit``); the passes
copy them with :func:`dataclasses.replace`.

A params class whose op holds graphs (a loop's or a branch's body) returns them from
:meth:`Params.subgraphs`; the checker checks each of them too.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from device_model.layout import DTYPES
from device_model.ops import ELEMENTWISE, MapBody, Reduce
from device_model.sorting import ORDERS

if TYPE_CHECKING:
    from .graph import Graph

__all__ = [
    "GraphError",
    "Params",
    "Fused",
    "Elementwise",
    "Convert",
    "Broadcast",
    "Transpose",
    "Slice",
    "Reshape",
    "Concatenate",
    "ReduceParams",
    "Matmul",
    "Gather",
    "Map",
    "Scan",
    "While",
    "Cond",
    "UpdateSlice",
    "Sort",
    "TakeAlong",
    "PARAMS",
    "GATHER_MODES",
    "make_params",
]

GATHER_MODES = ("clip", "fill")
_KINDS = frozenset(r.value for r in Reduce)


class GraphError(ValueError):
    """A graph that breaks an invariant (raised by :func:`~lowering.graph.check_graph`)."""


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise GraphError(msg)


_INTS = "tuple[int, ...]"  # the annotation (a string: postponed) of an int-tuple field


def _ints(v: Any) -> Any:
    """``v`` as a tuple of Python ints when it is a sequence of integers (NumPy's, a list),
    else unchanged (for the checker to reject)."""
    if isinstance(v, list | tuple):
        try:
            return tuple(operator.index(x) for x in v)
        except TypeError:
            return v
    return v


@dataclass(frozen=True, slots=True)
class Params:
    """The base of every op's parameters. Fields annotated ``tuple[int, ...]`` are normalized
    to tuples of ints and checked as such; subclasses name the optional fields not printed at
    their default in ``_quiet``."""

    _quiet: ClassVar[tuple[str, ...]] = ()

    def _int_fields(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if f.type == _INTS]

    def __post_init__(self) -> None:
        for name in self._int_fields():
            object.__setattr__(self, name, _ints(getattr(self, name)))

    def subgraphs(self) -> tuple[Graph, ...]:
        """The graphs this op holds (a body), which the checker checks too; none by default."""
        return ()

    def check(self, op: str) -> None:
        """Raise GraphError unless every field is well-formed (types and closed sets)."""
        for name in self._int_fields():
            v = getattr(self, name)
            ok = isinstance(v, tuple) and all(type(x) is int for x in v)
            _need(ok, f"{op}: {name}={v!r} is not a tuple of ints")

    def items(self) -> tuple[tuple[str, Any], ...]:
        """``(name, value)`` pairs as the printer shows them, by name."""
        out = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name not in self._quiet or v != f.default:
                out.append((f.name, v))
        return tuple(sorted(out, key=lambda kv: kv[0]))


def _dtype(op: str, name: str, v: Any) -> None:
    _need(isinstance(v, str) and v in DTYPES, f"{op}: {name}={v!r} is not a card dtype")


def _body(op: str, name: str, v: Any) -> None:
    _need(isinstance(v, MapBody), f"{op}: {name} is a {type(v).__name__}, not a MapBody")


@dataclass(frozen=True, slots=True)
class Elementwise(Params):
    """``fn`` (a name in ``device_model.ops.ELEMENTWISE``) of the inputs; scalar operands are
    immediates in ``scalars`` (``(position, value, dtype)`` triples); ``param``: the fn's own
    (``integer_pow``'s exponent)."""

    fn: str
    dtype: str
    scalars: tuple[tuple[int, Any, str], ...] = ()
    shape: tuple[int, ...] | None = None
    param: Any = None

    def __post_init__(self) -> None:
        if self.shape is not None:
            object.__setattr__(self, "shape", _ints(self.shape))
        if isinstance(self.scalars, list):
            object.__setattr__(self, "scalars", tuple(self.scalars))

    def check(self, op: str) -> None:
        _need(
            isinstance(self.fn, str) and self.fn in ELEMENTWISE,
            f"unknown elementwise fn {self.fn!r}",
        )
        _dtype(op, "dtype", self.dtype)
        sh = self.shape
        ok = sh is None or (isinstance(sh, tuple) and all(type(x) is int for x in sh))
        _need(ok, f"{op}: shape={sh!r} is not a tuple of ints")
        _need(isinstance(self.scalars, tuple), f"{op}: scalars={self.scalars!r} is not a tuple")
        for s in self.scalars:
            ok = isinstance(s, tuple) and len(s) == 3 and type(s[0]) is int
            _need(ok, f"{op}: scalar {s!r} is not (position, value, dtype)")
            _dtype(op, "a scalar's dtype", s[2])


@dataclass(frozen=True, slots=True)
class Broadcast(Params):
    """jax's broadcast_in_dim: operand dim ``j`` is result dim ``dims[j]``."""

    shape: tuple[int, ...]
    dims: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Convert(Params):
    dtype: str

    def check(self, op: str) -> None:
        _dtype(op, "dtype", self.dtype)


@dataclass(frozen=True, slots=True)
class Transpose(Params):
    """Result dim ``i`` is operand dim ``perm[i]``."""

    perm: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Concatenate(Params):
    axis: int

    def check(self, op: str) -> None:
        _need(type(self.axis) is int, f"{op}: axis={self.axis!r} is not an int")


@dataclass(frozen=True, slots=True)
class Slice(Params):
    """``x[starts:limits:strides]`` per dim."""

    starts: tuple[int, ...]
    limits: tuple[int, ...]
    strides: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Reshape(Params):
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReduceParams(Params):
    """``kind`` (a ``device_model.ops.Reduce``) over ``axes``."""

    kind: Reduce
    axes: tuple[int, ...]

    def __post_init__(self) -> None:
        Params.__post_init__(self)
        if isinstance(self.kind, str) and self.kind in _KINDS:
            object.__setattr__(self, "kind", Reduce(self.kind))

    def check(self, op: str) -> None:
        _need(isinstance(self.kind, Reduce), f"unknown reduction kind {self.kind!r}")
        Params.check(self, op)


@dataclass(frozen=True, slots=True)
class Fused:
    """A map fused into a matmul: ``body`` (elementwise, over the product's or the lhs's
    shape), whose input ``slot`` is the product (an epilogue) or the lhs (a prologue)."""

    body: MapBody
    slot: int = 0


@dataclass(frozen=True, slots=True)
class Matmul(Params):
    """``[B, M, K] x [B, K, N] -> [B, M, N]`` in ``dtype`` (``rhs_t``: the rhs given as
    ``[B, N, K]``); after fusion an ``epilogue`` applied to the product on its way out and a
    ``prologue`` to the lhs on its way in. Printed with the slots as ``acc_slot`` and
    ``lhs_slot``."""

    dtype: str
    rhs_t: bool = False
    epilogue: Fused | None = None
    prologue: Fused | None = None
    _quiet: ClassVar[tuple[str, ...]] = ("rhs_t", "epilogue", "prologue")

    def check(self, op: str) -> None:
        _dtype(op, "dtype", self.dtype)
        _need(isinstance(self.rhs_t, bool), f"matmul rhs_t={self.rhs_t!r} is not a bool")
        for name in ("epilogue", "prologue"):
            f = getattr(self, name)
            if f is not None:
                _need(isinstance(f, Fused), f"{op}: {name} is a {type(f).__name__}, not a Fused")
                _body(op, name, f.body)
                _need(type(f.slot) is int, f"{op}: {name} slot {f.slot!r} is not an int")

    def items(self) -> tuple[tuple[str, Any], ...]:
        out = [("dtype", self.dtype)] + ([("rhs_t", self.rhs_t)] if self.rhs_t else [])
        for name, slot in (("epilogue", "acc_slot"), ("prologue", "lhs_slot")):
            f = getattr(self, name)
            if f is not None:
                out += [(name, f.body), (slot, f.slot)]
        return tuple(sorted(out, key=lambda kv: kv[0]))


@dataclass(frozen=True, slots=True)
class Gather(Params):
    """Rows of a table by int32 indices; ``mode`` clip clamps them, fill gives ``fill_value``
    (None: NaN for floats, 0 for integers) for rows out of range."""

    mode: str
    fill_value: float | int | None = None
    _quiet: ClassVar[tuple[str, ...]] = ("fill_value",)

    def check(self, op: str) -> None:
        _need(self.mode in GATHER_MODES, f"{op}: mode={self.mode!r} is not one of {GATHER_MODES}")
        fv = self.fill_value
        _need(fv is None or isinstance(fv, int | float), f"{op}: fill_value={fv!r} is not a number")


@dataclass(frozen=True, slots=True)
class Map(Params):
    """A fused SFU chain (made by the fusion passes)."""

    body: MapBody

    def check(self, op: str) -> None:
        _body(op, "body", self.body)


def _graph(op: str, name: str, g: Any) -> None:
    """(The graph checker checks that each of ``subgraphs()`` is a Graph, and checks it.)"""
    _need(hasattr(g, "nodes") and hasattr(g, "outputs"), f"{op}: {name} is not a Graph")


def _count(op: str, name: str, v: Any) -> None:
    _need(type(v) is int and v >= 0, f"{op}: {name}={v!r} is not a count")


@dataclass(frozen=True, slots=True)
class Scan(Params):
    """``lax.scan``: ``body`` maps (consts, carry, one slice of each stacked input) to (carry,
    one slice of each stacked output), ``length`` times, from the end when ``reverse``. The
    node's inputs are the consts, the initial carry and the stacked inputs; its outputs the
    final carry and the stacked outputs. ``unroll``: iterations per launch the user asked
    for (1: the compiler chooses; ``length``: the whole loop inlined)."""

    body: Graph
    length: int
    num_consts: int
    num_carry: int
    reverse: bool = False
    unroll: int = 1
    _quiet: ClassVar[tuple[str, ...]] = ("reverse", "unroll")

    def subgraphs(self) -> tuple[Graph, ...]:
        return (self.body,)

    def check(self, op: str) -> None:
        _graph(op, "body", self.body)
        for name in ("length", "num_consts", "num_carry"):
            _count(op, name, getattr(self, name))
        _need(type(self.unroll) is int and self.unroll >= 1, f"{op}: unroll={self.unroll!r}")
        _need(isinstance(self.reverse, bool), f"{op}: reverse={self.reverse!r} is not a bool")

    def items(self) -> tuple[tuple[str, Any], ...]:
        return _with_graphs(self, Params.items(self))


@dataclass(frozen=True, slots=True)
class While(Params):
    """``lax.while_loop``: while ``cond`` (cond consts, carry) -> bool[] holds, ``body`` (body
    consts, carry) -> carry. The node's inputs are the cond consts, the body consts and the
    initial carry; its outputs the final carry."""

    cond: Graph
    body: Graph
    cond_nconsts: int
    body_nconsts: int

    def subgraphs(self) -> tuple[Graph, ...]:
        return (self.cond, self.body)

    def check(self, op: str) -> None:
        _graph(op, "cond", self.cond)
        _graph(op, "body", self.body)
        _count(op, "cond_nconsts", self.cond_nconsts)
        _count(op, "body_nconsts", self.body_nconsts)

    def items(self) -> tuple[tuple[str, Any], ...]:
        return _with_graphs(self, Params.items(self))


@dataclass(frozen=True, slots=True)
class Cond(Params):
    """``lax.cond`` / ``lax.switch``: the branch the first input (an int32 index, clamped to
    the branches as JAX does) names, applied to the other inputs."""

    branches: tuple[Graph, ...]

    def subgraphs(self) -> tuple[Graph, ...]:
        return self.branches

    def check(self, op: str) -> None:
        _need(isinstance(self.branches, tuple) and self.branches, f"{op}: no branches")
        for i, g in enumerate(self.branches):
            _graph(op, f"branch {i}", g)

    def items(self) -> tuple[tuple[str, Any], ...]:
        return (("branches", tuple(g.name for g in self.branches)),)


@dataclass(frozen=True, slots=True)
class UpdateSlice(Params):
    """``lax.dynamic_update_slice``: the node's inputs are the operand, the update and one
    int32 scalar per traced start; ``starts`` has per dim its static start, or None where the
    start is the next of those inputs. Every start is clamped so the update fits, as JAX does.
    Kept as one node so that a loop may write a carried buffer in place
    (:mod:`lowering.control`); inside a kernel it is a gather and a select
    (:func:`lowering.indexing.expand_updates`)."""

    starts: tuple[int | None, ...]

    def check(self, op: str) -> None:
        ok = isinstance(self.starts, tuple)
        ok = ok and all(s is None or type(s) is int for s in self.starts)
        _need(ok, f"{op}: starts={self.starts!r} is not a tuple of ints and Nones")


@dataclass(frozen=True, slots=True)
class Sort(Params):
    """The first ``k`` indices (int32) of a stable sort of each row: the node's inputs are the
    keys ``[R, n]``, the first the most significant; ``order`` and ``descending`` as
    :mod:`device_model.sorting` defines them. Values follow by ``take_along``."""

    k: int
    descending: bool = False
    order: str = "nan_last"

    def check(self, op: str) -> None:
        _need(type(self.k) is int and self.k > 0, f"{op}: k={self.k!r} is not a positive int")
        _need(isinstance(self.descending, bool), f"{op}: descending={self.descending!r}")
        _need(self.order in ORDERS, f"{op}: order={self.order!r} is not one of {ORDERS}")


@dataclass(frozen=True, slots=True)
class Conv(Params):
    """A 2-D convolution as an implicit GEMM: the node's inputs are the channels-last input
    ``[N, H, W, C]`` and the kernel ``[KH * KW, C, O]`` (taps row-major), its output ``[N, OH *
    OW, O]`` in ``dtype`` (fp32 accumulation). ``padding``: zeros around the input, ``(low,
    high)`` per spatial dim, each at most the kernel's extent less one (more is padded before).
    After fusion an ``epilogue`` (as a matmul's: over the output ``[N, OH * OW, O]``, its
    inputs the node's past the kernel; printed with its slot as ``acc_slot``)."""

    dtype: str
    kernel: tuple[int, int]
    strides: tuple[int, int]
    dilation: tuple[int, int]
    padding: tuple[tuple[int, int], tuple[int, int]]
    epilogue: Fused | None = None
    _quiet: ClassVar[tuple[str, ...]] = ("epilogue",)

    @property
    def prologue(self) -> None:
        """A convolution fuses no prologue (the node's inputs past the kernel are the
        epilogue's: :func:`lowering.graph.matmul_inputs` reads them as a matmul's)."""
        return None

    def items(self) -> tuple[tuple[str, Any], ...]:
        out = [kv for kv in Params.items(self) if kv[0] != "epilogue"]
        if self.epilogue is not None:
            out += [("epilogue", self.epilogue.body), ("acc_slot", self.epilogue.slot)]
        return tuple(sorted(out, key=lambda kv: kv[0]))

    def check(self, op: str) -> None:
        _dtype(op, "dtype", self.dtype)
        if self.epilogue is not None:
            _need(isinstance(self.epilogue, Fused), f"{op}: epilogue is not a Fused")
            _body(op, "epilogue", self.epilogue.body)
        for name in ("kernel", "strides", "dilation"):
            v = getattr(self, name)
            _need(
                len(v) == 2 and all(type(x) is int and x > 0 for x in v),
                f"{op}: {name}={v!r} is not two positive ints",
            )
        pads = self.padding
        _need(len(pads) == 2, f"{op}: padding={pads!r} is not (low, high) per spatial dim")
        for (lo, hi), k, d in zip(pads, self.kernel, self.dilation, strict=True):
            ext = (k - 1) * d
            _need(0 <= lo <= ext and 0 <= hi <= ext, f"{op}: padding {pads!r} beyond the kernel")

    def out_hw(self, h: int, w: int) -> tuple[int, int]:
        """The output's spatial extent for an ``h`` x ``w`` input."""
        return tuple(
            (n + lo + hi - (k - 1) * d - 1) // s + 1
            for n, (lo, hi), k, d, s in zip(
                (h, w), self.padding, self.kernel, self.dilation, self.strides, strict=True
            )
        )


@dataclass(frozen=True, slots=True)
class TakeAlong(Gather):
    """``out[r, j] = x[r, idx[r, j]]``: the node's inputs are ``x`` ``[R, n]`` and int32
    ``idx`` ``[R, m]``; ``mode`` and ``fill_value`` as a gather's, per element."""


def _with_graphs(p: Params, items: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    """The printer's items with each graph shown by its name (its body printed below)."""
    graphs = {id(g) for g in p.subgraphs()}
    return tuple((k, v.name if id(v) in graphs else v) for k, v in items)


#: op name -> its params class (what :func:`~lowering.graph.check_graph` checks a node against)
PARAMS: dict[str, type[Params]] = {
    "elementwise": Elementwise,
    "convert": Convert,
    "broadcast": Broadcast,
    "transpose": Transpose,
    "slice": Slice,
    "reshape": Reshape,
    "concatenate": Concatenate,
    "reduce": ReduceParams,
    "matmul": Matmul,
    "gather": Gather,
    "map": Map,
    "scan": Scan,
    "while": While,
    "cond": Cond,
    "update_slice": UpdateSlice,
    "sort": Sort,
    "take_along": TakeAlong,
    "conv": Conv,
}


def make_params(op: str, **kw: Any) -> Params:
    """``op``'s params from keywords; GraphError naming the op for an unknown op, an unknown
    keyword or a missing one."""
    cls = PARAMS.get(op)
    if cls is None:
        _need(not kw, f"unknown op {op!r}")
        return Params()
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(kw) - set(names))
    _need(
        not unknown, f"op {op!r} has no parameter {', '.join(unknown)} (it has {', '.join(names)})"
    )
    try:
        return cls(**kw)
    except TypeError as e:
        raise GraphError(f"op {op!r}: {e}") from None

"""Size buckets for eager one-op kernels: a dimension whose size keeps changing (a KV cache that
grows by one each decode step) compiles once per bucket, not once per size.

Dynamic detection is Dynamo's "automatic dynamic": per op and argument structure (ranks, dtypes,
devices, static arguments), a tensor dimension seen with two different sizes (both above 1) is
dynamic from then on. A dynamic dimension of ``n`` runs padded to :func:`bucket` ``(n)``: 64 up
to 64, then the next power of two (every bucket is a whole number of 128-byte sticks for every
dtype). The number of kernels then grows with log2 of the largest size, not with the number of
sizes.

Padding never changes a result. The padded inputs are filled so that the positions past each
tensor's own size are neutral for the op, and the results are cropped back to their sizes:

* pointwise ops (``torch.Tag.pointwise``): every position is its own; the padding's results
  are cropped away (fill 0);
* ``mm``/``bmm``: padded rows and columns are cropped; padded positions of the contracted
  dimension are zero in both operands, so they add nothing;
* reductions and softmax over a padded dimension: filled with the reduction's identity (0 for a
  sum, -inf for a max and a softmax, True for ``all``, ...);
* ``isin`` over a padded first tensor (the tensor of values looked up is never padded);
* ``mean`` over dimensions that are not padded, ``cumsum`` (a running sum: the padding comes
  after), ``tril``/``triu``, ``embedding`` (padded indices are 0: a row of the table, cropped).
  A ``mean`` over a padded dimension (it counts its elements) and every other op run at their
  exact sizes; ``cat`` runs on a bucket as a data movement (:mod:`torch_bridge.card_cat`).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

__all__ = ["bucket", "plan_padding", "dynamic_dims", "varied", "Padding", "reset"]

aten = torch.ops.aten

#: a dynamic size up to this runs padded to it; above, to the next power of two
MIN_BUCKET = 64

#: reductions over a padded dimension: the fill that leaves them unchanged
_IDENTITY: dict[str, str] = {
    "aten::sum": "zero",
    "aten::nansum": "zero",
    "aten::prod": "one",
    "aten::amax": "lowest",
    "aten::max": "lowest",
    "aten::argmax": "lowest",
    "aten::amin": "highest",
    "aten::min": "highest",
    "aten::argmin": "highest",
    "aten::all": "one",
    "aten::any": "zero",
    "aten::logsumexp": "lowest",
    "aten::_softmax": "lowest",
    "aten::_log_softmax": "lowest",
    "aten::softmax": "lowest",
    "aten::log_softmax": "lowest",
}

_MATMUL = frozenset({"aten::mm", "aten::bmm"})

#: ops whose results at the tensor's own positions do not depend on the positions past them,
#: padded at the end of any dimension: a mean over dims that are not padded, a running sum,
#: a triangle, a row gather (padded indices are 0, a row of the table)
_POSITIONAL = frozenset(
    {"aten::mean", "aten::cumsum", "aten::tril", "aten::triu", "aten::embedding"}
)

#: ops pointwise over their first tensor only (``isin``: each element looked up in the whole
#: second; that one is never padded)
_OF_FIRST = frozenset({"aten::isin"})

#: ops whose padded positions a tensor argument masks: the op's name -> that argument's leaf
#: index, filled with the lowest value (``spyre_jax::attention``'s additive bias: a padded key
#: scores -inf and gets no weight)
MASKED: dict[str, int] = {}

_lock = threading.Lock()
#: family -> per tensor leaf, per dim: the size first seen, or -1 once it has varied
_seen: dict[Any, list[list[int]]] = {}


def bucket(n: int) -> int:
    """The size a dynamic dimension of ``n`` runs at: 64 up to 64, then the next power of 2."""
    if n <= MIN_BUCKET:
        return MIN_BUCKET
    return 1 << (n - 1).bit_length()


def reset() -> None:
    """Forget which dimensions were seen to vary."""
    with _lock:
        _seen.clear()


class Padding:
    """How one exact signature runs on a bucket's kernel: each tensor leaf's padded shape and
    fill (None: not a tensor), and each result's own shape to crop to."""

    __slots__ = ("shapes", "fills", "out_shapes")

    def __init__(
        self,
        shapes: list[tuple[int, ...] | None],
        fills: list[Any],
        out_shapes: list[tuple[int, ...]],
    ):
        self.shapes = shapes
        self.fills = fills
        self.out_shapes = out_shapes


def _family(op: Any, spec: Any, leaves: list) -> Any:
    fam: list[Any] = [op, spec]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            fam.append((x.dim(), x.dtype, x.device.type))
        else:
            try:
                hash(x)
                fam.append(x)
            except TypeError:
                fam.append(repr(x))
    return tuple(fam)


def dynamic_dims(op: Any, spec: Any, leaves: list) -> list[set[int]] | None:
    """Record the sizes of this call; each tensor leaf's dims seen to vary (None: none)."""
    fam = _family(op, spec, leaves)
    sizes = [list(x.shape) if isinstance(x, torch.Tensor) else [] for x in leaves]
    return varied(fam, sizes)


def varied(fam: Any, sizes: list[list[int]]) -> list[set[int]] | None:
    """:func:`dynamic_dims` for a call whose family key its caller made (``fam``, hashable, the
    same for every call of the op that may share a bucket's program) and whose tensors have
    ``sizes`` (one list per leaf, empty for a non-tensor)."""
    with _lock:
        seen = _seen.get(fam)
        if seen is None:
            _seen[fam] = sizes
            return None
        dyn: list[set[int]] = []
        for k, (old, new) in enumerate(zip(seen, sizes, strict=True)):
            d = set()
            for i, (a, b) in enumerate(zip(old, new, strict=True)):
                if a != b and b > 1 and a != 1:
                    seen[k][i] = -1
                if seen[k][i] == -1 and b > 1:
                    d.add(i)
            dyn.append(d)
    return dyn if any(dyn) else None


def _reduced_dims(op: Any, args: tuple, kwargs: dict, rank: int) -> set[int] | None:
    """The dims a reduction or softmax reduces (from its ``dim`` argument)."""
    names = [a.name for a in op._schema.arguments]
    if "dim" not in names:
        return set(range(rank))
    i = names.index("dim")
    d = args[i] if i < len(args) else kwargs.get("dim")
    if d is None:
        return set(range(rank))
    if isinstance(d, int):
        d = [d]
    return {int(x) % max(rank, 1) for x in d}


def _fill(kind: str, dtype: torch.dtype) -> Any:
    if kind == "zero":
        return False if dtype == torch.bool else 0
    if kind == "one":
        return True if dtype == torch.bool else 1
    if dtype == torch.bool:
        return kind == "highest"
    if dtype.is_floating_point:
        return -math.inf if kind == "lowest" else math.inf
    info = torch.iinfo(torch.int32 if dtype == torch.int64 else dtype)
    return info.min if kind == "lowest" else info.max


def plan_padding(
    op: Any, spec: Any, leaves: list, args: tuple, kwargs: dict, outs: list[torch.Tensor]
) -> Padding | None:
    """How this call runs on a bucket's kernel, or None (its exact sizes: nothing varied yet,
    or an op whose results padding could change). ``outs``: the call's fake results."""
    name = op._schema.name
    pointwise = torch.Tag.pointwise in op.tags
    identity = _IDENTITY.get(name)
    masked = MASKED.get(name)
    if not (
        pointwise
        or identity
        or masked is not None
        or name in _MATMUL
        or name in _POSITIONAL
        or name in _OF_FIRST
    ):
        return None
    dyn = dynamic_dims(op, spec, leaves)
    if dyn is None:
        return None
    if name in _OF_FIRST and (
        not isinstance(leaves[0], torch.Tensor) or any(d for d in dyn[1:])
    ):  # only the first tensor's positions are each their own
        return None
    if name == "aten::mean":  # it counts its elements: none of them may be padding
        t = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        if len(t) != 1 or _reduced_dims(op, args, kwargs, leaves[t[0]].dim()) & dyn[t[0]]:
            return None
    tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    shapes: list[tuple[int, ...] | None] = [None] * len(leaves)
    fills: list[Any] = [None] * len(leaves)
    for i in tensors:
        x = leaves[i]
        shapes[i] = tuple(bucket(n) if d in dyn[i] else n for d, n in enumerate(x.shape))
        fills[i] = 0 if x.dtype != torch.bool else False
    if masked is not None and isinstance(leaves[masked], torch.Tensor):
        fills[masked] = _fill("lowest", leaves[masked].dtype)
    if identity is not None and not pointwise:
        if len(tensors) != 1:
            return None
        x = leaves[tensors[0]]
        if _reduced_dims(op, args, kwargs, x.dim()) & dyn[tensors[0]]:
            fills[tensors[0]] = _fill(identity, x.dtype)
    if all(shapes[i] == tuple(leaves[i].shape) for i in tensors):
        return None
    if any(not isinstance(o, torch.Tensor) for o in outs):
        return None
    return Padding(shapes, fills, [tuple(o.shape) for o in outs])

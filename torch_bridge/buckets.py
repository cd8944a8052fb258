"""Size buckets for eager one-op kernels: a dimension whose size keeps changing (a KV cache that
grows by one each decode step) compiles once per bucket, not once per size.

Dynamic detection is Dynamo's "automatic dynamic": per op and argument structure (ranks, dtypes,
devices, static arguments), a tensor dimension seen with two different sizes is dynamic from then
on. A dynamic dimension of ``n`` > 1 runs padded to :func:`bucket` ``(n)``: 64 up to 64, then the
next power of two (every bucket is a whole number of 128-byte sticks for every dtype); a size of 1
runs as it is (a decode step's one token: padding it would multiply the work, and Dynamo counts 1
apart too, but here seeing 8 and then 1 is what shows a prompt's length varies). The number of
kernels then grows with log2 of the largest size, not with the number of sizes.

A dimension seen at n > 1 and at 1 is how a prompt and its decode steps look (``generate()``'s
prefill and then one token at a time); when that shows, the buckets of the family's earlier
calls are compiled then (:func:`seen_sizes`), so a second prompt length inside a bucket already
seen compiles nothing: the first prompt's calls ran at their own sizes before anything varied.
(A cost of the first call: kernels a workload that never changes its lengths does not use.)

Padding never changes a result: the padded inputs are filled so that the positions past each
tensor's own size are neutral for the op, and the results are cropped back to their sizes.
Which ops may be padded, and with what fill, is :mod:`torch_bridge.pad_rules`' table (shared
with the compiled path). Here: pointwise ops, reductions and softmax (the padding of a reduced
dimension takes the reduction's identity), ``mm``/``bmm``, positional ops, ``isin`` over its
first tensor, masked ops, and ``mean``/``var`` over dimensions that are not padded (they count
their elements). Every other op runs at its exact sizes; ``cat`` runs on a bucket as a data
movement (:mod:`torch_bridge.card_cat`).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .pad_rules import PadKind, fill_value, rule_of

__all__ = ["bucket", "plan_padding", "dynamic_dims", "seen_sizes", "varied", "Padding", "reset"]

aten = torch.ops.aten

#: a dynamic size up to this runs padded to it; above, to the next power of two
MIN_BUCKET = 64

#: the classes of :mod:`torch_bridge.pad_rules` an eager one-op kernel runs padded
_PADDED = frozenset(
    {
        PadKind.POINTWISE,
        PadKind.REDUCTION,
        PadKind.MOMENTS,
        PadKind.CONTRACTION,
        PadKind.POSITIONAL,
        PadKind.OF_FIRST,
        PadKind.MASKED,
    }
)

_lock = threading.Lock()
#: family -> per tensor leaf, per dim: the size first seen, or -1 once it has varied
_seen: dict[Any, list[list[int]]] = {}
#: family -> the distinct sizes of its calls (at most :data:`SIZES_KEPT`), as seen
_sizes: dict[Any, list[list[list[int]]]] = {}
#: families with a dimension that became dynamic since :func:`seen_sizes` last looked
_fresh: set[Any] = set()
#: distinct call sizes kept per family (for the buckets compiled when a dimension varies)
SIZES_KEPT = 32


def bucket(n: int, least: int = MIN_BUCKET) -> int:
    """The size a dynamic dimension of ``n`` runs at: ``least`` (64) up to it, then the next
    power of 2. A stick dimension's ``least`` is a stick's elements (:func:`plan_padding`)."""
    if n <= least:
        return least
    return 1 << (n - 1).bit_length()


def reset() -> None:
    """Forget which dimensions were seen to vary."""
    with _lock:
        _seen.clear()
        _sizes.clear()
        _fresh.clear()


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
            _sizes[fam] = [[list(s) for s in sizes]]
            return None
        kept = _sizes[fam]
        if len(kept) < SIZES_KEPT and sizes not in kept:
            kept.append([list(s) for s in sizes])
        dyn: list[set[int]] = []
        for k, (old, new) in enumerate(zip(seen, sizes, strict=True)):
            d = set()
            for i, (a, b) in enumerate(zip(old, new, strict=True)):
                # two sizes seen (a size of 1 among them: it still runs as it is, below)
                if a != b and a >= 1 and b >= 1:
                    seen[k][i] = -1
                    if min(a, b) == 1:  # n and then 1: a prompt and its decode steps
                        _fresh.add(fam)
                if seen[k][i] == -1 and b > 1:
                    d.add(i)
            dyn.append(d)
    return dyn if any(dyn) else None


def seen_sizes(op: Any, spec: Any, leaves: list) -> list[list[list[int]]]:
    """Once after a dimension of this call's family became dynamic: the sizes of the family's
    earlier calls (one list per leaf, empty for a non-tensor) that ran at their own sizes and now
    belong to a bucket, whose kernels the caller compiles then, so that a later call of any size
    in a bucket already seen compiles nothing (a second prompt length: the first prompt's calls
    ran before the length was seen to vary); else an empty list."""
    fam = _family(op, spec, leaves)
    with _lock:
        if fam not in _fresh:
            return []
        _fresh.discard(fam)
        seen = _seen[fam]
        return [
            [list(s) for s in sizes]
            for sizes in _sizes[fam]
            if any(
                seen[k][i] == -1 and n > 1 and bucket(n) != n
                for k, row in enumerate(sizes)
                for i, n in enumerate(row)
            )
        ]


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


#: the classes whose tensors' last dimensions meet no other dimension of another tensor: there
#: a last dimension runs in whole sticks (a contraction's K is one operand's last dimension
#: and the other's first; an attention's key length is the mask's last and the keys' third)
_STICKY = frozenset(
    {PadKind.POINTWISE, PadKind.REDUCTION, PadKind.MOMENTS, PadKind.POSITIONAL, PadKind.OF_FIRST}
)


def _aligned(leaves: list, var: list[set[int]]) -> list[set[int]]:
    """A pointwise op's dynamic dims made the same on every tensor where they broadcast
    together (aligned from the last; a size of 1 broadcasts and is never padded)."""
    offs: set[int] = set()
    for x, v in zip(leaves, var, strict=True):
        if isinstance(x, torch.Tensor):
            offs |= {x.dim() - d for d in v}
    out = []
    for x, v in zip(leaves, var, strict=True):
        if isinstance(x, torch.Tensor) and offs:
            r = x.dim()
            v = v | {r - o for o in offs if 0 < o <= r and x.shape[r - o] > 1}
        out.append(v)
    return out


def _stick_dims(
    rule: Any, op: Any, leaves: list, args: tuple, kwargs: dict, stick_bytes: int
) -> tuple[list[set[int]], int]:
    """Each tensor leaf's last dimension where it is shorter than one stick (per leaf, a set;
    only where every tensor is one row), and the elements of a stick of the widest of the
    call's card dtypes: the size those dims round up to. Free on the card: every tensor's last
    dimension is stored in whole sticks, and a stick of a narrower dtype holds a whole number of
    the widest's."""
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    width = max((min(x.element_size(), 4) for x in tensors), default=4)  # int64: int32 there
    per = stick_bytes // width
    if any(n > 1 for x in tensors for n in x.shape[:-1]):
        # rows only (a prompt's tokens, its mask, its positions): a tensor of several rows
        # keeps its sizes (its padded result would be gathered by the exact kernels after it),
        # and its buckets (0: no stick size)
        return [set() for _ in leaves], 0
    dims: list[set[int]] = []
    for k, x in enumerate(leaves):
        last = x.dim() - 1 if isinstance(x, torch.Tensor) else -1
        ok = last >= 0 and 1 < x.shape[last] < per
        if rule.kind is PadKind.OF_FIRST and k > 0:
            ok = False  # the looked-up elements are never padded
        if ok and rule.kind is PadKind.MOMENTS:
            ok = last not in _reduced_dims(op, args, kwargs, x.dim())
        dims.append({last} if ok else set())
    return dims, per


def plan_padding(
    op: Any,
    spec: Any,
    leaves: list,
    args: tuple,
    kwargs: dict,
    outs: list[torch.Tensor],
    stick_bytes: int = 0,
) -> Padding | None:
    """How this call runs on a bucket's kernel, or None (its exact sizes: nothing varied yet,
    or an op whose results padding could change). ``outs``: the call's fake results.

    With ``stick_bytes`` (the card's), the last dimension of a row shorter than one stick runs
    at one stick from the first call on (an op that is not a contraction): the card stores it
    so anyway, and every length inside the stick shares one kernel (a prompt of 8 tokens and
    one of 13: their token rows are one stick of int32). Longer rows and tensors of several
    rows keep their sizes until they vary (a padded result costs the exact kernels after it a
    gather)."""
    rule = rule_of(op)
    if rule.kind not in _PADDED:
        return None
    var = dynamic_dims(op, spec, leaves) or [set() for _ in leaves]
    if rule.kind is PadKind.POINTWISE:
        var = _aligned(leaves, var)
    sticky: list[set[int]] = [set() for _ in leaves]
    per = 0
    if stick_bytes and rule.kind in _STICKY:
        sticky, per = _stick_dims(rule, op, leaves, args, kwargs, stick_bytes)
    dyn = [v | s for v, s in zip(var, sticky, strict=True)]
    if not any(dyn):
        return None
    if rule.kind is PadKind.OF_FIRST and (
        not isinstance(leaves[0], torch.Tensor) or any(d for d in dyn[1:])
    ):  # only the first tensor's positions are each their own
        return None
    if rule.kind is PadKind.MOMENTS:  # it counts its elements: none of them may be padding
        t = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        if len(t) != 1 or _reduced_dims(op, args, kwargs, leaves[t[0]].dim()) & dyn[t[0]]:
            return None
    tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    shapes: list[tuple[int, ...] | None] = [None] * len(leaves)
    fills: list[Any] = [None] * len(leaves)
    for i in tensors:
        x = leaves[i]
        last = x.dim() - 1
        shapes[i] = tuple(
            (bucket(n, per) if per and d == last else bucket(n))
            if d in var[i]
            else -(-n // per) * per
            if d in sticky[i]
            else n
            for d, n in enumerate(x.shape)
        )
        fills[i] = 0 if x.dtype != torch.bool else False
    if rule.kind is PadKind.MASKED and isinstance(leaves[rule.arg], torch.Tensor):
        fills[rule.arg] = fill_value("lowest", leaves[rule.arg].dtype)
    if rule.kind is PadKind.REDUCTION:
        if len(tensors) != 1:
            return None
        x = leaves[tensors[0]]
        if _reduced_dims(op, args, kwargs, x.dim()) & dyn[tensors[0]]:
            fills[tensors[0]] = fill_value(rule.identity, x.dtype)
    if all(shapes[i] == tuple(leaves[i].shape) for i in tensors):
        return None
    if any(not isinstance(o, torch.Tensor) for o in outs):
        return None
    return Padding(shapes, fills, [tuple(o.shape) for o in outs])

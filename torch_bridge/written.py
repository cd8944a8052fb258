"""What an in-place or ``out=`` op on spyre tensors writes, and the write back of the card's
results into it (:func:`torch_bridge.eager.fallback` runs the op's functional form on the card).

An ``out=`` tensor with no bytes yet (``torch.empty(0)``, as ``generate()``'s ``isin`` and the
math path's ``where`` are called) takes the result's storage as its own: torch would resize it
to fresh memory and copy the result in, which gives the same tensor one copy later.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from . import storage as st
from .view_writes import write_on_card

aten = torch.ops.aten


def written_tensors(op: Any, args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, bool]]:
    """The tensors ``op`` writes, as (tensor, is an out= argument), in schema order."""
    out = []
    for i, a in enumerate(op._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
        if isinstance(v, torch.Tensor):
            out.append((v, bool(a.is_out)))
    return out


def has_spyre_input(op: Any, args: tuple, kwargs: dict) -> bool:
    for i, a in enumerate(op._schema.arguments):
        if a.is_out:
            continue
        v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
        if any(st.is_spyre(x) for x in tree_flatten(v)[0]):
            return True
    return False


_functional_cache: dict[Any, Any] = {}


def functional(op: Any) -> Any:
    """The functional overload of an in-place (``add_.Tensor`` -> ``add.Tensor``) or ``out=``
    (``add.out`` -> ``add.Tensor``) op, or None."""
    if op in _functional_cache:
        return _functional_cache[op]
    s = op._schema
    name = s.name.split("::", 1)[1]
    found = None
    if any(a.is_out for a in s.arguments):
        want = [(a.name, str(a.type)) for a in s.arguments if not a.is_out]
        nouts = sum(1 for a in s.arguments if a.is_out)
        packet = op.overloadpacket
        for ov in packet.overloads():
            cand = getattr(packet, ov)
            cs = cand._schema
            if any(a.alias_info is not None for a in cs.arguments) or len(cs.returns) != nouts:
                continue
            if [(a.name, str(a.type)) for a in cs.arguments] == want:
                found = cand
                break
    elif name.endswith("_"):
        packet = getattr(aten, name[:-1], None)
        cand = getattr(packet, op._overloadname, None) if packet is not None else None
        if cand is not None:
            names = [a.name for a in cand._schema.arguments]
            if names == [a.name for a in s.arguments] and not any(
                a.alias_info is not None for a in cand._schema.arguments
            ):
                found = cand
    _functional_cache[op] = found
    return found


def functional_args(op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The functional op's arguments: the in-place/out= op's, without the out= ones."""
    outs = {a.name for a in op._schema.arguments if a.is_out}
    return args, {k: v for k, v in kwargs.items() if k not in outs}


def write_back(op: Any, written: list, results: list) -> Any:
    """Copy the card's results into the tensors the op writes; return what the op returns."""
    for (dst, is_out), r in zip(written, results, strict=True):
        if not torch.can_cast(r.dtype, dst.dtype):
            raise RuntimeError(  # torch's own words
                f"result type {_name(r.dtype)} can't be cast to the desired output type "
                f"{_name(dst.dtype)}"
            )
        if is_out and st.takes_storage(dst, r.dtype):
            st.adopt(dst, r)
            continue
        if tuple(r.shape) != tuple(dst.shape):
            if not is_out:
                raise RuntimeError(
                    f"output with shape {list(dst.shape)} doesn't match the broadcast shape "
                    f"{list(r.shape)}"
                )
            dst.resize_(r.shape)
        if not st.copy_on_card(dst, r) and not write_on_card(dst, r):
            st.alias(dst).copy_(st.alias(r))
            st.device_step("copy", dst, [r])
    ts = [d for d, _ in written]
    return ts[0] if len(op._schema.returns) == 1 else tuple(ts)


def _name(dtype: torch.dtype) -> str:
    """A dtype as torch's messages name it (``Float``, ``Half``, ``Long``, ``Bool``, ...): the
    scalar type of its tensor type name (``torch.FloatTensor``)."""
    return torch.empty(0, dtype=dtype).type().removeprefix("torch.").removesuffix("Tensor")

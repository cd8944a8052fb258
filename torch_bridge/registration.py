"""Which ATen ops get a ``spyre`` (PrivateUse1) kernel of their own in :mod:`torch_bridge.eager`:
the functional ops with a lowering rule, minus views, in-place ops and composites."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["NOT_REGISTERED", "eligible", "is_tensor_type"]

#: ops with lowering rules that are better left to their composite kernels (data movement:
#: empty + copy_/fill_, which work on the payload directly)
NOT_REGISTERED = frozenset(
    {
        "aten::_to_copy",
        "aten::clone",
        "aten::lift_fresh_copy",
        "aten::_unsafe_view",
        "aten::full_like",
        "aten::empty_like",
        "aten::zeros_like",
        "aten::ones_like",
    }
)


def eligible(op: Any) -> bool:
    """A rule's op gets a spyre kernel if it computes (no view), has a tensor input and no
    CompositeImplicitAutograd kernel (those decompose before reaching the backend)."""
    if not isinstance(op, torch._ops.OpOverload):
        return False
    s = op._schema
    if s.name in NOT_REGISTERED:
        return False
    if any(r.alias_info is not None for r in s.returns):
        return False
    if any(a.alias_info is not None and a.alias_info.is_write for a in s.arguments):
        return False
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
        return False
    return any(is_tensor_type(a.type) or "Tensor" in str(a.type) for a in s.arguments)


def is_tensor_type(t: Any) -> bool:
    if isinstance(t, torch._C.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch._C.TensorType)

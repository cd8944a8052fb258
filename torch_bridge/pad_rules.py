"""Which ATen ops may run on padded tensors, and how: the one table both bucketed paths read.

A dimension whose size keeps changing runs padded up to its size bucket
(:func:`torch_bridge.buckets.bucket`), on the eager device (:mod:`torch_bridge.buckets`: one
kernel per bucket for each op) and through ``torch.compile`` (:mod:`torch_bridge.padded`: a
graph of symbolic sizes compiled once per bucket). Padding must never change a result. Each op
falls in one class (:class:`PadKind`), which says what makes its padded positions harmless:

* ``POINTWISE`` (an overload tagged ``torch.Tag.pointwise``; the tag wins over the table):
  every position is its own; the padding's results are
  cropped away.
* ``REDUCTION``: positions of a reduced dimension mix; the padding is filled with the
  reduction's identity, read from :data:`device_model.ops.REDUCTIONS` (0 for a sum, -inf for a
  max or a softmax's row, True for ``all``, ...).
* ``MOMENTS``: ``mean`` and ``var`` count their elements. The compiled path divides masked sums
  by the runtime count; the eager path pads them only where no reduced dimension is padded.
* ``CONTRACTION``: matrix products; padded positions of the contracted dimension are zero in
  both operands (``contract``: its dim in the lhs and in the rhs).
* ``POSITIONAL``: a result position depends on the positions before it only (a running sum, a
  triangle, a row gather whose padded indices are 0, a row-wise norm over static dims): padded
  at the end of any dimension, the tensor's own positions are unchanged.
* ``OF_FIRST``: pointwise over the first tensor only (``isin``: each element looked up in the
  whole second, which is never padded).
* ``MASKED``: a tensor argument (leaf ``arg``) masks the padded positions and is filled with the
  lowest value (``spyre_jax::attention``'s additive bias: a padded key scores -inf).
* ``MOVEMENT``: layout, copies, factories and selections that do not mix positions along a
  padded dimension (the compiled path runs them on the padded tensors as they are).
* ``OFFSET``: ops whose result depends on where the runtime sizes end (``cat``, ``slice``,
  ``select``, reshapes, ``split``, ``arange``); the compiled path has a rule for each, written
  in :class:`torch_bridge.padded._Padder`; the eager path runs them at exact sizes.
* ``UNSAFE``: everything else runs at its exact sizes (eager) or makes the graph compile per
  exact size (compiled: :class:`torch_bridge.padded.NotBucketable`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from device_model.ops import REDUCTIONS, Reduce, identity_value

__all__ = ["PadKind", "PadRule", "RULES", "rule_of", "fill_value", "register_masked"]


class PadKind(enum.Enum):
    """How an op's padded positions are kept harmless (see the module docstring)."""

    POINTWISE = "pointwise"
    REDUCTION = "reduction"
    MOMENTS = "moments"
    CONTRACTION = "contraction"
    POSITIONAL = "positional"
    OF_FIRST = "of_first"
    MASKED = "masked"
    MOVEMENT = "movement"
    OFFSET = "offset"
    UNSAFE = "unsafe"


@dataclass(frozen=True, slots=True)
class PadRule:
    """One op's padding rule. ``identity``: a REDUCTION's fill, by
    :class:`device_model.ops.Reduction`'s names (``zero``, ``one``, ``lowest``, ``highest``);
    ``contract``: a CONTRACTION's contracted dim in (lhs, rhs); ``arg``: a MASKED op's mask
    leaf."""

    kind: PadKind
    identity: str = ""
    contract: tuple[int, int] = (0, 0)
    arg: int = -1


def _red(kind: Reduce) -> PadRule:
    return PadRule(PadKind.REDUCTION, identity=REDUCTIONS[kind].identity)


_P = PadKind
#: ATen schema name -> its rule (overloads tagged pointwise need no entry)
RULES: dict[str, PadRule] = {
    "aten::sum": _red(Reduce.SUM),
    "aten::nansum": _red(Reduce.SUM),
    "aten::prod": _red(Reduce.PROD),
    "aten::amax": _red(Reduce.MAX),
    "aten::max": _red(Reduce.MAX),
    "aten::argmax": _red(Reduce.ARGMAX),
    "aten::amin": _red(Reduce.MIN),
    "aten::min": _red(Reduce.MIN),
    "aten::argmin": _red(Reduce.ARGMIN),
    # any/all test truth: 0 (False) adds nothing to an "or", 1 (True) to an "and", whatever the
    # dtype (a max's -inf would be a truthy value)
    "aten::any": PadRule(_P.REDUCTION, identity="zero"),
    "aten::all": PadRule(_P.REDUCTION, identity="one"),
    # the max of a row is subtracted first: -inf gets no weight
    "aten::logsumexp": _red(Reduce.MAX),
    "aten::softmax": _red(Reduce.MAX),
    "aten::_softmax": _red(Reduce.MAX),
    "aten::log_softmax": _red(Reduce.MAX),
    "aten::_log_softmax": _red(Reduce.MAX),
    "aten::mean": PadRule(_P.MOMENTS),
    "aten::var": PadRule(_P.MOMENTS),
    "aten::mm": PadRule(_P.CONTRACTION, contract=(1, 0)),
    "aten::bmm": PadRule(_P.CONTRACTION, contract=(2, 1)),
    "aten::addmm": PadRule(_P.CONTRACTION, contract=(1, 0)),
    **{
        f"aten::{n}": PadRule(_P.POSITIONAL)
        for n in ("cumsum", "cumprod", "logcumsumexp", "cummax", "cummin")
    },
    "aten::tril": PadRule(_P.POSITIONAL),
    "aten::triu": PadRule(_P.POSITIONAL),
    "aten::embedding": PadRule(_P.POSITIONAL),
    "aten::native_layer_norm": PadRule(_P.OFFSET),
    "aten::isin": PadRule(_P.OF_FIRST),
    **{
        f"aten::{n}": PadRule(_P.MOVEMENT)
        for n in (
            "permute",
            "transpose",
            "t",
            "unsqueeze",
            "squeeze",
            "expand",
            "clone",
            "contiguous",
            "alias",
            "detach",
            "_to_copy",
            "full_like",
            "zeros_like",
            "ones_like",
            "empty_like",
            "full",
            "zeros",
            "ones",
            "empty",
            "where",
            "index_select",
            "gather",
            "lift_fresh_copy",
        )
    },
    **{
        f"aten::{n}": PadRule(_P.OFFSET)
        for n in (
            "cat",
            "slice",
            "select",
            "view",
            "reshape",
            "_unsafe_view",
            "split",
            "split_with_sizes",
            "arange",
            "scalar_tensor",
        )
    },
}

_UNSAFE = PadRule(PadKind.UNSAFE)
_POINTWISE = PadRule(PadKind.POINTWISE)


def register_masked(name: str, arg: int) -> None:
    """Declare op ``name`` (a schema name, ``ns::op``) MASKED by its tensor leaf ``arg``."""
    RULES[name] = PadRule(PadKind.MASKED, arg=arg)


def rule_of(op: Any) -> PadRule:
    """The rule of an ``OpOverload`` (or anything with a ``_schema``): POINTWISE for an
    overload tagged pointwise (``aten.max.other``, while ``aten.max.dim`` reduces), else the
    table's entry for its schema name, else UNSAFE."""
    if torch.Tag.pointwise in getattr(op, "tags", ()):
        return _POINTWISE
    schema = getattr(op, "_schema", None)
    if schema is None:
        return _UNSAFE
    return RULES.get(schema.name, _UNSAFE)


def fill_value(identity: str, dtype: torch.dtype) -> Any:
    """A REDUCTION's (or a MASKED op's ``lowest``) fill as a Python scalar for a tensor of
    ``dtype``. Integers take the card's int32 range (int64 is computed as int32 there)."""
    if dtype == torch.bool:
        np_dt: Any = np.bool_
    elif dtype.is_floating_point:
        np_dt = np.float32
    else:
        np_dt = np.int32
    return identity_value(identity, np_dt).item()

"""The JAX importer's rules for sorting and selection: ``sort`` (``jnp.sort``, ``argsort``,
multi-operand ``lax.sort``) and ``top_k``, through :mod:`lowering.sort_ops` (registered into
:data:`lowering.jaxpr_common.RULES` when ``lowering.from_jaxpr`` imports this module)."""

from __future__ import annotations

from typing import Any

from . import sort_ops
from .builder import Builder, Lit
from .graph import Var
from .jaxpr_common import aval as _aval
from .jaxpr_common import rule

__all__: list[str] = []


@rule("sort")
def _sort(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    """``lax.sort``: stable or not, JAX's order is the stable one (NaNs last, ``-0.0 == 0.0``:
    ``nan_last``); every operand reordered by the first ``num_keys``."""
    ops_ = [b.as_var(a, _aval(v)[0]) for a, v in zip(args, eqn.invars, strict=True)]
    p = eqn.params
    return sort_ops.sort(b, ops_, int(p["dimension"]), int(p["num_keys"]))


@rule("top_k")
def _top_k(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    """``lax.top_k``: the ``k`` largest along ``axis`` (the last by default) in IEEE total order
    (``-NaN`` smallest, ``NaN`` largest, ``-0.0 < 0.0``), ties in index order; values and
    indices."""
    x = b.as_var(args[0], _aval(eqn.invars[0])[0])
    axis = int(eqn.params.get("axis", -1))
    k = int(eqn.params["k"])
    idx = sort_ops.argsort(b, [x], axis, k=k, descending=True, order="total")
    return [sort_ops.take_along(b, x, idx, axis), idx]


def _total_order_key(b: Builder, x: Var) -> Var:
    """An int32 (or the integer itself) whose order is IEEE totalOrder on ``x``'s values:
    the fp32 bits with the magnitude bits of the negatives flipped."""
    if x.dtype not in ("float16", "bfloat16", "float32"):
        return x
    if x.dtype != "float32":
        x = b.emit("convert", [x], x.shape, "float32", dtype="float32")
    i = b.elementwise("bitcast", [x], x.shape, "int32", param="int32")
    sign = b.elementwise("shr", [i, Lit(31, "int32")], x.shape, "int32")
    flip = b.elementwise("and", [sign, Lit(0x7FFFFFFF, "int32")], x.shape, "int32")
    return b.elementwise("xor", [i, flip], x.shape, "int32")


_TOTAL_ORDER = {"eq_to": "eq", "le_to": "le", "lt_to": "lt"}


@rule(*_TOTAL_ORDER)
def _compare_total(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    """``lax``'s total-order comparisons (``searchsorted``, ``random.choice`` with ``p``):
    floats compared by IEEE totalOrder (``-NaN < -inf``, ``-0.0 < 0.0``, ``inf < NaN``)."""
    shape = _aval(eqn.outvars[0])[0]
    x, y = (b.as_var(a, _aval(v)[0]) for a, v in zip(args, eqn.invars, strict=True))
    if x.shape != shape:
        x = b.emit("broadcast", [x], shape, x.dtype, shape=shape, dims=())
    if y.shape != shape:
        y = b.emit("broadcast", [y], shape, y.dtype, shape=shape, dims=())
    kx, ky = _total_order_key(b, x), _total_order_key(b, y)
    return [b.elementwise(_TOTAL_ORDER[eqn.primitive.name], [kx, ky], shape, "bool")]

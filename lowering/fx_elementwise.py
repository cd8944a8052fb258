"""torch FX rules: elementwise ops, activations, copies and creation ops.

They register into :data:`lowering.fx_common.RULES` when ``lowering.from_fx`` imports this module.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import torch_import
from .builder import Builder, Lit
from .errors import LoweringError
from .fx_common import RULES, bcast, convert, ew, ew_raw, operand, promote, result, rule, to_bool
from .graph import Var
from .torch_import import torch

aten = torch.ops.aten
#: the card's integer dtypes (bitwise ops act on their bits)
_INTS = ("int32", "int8", "uint8", "uint32")

# ---------------------------------------------------------------------------------------------
# rules: elementwise

_UNARY = {
    aten.neg.default: "neg",
    aten.abs.default: "abs",
    aten.sign.default: "sign",
    aten.floor.default: "floor",
    aten.ceil.default: "ceil",
    aten.exp.default: "exp",
    aten.log.default: "log",
    aten.sqrt.default: "sqrt",
    aten.rsqrt.default: "rsqrt",
    aten.tanh.default: "tanh",
    aten.sigmoid.default: "logistic",
    aten.erf.default: "erf",
    aten.sin.default: "sin",
    aten.cos.default: "cos",
    aten.tan.default: "tan",
    aten.asin.default: "asin",
    aten.acos.default: "acos",
    aten.atan.default: "atan",
    aten.sinh.default: "sinh",
    aten.cosh.default: "cosh",
    aten.asinh.default: "asinh",
    aten.acosh.default: "acosh",
    aten.atanh.default: "atanh",
    aten.lgamma.default: "lgamma",
    aten.digamma.default: "digamma",
    aten.erfinv.default: "erf_inv",
    aten.special_i0e.default: "bessel_i0e",
    aten.special_i1e.default: "bessel_i1e",
    aten.logical_not.default: "not",
    aten.bitwise_not.default: "not",
}
for _op, _fn in _UNARY.items():

    def _u(b: Builder, node: torch.fx.Node, x: Var, _fn: str = _fn) -> Var:
        if _fn == "not":
            if result(node)[1] in _INTS:  # bitwise not on integers
                return ew(b, node, "not", x, compute=result(node)[1])
            return ew(b, node, "not", convert(b, x, "bool"), compute="bool")
        shape, out_dt = result(node)
        cdt = out_dt if out_dt != "bool" else "float32"
        return ew(b, node, _fn, convert(b, x, cdt), compute=cdt)

    RULES[_op] = _u

_BINARY = {
    aten.add.Tensor: "add",
    aten.add.Scalar: "add",
    aten.sub.Tensor: "sub",
    aten.sub.Scalar: "sub",
    aten.mul.Tensor: "mul",
    aten.mul.Scalar: "mul",
    aten.div.Tensor: "div",
    aten.div.Scalar: "div",
    aten.maximum.default: "max",
    aten.minimum.default: "min",
    aten.pow.Tensor_Tensor: "pow",
    aten.logical_and.default: "and",
    aten.logical_or.default: "or",
    aten.logical_xor.default: "xor",
    aten.bitwise_and.Tensor: "and",
    aten.bitwise_or.Tensor: "or",
    aten.bitwise_and.Scalar: "and",
    aten.bitwise_or.Scalar: "or",
    aten.bitwise_xor.Tensor: "xor",
    aten.bitwise_xor.Scalar: "xor",
    aten.bitwise_left_shift.Tensor: "shl",
    aten.bitwise_left_shift.Tensor_Scalar: "shl",
    aten.bitwise_right_shift.Tensor: "shr",
    aten.bitwise_right_shift.Tensor_Scalar: "shr",
    aten.nextafter.default: "nextafter",
    aten.__lshift__.Tensor: "shl",
    aten.__lshift__.Scalar: "shl",
    aten.__rshift__.Tensor: "shr",
    aten.__rshift__.Scalar: "shr",
    aten.eq.Tensor: "eq",
    aten.eq.Scalar: "eq",
    aten.ne.Tensor: "ne",
    aten.ne.Scalar: "ne",
    aten.lt.Tensor: "lt",
    aten.lt.Scalar: "lt",
    aten.le.Tensor: "le",
    aten.le.Scalar: "le",
    aten.gt.Tensor: "gt",
    aten.gt.Scalar: "gt",
    aten.ge.Tensor: "ge",
    aten.ge.Scalar: "ge",
}
for _op, _fn in _BINARY.items():

    def _bin(
        b: Builder,
        node: torch.fx.Node,
        x: Any,
        y: Any,
        *,
        alpha: Any = None,
        rounding_mode: Any = None,
        _fn: str = _fn,
    ) -> Var:
        if rounding_mode is not None:
            raise LoweringError(f"spyre: div with rounding_mode={rounding_mode!r}")
        if _fn in ("and", "or", "xor"):
            shape, out_dt = result(node)
            if out_dt in _INTS:  # bitwise on integers
                return ew(b, node, _fn, x, y, compute=out_dt)
            return ew(b, node, _fn, *(to_bool(b, v) for v in (x, y)), compute="bool")
        if alpha is not None and alpha != 1:
            shape, _ = result(node)
            y = ew_raw(b, "mul", [y, alpha], shape, promote(x, y))
        if _fn == "div":  # true division: integer operands divide as floats
            shape, out_dt = result(node)
            return ew(b, node, "div", x, y, compute=out_dt)
        return ew(b, node, _fn, x, y)

    RULES[_op] = _bin


@rule(aten.remainder.Tensor, aten.remainder.Scalar)
def _remainder(b: Builder, node: torch.fx.Node, x: Any, y: Any) -> Var:
    """torch's remainder takes the divisor's sign (Python ``%``), not the dividend's (fmod)."""
    shape, dt = result(node)
    cdt = promote(x, y)
    r = ew_raw(b, "rem", [x, y], shape, cdt)
    yv = operand(b, y, shape, cdt)
    zero = Lit(0, cdt)
    rneg = b.elementwise("lt", [r, zero], shape, "bool")
    yneg = b.elementwise("lt", [yv, zero], shape, "bool") if isinstance(yv, Var) else None
    nz = b.elementwise("ne", [r, zero], shape, "bool")
    if yneg is None:  # a scalar divisor: its sign is known now
        fix = rneg if float(y) > 0 else b.elementwise("not", [rneg], shape, "bool")
    else:
        fix = b.elementwise("xor", [rneg, yneg], shape, "bool")
    fix = b.elementwise("and", [fix, nz], shape, "bool")
    shifted = b.elementwise("add", [r, yv], shape, cdt)
    return convert(b, b.elementwise("select_n", [fix, r, shifted], shape, cdt), dt)


@rule(aten.floor_divide.default, aten.floor_divide.Scalar)
def _floor_divide(b: Builder, node: torch.fx.Node, x: Any, y: Any) -> Var:
    return _rounded_div(b, node, x, y, "floor")


@rule(aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div_mode(b: Builder, node: torch.fx.Node, x: Any, y: Any, *, rounding_mode: Any) -> Var:
    if rounding_mode is None:
        shape, out_dt = result(node)
        return ew(b, node, "div", x, y, compute=out_dt)
    if rounding_mode not in ("floor", "trunc"):
        raise LoweringError(f"spyre: div with rounding_mode={rounding_mode!r}")
    return _rounded_div(b, node, x, y, rounding_mode)


def _rounded_div(b: Builder, node: torch.fx.Node, x: Any, y: Any, mode: str) -> Var:
    """``x / y`` rounded toward zero (``trunc``) or toward minus infinity (``floor``), as torch
    computes it. Integers: the card's truncating division, less one where the remainder is
    non-zero and its sign differs from the divisor's. Floats: torch's own formula (not
    ``floor(x / y)``, which differs where ``x / y`` rounds up to an integer): ``(x - fmod(x, y))
    / y`` less that fix, rounded to the nearest integer, ``x / y`` where ``y`` is 0."""
    shape, dt = result(node)
    cdt = promote(x, y)
    xv, yv = operand(b, x, shape, cdt), operand(b, y, shape, cdt)
    zero = Lit(0, cdt)

    def e(fn: str, *a: Any, out: str = cdt) -> Var:
        return b.elementwise(fn, list(a), shape, out)

    if cdt in ("int32", "bool"):
        q = e("div", xv, yv)
        if mode == "trunc":
            return convert(b, q, dt)
        r = e("rem", xv, yv)
        fix = e(
            "and",
            e("ne", r, zero, out="bool"),
            e("ne", e("lt", r, zero, out="bool"), e("lt", yv, zero, out="bool"), out="bool"),
            out="bool",
        )
        return convert(b, e("sub", q, convert(b, fix, cdt)), dt)
    quot = e("div", xv, yv)
    if mode == "trunc":
        neg = e("lt", quot, zero, out="bool")
        return convert(b, e("select_n", neg, e("floor", quot), e("ceil", quot)), dt)
    mod = e("rem", xv, yv)
    div = e("div", e("sub", xv, mod), yv)
    fix = e(
        "and",
        e("ne", mod, zero, out="bool"),
        e("ne", e("lt", yv, zero, out="bool"), e("lt", mod, zero, out="bool"), out="bool"),
        out="bool",
    )
    div = e("sub", div, convert(b, fix, cdt))
    fl = e("floor", div)
    up = e("gt", e("sub", div, fl), Lit(0.5, cdt), out="bool")
    fl = e("add", fl, convert(b, up, cdt))
    signed_zero = e("mul", quot, zero)
    res = e("select_n", e("ne", div, zero, out="bool"), signed_zero, fl)
    res = e("select_n", e("eq", yv, zero, out="bool"), res, quot)
    return convert(b, res, dt)


@rule(aten.rsub.Scalar, aten.rsub.Tensor)
def _rsub(b: Builder, node: torch.fx.Node, x: Any, y: Any, alpha: Any = 1) -> Var:
    shape, _ = result(node)
    if alpha != 1:
        x = ew_raw(b, "mul", [x, alpha], shape, promote(x, y))
    return ew(b, node, "sub", y, x)


@rule(aten.round.default)
def _round(b: Builder, node: torch.fx.Node, x: Var) -> Var:
    shape, dt = result(node)
    return b.elementwise("round", [x], shape, dt, param=1)  # half to even, as torch rounds


@rule(aten.tril.default, aten.triu.default)
def _tril(b: Builder, node: torch.fx.Node, x: Var, diagonal: int = 0) -> Var:
    """Keep ``col - row <= diagonal`` (tril) or ``>= diagonal`` (triu) of the last two dims."""
    shape, dt = result(node)
    r, c = shape[-2], shape[-1]
    d = np.arange(c)[None, :] - np.arange(r)[:, None]
    keep = d <= diagonal if node.target is aten.tril.default else d >= diagonal
    mask = bcast(b, b.const(keep, "bool"), shape)
    zero = Lit(False if dt == "bool" else 0, dt)
    return b.elementwise("select_n", [mask, zero, x], shape, dt)


@rule(aten.pow.Tensor_Scalar)
def _pow(b: Builder, node: torch.fx.Node, x: Var, e: Any) -> Var:
    shape, out_dt = result(node)
    if float(e) == int(e) and abs(int(e)) <= 16:
        return ew(b, node, "integer_pow", convert(b, x, out_dt), compute=out_dt, param=int(e))
    return ew(b, node, "pow", convert(b, x, out_dt), float(e), compute=out_dt)


@rule(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where(b: Builder, node: torch.fx.Node, c: Any, x: Any, y: Any) -> Var:
    shape, out_dt = result(node)
    pred = bcast(b, convert(b, c, "bool"), shape)
    xs = [operand(b, v, shape, out_dt) for v in (y, x)]  # select_n: case 0 if false
    return b.elementwise("select_n", [pred, *xs], shape, out_dt)


@rule(aten.clamp.default, aten.clamp.Tensor)
def _clamp(b: Builder, node: torch.fx.Node, x: Var, lo: Any = None, hi: Any = None) -> Var:
    shape, out_dt = result(node)
    v = convert(b, x, out_dt)
    if lo is not None:
        v = ew_raw(b, "max", [v, lo], shape, out_dt)
    if hi is not None:
        v = ew_raw(b, "min", [v, hi], shape, out_dt)
    return v


@rule(aten.gelu.default)
def _gelu(b: Builder, node: torch.fx.Node, x: Var, approximate: str = "none") -> Var:
    shape, dt = result(node)
    if approximate == "tanh":
        x3 = b.elementwise("integer_pow", [x], shape, dt, param=3)
        inner = ew_raw(b, "add", [x, ew_raw(b, "mul", [x3, 0.044715], shape, dt)], shape, dt)
        t = b.elementwise(
            "tanh", [ew_raw(b, "mul", [inner, math.sqrt(2 / math.pi)], shape, dt)], shape, dt
        )
        return ew_raw(
            b,
            "mul",
            [ew_raw(b, "mul", [x, 0.5], shape, dt), ew_raw(b, "add", [t, 1.0], shape, dt)],
            shape,
            dt,
        )
    e = b.elementwise("erf", [ew_raw(b, "mul", [x, 1 / math.sqrt(2)], shape, dt)], shape, dt)
    return ew_raw(
        b,
        "mul",
        [ew_raw(b, "mul", [x, 0.5], shape, dt), ew_raw(b, "add", [e, 1.0], shape, dt)],
        shape,
        dt,
    )


@rule(aten.relu.default)
def _relu(b: Builder, node: torch.fx.Node, x: Var) -> Var:
    shape, dt = result(node)
    return b.elementwise("max", [x, Lit(0, dt)], shape, dt)


@rule(aten.leaky_relu.default)
def _leaky_relu(b: Builder, node: torch.fx.Node, x: Var, slope: float = 0.01) -> Var:
    shape, dt = result(node)
    neg = b.elementwise("lt", [x, Lit(0, dt)], shape, "bool")
    return b.elementwise("select_n", [neg, x, ew_raw(b, "mul", [x, slope], shape, dt)], shape, dt)


@rule(aten.silu.default)
def _silu(b: Builder, node: torch.fx.Node, x: Var) -> Var:
    shape, dt = result(node)
    return ew_raw(b, "mul", [x, b.elementwise("logistic", [x], shape, dt)], shape, dt)


@rule(
    aten._to_copy.default,
    aten.clone.default,
    aten.alias.default,
    aten.lift_fresh_copy.default,
    aten.detach.default,
    aten.contiguous.default,
)
def _copy(b: Builder, node: torch.fx.Node, x: Any, **kw: Any) -> Var:
    shape, dt = result(node)
    if not isinstance(x, Var):
        return b.const(np.asarray(x), dt)
    return convert(b, x, dt)


# ---------------------------------------------------------------------------------------------
# rules: creation


@rule(aten.full.default)
def _full(b: Builder, node: torch.fx.Node, size: Any, value: Any, **kw: Any) -> Var:
    shape, dt = result(node)
    return b.full(shape, value, dt)


@rule(aten.empty.memory_format, aten.empty_like.default, aten.empty_permuted.default)
def _empty(b: Builder, node: torch.fx.Node, size: Any, *layout: Any, **kw: Any) -> Var:
    """Uninitialized memory: zeros (a program reads only what it wrote into it)."""
    shape, dt = result(node)
    return b.full(shape, 0, dt)


@rule(aten.full_like.default)
def _full_like(b: Builder, node: torch.fx.Node, x: Any, value: Any, **kw: Any) -> Var:
    shape, dt = result(node)
    return b.full(shape, value, dt)


@rule(aten.zeros_like.default, aten.ones_like.default)
def _zeros_like(b: Builder, node: torch.fx.Node, x: Any, **kw: Any) -> Var:
    shape, dt = result(node)
    return b.full(shape, 1 if node.target is aten.ones_like.default else 0, dt)


@rule(aten.scalar_tensor.default)
def _scalar_tensor(b: Builder, node: torch.fx.Node, value: Any, **kw: Any) -> Var:
    shape, dt = result(node)
    return b.const(np.asarray(value), dt)


@rule(aten.arange.start_step, aten.arange.default, aten.arange.start)
def _arange(b: Builder, node: torch.fx.Node, *a: Any, **kw: Any) -> Var:
    shape, dt = result(node)
    nums = [x for x in a if isinstance(x, int | float)]
    if len(nums) == 1:
        start, step = 0, 1
    else:
        start = nums[0]
        step = nums[2] if len(nums) > 2 else 1
    return b.const(start + step * np.arange(shape[0]), dt)


torch_import.finish(__name__)  # see lowering.torch_import

"""Import a jaxpr into the graph IR: one registry from JAX primitive to lowering rule.

Rules are registered with ``@rule("name", ...)`` next to their bodies. A rule gets the builder,
the equation and its operands (``Var`` or :class:`Lit` for scalar literals) and returns the
output ``Var`` s. Nested ``jit``/``pjit``, ``custom_jvp_call`` and ``custom_vjp_call`` are inlined.
A primitive with no rule raises :class:`UnsupportedPrimitiveError` naming it, with the equation
and the user's source line; an exception a rule raises is wrapped once in a
:class:`~lowering.errors.LoweringRuleError` carrying the same (as ``lowering.from_fx`` does).
Tests plant a bug by patching :data:`RULES`, the one registry.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.extend import core as jcore

from device_model.layout import SUPPORTED_DTYPES

from . import (
    indexing,
    jaxpr_common,
    jaxpr_control,  # noqa: F401  (the rules of loops and branches register)
    jaxpr_conv,  # noqa: F401  (the rule of convolutions registers)
    jaxpr_gather,  # (windowed gathers as single-element ones)
    jaxpr_random,  # (the rules of random numbers register; keys' structural ops)
    jaxpr_sort,  # noqa: F401  (the rules of sorting and selection register)
    jaxpr_special,  # noqa: F401  (the rules of special functions register: polygamma)
)
from .builder import Builder, Lit
from .errors import PASS_THROUGH, LoweringError, UnsupportedPrimitiveError, rule_error
from .graph import Graph, Var
from .jaxpr_common import INLINED, RULES, PRNGKeyError, Rule, aval, key_impl, rule
from .source import user_line

__all__ = ["from_jaxpr", "RULES", "Lit", "aval", "rule", "user_source_line"]


_dtype_name = jaxpr_common.dtype_name
_aval = jaxpr_common.aval


def _frames(source_info: Any) -> list[tuple[str, int, str]]:
    """The frames of an equation's traceback, innermost first."""
    tb = getattr(source_info, "traceback", None)
    return [(f.file_name, f.line_num, f.function_name) for f in getattr(tb, "frames", None) or []]


def _user_frame(source_info: Any) -> str:
    """``file:line (function)`` of the innermost user frame of an equation, or ``""``.

    An equation traced inside a nested ``jit`` (``jnp.sort``, ``jnp.fft.fft`` are jitted
    wrappers) may carry only JAX-internal frames: then there is no user frame here.
    """
    return user_line(_frames(source_info), fallback=False)


def user_source_line(source_info: Any) -> str:
    """``file:line (function)`` of the innermost frame outside JAX, equinox and this project.

    Falls back to the innermost frame when every frame is library code, ``""`` without frames.
    """
    return user_line(_frames(source_info))


# ---------------------------------------------------------------------------------------------
# the importer loop


def from_jaxpr(closed: Any, name: str = "main", source: str = "") -> Graph:
    """Import a ``ClosedJaxpr`` (from ``jax.make_jaxpr``) into a :class:`Graph`. ``source``:
    the user line of equations that have none of their own (a loop body's, the loop's)."""
    b = Builder()
    b.source = source
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = {}
    for v, c in zip(jaxpr.constvars, closed.consts, strict=True):
        env[v] = b.const(np.asarray(c), _aval(v)[1])
    inputs = []
    for v in jaxpr.invars:
        shape, dt = _aval(v)
        var = Var(shape, dt)
        env[v] = var
        inputs.append(var)
    outs = _run(b, jaxpr, env)
    outputs = []
    for o in outs:
        if isinstance(o, Lit):
            o = b.const(np.asarray(o.value, dtype=o.dtype), o.dtype)
        outputs.append(o)
    return Graph(name, tuple(inputs), tuple(b.nodes), tuple(outputs), tuple(b.consts))


def _read(env: dict[Any, Any], x: Any) -> Any:
    if isinstance(x, jcore.Literal):
        val = np.asarray(x.val)
        dt = _dtype_name(x.aval.dtype)
        if val.shape == ():
            return Lit(val.item(), dt)
        raise LoweringError(f"non-scalar literal {x}")
    return env[x]


#: primitives whose body is inlined: their equations are checked one by one inside
_INLINED = INLINED


def _run(b: Builder, jaxpr: Any, env: dict[Any, Any]) -> list[Any]:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        # eqns inlined from a nested jit may have only JAX-internal frames: they then take the
        # user line of the call they were inlined from (``b.source`` while the call is inlined)
        where = _user_frame(eqn.source_info) or b.source or user_source_line(eqn.source_info)
        if name not in _INLINED:
            _check_eqn_dtypes(jaxpr, eqn, where)
        fn = jaxpr_random.key_rule(eqn) or RULES.get(name)
        if fn is None:
            raise UnsupportedPrimitiveError(
                "JAX", name, _eqn_text(eqn), where, _eqn_context(jaxpr, eqn)
            )
        args = [_read(env, x) for x in eqn.invars]
        saved = b.source
        b.source = where
        try:
            outs = fn(b, eqn, args)
        except PASS_THROUGH:
            raise
        except Exception as e:
            if name in _INLINED:  # the inlined body's own equations reported it as they saw fit
                raise
            raise rule_error("JAX", name, _eqn_text(eqn), where, e, _eqn_context(jaxpr, eqn)) from e
        finally:
            b.source = saved
        for v, o in zip(eqn.outvars, outs, strict=True):
            env[v] = o
    return [_read(env, x) for x in jaxpr.outvars]


def _check_eqn_dtypes(jaxpr: Any, eqn: Any, where: str) -> None:
    """Raise TypeError naming the primitive, the equation and the user's line when an operand
    or a result of ``eqn`` has a dtype the card does not support (complex64 in an FFT...)."""
    for kind, vs in (("an operand", eqn.invars), ("a result", eqn.outvars)):
        for v in vs:
            dt = getattr(getattr(v, "aval", None), "dtype", None)
            if dt is None:
                continue
            try:
                if key_impl(dt) is not None:  # a threefry key: its uint32 data
                    continue
            except PRNGKeyError as e:
                raise PRNGKeyError(
                    f"{e}\n  equation: {_eqn_text(eqn)}\n  at: {where or '<unknown source line>'}"
                ) from None
            try:
                name = np.dtype(dt).name
            except TypeError:  # extended dtypes (PRNG keys) have no NumPy counterpart
                name = str(dt)
            if name in SUPPORTED_DTYPES:
                continue
            raise TypeError(
                f"spyre: JAX primitive '{eqn.primitive.name}' has {kind} of dtype {name}, "
                f"which the card does not support; supported dtypes: "
                f"{', '.join(SUPPORTED_DTYPES)}\n"
                f"  equation: {_eqn_text(eqn)}\n"
                f"  at: {where or '<unknown source line>'}\n"
                f"  in:\n{_eqn_context(jaxpr, eqn)}"
            )


def _eqn_text(eqn: Any) -> str:
    try:
        return str(eqn).strip().replace("\n", " ")[:400]
    except Exception:  # pragma: no cover - printing never fails in practice
        return eqn.primitive.name


def _eqn_context(jaxpr: Any, eqn: Any, radius: int = 2) -> str:
    eqns = list(jaxpr.eqns)
    i = next(k for k, e in enumerate(eqns) if e is eqn)
    lines = []
    for k in range(max(0, i - radius), min(len(eqns), i + radius + 1)):
        mark = ">>" if k == i else "  "
        lines.append(f"    {mark} {_eqn_text(eqns[k])[:160]}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# rules: calls (inlined)


def _inline(b: Builder, closed: Any, args: list[Any]) -> list[Any]:
    inner = closed.jaxpr if hasattr(closed, "jaxpr") and hasattr(closed, "consts") else closed
    consts = getattr(closed, "consts", [])
    env: dict[Any, Any] = {}
    for v, c in zip(inner.constvars, consts, strict=True):
        env[v] = b.const(np.asarray(c), _aval(v)[1])
    for v, a in zip(inner.invars, args, strict=True):
        env[v] = a
    return _run(b, inner, env)


@rule("pjit", "jit", "closed_call", "core_call", "remat", "remat2", "checkpoint", "spyre_call")
def _call(b: Builder, eqn: Any, args: list[Any]) -> list[Any]:
    return _inline(b, eqn.params["jaxpr"], args)


@rule("custom_jvp_call")
def _custom_jvp(b: Builder, eqn: Any, args: list[Any]) -> list[Any]:
    return _inline(b, eqn.params["call_jaxpr"], args)


@rule("custom_vjp_call", "custom_vjp_call_jaxpr")
def _custom_vjp(b: Builder, eqn: Any, args: list[Any]) -> list[Any]:
    p = eqn.params
    closed = p.get("call_jaxpr") or p.get("fun_jaxpr")
    n = len(closed.jaxpr.invars)
    return _inline(b, closed, args[-n:] if len(args) > n else args)


@rule("empty", "empty2")
def _empty(b: Builder, eqn: Any, args: list[Any]) -> list[Any]:
    """An array whose values nobody reads before writing them (a differentiated loop's or
    branch's zero-initialized buffers): zeros, a broadcast constant."""
    shape, dt = _aval(eqn.outvars[0])
    return [b.full(shape, 0, dt)]


@rule("stop_gradient", "copy", "copy_p", "optimization_barrier", "pvary", "pbroadcast")
def _identity(b: Builder, eqn: Any, args: list[Any]) -> list[Any]:
    # pvary/pbroadcast: a shard_map body's varying-axes types (spyre_jax.multicard), no data
    outs = []
    for a, v in zip(args, eqn.outvars, strict=True):
        outs.append(b.as_var(a, _aval(v)[0]) if isinstance(a, Lit) else a)
    return outs


# ---------------------------------------------------------------------------------------------
# rules: elementwise

_UNARY = {
    "neg": "neg",
    "abs": "abs",
    "sign": "sign",
    "floor": "floor",
    "ceil": "ceil",
    "exp": "exp",
    "exp2": "exp2",
    "log": "log",
    "log1p": "log1p",
    "expm1": "expm1",
    "sqrt": "sqrt",
    "rsqrt": "rsqrt",
    "tanh": "tanh",
    "logistic": "logistic",
    "erf": "erf",
    "erfc": "erfc",
    "sin": "sin",
    "cos": "cos",
    **{n: n for n in ("tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh")},
    "cbrt": "cbrt",
    **{n: n for n in ("lgamma", "digamma", "erf_inv", "bessel_i0e", "bessel_i1e")},
    "square": "square",
    "not": "not",
    "is_finite": "is_finite",
}
_BINARY = {
    "add": "add",
    "add_any": "add",
    "sub": "sub",
    "mul": "mul",
    "div": "div",
    "rem": "rem",
    "pow": "pow",
    "max": "max",
    "min": "min",
    "atan2": "atan2",
    "nextafter": "nextafter",
    "shift_left": "shl",
    "shift_right_arithmetic": "shr",
    "shift_right_logical": "shr_logical",
    "and": "and",
    "or": "or",
    "xor": "xor",
    "eq": "eq",
    "ne": "ne",
    "lt": "lt",
    "le": "le",
    "gt": "gt",
    "ge": "ge",
}


def _ew_rule(fn: str) -> Rule:
    def r(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
        shape, dt = _aval(eqn.outvars[0])
        return [b.elementwise(fn, args, shape, dt)]

    return r


for _p, _f in {**_UNARY, **_BINARY}.items():
    RULES[_p] = _ew_rule(_f)


@rule("select_n")
def _select_n(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    shape, dt = _aval(eqn.outvars[0])
    return [b.elementwise("select_n", args, shape, dt)]


@rule("clamp")
def _clamp(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    lo, x, hi = args
    shape, dt = _aval(eqn.outvars[0])
    return [b.elementwise("min", [b.elementwise("max", [x, lo], shape, dt), hi], shape, dt)]


@rule("integer_pow")
def _integer_pow(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    shape, dt = _aval(eqn.outvars[0])
    return [b.elementwise("integer_pow", args, shape, dt, param=int(eqn.params["y"]))]


@rule("round")
def _round(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    shape, dt = _aval(eqn.outvars[0])
    method = int(eqn.params.get("rounding_method", 0))
    return [b.elementwise("round", args, shape, dt, param=method)]


@rule("convert_element_type")
def _convert(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    shape, dt = _aval(eqn.outvars[0])
    (x,) = args
    if isinstance(x, Lit):
        return [b.elementwise("convert", [x], shape, dt, param=dt)]
    if x.dtype == dt:
        return [x]
    if x.dtype in ("float16", "bfloat16") and dt not in _FLOAT_FORMATS:
        # a fused chain keeps a float16 value in float32 until it stores it; an integer (or
        # bool) conversion of it must see the value the program computed, rounded to float16
        # (``(x * 10).astype(int32)``: -17.998 is -18.0 in float16, so -18, not -17)
        x = b.elementwise("convert", [x], shape, x.dtype, param=x.dtype)
    return [b.emit("convert", [x], shape, dt, dtype=dt)]


# ---------------------------------------------------------------------------------------------
# rules: layout and movement


@rule("broadcast_in_dim")
def _broadcast(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    shape, dt = _aval(eqn.outvars[0])
    (x,) = args
    if isinstance(x, Lit):
        return [b.elementwise("copy", [x], shape, dt)]
    dims = tuple(int(d) for d in eqn.params["broadcast_dimensions"])
    if x.shape == shape and dims == tuple(range(len(shape))):
        return [x]
    return [b.emit("broadcast", [x], shape, dt, shape=shape, dims=dims)]


@rule("tile")
def _tile(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    # jnp.tile: each dim d repeated r times whole, as a broadcast to (r0, d0, r1, d1, ...) and a
    # reshape to (r0 * d0, r1 * d1, ...)
    shape, dt = _aval(eqn.outvars[0])
    x = b.as_var(args[0])
    reps = tuple(int(r) for r in eqn.params["reps"])
    lead = (1,) * (len(reps) - len(x.shape))
    if lead:
        x = b.reshape(x, lead + tuple(x.shape))
    pairs = tuple(v for r, d in zip(reps, x.shape, strict=True) for v in (r, d))
    dims = tuple(range(1, 2 * len(reps), 2))
    wide = b.emit("broadcast", [x], pairs, dt, shape=pairs, dims=dims)
    return [b.reshape(wide, shape)]


@rule("reshape")
def _reshape(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    shape, _ = _aval(eqn.outvars[0])
    x = b.as_var(args[0])
    dims = eqn.params.get("dimensions")
    if dims not in (None, ()) and tuple(int(d) for d in dims) != tuple(range(len(x.shape))):
        # lax.reshape(x, shape, dimensions): x's dims read in this order (the transpose of
        # reduce_prod's derivative uses it), a transpose then a row-major reshape
        x = b.transpose(x, tuple(int(d) for d in dims))
    return [b.reshape(x, shape)]


@rule("squeeze", "expand_dims")
def _squeeze(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    shape, _ = _aval(eqn.outvars[0])
    return [b.reshape(b.as_var(args[0]), shape)]


@rule("transpose")
def _transpose(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    return [b.transpose(args[0], tuple(eqn.params["permutation"]))]


@rule("slice")
def _slice(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    shape, dt = _aval(eqn.outvars[0])
    (x,) = args
    st = tuple(int(s) for s in eqn.params["start_indices"])
    li = tuple(int(s) for s in eqn.params["limit_indices"])
    sd = tuple(int(s) for s in (eqn.params.get("strides") or (1,) * len(st)))
    return [b.emit("slice", [x], shape, dt, starts=st, limits=li, strides=sd)]


@rule("split")
def _split(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    """``jnp.split``: one slice per piece, along ``axis``."""
    (x,) = args
    x = b.as_var(x, _aval(eqn.invars[0])[0])
    ax = int(eqn.params["axis"])
    outs, start = [], 0
    for size, v in zip(eqn.params["sizes"], eqn.outvars, strict=True):
        shape, dt = _aval(v)
        st = tuple(start if d == ax else 0 for d in range(len(x.shape)))
        li = tuple(start + int(size) if d == ax else n for d, n in enumerate(x.shape))
        outs.append(b.emit("slice", [x], shape, dt, starts=st, limits=li, strides=(1,) * len(st)))
        start += int(size)
    return outs


@rule("concatenate")
def _concatenate(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    shape, dt = _aval(eqn.outvars[0])
    ax = int(eqn.params["dimension"])
    vs = [b.as_var(a, tuple(_aval(v)[0])) for a, v in zip(args, eqn.invars, strict=True)]
    return [b.emit("concatenate", vs, shape, dt, axis=ax)]


@rule("pad")
def _pad(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    shape, _ = _aval(eqn.outvars[0])
    x, value = args
    x = b.as_var(x, _aval(eqn.invars[0])[0])
    config = [tuple(int(c) for c in cfg) for cfg in eqn.params["padding_config"]]
    y = b.pad(x, value, config)
    if y.shape != shape:  # pragma: no cover - Builder.pad follows XLA's arithmetic
        raise LoweringError(f"pad gave {y.shape}, expected {shape}")
    return [y]


#: IEEE formats of the card's float dtypes: (exponent bits, mantissa bits)
_FLOAT_FORMATS = {"float32": (8, 23), "float16": (5, 10), "bfloat16": (8, 7)}


@rule("reduce_precision")
def _reduce_precision(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    """``lax.reduce_precision`` as XLA computes it (round the mantissa to ``mantissa_bits`` to
    nearest even, then flush what is below the reduced format's smallest normal to a signed zero
    and send what is above its largest finite to a signed infinity; NaN and infinities pass,
    signed zeros keep their sign), from existing ops only: XLA does it on the bits; here the
    binade ``p = 2^e`` of ``|x|`` comes from a table of powers of two (a row gather) indexed by
    ``floor(log2|x|)``, corrected by one either way, so that ``|x| / p * 2^m`` is exact and
    ``round`` (half to even) rounds the mantissa. Below the source's normal range the quantum
    stays the smallest normal's (subnormals round as XLA's bit arithmetic rounds them)."""
    shape, dt = _aval(eqn.outvars[0])
    ebits, mbits = int(eqn.params["exponent_bits"]), int(eqn.params["mantissa_bits"])
    src_e, src_m = _FLOAT_FORMATS[dt]
    x = b.as_var(args[0], shape)
    if ebits >= src_e and mbits >= src_m:
        return [x]
    f32 = "float32"

    def ew(fn: str, xs: list[Any], out: str = f32, param: Any = None) -> Var:
        return b.elementwise(fn, xs, shape, out, param=param)

    xf = x if dt == f32 else b.emit("convert", [x], shape, f32, dtype=f32)
    fin = ew("is_finite", [xf], "bool")
    a = ew("select_n", [fin, Lit(1.0, f32), ew("abs", [xf])])  # |x|, 1 where not finite
    y = a
    if mbits < src_m:
        emin, emax = 2 - 2 ** (src_e - 1), 2 ** (src_e - 1) - 1
        e = ew("floor", [ew("mul", [ew("log", [a]), Lit(1 / np.log(2.0), f32)])])
        e = ew("max", [ew("min", [e, Lit(float(emax), f32)]), Lit(float(emin), f32)])
        ei = b.emit("convert", [e], shape, "int32", dtype="int32")
        idx = ew("sub", [ei, Lit(emin, "int32")], "int32")
        n = int(np.prod(shape, dtype=np.int64))
        table = b.const(
            np.exp2(np.arange(emin, emax + 1, dtype=np.float64)).astype(np.float32)[:, None]
        )
        p = b.emit(
            "gather", [table, b.reshape(idx, (n,))], (n, 1), f32, mode="clip", fill_value=None
        )
        p = b.reshape(p, shape)
        # log2 is a few ulps off: p is one binade too high or too low near powers of two
        high = ew(
            "and", [ew("gt", [p, a], "bool"), ew("gt", [p, Lit(2.0**emin, f32)], "bool")], "bool"
        )
        p = ew("select_n", [high, p, ew("mul", [p, Lit(0.5, f32)])])
        e = ew("select_n", [high, e, ew("sub", [e, Lit(1.0, f32)])])
        low = ew("le", [ew("mul", [p, Lit(2.0, f32)]), a], "bool")
        p = ew("select_n", [low, p, ew("mul", [p, Lit(2.0, f32)])])
        e = ew("select_n", [low, e, ew("add", [e, Lit(1.0, f32)])])
        t = ew("mul", [ew("div", [a, p]), Lit(2.0**mbits, f32)])  # exact: in [2^m, 2^(m+1))
        r = ew("round", [t], param=1)  # half to even
        if mbits == 0:
            # no mantissa bits: a tie goes to the even bit pattern, i.e. the even biased exponent
            odd = ew("rem", [ew("add", [e, Lit(float(emax), f32)]), Lit(2.0, f32)])
            tie = ew("eq", [t, Lit(1.5, f32)], "bool")
            r = ew("select_n", [tie, r, ew("add", [odd, Lit(1.0, f32)])])
        y = ew("mul", [ew("mul", [r, Lit(2.0**-mbits, f32)]), p])
    if ebits < src_e:
        emin_r, emax_r = 2 - 2 ** (ebits - 1), 2 ** (ebits - 1) - 1
        under = ew("lt", [y, Lit(2.0**emin_r, f32)], "bool")
        y = ew("select_n", [under, y, Lit(0.0, f32)])
        over = ew("ge", [y, Lit(2.0 ** (emax_r + 1), f32)], "bool")
        y = ew("select_n", [over, y, Lit(float("inf"), f32)])
    # the sign: x < 0, or 1/x < 0 for -0.0 (1/-0.0 = -inf), so zeros keep their sign
    recip = ew("div", [Lit(1.0, f32), xf])
    neg = ew(
        "or",
        [ew("lt", [xf, Lit(0.0, f32)], "bool"), ew("lt", [recip, Lit(0.0, f32)], "bool")],
        "bool",
    )
    y = ew("select_n", [neg, y, ew("neg", [y])])
    y = ew("select_n", [fin, xf, y])  # inf and NaN pass through
    return [y if dt == f32 else b.emit("convert", [y], shape, dt, dtype=dt)]


@rule("iota")
def _iota(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    shape, dt = _aval(eqn.outvars[0])
    dim = int(eqn.params["dimension"])
    ar = np.arange(shape[dim]).reshape([-1 if i == dim else 1 for i in range(len(shape))])
    return [b.const(np.broadcast_to(ar, shape).astype(dt), dt)]


# ---------------------------------------------------------------------------------------------
# rules: reductions


def _reduce_rule(kind: str) -> Rule:
    def r(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
        shape, dt = _aval(eqn.outvars[0])
        axes = tuple(sorted(int(a) for a in eqn.params["axes"]))
        x = b.as_var(args[0])
        if not axes:
            return [x]
        return [b.emit("reduce", [x], shape, dt, kind=kind, axes=axes)]

    return r


for _p, _k in {
    "reduce_sum": "sum",
    "reduce_max": "max",
    "reduce_min": "min",
    "reduce_prod": "prod",
    "argmax": "argmax",
    "argmin": "argmin",
}.items():
    RULES[_p] = _reduce_rule(_k)


def _bool_reduce_rule(kind: str) -> Rule:
    """``reduce_or`` / ``reduce_and`` (``jnp.any`` / ``jnp.all``): max / min over the operand
    as int32 (0 or 1), then ``> 0`` (over no elements max gives INT32_MIN: False, min
    INT32_MAX: True, as any / all of nothing)."""

    def r(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
        shape, dt = _aval(eqn.outvars[0])
        axes = tuple(sorted(int(a) for a in eqn.params["axes"]))
        x = b.as_var(args[0])
        if x.dtype != "bool":
            raise LoweringError(f"bitwise {eqn.primitive.name} of {x.dtype} is not supported")
        if not axes:
            return [x]
        xi = b.emit("convert", [x], x.shape, "int32", dtype="int32")
        red = b.emit("reduce", [xi], shape, "int32", kind=kind, axes=axes)
        return [b.elementwise("gt", [red, Lit(0, "int32")], shape, "bool")]

    return r


RULES["reduce_or"] = _bool_reduce_rule("max")
RULES["reduce_and"] = _bool_reduce_rule("min")


@rule("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def _cumulative(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    shape, dt = _aval(eqn.outvars[0])
    kind = eqn.primitive.name + ("_rev" if eqn.params.get("reverse") else "")
    return [b.emit("reduce", [args[0]], shape, dt, kind=kind, axes=(int(eqn.params["axis"]),))]


# ---------------------------------------------------------------------------------------------
# rules: matmul and gather


@rule("dot_general")
def _dot_general(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    out_shape, out_dt = _aval(eqn.outvars[0])
    lhs, rhs = (b.as_var(a) for a in args)
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lc, rc, lb, rb = (tuple(int(d) for d in t) for t in (lc, rc, lb, rb))
    lf = tuple(d for d in range(len(lhs.shape)) if d not in lc and d not in lb)
    rf = tuple(d for d in range(len(rhs.shape)) if d not in rc and d not in rb)
    prod = lambda v, ds: int(np.prod([v.shape[d] for d in ds], dtype=np.int64))
    bsz, m, k, n = prod(lhs, lb), prod(lhs, lf), prod(lhs, lc), prod(rhs, rf)
    a = b.reshape(b.transpose(lhs, lb + lf + lc), (bsz, m, k))
    c = b.reshape(b.transpose(rhs, rb + rc + rf), (bsz, k, n))
    mm = b.emit("matmul", [a, c], (bsz, m, n), out_dt, dtype=out_dt)
    return [b.reshape(mm, out_shape)]


@rule("gather")
def _gather(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    out_shape, dt = _aval(eqn.outvars[0])
    table, idx = b.as_var(args[0]), b.as_var(args[1])
    p = eqn.params
    dn = p["dimension_numbers"]
    sizes = tuple(int(s) for s in p["slice_sizes"])
    mode = str(p["mode"]).upper()
    sim = tuple(int(d) for d in dn.start_index_map)
    coll = tuple(int(d) for d in dn.collapsed_slice_dims)
    obatch = tuple(int(d) for d in dn.operand_batching_dims)
    ibatch = tuple(int(d) for d in dn.start_indices_batching_dims)
    # an indexed dim taken whole (its start clamps to 0) is no index at all
    whole = [c for c, d in enumerate(sim) if d not in coll and sizes[d] == table.shape[d]]
    if whole and len(idx.shape) >= 1 and idx.shape[-1] == len(sim):
        cols = [c for c in range(len(sim)) if c not in whole]
        last = len(idx.shape) - 1
        idx = b.concat([b.slice_dim(idx, last, c, c + 1) for c in cols], last) if cols else idx
        sim = tuple(sim[c] for c in cols)
    offset_dims, gshape, perm = tuple(int(d) for d in dn.offset_dims), out_shape, None
    win = jaxpr_gather.expand_windows(
        b, table.shape, idx, sim, coll, sizes, offset_dims, obatch, "FILL" not in mode
    )
    if win is not None:  # windows of indexed dims: single elements, then a transpose
        idx, coll, sizes, perm = win.index, win.collapsed, win.slice_sizes, win.perm
        offset_dims, gshape = win.offset_dims, win.out_shape
    rest = [d for d in range(len(table.shape)) if d not in sim and d not in obatch]
    kept = [d for d in range(len(table.shape)) if d not in coll and d not in obatch]
    ok = (
        set(coll) <= set(sim)
        and all(sizes[d] == 1 for d in (*sim, *obatch))
        and all(sizes[d] == table.shape[d] for d in rest)
        and len(offset_dims) == len(kept)
        and len(idx.shape) >= 1
        and (idx.shape[-1] == len(sim) or not sim)
    )
    if not ok:
        raise LoweringError(
            "gather is supported where each index names single elements of its dims (the "
            f"other dims taken whole); got {eqn.params}"
        )
    fill = None
    if "FILL" in mode:
        # JAX's defaults: NaN for floats, the most negative value for signed ints, True for bool
        fv = p.get("fill_value")
        if fv is not None:
            fill = float(fv) if np.dtype(eqn.outvars[0].aval.dtype).kind == "f" else int(fv)
        elif dt == "int32":
            fill = int(np.iinfo(np.int32).min)
        elif dt == "bool":
            fill = 1
        else:
            fill = float("nan")
    out = indexing.gather(
        b,
        table,
        idx,
        start_index_map=sim,
        collapsed=coll,
        offset_dims=offset_dims,
        slice_sizes=sizes,
        operand_batching=obatch,
        index_batching=ibatch,
        out_shape=gshape,
        clip="FILL" not in mode,
        fill=fill,
    )
    return [out if perm is None else b.transpose(out, perm)]


# the rules of loops and branches import their bodies with this importer, and the rules of
# random numbers inline the jaxprs of JAX's own PRNG functions
jaxpr_common.import_body = from_jaxpr
jaxpr_common.inline = _inline

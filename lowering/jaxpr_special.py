"""The JAX importer's rules for special functions that JAX's derivatives bring in and the card
has no op for: ``polygamma`` (the derivative of ``digamma``, trigamma; its second, order 2),
built from existing elementwise ops. Registers into :data:`lowering.from_jaxpr.RULES` when
``lowering.from_jaxpr`` imports this module."""

from __future__ import annotations

import math
from typing import Any

from .builder import Builder, Lit
from .errors import LoweringError
from .graph import Var
from .jaxpr_common import aval as _aval
from .jaxpr_common import rule

__all__: list[str] = []

_F32 = "float32"

#: the shift of the recurrence ``psi_n(x) = psi_n(x + 1) + (-1)^(n+1) n! / x^(n+1)`` before the
#: asymptotic series: from x > 0 to z = x + 6 >= 6, where the series' terms below fall under
#: float32's resolution
_SHIFT = 6

#: Bernoulli numbers B_2, B_4, ..., B_10 of the asymptotic series
_BERNOULLI = (1 / 6, -1 / 30, 1 / 42, -1 / 30, 5 / 66)


class _F:
    """float32 elementwise arithmetic on one shape (a terse front to ``Builder.elementwise``)."""

    def __init__(self, b: Builder, shape: tuple[int, ...]):
        self.b, self.shape = b, shape

    def __call__(self, fn: str, *xs: Any, out: str = _F32, param: Any = None) -> Var:
        ys = [Lit(float(x), _F32) if isinstance(x, int | float) else x for x in xs]
        return self.b.elementwise(fn, ys, self.shape, out, param=param)


def _positive(f: _F, x: Var, n: int) -> Var:
    """``(-1)^(n+1) psi_n(x)`` for ``x > 0``: the recurrence up to ``z = x + 6``, then the
    asymptotic series ``(n-1)!/z^n + n!/(2 z^(n+1)) + sum_k B_2k (2k+n-1)! / ((2k)! z^(2k+n))``."""
    acc = None
    for k in range(_SHIFT):
        t = f("div", 1.0, f("integer_pow", f("add", x, k), param=n + 1))
        acc = t if acc is None else f("add", acc, t)
    z = f("add", x, _SHIFT)
    w = f("div", 1.0, z)
    series = f("mul", math.factorial(n - 1), f("integer_pow", w, param=n))
    series = f("add", series, f("mul", math.factorial(n) / 2, f("integer_pow", w, param=n + 1)))
    for k, b2k in enumerate(_BERNOULLI, start=1):
        c = b2k * math.factorial(2 * k + n - 1) / math.factorial(2 * k)
        series = f("add", series, f("mul", c, f("integer_pow", w, param=2 * k + n)))
    assert acc is not None
    return f("add", f("mul", math.factorial(n), acc), series)


@rule("polygamma")
def _polygamma(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    """``lax.polygamma(n, x)`` for a literal order ``n`` of 0 (digamma), 1 or 2, as XLA computes
    it: for ``x > 0`` :func:`_positive`; for ``x <= 0`` the reflection
    ``psi_1(x) = pi^2 / sin^2(pi x) - psi_1(1 - x)``,
    ``psi_2(x) = psi_2(1 - x) - 2 pi^3 cos(pi x) / sin^3(pi x)``; at the poles (the integers
    ``<= 0``) +inf for order 1 and NaN for order 2, XLA's values."""
    shape, dt = _aval(eqn.outvars[0])
    order, x = args
    if not isinstance(order, Lit) or float(order.value) not in (0.0, 1.0, 2.0):
        what = order.value if isinstance(order, Lit) else "a traced order"
        raise LoweringError(f"polygamma is supported for the literal orders 0, 1, 2; got {what}")
    n = int(order.value)
    x = b.as_var(x, shape)
    if n == 0:
        return [b.elementwise("digamma", [x], shape, dt)]
    f = _F(b, shape)
    xf = x if x.dtype == _F32 else b.emit("convert", [x], shape, _F32, dtype=_F32)
    pos = f("gt", xf, 0.0, out="bool")
    y = f("select_n", pos, f("sub", 1.0, xf), xf)  # x > 0: x; else 1 - x (>= 1)
    p = _positive(f, y, n)  # (-1)^(n+1) psi_n(y)
    # sin^2(pi x) and cos(pi x) / sin^3(pi x) are periodic in 1: of r = x - floor(x), exact
    fl = f("floor", xf)
    r = f("mul", f("sub", xf, fl), math.pi)
    s = f("sin", r)
    if n == 1:
        refl = f("sub", f("div", math.pi**2, f("mul", s, s)), p)
        pole = math.inf
    else:  # psi_2(y) = -p
        cube = f("integer_pow", s, param=3)
        refl = f("sub", f("neg", p), f("div", f("mul", f("cos", r), 2 * math.pi**3), cube))
        p = f("neg", p)
        pole = math.nan
    at_pole = f("eq", fl, xf, out="bool")
    refl = f("select_n", at_pole, refl, pole)
    out = f("select_n", pos, refl, p)
    return [out if dt == _F32 else b.emit("convert", [out], shape, dt, dtype=dt)]

"""Reductions: one table that the graph checker, the passes, the tilers, both executors and the
torch padding read (re-exported by :mod:`device_model.ops`).

Adding a reduction kind: a :class:`Reduce` member and its :class:`Reduction` row here; then the
importers' rules that emit it (``docs/adding-an-op.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

__all__ = ["Reduce", "Reduction", "REDUCTIONS", "identity_value"]


class Reduce(StrEnum):
    """The closed set of reduction kinds (a ``reduce`` node's and a map body's ``reduce``)."""

    SUM = "sum"
    PROD = "prod"
    MAX = "max"
    MIN = "min"
    ARGMAX = "argmax"
    ARGMIN = "argmin"
    CUMSUM = "cumsum"
    CUMSUM_REV = "cumsum_rev"
    CUMPROD = "cumprod"
    CUMPROD_REV = "cumprod_rev"
    CUMMAX = "cummax"
    CUMMAX_REV = "cummax_rev"
    CUMMIN = "cummin"
    CUMMIN_REV = "cummin_rev"
    CUMLOGSUMEXP = "cumlogsumexp"
    CUMLOGSUMEXP_REV = "cumlogsumexp_rev"


def _whole(name: str, typed: bool = True) -> Callable[[Any, Any, tuple], Any]:
    """The reduction of ``x`` ``[C, *space]`` over space ``axes`` by ``xp.<name>`` (``typed``:
    accumulating in ``x``'s dtype)."""

    def red(xp: Any, x: Any, axes: tuple[int, ...]) -> Any:
        f = getattr(xp, name)
        ax = tuple(1 + a for a in axes)
        return f(x, axis=ax, dtype=x.dtype) if typed else f(x, axis=ax)

    return red


def _arg(name: str) -> Callable[[Any, Any, tuple], Any]:
    def red(xp: Any, x: Any, axes: tuple[int, ...]) -> Any:
        (a,) = axes
        return getattr(xp, name)(x, axis=1 + a).astype(np.int32)

    return red


#: a running reduction's NumPy ufunc (its ``accumulate``) and the ``jax.lax`` function
_CUM = {
    "sum": ("add", "cumsum"),
    "prod": ("multiply", "cumprod"),
    "max": ("maximum", "cummax"),
    "min": ("minimum", "cummin"),
    "logsumexp": ("logaddexp", "cumlogsumexp"),
}


def _cum(op: str, reverse: bool) -> Callable[[Any, Any, tuple], Any]:
    """The running ``op`` of ``x`` ``[C, *space]`` along one space axis, in ``x``'s dtype."""
    ufunc, lax_fn = _CUM[op]

    def red(xp: Any, x: Any, axes: tuple[int, ...]) -> Any:
        (a,) = axes
        a += 1
        if xp is np:
            y = np.flip(x, axis=a) if reverse else x
            r = getattr(np, ufunc).accumulate(y, axis=a).astype(x.dtype)
            return np.flip(r, axis=a) if reverse else r
        from jax import lax  # the JAX executor's path: lax's cumulative ops

        return getattr(lax, lax_fn)(x, axis=a, reverse=reverse)

    return red


@dataclass(frozen=True, slots=True)
class Reduction:
    """What one reduction kind is, for every layer that handles one.

    ``identity``: the value over no elements, by name: ``zero``, ``one``, ``lowest`` (-inf,
    the integer minimum, False) or ``highest``; padding and masked elements take it.
    ``whole(xp, x, axes)``: the reduction of a ``[C, *space]`` tile over space ``axes``.
    ``combine(xp, acc, part)``: two partial results into one (a reduction split across the
    steps of a stage keeps one accumulator; a scan merges the carry from the blocks before into
    a block's running results); None for an index, which keeps a value/index pair.
    ``index_of``: an argmax-like reduction gives the int32 index of the element the
    ``index_of`` reduction picks (the first, on ties; its accumulator is a pair).
    ``scan``: the result keeps the input's shape (a running result along one axis; split
    across steps, a carry passes from block to block), ``reverse`` from the far end.
    ``one_axis``: it reduces exactly one axis.
    """

    kind: Reduce
    identity: str
    whole: Callable[[Any, Any, tuple[int, ...]], Any]
    combine: Callable[[Any, Any, Any], Any] | None = None
    index_of: str = ""
    scan: bool = False
    reverse: bool = False

    @property
    def one_axis(self) -> bool:
        return bool(self.index_of) or self.scan

    def out_dtype(self, dtype: str) -> str:
        """The result's dtype for an input of ``dtype``."""
        return "int32" if self.index_of else dtype

    def identity_value(self, dtype: Any) -> Any:
        """The identity as a NumPy scalar of ``dtype`` (an index reduction: its values')."""
        return identity_value(self.identity, dtype)


def identity_value(identity: str, dtype: Any) -> Any:
    """A :class:`Reduction` identity by name (``zero``, ``one``, ``lowest``, ``highest``) as a
    NumPy scalar of ``dtype``: lowest is -inf for floats, the minimum for integers, False for
    bool; highest the opposite."""
    dt = np.dtype(dtype)
    if identity == "zero":
        return np.zeros((), dt)[()]
    if identity == "one":
        return np.ones((), dt)[()]
    if identity not in ("lowest", "highest"):
        raise ValueError(f"unknown identity {identity!r}")
    low = identity == "lowest"
    if dt == np.bool_:
        return np.bool_(not low)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return dt.type(info.min if low else info.max)
    return dt.type(-np.inf if low else np.inf)


def _max(xp: Any, a: Any, b: Any) -> Any:
    return xp.maximum(a, b)


def _min(xp: Any, a: Any, b: Any) -> Any:
    return xp.minimum(a, b)


def _scans(fwd: Reduce, rev: Reduce, op: str, identity: str, combine: Callable) -> tuple:
    """A running reduction's two rows: from the start of the axis and from its end."""
    return (
        Reduction(fwd, identity, _cum(op, False), combine, scan=True),
        Reduction(rev, identity, _cum(op, True), combine, scan=True, reverse=True),
    )


#: every reduction kind -> what it is
REDUCTIONS: dict[str, Reduction] = {
    r.kind: r
    for r in (
        Reduction(Reduce.SUM, "zero", _whole("sum"), lambda xp, a, b: a + b),
        Reduction(Reduce.PROD, "one", _whole("prod"), lambda xp, a, b: a * b),
        Reduction(Reduce.MAX, "lowest", _whole("max", False), _max),
        Reduction(Reduce.MIN, "highest", _whole("min", False), _min),
        Reduction(Reduce.ARGMAX, "lowest", _arg("argmax"), index_of="max"),
        Reduction(Reduce.ARGMIN, "highest", _arg("argmin"), index_of="min"),
        *_scans(Reduce.CUMSUM, Reduce.CUMSUM_REV, "sum", "zero", lambda xp, a, b: a + b),
        *_scans(Reduce.CUMPROD, Reduce.CUMPROD_REV, "prod", "one", lambda xp, a, b: a * b),
        *_scans(Reduce.CUMMAX, Reduce.CUMMAX_REV, "max", "lowest", _max),
        *_scans(Reduce.CUMMIN, Reduce.CUMMIN_REV, "min", "highest", _min),
        *_scans(
            Reduce.CUMLOGSUMEXP,
            Reduce.CUMLOGSUMEXP_REV,
            "logsumexp",
            "lowest",
            lambda xp, a, b: xp.logaddexp(a, b),
        ),
    )
}

"""The JAX importer's rules for sorting and selection: ``sort`` (``jnp.sort``, ``argsort``,
multi-operand ``lax.sort``) and ``top_k``, through :mod:`lowering.sort_ops` (registered into
:data:`lowering.jaxpr_common.RULES` when ``lowering.from_jaxpr`` imports this module)."""

from __future__ import annotations

from typing import Any

from . import sort_ops
from .builder import Builder
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

"""The JAX importer's rule for ``conv_general_dilated`` (``lax.conv``, ``jax.lax.conv_transpose``,
flax/equinox convolutions), through :mod:`lowering.conv_ops` (registered into
:data:`lowering.jaxpr_common.RULES` when ``lowering.from_jaxpr`` imports this module)."""

from __future__ import annotations

from typing import Any

from . import conv_ops
from .builder import Builder
from .errors import LoweringError
from .graph import Var
from .jaxpr_common import aval as _aval
from .jaxpr_common import rule

__all__: list[str] = []


@rule("conv_general_dilated")
def _conv(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    """The operands put in ``[N, C, *S]`` and ``[O, I, *K]`` order by the dimension numbers,
    the convolution, and the result put in the output's order."""
    p = eqn.params
    if int(p.get("batch_group_count", 1)) != 1:
        raise LoweringError("spyre: conv_general_dilated with batch_group_count > 1")
    x, w = (b.as_var(a, _aval(v)[0]) for a, v in zip(args, eqn.invars, strict=True))
    lhs_spec, rhs_spec, out_spec = (tuple(int(d) for d in s) for s in p["dimension_numbers"])
    out_shape, out_dt = _aval(eqn.outvars[0])
    nsp = len(x.shape) - 2
    pad = p["padding"]
    if isinstance(pad, str):  # (jaxprs carry explicit pairs; a string only from older JAX)
        raise LoweringError(f"spyre: conv_general_dilated padding {pad!r} not resolved")
    out = conv_ops.conv(
        b,
        b.transpose(x, lhs_spec),
        b.transpose(w, rhs_spec),
        strides=tuple(int(s) for s in p["window_strides"]),
        padding=tuple((int(lo), int(hi)) for lo, hi in pad),
        lhs_dilation=tuple(int(d) for d in (p.get("lhs_dilation") or (1,) * nsp)),
        rhs_dilation=tuple(int(d) for d in (p.get("rhs_dilation") or (1,) * nsp)),
        groups=int(p.get("feature_group_count", 1)),
        out_dtype=out_dt,
    )
    back = tuple(out_spec.index(d) for d in range(len(out_spec)))
    out = b.transpose(out, back)
    assert out.shape == out_shape, (out.shape, out_shape)
    return [out]

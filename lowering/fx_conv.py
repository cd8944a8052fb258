"""torch FX rules: convolutions (``aten.convolution``: ``conv1d``, ``conv2d``, their transposes,
groups and depthwise), through :mod:`lowering.conv_ops`.

A transposed convolution is the direct one over the input dilated by the stride (interior
padding), padded by ``dilation * (k - 1) - padding`` (plus ``output_padding`` at the end),
with the kernel flipped and each group's input and output channels swapped. They register into
:data:`lowering.fx_common.RULES` when ``lowering.from_fx`` imports this module.
"""

from __future__ import annotations

from typing import Any

from . import conv_ops, indexing, torch_import
from .builder import Builder
from .errors import LoweringError
from .fx_common import bcast, convert, result, rule
from .graph import Var
from .torch_import import torch

aten = torch.ops.aten


def _flipped_transpose_kernel(b: Builder, w: Var, groups: int) -> Var:
    """A transposed convolution's kernel ``[Cin, Cout / G, *K]`` as the direct convolution's
    ``[Cout, Cin / G, *K]``, flipped in space."""
    cin, cog, *k = w.shape
    g = groups
    wg = b.reshape(w, (g, cin // g, cog, *k))
    sw = b.transpose(wg, (0, 2, 1, *range(3, 3 + len(k))))
    sw = b.reshape(sw, (g * cog, cin // g, *k))
    return indexing.reverse(b, sw, tuple(range(2, 2 + len(k))))


@rule(aten.convolution.default)
def _convolution(
    b: Builder,
    node: torch.fx.Node,
    x: Var,
    w: Var,
    bias: Var | None,
    stride: Any,
    padding: Any,
    dilation: Any,
    transposed: bool,
    output_padding: Any,
    groups: int,
) -> Var:
    shape, dt = result(node)
    nsp = len(x.shape) - 2
    stride, padding, dilation = (tuple(int(v) for v in t) for t in (stride, padding, dilation))
    if transposed:
        k = w.shape[2:]
        lo = [d * (kk - 1) - p for d, kk, p in zip(dilation, k, padding, strict=True)]
        if any(v < 0 for v in lo):
            raise LoweringError(
                f"spyre: a transposed convolution whose padding {list(padding)} passes the "
                f"kernel's reach"
            )
        pads = tuple((v, v + int(op)) for v, op in zip(lo, output_padding, strict=True))
        w = _flipped_transpose_kernel(b, w, groups)
        strides, lhs_dil = (1,) * nsp, stride
    else:
        pads = tuple((p, p) for p in padding)
        strides, lhs_dil = stride, (1,) * nsp
    x = convert(b, x, dt)
    out = conv_ops.conv(
        b,
        x,
        convert(b, w, dt),
        strides=strides,
        padding=pads,
        lhs_dilation=lhs_dil,
        rhs_dilation=dilation,
        groups=int(groups),
        out_dtype=dt,
    )
    if bias is not None:
        bb = b.reshape(convert(b, bias, dt), (1, bias.shape[0], *([1] * nsp)))
        out = b.elementwise("add", [out, bcast(b, bb, out.shape)], out.shape, dt)
    assert out.shape == shape, (out.shape, shape)
    return out


torch_import.finish(__name__)  # see lowering.torch_import

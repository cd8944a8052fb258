"""``aten.convolution_backward`` as convolutions: a decomposition for training graphs.

PyTorch has no decomposition of ``convolution_backward`` (Inductor calls a library kernel), so a
training graph with a convolution would run its backward on the CPU. Its three results are
convolutions and a sum, which the card has rules for (``lowering/fx_conv.py``):

* the input's gradient is the transposed convolution of the output's gradient with the same
  kernel, stride, padding, dilation and groups, with ``output_padding`` the input positions the
  forward's last window did not reach (``(in + 2p - d (k - 1) - 1) mod s``); where the padding
  passes the kernel's reach (``p > d (k - 1)``, which the transposed rule cannot pad), it is the
  unpadded transposed convolution, cropped;
* the kernel's gradient is a convolution over the batch: the input with its channels as the
  batch and its batch as the channels (per group), the output's gradient as the kernel, the
  forward's stride as the dilation and its dilation as the stride, cropped to the kernel's size;
* the bias's gradient is the output's gradient summed over all but the channel dim.

A transposed convolution is the direct one run backwards (from its output's space into its
input's, with the same kernel ``[Cin, Cout / G, *K]``): its input's gradient is that direct
convolution of the output's gradient, and its kernel's gradient is the direct convolution's
with the roles of input and output gradient swapped.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["convolution_backward", "DECOMPOSITIONS"]

aten = torch.ops.aten


def _grad_input(
    grad: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
) -> torch.Tensor:
    nsp = x.dim() - 2
    k = w.shape[2:]
    size = x.shape[2:]
    reach = [d * (kk - 1) for d, kk in zip(dilation, k, strict=True)]
    extra = [
        (n + 2 * p - r - 1) % s for n, p, r, s in zip(size, padding, reach, stride, strict=True)
    ]
    if all(p <= r for p, r in zip(padding, reach, strict=True)):
        return aten.convolution(grad, w, None, stride, padding, dilation, True, extra, groups)
    full = aten.convolution(grad, w, None, stride, [0] * nsp, dilation, True, extra, groups)
    for i in range(nsp):  # ``in + 2p`` positions: drop the padding's
        full = aten.slice(full, 2 + i, padding[i], padding[i] + size[i])
    return full


def _grad_weight(
    grad: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
) -> torch.Tensor:
    n, cin = x.shape[:2]
    nsp = x.dim() - 2
    sp = list(range(3, 3 + nsp))
    # [N, Cin, *S] -> [Cin / G, G * N, *S]: the batch as channels, group-major, per group
    xt = aten.reshape(x, [n, groups, cin // groups, *x.shape[2:]])
    xt = aten.permute(xt, [2, 1, 0, *sp])
    xt = aten.reshape(xt, [cin // groups, groups * n, *x.shape[2:]])
    gt = aten.permute(grad, [1, 0, *range(2, 2 + nsp)])  # [Cout, N, *O]: the kernel
    r = aten.convolution(xt, gt, None, dilation, padding, stride, False, [0] * nsp, groups)
    for i, kk in enumerate(w.shape[2:]):  # the last windows may reach past the kernel's size
        if r.shape[2 + i] != kk:
            r = aten.slice(r, 2 + i, 0, kk)
    return aten.permute(r, [1, 0, *range(2, 2 + nsp)])  # [Cout, Cin / G, *K]


def _per_dim(v: Any, nsp: int) -> list[int]:
    vals = [int(e) for e in v]
    return vals * nsp if len(vals) == 1 else vals


def convolution_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    bias_sizes: Any,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    transposed: bool,
    output_padding: list[int],
    groups: int,
    output_mask: list[bool],
) -> Any:
    """``aten.convolution_backward`` as convolutions and a sum (module docstring);
    ``NotImplemented`` (PyTorch's own kernel) for an input without a batch dim."""
    if x.dim() < 3:
        return NotImplemented
    nsp = x.dim() - 2
    stride, padding, dilation = (_per_dim(t, nsp) for t in (stride, padding, dilation))
    gi = gw = gb = None
    if transposed:  # the direct convolution of the output's space into the input's, reversed
        if output_mask[0]:
            zero = [0] * nsp
            gi = aten.convolution(grad, w, None, stride, padding, dilation, False, zero, groups)
            for i, n in enumerate(x.shape[2:]):  # output_padding past the stride: one more
                if gi.shape[2 + i] != n:
                    gi = aten.slice(gi, 2 + i, 0, n)
        if output_mask[1]:
            gw = _grad_weight(x, grad, w, stride, padding, dilation, groups)
    else:
        if output_mask[0]:
            gi = _grad_input(grad, x, w, stride, padding, dilation, groups)
        if output_mask[1]:
            gw = _grad_weight(grad, x, w, stride, padding, dilation, groups)
    if output_mask[2]:
        gb = aten.sum(grad, [0, *range(2, 2 + nsp)])
    return gi, gw, gb


#: the decomposition table entry, for ``aot_module_simplified(decompositions=...)``
DECOMPOSITIONS = {aten.convolution_backward.default: convolution_backward}

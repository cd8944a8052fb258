"""Spyre kernels for PyTorch's ``*_overrideable`` ops, which the device's fallback never sees.

The spyre device's boxed fallback (:func:`torch_bridge.eager.fallback`: the card, else the CPU
with a ``SpyreFallbackWarning``, counted in ``fallback_stats()``) is what PyTorch's dispatcher
calls for an op with no PrivateUse1 kernel, *unless* the op has a CompositeExplicitAutograd
kernel: a composite kernel fills the PrivateUse1 slot of the dispatch table too and is preferred
to a backend fallback. Most composite kernels are device-agnostic and end in ops that reach the
fallback, but PyTorch leaves a few hooks to out-of-tree backends whose composite kernel raises
for every device, ``NotImplementedError: ... please use TORCH_LIBRARY_IMPL to override this
function``:

- ``convolution_overrideable`` (and its backward): every convolution (``conv1d``/``2d``/``3d``,
  the transposed ones, ``nn.Conv*``) goes ``convolution`` -> ``_convolution``, whose backend
  choice for a PrivateUse1 tensor is ``ConvBackend::Overrideable``;
- ``_scaled_dot_product_fused_attention_overrideable`` (and its backward), the fused attention
  of PrivateUse1 backends.

Each gets a spyre kernel here that runs the op's ordinary counterpart through the device's
fallback path: ``convolution`` / ``convolution_backward`` for the convolution hooks (on the
card once the lowering has a rule for them, until then on the CPU with the warning and the
count), the CPU's fused attention (``_scaled_dot_product_flash_attention_for_cpu`` and its
backward) for the attention hooks. :func:`holes` lists the hooks still without a spyre kernel.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import eager

__all__ = ["register", "holes"]

aten = torch.ops.aten
Tensor = torch.Tensor

_CONV = aten.convolution.default
_CONV_BACKWARD = aten.convolution_backward.default
_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _convolution(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    transposed: bool,
    output_padding: list[int],
    groups: int,
) -> Tensor:
    """``convolution_overrideable``: ``convolution`` with the same arguments."""
    args = (input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    return eager.fallback(_CONV, *args)


def _convolution_backward(
    grad_output: Tensor,
    input: Tensor,
    weight: Tensor,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    transposed: bool,
    output_padding: list[int],
    groups: int,
    output_mask: list[bool],
) -> tuple[Tensor | None, ...]:
    """``convolution_backward_overrideable``: ``convolution_backward``, whose bias size is the
    gradient's channels."""
    bias_sizes = [grad_output.shape[1]] if output_mask[2] else None
    return eager.fallback(
        _CONV_BACKWARD,
        grad_output,
        input,
        weight,
        bias_sizes,
        stride,
        padding,
        dilation,
        transposed,
        output_padding,
        groups,
        output_mask,
    )


def _batched(*ts: Tensor) -> list[Tensor]:
    """A ``(heads, length, dim)`` attention operand as a batch of one (the CPU kernel's rank)."""
    return [t.unsqueeze(0) if t.dim() == 3 else t for t in ts]


def _bias4(bias: Tensor | None) -> Tensor | None:
    """An additive bias of rank 1 or 3 with leading dims of one (the CPU kernel takes 2 or 4)."""
    if bias is None or bias.dim() in (2, 4):
        return bias
    return bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))


def _fused_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_bias: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    return_debug_mask: bool = False,
    *,
    scale: float | None = None,
) -> tuple[Any, ...]:
    """``_scaled_dot_product_fused_attention_overrideable``: the CPU's fused attention (its
    output and log-sum-exp); no cumulative lengths, random state or debug mask (as its meta)."""
    q, k, v = _batched(query, key, value)
    out, lse = eager.fallback(
        _FLASH, q, k, v, dropout_p, is_causal, attn_mask=_bias4(attn_bias), scale=scale
    )
    if query.dim() == 3:
        out = out.squeeze(0)
    seed = torch.zeros((), dtype=torch.int64)
    return out, lse, None, None, query.shape[-2], key.shape[-2], seed, seed.clone(), None


def _fused_attention_backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_bias: Tensor | None,
    grad_input_mask: list[bool],
    out: Tensor,
    logsumexp: Tensor,
    cum_seq_q: Tensor | None,
    cum_seq_k: Tensor | None,
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    philox_seed: Tensor,
    philox_offset: Tensor,
    *,
    scale: float | None = None,
) -> tuple[Tensor | None, ...]:
    """``_scaled_dot_product_fused_attention_overrideable_backward``: the CPU's fused attention
    backward for the query, key and value, and the additive bias's gradient (``dS``)."""
    g, q, k, v, o = _batched(grad_out, query, key, value, out)
    gq, gk, gv = eager.fallback(
        _FLASH_BACKWARD, g, q, k, v, o, logsumexp, dropout_p, is_causal,
        attn_mask=_bias4(attn_bias), scale=scale,
    )  # fmt: skip
    if query.dim() == 3:
        gq, gk, gv = gq.squeeze(0), gk.squeeze(0), gv.squeeze(0)
    gb = None
    if attn_bias is not None and grad_input_mask[3]:
        s = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
        scores = torch.matmul(q, k.transpose(-2, -1)) * s + attn_bias
        if is_causal:
            n, m = scores.shape[-2:]
            keep = torch.ones(n, m, dtype=torch.bool, device=scores.device).tril()
            scores = scores.masked_fill(keep.logical_not(), float("-inf"))
        p = torch.exp(scores - logsumexp.unsqueeze(-1))
        dp = torch.matmul(g, v.transpose(-2, -1))
        gb = (p * (dp - (g * o).sum(-1, keepdim=True))).sum_to_size(attn_bias.shape)
    return gq, gk, gv, gb


#: the hooks' spyre kernels
KERNELS = {
    "convolution_overrideable": _convolution,
    "convolution_backward_overrideable": _convolution_backward,
    "_scaled_dot_product_fused_attention_overrideable": _fused_attention,
    "_scaled_dot_product_fused_attention_overrideable_backward": _fused_attention_backward,
}


def register(lib: torch.library.Library) -> None:
    """A PrivateUse1 kernel for each ``*_overrideable`` hook (their ``out=`` overloads call the
    functional op through the dispatcher, so they reach these too)."""
    for name, kernel in KERNELS.items():
        lib.impl(name, kernel, "PrivateUse1")


def holes() -> list[str]:
    """The ``aten::*_overrideable`` ops (every overload) a spyre tensor cannot run: no
    PrivateUse1 kernel of the op, nor of its functional op for an ``out=`` overload, so the
    call ends in PyTorch's NotImplementedError. Empty once the device is registered."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    left = []
    for name in torch._C._dispatch_get_all_op_names():
        base, _, overload = name.partition(".")
        if not name.startswith("aten::") or "_overrideable" not in base:
            continue
        if has(name, "PrivateUse1") or (overload == "out" and has(base, "PrivateUse1")):
            continue
        left.append(name)
    return sorted(left)

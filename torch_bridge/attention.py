"""``F.scaled_dot_product_attention`` on spyre tensors as one card kernel instead of the eight
of PyTorch's math path.

PyTorch picks an attention implementation per device through a C++ dispatch stub that a
Python device cannot fill, so on a PrivateUse1 device it always takes the math path: the query
and key each scaled, two batched matmuls, a softmax and the safe-softmax guard of fully masked
rows (``isneginf``, ``all``, ``where``, run through their ``out=`` forms): eight card launches
per attention. Here the spyre device registers its own ``aten::scaled_dot_product_attention``
(for the autograd and the device key both), which for the common case launches one op of ours,
``spyre_jax::attention(q, k, v, bias, scale)``: ``softmax(q k^T * scale + bias) v``, an eager
kernel compiled from its decomposition as one graph (both matmuls, the softmax between them).
Grouped-query attention (fewer key/value heads than query heads) regroups the query's heads
over each key head, a view, instead of repeating the keys and values. The additive bias is
zeros (kept on the device per length) or, for causal masking, the causal triangle; it is also
what lets the kernel run on a size bucket (:mod:`torch_bridge.buckets`) while the keys grow each
decode step: its padding is ``-inf`` (:mod:`torch_bridge.pad_rules`, MASKED), so a padded key
gets no weight, and one kernel serves every length of a bucket.

The one-launch path is taken without a mask or dropout, for eager tensors whose inputs need no
gradient. A mask can mask a whole row, where the math path's safe softmax gives zeros and a
plain one NaN, so calls with a mask, training, and traces (``torch.compile``'s fake and
functional tensors: the compiled graph is one kernel either way) keep PyTorch's composite
kernel of ``aten::scaled_dot_product_attention``: the same ops and gradients as before.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_mode

from device_model.runtime import runtime

from . import eager, one_op, pad_rules

__all__ = ["register", "fast_path"]

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default


def fast_path(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> bool:
    """Whether this attention runs as one launch (else PyTorch's math path). Only for eager
    tensors: a trace (``torch.compile``'s fake or functional tensors, a dispatch mode) keeps
    PyTorch's decomposition, and the compiled graph is one kernel either way."""
    if attn_mask is not None or dropout_p != 0.0:
        return False
    if type(q) is not torch.Tensor or _current_mode() is not None:
        return False
    if q.dim() < 3 or q.dim() != k.dim() or k.dim() != v.dim():
        return False
    if q.dtype != k.dtype or k.dtype != v.dtype or not q.dtype.is_floating_point:
        return False
    if q.shape[:-3] != k.shape[:-3] or k.shape[:-1] != v.shape[:-1] or q.shape[-1] != k.shape[-1]:
        return False
    hq, hk = q.shape[-3], k.shape[-3]
    if hq != hk and (not enable_gqa or hk == 0 or hq % hk):
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    return q.numel() > 0 and k.numel() > 0 and v.numel() > 0


def _sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` in one launch where :func:`fast_path` allows, else
    PyTorch's math path."""
    if not fast_path(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
        # PyTorch's own composite kernel (its mask conversion, then the math path)
        return _SDPA.decompose(
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    *batch, hq, lq, d = query.shape
    hk, lk = key.shape[-3], key.shape[-2]
    s = scale if scale is not None else 1.0 / math.sqrt(d)
    with torch._C._AutoDispatchBelowAutograd():
        # each key head serves hq // hk query heads: their rows side by side (a view)
        g = hq // hk
        q = query.reshape(*batch, hk, g * lq, d)
        bias = _bias(g, lq, lk, is_causal, query.dtype, query.device)
        out = ATTENTION(q, key, value, bias, s)
        return out.reshape(*batch, hq, lq, value.shape[-1])


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """``spyre_jax::attention``: ``softmax(q k^T * scale + bias) v`` (its decomposition, and its
    CPU kernel for a host fallback)."""
    scores = torch.matmul(q * scale, k.transpose(-1, -2)) + bias
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _attention_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


#: biases kept on the device, by (groups, query and key length, causal, dtype, device, card)
_biases: dict[tuple, torch.Tensor] = {}
_BIASES = 256


def _bias(
    groups: int, lq: int, lk: int, causal: bool, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The additive bias of ``groups`` query heads' rows side by side (``[groups * lq, lk]``,
    one row per query row): zeros, or with ``causal`` ``-inf`` where query ``i`` may not see
    key ``j`` (``j > i``, PyTorch's ``is_causal``: aligned at the top left; every row sees key
    0, so no row is fully masked). It is also what a size bucket masks: padded past ``lk``
    with -inf (:mod:`torch_bridge.pad_rules`, MASKED), a padded key gets no weight; a row per
    query row, since a bias of one row would never be padded with the query's rows (a size
    first seen as 1 is a broadcast, never a varying size). Kept on the device per length."""
    key = (groups, lq, lk, causal, dtype, device, runtime())  # a new card: made again
    bias = _biases.get(key)
    if bias is None:
        host = torch.zeros(lq, lk, dtype=dtype)
        if causal:
            host = host.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(), -math.inf)
        bias = host.repeat(groups, 1).to(device)
        if len(_biases) >= _BIASES:
            _biases.clear()
        _biases[key] = bias
    return bias


_libs: list[torch.library.Library] = []
#: ``spyre_jax::attention(q, k, v, bias, scale)``: one eager kernel (its decomposition compiled
#: as one graph), set by :func:`register`
ATTENTION: Any = None


def register(lib: torch.library.Library) -> None:
    """The spyre kernel of ``scaled_dot_product_attention``, for the autograd key (where
    PyTorch's own composite kernel runs) and the device key (under ``inference_mode``); and
    ``spyre_jax::attention``, the op it launches."""
    global ATTENTION
    lib.impl("scaled_dot_product_attention", _sdpa, "AutogradPrivateUse1")
    lib.impl("scaled_dot_product_attention", _sdpa, "PrivateUse1")
    own = torch.library.Library("spyre_jax", "DEF")
    _libs.append(own)
    own.define("attention(Tensor q, Tensor k, Tensor v, Tensor bias, float scale) -> Tensor")
    own.impl("attention", _attention, "CPU")
    own.impl("attention", _attention_fake, "Meta")
    ATTENTION = torch.ops.spyre_jax.attention.default
    own.impl("attention", eager._kernel_for(ATTENTION), "PrivateUse1")
    one_op.DECOMPOSITIONS[ATTENTION] = _attention
    pad_rules.register_masked("spyre_jax::attention", 3)

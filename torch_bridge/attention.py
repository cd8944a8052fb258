"""``F.scaled_dot_product_attention`` on spyre tensors as four card kernels instead of the eight
of PyTorch's math path.

PyTorch picks an attention implementation per device through a C++ dispatch stub that a
Python device cannot fill, so on a PrivateUse1 device it always takes the math path: the query
and key each scaled, two batched matmuls, a softmax and the safe-softmax guard of fully masked
rows (``isneginf``, ``all``, ``where``, run through their ``out=`` forms): eight card launches
per attention. Here the spyre device registers its own ``aten::scaled_dot_product_attention``
(for the autograd and the device key both), which for the common case launches four: the query
scaled, ``q @ k^T``, the softmax and ``p @ v``. Grouped-query attention (fewer key/value heads
than query heads) regroups the query's heads over each key head, a view, instead of repeating
the keys and values. Each launch is an ordinary eager op, so keys whose length grows each decode
step run on a size bucket's kernels (:mod:`torch_bridge.buckets`), the softmax's padding
``-inf`` (a padded key gets no weight).

The four-launch path is taken without a mask or dropout (a decode step's attention in
``generate()``), and when no input needs a gradient; causal masking (a prefill) adds a fifth,
the add of a causal bias kept on the device. A mask can mask a whole row, where the math path's
safe softmax gives zeros and a plain one NaN, so calls with a mask, and training, keep PyTorch's
math path (PyTorch's composite kernel of
``aten::scaled_dot_product_attention``: the same ops and gradients as before).
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_mode

from device_model.runtime import runtime

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
    """Whether this attention runs as four launches (else PyTorch's math path). Only for eager
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
    """``softmax(q k^T * scale) v`` in four launches where :func:`fast_path` allows, else
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
        q = query.reshape(*batch, hk, (hq // hk) * lq, d)
        scores = torch.matmul(q * s, key.transpose(-1, -2))
        if is_causal:
            scores = scores + _causal_bias(hq // hk, lq, lk, scores.dtype, scores.device)
        out = torch.matmul(torch.softmax(scores, dim=-1), value)
        return out.reshape(*batch, hq, lq, value.shape[-1])


#: causal biases kept on the device, by (groups, query and key length, dtype, device, card)
_biases: dict[tuple, torch.Tensor] = {}
_BIASES = 16


def _causal_bias(
    groups: int, lq: int, lk: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``-inf`` where query ``i`` may not see key ``j`` (``j > i``, PyTorch's ``is_causal``:
    aligned at the top left), for the rows of ``groups`` query heads side by side. Every row
    sees key 0, so no row is fully masked. Kept on the device (a prefill's length repeats)."""
    key = (groups, lq, lk, dtype, device, runtime())  # a new card (set_card): made again
    bias = _biases.get(key)
    if bias is None:
        seen = torch.ones(lq, lk, dtype=torch.bool).tril()
        host = torch.zeros(lq, lk, dtype=dtype).masked_fill(~seen, -math.inf)
        bias = host.repeat(groups, 1).to(device)
        if len(_biases) >= _BIASES:
            _biases.clear()
        _biases[key] = bias
    return bias


def register(lib: torch.library.Library) -> None:
    """The spyre kernel of ``scaled_dot_product_attention``, for the autograd key (where
    PyTorch's own composite kernel runs) and the device key (under ``inference_mode``)."""
    lib.impl("scaled_dot_product_attention", _sdpa, "AutogradPrivateUse1")
    lib.impl("scaled_dot_product_attention", _sdpa, "PrivateUse1")

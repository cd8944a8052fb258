"""The PE side of the card's compute: a matmul step on scratchpad tiles, the masks of K and N
blocks that reach past the tensor, a matmul's epilogue (an SFU map on the rounded product
on its way to the store) and its prologue (an SFU map on each lhs tile on its way to the PE).
The steps they run are :mod:`device_model.steps`' ``MatmulStep`` (its epilogue and prologue
are :mod:`device_model.ops`' ``MapBody``); ``xp`` is NumPy (the reference interpreter) or
``jax.numpy`` (the vectorized card).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .ops import fit, narrow, run_map
from .steps import ConvWindow, MatmulStep

__all__ = [
    "mask_k",
    "mask_n",
    "run_matmul_step",
    "run_epilogue",
    "run_prologue",
    "conv_patches",
]


def mask_k(xp: Any, lhs: Any, rhs: Any, valid: Any, rhs_t: bool = False) -> tuple[Any, Any]:
    """Zero the K positions at or past ``valid`` of a K block: the lhs tile's columns
    ``[..., tm, tk]`` and the rhs tile's rows ``[..., tk, tn]`` (columns of ``[..., tn, tk]``
    with ``rhs_t``) (the last block of a K that the block does not divide reaches past K: stick
    padding, or scratchpad never loaded)."""
    k = lhs.shape[-1]
    keep = xp.arange(k) < valid
    lhs = xp.where(keep, lhs, xp.zeros((), lhs.dtype))
    rhs = xp.where(keep if rhs_t else keep[:, None], rhs, xp.zeros((), rhs.dtype))
    return lhs, rhs


def mask_n(xp: Any, r: Any, col0: Any, n_logical: int) -> Any:
    """Zero the columns of result tiles ``[C, ..., tn]`` at or past ``n_logical``; ``col0``
    (``[C]``): each tile's first column."""
    tn = r.shape[-1]
    cols = xp.reshape(col0, (-1,) + (1,) * (r.ndim - 1)) + xp.arange(tn)
    return xp.where(cols < n_logical, r, xp.zeros((), r.dtype))


def run_matmul_step(
    xp: Any,
    acc: Any,
    lhs: Any,
    rhs: Any,
    first: Any,
    k_valid: int | None = None,
    rhs_t: bool = False,
    k_logical: int | None = None,
) -> Any:
    """One PE step on ``[C, 1, tm, tk]`` x ``[C, 1, tk, tn]`` tiles: fp32 ``acc + lhs @ rhs``.

    The lhs tile may carry stick padding along K beyond the rhs block's K; it is sliced off.
    ``first`` (a Python bool, or a traced one) starts the accumulator from zero. ``k_valid``:
    only the block's first ``k_valid`` K positions count (:func:`mask_k`). ``rhs_t``: the rhs
    tile is ``[C, 1, tn, tk]`` (its K, stick-padded when it is the whole K, cut at
    ``k_logical``).
    """
    k = rhs.shape[3] if rhs_t else rhs.shape[2]
    if rhs_t and k_logical is not None:
        k = min(k, k_logical)
        rhs = rhs[..., :k]
    a = lhs[..., :k]
    if k_valid is not None and k_valid < k:
        a, rhs = mask_k(xp, a, rhs, k_valid, rhs_t)
    if rhs_t:
        rhs = xp.swapaxes(rhs, 2, 3)
    if xp is np:
        prod = np.einsum("cbmk,cbkn->cbmn", a.astype(np.float32), rhs.astype(np.float32))
    else:
        from jax import lax

        # products of the tiles' own dtype, accumulated in fp32 (the PE's contract)
        # materialize the tiles so XLA hands the dot to its GEMM rather than fusing the
        # scratchpad reads into a naive loop
        a, rhs = lax.optimization_barrier((a, rhs))
        prod = lax.dot_general(
            a, rhs, (((3,), (2,)), ((0, 1), (0, 1))), preferred_element_type=np.float32
        )
    if isinstance(first, bool | np.bool_):
        return prod if first else acc + prod
    return xp.where(first, prod, acc + prod)


def run_epilogue(
    xp: Any,
    body: MatmulStep,
    prod: Any,
    extras: list[Any],
    extra_dtypes: list[str],
    out_block: tuple[int, ...],
    space: tuple[int, ...],
    dl16: bool = False,
) -> Any:
    """A matmul's epilogue on every core's rounded product ``[C, *out_block]`` (``out_dtype``)
    and its other input tiles: the stored tile ``[C, *out_block]`` in the epilogue's dtype.
    Only the block's part inside the logical ``space`` is computed; the rest (stick padding)
    is zero."""
    ep = body.epilogue
    assert ep is not None
    sb = tuple(min(b, s) for b, s in zip(out_block, space, strict=True))
    tiles = list(extras)
    tiles.insert(body.acc_slot, prod)
    dts = list(extra_dtypes)
    dts.insert(body.acc_slot, body.out_dtype)
    r = run_map(xp, ep, tiles, dts, sb, prod.shape[0])
    return fit(xp, narrow(xp, r, ep.out_dtype, dl16), out_block)


def run_prologue(
    xp: Any,
    body: MatmulStep,
    lhs: Any,
    extras: list[Any],
    extra_dtypes: list[str],
    lhs_dtype: str,
    dl16: bool = False,
) -> Any:
    """A matmul's prologue on lhs tiles ``[R, *lhs_block]`` (``lhs_dtype``) and the tiles of its
    other inputs for the same blocks: the tiles the PE multiplies, ``[R, *lhs_block]`` in the
    prologue's dtype, rounded as a store of the unfused map rounds them. Only the block's part
    inside the logical space is computed; the rest (stick padding) is zero."""
    pro = body.prologue
    assert pro is not None
    block = tuple(lhs.shape[1:])
    sb = tuple(min(b, s) for b, s in zip(block, pro.space, strict=True))
    tiles = list(extras)
    tiles.insert(body.lhs_slot, lhs)
    dts = list(extra_dtypes)
    dts.insert(body.lhs_slot, lhs_dtype)
    r = run_map(xp, pro, tiles, dts, sb, lhs.shape[0])
    return fit(xp, narrow(xp, r, pro.out_dtype, dl16), block)


def conv_patches(xp: Any, lhs: Any, rhs: Any, win: ConvWindow) -> tuple[Any, Any]:
    """A convolution's PE operands from its scratchpad blocks: the window tiles ``[C, 1, rows_in,
    cols_in, tcp]`` read as patches ``[C, 1, rows * cols, taps * tc]`` (tap-major, as
    :class:`~device_model.steps.ConvWindow` says) and the rhs tiles ``[C, taps, tc, tn]`` as
    ``[C, 1, taps * tc, tn]``; ``tc`` is the rhs block's (the window's stick padding beyond it
    is not read)."""
    taps, tc, tn = rhs.shape[1:]
    (kh_n, kw_n), (sh, sw), (dh, dw) = win.kernel, win.strides, win.dilation
    r, ow = win.rows, win.cols
    parts = []
    for kh in range(kh_n):
        for kw in range(kw_n):
            h0, w0 = kh * dh, kw * dw
            part = lhs[:, 0, h0 : h0 + (r - 1) * sh + 1 : sh, w0 : w0 + (ow - 1) * sw + 1 : sw, :tc]
            parts.append(part)
    pat = xp.stack(parts, axis=3)  # [C, r, ow, taps, tc]
    pat = pat.reshape(lhs.shape[0], 1, r * ow, taps * tc)
    return pat, rhs.reshape(rhs.shape[0], 1, taps * tc, tn)

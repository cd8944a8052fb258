"""Sorting and selection on the card: the semantics of the ``sort`` and ``take`` steps, written
once for NumPy and JAX, and what the timing model charges for them.

The card has no sorting unit. A compiler for it sorts a row held in scratchpad with a bitonic
network on the SFUs: ``log2 P * (log2 P + 1) / 2`` passes of ``P / 2`` compare-exchanges over
the row padded to a power of two ``P``, carrying each element's index beside its keys. Ties are
broken by that index, so the result is the one a *stable* sort gives, whatever network computes
it: the functions here compute it with NumPy's ``lexsort`` and ``lax.sort`` on the same keys,
which is exact (sorting rounds nothing).

Orders (``order``):

* ``"nan_last"``: NaN (of either sign) greater than every number, ``-0.0 == 0.0``: ``lax.sort``
  (``jnp.sort``, ``jnp.argsort``) and every torch sort, top-k and k-th value;
* ``"total"``: IEEE 754 totalOrder on the bits, ``-NaN < -inf < ... < -0.0 < 0.0 < ... < inf <
  NaN``: ``lax.top_k``.

``descending`` reverses the order of the keys; ties still go in ascending index order (what
``torch.sort(stable=True, descending=True)`` and ``jnp.argsort(descending=True)`` give).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = [
    "ORDERS",
    "COMPARE_EXCHANGE_OPS",
    "order_keys",
    "argsort_rows",
    "take_rows",
    "compare_exchanges",
    "sort_sfu_ops",
]

ORDERS = ("nan_last", "total")

#: SFU element-ops of one compare-exchange per lane it carries (a key or the index): the
#: compare, and a select into each of the two outputs. The model's assumption (CARD.md gives no
#: figure for the SFU's compare or select); a parameter of the timing model, not a measurement.
COMPARE_EXCHANGE_OPS = 3

#: the simulator (not the card): rows of at most this many elements, and sorts of at most
#: :data:`NATIVE_SORT_MAX` elements in all, run as XLA's own sort inside the simulated program;
#: larger ones call NumPy's ``lexsort`` back from it (a callback's fixed host cost is a few
#: hundred microseconds, XLA's comparator sort grows faster with the row)
NATIVE_SORT_MAX_ROW = 4096
NATIVE_SORT_MAX = 1 << 16


def _bits(xp: Any, x: Any) -> Any:
    """fp32 ``x``'s bits as int32."""
    if xp is np:
        return np.ascontiguousarray(x, np.float32).view(np.int32)
    from jax import lax

    return lax.bitcast_convert_type(x, np.int32)


def order_keys(xp: Any, x: Any, order: str, descending: bool) -> list[Any]:
    """Arrays whose lexicographic ascending order is ``x``'s order (``order``, ``descending``).

    Integers and bools sort as int32 (``~v`` reverses an int32's order exactly; uint32 with its
    top bit flipped); floats in fp32 (widening keeps the order of fp16 and bf16 values, the
    sign of their NaNs too)."""
    if x.dtype.kind == "u":  # uint32: its order is int32's with the top bit flipped
        v = (x.astype(np.uint32) ^ np.uint32(0x80000000)).astype(np.int32)
        return [~v if descending else v]
    if x.dtype.kind in "bi":
        v = x.astype(np.int32)
        return [~v if descending else v]
    x = x.astype(np.float32)
    if order == "total":
        i = _bits(xp, x)
        k = i ^ ((i >> 31) & np.int32(0x7FFFFFFF))
        return [~k if descending else k]
    nan = xp.isnan(x)
    v = xp.where(nan, np.float32(0), x) + np.float32(0)  # -0.0 + 0.0 == +0.0
    f = nan.astype(np.int32)
    return [-f, -v] if descending else [f, v]


def argsort_rows(xp: Any, keys: list[Any], order: str, descending: bool, k: int) -> Any:
    """The first ``k`` indices (int32) of a stable sort of the last axis of ``keys`` (same
    shapes; the first the most significant)."""
    ks = [c for key in keys for c in order_keys(xp, key, order, descending)]
    if xp is np:
        perm = np.lexsort(tuple(reversed(ks)), axis=-1)
        return perm[..., :k].astype(np.int32)
    import jax

    if ks[0].shape[-1] <= NATIVE_SORT_MAX_ROW and math.prod(ks[0].shape) <= NATIVE_SORT_MAX:
        # small rows: XLA's own stable sort, the keys with an iota carried beside them
        from jax import lax

        iota = lax.broadcasted_iota(np.int32, ks[0].shape, len(ks[0].shape) - 1)
        perm = lax.sort((*ks, iota), dimension=-1, num_keys=len(ks), is_stable=True)[-1]
        return perm[..., :k]
    # XLA's CPU sort runs a comparator per comparison; past a few thousand elements NumPy's
    # lexsort, called back from the simulated program, is faster despite the callback's fixed
    # cost, and gives the same (stable) order
    shape = (*ks[0].shape[:-1], k)

    def host(*arrays: np.ndarray) -> np.ndarray:
        perm = np.lexsort(tuple(reversed(arrays)), axis=-1)[..., :k]
        return np.ascontiguousarray(perm, dtype=np.int32)

    out = jax.ShapeDtypeStruct(shape, np.int32)
    return jax.pure_callback(host, out, *ks, vmap_method="expand_dims")


def take_rows(xp: Any, x: Any, idx: Any, n: int, mode: str, fill: Any) -> Any:
    """``out[..., j] = x[..., idx[..., j]]`` along the last axis (of logical length ``n``);
    ``mode`` clip clamps the indices, fill gives ``fill`` (None: NaN for floats, 0 for
    integers) where an index is out of range."""
    idx = idx.astype(np.int32)
    ok = (idx >= 0) & (idx < n)
    got = xp.take_along_axis(x, xp.clip(idx, 0, n - 1), axis=-1)
    if mode == "fill":
        if fill is None:
            fill = np.nan if x.dtype.kind == "f" else 0
        got = xp.where(ok, got, xp.asarray(fill).astype(x.dtype))
    return got


def compare_exchanges(n: int, k: int) -> int:
    """Compare-exchanges per row of ``n`` for its first ``k`` in order: a bitonic sort of the
    row padded to ``P = 2**ceil(log2 n)``, or, when cheaper, a bitonic top-k (sort blocks of
    ``K = 2**ceil(log2 k)``, then ``log2(P / K)`` rounds each merging pairs of blocks and
    keeping the better half: at most ``P * (log2 K + 1)`` over all rounds)."""
    if n <= 1:
        return 0
    lp = math.ceil(math.log2(n))
    p = 1 << lp
    full = p // 2 * lp * (lp + 1) // 2
    if k >= n:
        return full
    lk = max(0, math.ceil(math.log2(max(k, 1))))
    topk = p // 2 * lk * (lk + 1) // 2 + p * (lk + 1)
    return min(full, topk)


def sort_sfu_ops(rows: int, n: int, k: int, num_keys: int) -> int:
    """SFU element-ops to sort ``rows`` rows of ``n`` on ``num_keys`` keys for their first
    ``k`` (each compare-exchange carries the keys and the index)."""
    return rows * compare_exchanges(n, k) * COMPARE_EXCHANGE_OPS * (num_keys + 1)

"""Re-layouts of spyre tensors on the card: a view's elements gathered into the stick layout a
launch takes, as a JAX program over the storage's bytes (or over the pending card array of the
launch that made them), so that a strided view, an int64 tensor or a row that is not a whole
number of sticks goes to the next kernel without the host waiting for the card.

One program per kind of source and target layout (:func:`view_program`), the view's sizes its
arguments: folded into the kernel that reads the view (:func:`fused`), or run alone
(:func:`gather_view`). Imported on the first launch that needs it (``import torch`` must not
load JAX): the :mod:`torch_bridge.storage` layer calls it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from device_model.layout import TensorLayout, np_dtype
from device_model.program import COMPILER_OPTIONS

__all__ = ["host_bytes", "worth_compiling", "fused", "view_program", "gather_view", "cat_program"]

#: torch dtype -> (bytes per element, how its bytes become the card's values)
_DECODE: dict[torch.dtype, tuple[int, str]] = {
    torch.float32: (4, "float32"),
    torch.float16: (2, "float16"),
    torch.bfloat16: (2, "bfloat16"),
    torch.int32: (4, "int32"),
    torch.int64: (8, "int64"),
    torch.int8: (1, "int8"),
    torch.uint8: (1, "uint8"),
    torch.bool: (1, "bool"),
}


def _decode(raw: jax.Array, dtype: torch.dtype) -> jax.Array:
    """Flat storage bytes (uint8) -> the storage's elements as the card holds them (int64
    narrowed to its low 32 bits, as the card's int32)."""
    isz, kind = _DECODE[dtype]
    n = raw.shape[0] // isz
    raw = raw[: n * isz]
    if kind == "bool":
        return raw != 0
    if kind == "int64":
        words = lax.bitcast_convert_type(raw.reshape(n, 2, 4), jnp.uint32)[:, 0]
        return lax.bitcast_convert_type(words, jnp.int32)
    if isz == 1:
        return lax.bitcast_convert_type(raw, jnp.dtype(kind))
    return lax.bitcast_convert_type(raw.reshape(n, isz), jnp.dtype(kind))


#: a geometry is gathered by a compiled program from its this-many-th use on; its first use
#: is a copy on the host (a compile costs 10-50 ms, a one-off view's host copy far less)
COMPILE_AFTER = 2
_uses: dict[Any, int] = {}


def worth_compiling(key: Any) -> bool:
    """Whether this geometry (hashable) has been used often enough to compile its program."""
    n = _uses.get(key, 0) + 1
    if n <= COMPILE_AFTER:
        if len(_uses) >= 1 << 16:
            _uses.clear()
        _uses[key] = n
    return n >= COMPILE_AFTER


#: host bytes up to this size go to the kernel as they are (the launch copies them in, a few
#: microseconds); larger ones become a card array once, over the same memory where XLA can
#: alias it (``jax.device_put`` costs tens of microseconds, repaid by the launches that reuse it)
SMALL_HOST_BYTES = 1 << 16


def host_bytes(payload: np.ndarray) -> jax.Array | np.ndarray:
    """A storage's host bytes as a kernel argument (see :data:`SMALL_HOST_BYTES`)."""
    if payload.nbytes <= SMALL_HOST_BYTES:
        return payload
    return jax.device_put(payload, may_alias=True)


@functools.lru_cache(maxsize=4096)
def view_program(
    source: tuple[Any, ...], layout: TensorLayout, fill: Any
) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The gather of any view of one kind of source into ``layout``, its sizes given when it
    runs: ``run(src, dyn)``, ``dyn`` int32 ``[source dims..., view shape..., view strides...,
    offset]``. One program serves every size that fits ``layout`` (a size bucket: the
    positions past the view's own sizes hold ``fill``), so a decode step whose lengths grow by
    one each time compiles nothing new.

    ``source``: ``("masked",)`` for a whole result already in ``layout`` (``dyn``: its own
    sizes; the rest is masked to ``fill``), ``("reshape", device shape)`` for a whole result
    whose leading dims are regrouped (same last dim, same sticks; ``dyn`` empty),
    ``("box", device shape)`` for a box of a pending result (``dyn``: its start and its sizes),
    ``("flat", torch dtype, length)`` for a contiguous run of a storage's elements in
    ``layout``'s shape (``dyn``: the offset), ``("flat card", device shape)`` for any view of a
    whole result with no padding (its elements in torch's order: ``dyn`` as for ``bytes``),
    ``("bytes", torch dtype, length)`` for a storage's
    flat bytes (padded to ``length``), or ``("card", device shape, rank, order)`` for a
    pending result in its card layout, whose logical dims (the first ``rank`` entries of
    ``dyn``) may be smaller than the device shape (a result computed at a size bucket and not
    cropped); ``order``: its dims from the outermost in the storage (None: contiguous). Not
    jitted: it runs inside the kernel's program (:func:`fused`)."""
    kind = source[0]
    rank = len(layout.shape)
    if kind == "masked":
        return _masked(layout, fill)
    if kind == "reshape":  # the same sticks, the leading dims regrouped: nothing moves
        dshape = layout.device_shape
        return lambda src, dyn: src.reshape(dshape)
    if kind in ("box", "flat"):
        return _sliced(kind, source, layout, fill)
    src_rank = source[2] if kind == "card" else 0
    order = (source[3] or tuple(range(src_rank))) if kind == "card" else ()
    out_dt = np_dtype(layout.dtype)
    shape = layout.shape if rank else (1,)

    def run(src: jax.Array, dyn: jax.Array) -> jax.Array:
        vshape = dyn[src_rank : src_rank + rank]
        vstride = dyn[src_rank + rank : src_rank + 2 * rank]
        e = jnp.full(shape, dyn[-1], jnp.int32)
        mask = jnp.ones(shape, bool)
        for k in range(rank):
            io = lax.broadcasted_iota(jnp.int32, shape, k)
            mask = mask & (io < vshape[k])
            e = e + io * vstride[k]
        e = jnp.where(mask, e, 0)
        if kind == "bytes":
            vals = _decode(src, source[1])[e]
        elif kind == "flat card":
            vals = src.reshape(-1)[e]
        elif src_rank == 0:
            vals = jnp.broadcast_to(src[0], shape)
        else:
            idx: list[Any] = [None] * src_rank
            rem = e
            for d in reversed(order):  # the storage index, unravelled by the result's own dims
                n = jnp.maximum(dyn[d], 1)
                idx[d] = rem % n
                rem = rem // n
            vals = src[tuple(idx)]
        vals = jnp.where(mask, vals.astype(out_dt), jnp.asarray(fill, out_dt))
        out = jnp.full(layout.device_shape, fill, out_dt)
        return lax.dynamic_update_slice(out, vals, (0,) * len(shape))

    return run


def _sliced(
    kind: str, source: tuple[Any, ...], layout: TensorLayout, fill: Any
) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """A box of a pending result (``dyn``: its start, then its sizes; the positions past its
    sizes take ``fill``) or a contiguous run of a storage's elements in ``layout``'s own shape
    (``dyn``: the offset): one slice of the source, no per-element index."""
    rank = len(layout.shape)
    shape = layout.shape if rank else (1,)
    out_dt = np_dtype(layout.dtype)
    tail = [(0, 0)] * (len(shape) - 1) + [(0, layout.device_shape[-1] - shape[-1])]

    def run(src: jax.Array, dyn: jax.Array) -> jax.Array:
        if kind == "flat":
            n = math.prod(shape)
            flat = jnp.pad(_decode(src, source[1]), (0, n))  # a slice never runs off the end
            vals = lax.dynamic_slice(flat, (dyn[0],), (n,)).reshape(shape).astype(out_dt)
        else:
            padded = jnp.pad(src, [(0, n) for n in shape])
            vals = lax.dynamic_slice(padded, tuple(dyn[:rank]), shape).astype(out_dt)
            mask = jnp.ones(shape, bool)
            for k in range(rank):
                mask = mask & (lax.broadcasted_iota(jnp.int32, shape, k) < dyn[rank + k])
            vals = jnp.where(mask, vals, jnp.asarray(fill, out_dt))
        return jnp.pad(vals, tail, constant_values=jnp.asarray(fill, out_dt))

    return run


def _masked(layout: TensorLayout, fill: Any) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """A result already in ``layout`` (a size bucket's) whose own sizes (``dyn``) are smaller:
    the positions past them take ``fill``, no gather."""
    out_dt = np_dtype(layout.dtype)
    dshape = layout.device_shape

    def run(src: jax.Array, dyn: jax.Array) -> jax.Array:
        mask = jnp.ones(dshape, bool)
        for k in range(len(layout.shape)):
            mask = mask & (lax.broadcasted_iota(jnp.int32, dshape, k) < dyn[k])
        return jnp.where(mask, src.astype(out_dt), jnp.asarray(fill, out_dt))

    return run


def gather_view(src: jax.Array, dyn: np.ndarray, key: tuple[Any, ...]) -> jax.Array:
    """:func:`view_program` run alone (jitted): for a kernel run stage by stage, and for an
    operand of a graph the backend compiled (``torch_bridge.operands.as_card_buffer``)."""
    return _jitted_view(key)(src, dyn)


@functools.lru_cache(maxsize=1024)
def _jitted_view(key: tuple[Any, ...]) -> Callable[[jax.Array, jax.Array], jax.Array]:
    return jax.jit(view_program(*key))


def _gathers(
    geometries: tuple[tuple[Any, ...] | None, ...],
) -> Callable[[Any], list[jax.Array]]:
    """Arguments -> operands, in a traced program: an argument whose geometry is None as it is,
    another (``(source array, sizes)``) gathered by its :func:`view_program`."""
    progs = [None if g is None else view_program(*g) for g in geometries]

    def gather(args: Any) -> list[jax.Array]:
        return [a if p is None else p(*a) for p, a in zip(progs, args, strict=True)]

    return gather


def fused(
    runner: Callable[..., list[jax.Array]],
    geometries: tuple[tuple[Any, ...] | None, ...],
) -> Callable[..., list[jax.Array]]:
    """``runner`` (a kernel's jitted card program) with its operands' gathers folded in: one
    program, one dispatch. ``geometries`` has one entry per leading argument: None (taken as
    it is) or the :func:`view_program` key (``(source, layout, fill)``) of the view that
    argument is, given as ``(source array, sizes)``; the arguments past them (the kernel's
    constants) are taken as they are."""
    gather = _gathers(geometries)
    n = len(geometries)
    kernel = runner.__wrapped__  # the program itself: options go on the outer jit only

    def run(*args: Any) -> list[jax.Array]:
        return kernel(*gather(args[:n]), *args[n:])

    return jax.jit(run, compiler_options=COMPILER_OPTIONS)


@functools.lru_cache(maxsize=256)
def cat_program(
    geometries: tuple[tuple[Any, ...] | None, ...], layout: TensorLayout, dim: int
) -> Callable[..., jax.Array]:
    """``torch.cat`` of spyre tensors along ``dim`` as one program that holds no size: each
    input comes in ``layout`` (the result's, a size bucket's) at its own sizes, the positions
    past them zero (given as it is, or as a view gathered first: its :func:`view_program` key
    in ``geometries``), and is placed at its offset along ``dim`` (``offsets``, int32, an
    argument). An input written over the positions past the one before it leaves the next
    positions to the inputs after it: in order, the later ones overwrite the earlier one's
    zeros."""
    gather = _gathers(geometries)
    dshape = layout.device_shape
    width = dshape[dim]

    def run(*args: Any) -> jax.Array:
        *ins, offsets = args
        grown = list(dshape)
        grown[dim] += width  # room for the last input's zeros past the end
        out = jnp.zeros(grown, np_dtype(layout.dtype))
        for k, v in enumerate(gather(ins)):
            start = [jnp.int32(0)] * len(dshape)
            start[dim] = offsets[k]
            out = lax.dynamic_update_slice(out, v, start)
        return lax.slice_in_dim(out, 0, width, axis=dim)

    return jax.jit(run, compiler_options=COMPILER_OPTIONS)

"""torch FX rules for random numbers: the ops ``spyre_jax::random`` and ``spyre_jax::dropout``.

Every random op of torch that reaches the card is one of these two (``torch_bridge.rng``
rewrites ``aten.rand``, ``randn``, ``randint``, ``bernoulli``, ``multinomial``, ``randperm``,
``native_dropout``, the in-place fills, ... into them): each takes the state of the device
generator for its call as its first operand, int32 ``[seed_lo, seed_hi, offset_lo,
offset_hi]``, and draws with :func:`lowering.rng_ops.draw`.

- ``random(state, x, dist, size, dtype, a, b, n)``: a draw of ``dist`` (``uniform``,
  ``normal``, ``randint``, ``bernoulli``, ``multinomial``, ...; :data:`lowering.rng_ops.DISTS`)
  of ``size`` in ``dtype``; ``a`` and ``b`` its numbers, ``x`` its tensor (bernoulli's
  probabilities, multinomial's weights), ``n`` multinomial's samples or randperm's length.
- ``dropout(state, x, p)``: ``native_dropout`` in training: ``(x * keep / (1 - p), keep)``,
  ``keep`` drawn with probability ``1 - p``.

Their CPU kernels compute the same numbers in NumPy (the same cipher, bit-equal; the same
formulas in float32, equal to rounding), so a host fallback of either draws what the card would.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import rng_ops, torch_import
from .builder import Builder, Lit
from .fx_common import convert, result, rule
from .graph import Var
from .torch_import import torch

__all__ = ["RANDOM", "DROPOUT", "random_cpu"]

_lib = torch.library.Library("spyre_jax", "FRAGMENT")
_lib.define(
    "random(Tensor state, Tensor? x, str dist, SymInt[] size, ScalarType dtype, float a, "
    "float b, int n) -> Tensor",
    tags=(torch.Tag.nondeterministic_seeded,),
)
_lib.define(
    "dropout(Tensor state, Tensor x, float p) -> (Tensor, Tensor)",
    tags=(torch.Tag.nondeterministic_seeded,),
)
#: ``torch.ops.spyre_jax.random.default`` and ``torch.ops.spyre_jax.dropout.default``
RANDOM = torch.ops.spyre_jax.random.default
DROPOUT = torch.ops.spyre_jax.dropout.default


def _out_shape(x: Any, dist: str, size: Any, n: int) -> tuple[int, ...]:
    if dist == "multinomial":
        return (*tuple(x.shape[:-1]), n)
    if dist == "randperm":
        return (n,)
    return tuple(size)


def _random_meta(
    state: Any, x: Any, dist: str, size: Any, dtype: Any, a: float, b: float, n: int
) -> torch.Tensor:
    return state.new_empty(_out_shape(x, dist, size, n), dtype=dtype)


def _dropout_meta(state: Any, x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)


# ---------------------------------------------------------------------------------------------
# the CPU kernels: the card's numbers in NumPy


def _unit_np(w: np.ndarray, bits: int) -> np.ndarray:
    m = ((w >> np.uint32(32 - bits)) << np.uint32(23 - bits)) | np.uint32(0x3F800000)
    return m.view(np.float32) - np.float32(1.0)


def _words_np(state: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(state, np.int32).view(np.uint32)
    idx = np.arange(math.prod(shape), dtype=np.uint32).reshape(shape)
    return rng_ops.threefry2x32_np(s[0], s[1] ^ s[3], idx, s[2])


def random_cpu(
    state: torch.Tensor,
    x: torch.Tensor | None,
    dist: str,
    size: Any,
    dtype: torch.dtype,
    a: float,
    b: float,
    n: int,
) -> torch.Tensor:
    """``spyre_jax::random`` on the CPU: what :func:`lowering.rng_ops.draw` computes on the
    card."""
    st = state.cpu().numpy()
    shape = _out_shape(x, dist, size, n)
    f32 = np.float32
    if dist == "randperm":
        w1, w2 = _words_np(st, (n,))
        out = np.lexsort((_unit_np(w2, 23), _unit_np(w1, 23))).astype(np.int64)
    elif dist == "multinomial":
        assert x is not None
        p = x.detach().cpu().float().numpy().reshape(-1, x.shape[-1])
        R, V = p.shape
        if b or n == 1:
            u = _unit_np(_words_np(st, (R, n))[0], 23)
            cdf = np.cumsum(p, axis=1, dtype=f32)
            t = u * cdf[:, -1:]
            idx = (cdf[:, None, :] <= t[:, :, None]).sum(-1)
            last = np.where(p > 0, np.arange(V), 0).max(1)
            out = np.minimum(idx, last[:, None])
        else:
            u = _unit_np(_words_np(st, (R, V))[0], 23) + f32(2.0**-24)
            with np.errstate(divide="ignore"):
                keys = np.log(p) - np.log(-np.log(u))
            out = np.argsort(-keys, axis=1, kind="stable")[:, :n]
        out = out.reshape(shape).astype(np.int64)
    else:
        w1, w2 = _words_np(st, shape)
        out = _dist_np(dist, w1, w2, dtype, a, b, x)
    return torch.from_numpy(np.ascontiguousarray(out)).to(dtype)


def _dist_np(
    dist: str, w1: np.ndarray, w2: np.ndarray, dtype: torch.dtype, a: float, b: float, x: Any
) -> np.ndarray:
    f32 = np.float32
    if dist == "randint":
        return (w1 % np.uint32(int(b) - int(a))).view(np.int32).astype(np.int64) + int(a)
    bits = {torch.float16: 10, torch.bfloat16: 7}.get(dtype, 23) if dist == "uniform" else 23
    u = _unit_np(w1, bits)
    with np.errstate(divide="ignore", invalid="ignore"):
        if dist == "uniform":
            return u * f32(b - a) + f32(a)
        if dist == "bernoulli":
            p = f32(a) if x is None else x.detach().cpu().float().numpy()
            return u < p
        if dist in ("normal", "log_normal"):
            rad = np.sqrt(np.log(f32(1) - u) * f32(-2))
            r = rad * np.cos(_unit_np(w2, 23) * f32(2 * math.pi)) * f32(b) + f32(a)
            return np.exp(r) if dist == "log_normal" else r
        if dist == "exponential":
            return np.log(f32(1) - u) / f32(-a)
        if dist == "cauchy":
            return np.tan((u - f32(0.5)) * f32(math.pi)) * f32(b) + f32(a)
        lg = np.log(f32(1) - u)  # geometric
        return np.maximum(np.ceil(lg / f32(math.log1p(-a))), f32(1))


def _dropout_cpu(state: torch.Tensor, x: torch.Tensor, p: float) -> tuple[torch.Tensor, ...]:
    keep = random_cpu(state, None, "bernoulli", x.shape, torch.bool, 1.0 - p, 0.0, 0)
    scale = 1.0 / (1.0 - p) if p < 1 else 0.0
    return x * keep * scale, keep


_lib.impl("random", random_cpu, "CPU")
_lib.impl("random", _random_meta, "Meta")
_lib.impl("dropout", _dropout_cpu, "CPU")
_lib.impl("dropout", _dropout_meta, "Meta")


# ---------------------------------------------------------------------------------------------
# the rules


@rule(RANDOM)
def _random(
    b: Builder,
    node: torch.fx.Node,
    state: Var,
    x: Any,
    dist: str,
    size: Any,
    dtype: Any,
    a: float,
    c: float,
    n: int,
) -> Var:
    shape, dt = result(node)
    drawn = rng_ops.draw(b, state, dist, tuple(shape), dt, a, c, n, x)
    return convert(b, drawn, dt)


@rule(DROPOUT)
def _dropout(b: Builder, node: torch.fx.Node, state: Var, x: Var, p: float) -> tuple[Var, Var]:
    keep = rng_ops.draw(b, state, "bernoulli", x.shape, "bool", 1.0 - float(p))
    scale = 1.0 / (1.0 - float(p)) if p < 1 else 0.0
    kept = b.elementwise("mul", [x, convert(b, keep, x.dtype)], x.shape, x.dtype)
    return b.elementwise("mul", [kept, Lit(scale, x.dtype)], x.shape, x.dtype), keep


torch_import.finish(__name__)  # see lowering.torch_import

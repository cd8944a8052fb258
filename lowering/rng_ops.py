"""Random numbers on the card: the Threefry-2x32 block cipher and the distributions drawn from it.

Threefry-2x32 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011; 20
rounds, the constants of the Random123 library, as JAX computes it) is a counter-based
generator: the ``i``-th number of a draw is the cipher of a counter under a key, so a draw needs
no state on the card and every position is computed independently, in uint32 adds, rotations and
xors that the fusion pass merges into SFU maps. The JAX importer uses :func:`threefry2x32` for
``jax.random`` (:mod:`lowering.jaxpr_random`, bit-equal to the CPU).

The torch importer draws with :func:`draw` from a **state** the host passes in with each call:
int32 ``[seed_lo, seed_hi, offset_lo, offset_hi]`` (:data:`STATE_WORDS`; the device
generator's 64-bit seed and the 64-bit count of draws made so far, ``torch_bridge.rng``). The
key is ``(seed_lo, seed_hi ^ offset_hi)``, the counter of position ``i`` (row-major) of a draw is
``(i, offset_lo)``; each cipher gives two words, ``w1`` and ``w2``. The distributions, computed in
float32 and rounded once to the result's dtype:

- ``uniform(a, b)``: ``a + (b - a) u``, ``u`` the top bits of ``w1`` as a float in ``[0, 1)``
  (as many bits as the result's dtype has mantissa: 23 for float32, 10 for float16, 7 for
  bfloat16, so ``u`` is exact in it).
- ``normal(mean, std)``: Box-Muller of ``w1`` and ``w2``; ``log_normal``: its ``exp``.
- ``exponential(rate)``: ``-log(1 - u) / rate``; ``cauchy(median, sigma)``:
  ``median + sigma tan(pi (u - 1/2))``; ``geometric(p)``: ``ceil(log(1 - u) / log(1 - p))``.
- ``randint(low, high)``: ``low + w1 mod (high - low)`` (torch's CPU generator has the same
  small bias for ranges that do not divide 2^32); ``high - low`` at most 2^31.
- ``bernoulli(p)``: ``u < p``, ``p`` a number or a tensor (broadcast).
- ``multinomial(probs, n, replacement)``: with replacement, or for one sample, the inverse of
  each row's cumulative sum at ``u`` times the row's total (a category of probability 0 is
  never drawn); without replacement, the ``n`` largest of ``log p - log(-log u)`` (Gumbel
  top-k, which draws the categories one by one without replacement).
- ``randperm(n)``: the stable argsort of 46 random bits per position.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import sort_ops
from .builder import Builder, Lit
from .errors import LoweringError
from .graph import Var

__all__ = ["DISTS", "STATE_WORDS", "draw", "mantissa_bits", "threefry2x32", "threefry2x32_np"]

_U32 = "uint32"
_I32 = "int32"
_F32 = "float32"
#: Threefry-2x32's rotation constants and key-schedule parity (the Random123 library's, as JAX)
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA
#: the words of a torch draw's state: seed (low, high), offset (low, high), as int32 bits
STATE_WORDS = 4
#: the distributions :func:`draw` makes
DISTS = frozenset(
    {
        "uniform",
        "normal",
        "log_normal",
        "exponential",
        "cauchy",
        "geometric",
        "randint",
        "bernoulli",
        "multinomial",
        "randperm",
    }
)


# ---------------------------------------------------------------------------------------------
# the cipher


def threefry2x32(b: Builder, k1: Any, k2: Any, x1: Any, x2: Any) -> tuple[Var, Var]:
    """Threefry-2x32 (20 rounds) of the counter pairs ``(x1, x2)`` under the key ``(k1, k2)``,
    every operand broadcast to the shape of the largest, in uint32 arithmetic."""
    shape = tuple(np.broadcast_shapes(*(v.shape for v in (k1, k2, x1, x2) if isinstance(v, Var))))
    k1, k2, x1, x2 = (_full(b, v, shape) for v in (k1, k2, x1, x2))

    def ew(fn: str, *xs: Any) -> Var:
        return b.elementwise(fn, list(xs), shape, _U32)

    def lit(v: int) -> Lit:
        return Lit(v & 0xFFFFFFFF, _U32)

    ks = [k1, k2, ew("xor", ew("xor", k1, k2), lit(_PARITY))]
    x = [ew("add", x1, ks[0]), ew("add", x2, ks[1])]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x[0] = ew("add", x[0], x[1])
            rot = ew("or", ew("shl", x[1], lit(r)), ew("shr_logical", x[1], lit(32 - r)))
            x[1] = ew("xor", x[0], rot)
        x[0] = ew("add", x[0], ks[(i + 1) % 3])
        x[1] = ew("add", ew("add", x[1], ks[(i + 2) % 3]), lit(i + 1))
    return x[0], x[1]


def threefry2x32_np(k1: Any, k2: Any, x1: Any, x2: Any) -> tuple[np.ndarray, np.ndarray]:
    """:func:`threefry2x32` in NumPy (the reference of the card's and the CPU kernel's)."""
    k1, k2, x1, x2 = np.broadcast_arrays(*(np.asarray(v, np.uint32) for v in (k1, k2, x1, x2)))
    ks = [k1, k2, k1 ^ k2 ^ np.uint32(_PARITY)]
    x = [x1 + ks[0], x2 + ks[1]]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x[0] = x[0] + x[1]
            x[1] = x[0] ^ ((x[1] << np.uint32(r)) | (x[1] >> np.uint32(32 - r)))
        x[0] = x[0] + ks[(i + 1) % 3]
        x[1] = x[1] + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x[0], x[1]


def _full(b: Builder, v: Any, shape: tuple[int, ...]) -> Var:
    if isinstance(v, Lit):
        return b.full(shape, int(v.value) & 0xFFFFFFFF, _U32)
    if v.shape == shape:
        return v
    dims = tuple(range(len(shape) - len(v.shape), len(shape)))  # NumPy's broadcasting
    return b.emit("broadcast", [v], shape, v.dtype, shape=shape, dims=dims)


# ---------------------------------------------------------------------------------------------
# torch's draws


def mantissa_bits(dtype: str) -> int:
    """The explicit mantissa bits of a float dtype (how many random bits a uniform float of it
    holds exactly below 1)."""
    return {"float32": 23, "float16": 10, "bfloat16": 7}.get(dtype, 23)


def _scalar_words(b: Builder, state: Var) -> tuple[Var, Var, Var]:
    """The key words and the offset's low word of a state (each rank 0, uint32)."""
    if state.shape != (STATE_WORDS,) or state.dtype not in (_I32, _U32):
        raise LoweringError(
            f"spyre: a random draw's state is int32[{STATE_WORDS}], not {state.dtype}{state.shape}"
        )
    s = state if state.dtype == _U32 else b.elementwise("bitcast", [state], state.shape, _U32, _U32)
    w = [b.reshape(b.slice_dim(s, 0, i, i + 1), ()) for i in range(STATE_WORDS)]
    return w[0], b.elementwise("xor", [w[1], w[3]], (), _U32), w[2]


def _words(b: Builder, state: Var, shape: tuple[int, ...]) -> tuple[Var, Var]:
    k1, k2, off = _scalar_words(b, state)
    n = math.prod(shape)
    if n >= 1 << 32:
        raise LoweringError(f"spyre: a random draw of {n} elements (at most 2^32 - 1)")
    idx = b.const(np.arange(n, dtype=np.uint32).reshape(shape), _U32)
    return threefry2x32(b, k1, k2, idx, off)


def _unit(b: Builder, w: Var, bits: int) -> Var:
    """float32 in ``[0, 1)`` from the top ``bits`` bits of ``w`` (multiples of ``2^-bits``)."""
    sh = w.shape
    m = b.elementwise("shr_logical", [w, Lit(32 - bits, _U32)], sh, _U32)
    m = b.elementwise("shl", [m, Lit(23 - bits, _U32)], sh, _U32)
    one = b.elementwise("or", [m, Lit(0x3F800000, _U32)], sh, _U32)
    f = b.elementwise("bitcast", [one], sh, _F32, _F32)
    return b.elementwise("sub", [f, Lit(1.0, _F32)], sh, _F32)


def _ew(b: Builder, fn: str, *xs: Any, dt: str = _F32) -> Var:
    shape = next(x.shape for x in xs if isinstance(x, Var))
    return b.elementwise(fn, list(xs), shape, dt)


def _f(v: float) -> Lit:
    return Lit(float(v), _F32)


def _convert(b: Builder, x: Var, dt: str) -> Var:
    return x if x.dtype == dt else b.emit("convert", [x], x.shape, dt, dtype=dt)


def draw(
    b: Builder,
    state: Var,
    dist: str,
    shape: tuple[int, ...],
    dtype: str,
    a: float = 0.0,
    c: float = 1.0,
    n: int = 0,
    x: Var | None = None,
) -> Var:
    """One torch draw of ``dist`` (see the module's docstring) in ``dtype`` and ``shape``, from
    ``state``. ``a`` and ``c`` are the distribution's two numbers (low/high, mean/std, rate, p,
    ...); ``x`` its tensor (bernoulli's probabilities, multinomial's weights); ``n`` the samples
    of multinomial (``c`` non-zero: with replacement) or randperm's length."""
    if dist not in DISTS:
        raise LoweringError(f"spyre: no random distribution {dist!r} (known: {sorted(DISTS)})")
    if dist == "multinomial":
        return _multinomial(b, state, x, n, bool(c))
    if dist == "randperm":
        w1, w2 = _words(b, state, (n,))
        keys = [_unit(b, w1, 23), _unit(b, w2, 23)]
        return sort_ops.argsort(b, keys, 0) if n else b.full((0,), 0, _I32)
    w1, w2 = _words(b, state, shape)
    if dist == "randint":
        span = int(c) - int(a)
        if not 0 < span <= 1 << 31:
            raise LoweringError(f"spyre: randint over [{int(a)}, {int(c)}) (at most 2^31 values)")
        r = _ew(b, "rem", w1, Lit(span, _U32), dt=_U32)
        r = b.elementwise("bitcast", [r], shape, _I32, _I32)
        if int(a):
            r = _ew(b, "add", r, Lit(int(a), _I32), dt=_I32)
        return _convert(b, r, dtype)
    bits = mantissa_bits(dtype) if dist == "uniform" else 23
    u = _unit(b, w1, bits)
    if dist == "uniform":
        r = _ew(b, "add", _ew(b, "mul", u, Lit(float(c) - float(a), _F32)), Lit(float(a), _F32))
    elif dist == "bernoulli":
        p = Lit(float(a), _F32) if x is None else _bcast(b, _convert(b, x, _F32), shape)
        r = _ew(b, "lt", u, p, dt="bool")
    elif dist in ("normal", "log_normal"):
        log1mu = _ew(b, "log", _ew(b, "sub", _f(1), u))
        rad = _ew(b, "sqrt", _ew(b, "mul", log1mu, _f(-2)))
        ang = _ew(b, "cos", _ew(b, "mul", _unit(b, w2, 23), _f(2 * math.pi)))
        r = _ew(b, "add", _ew(b, "mul", _ew(b, "mul", rad, ang), _f(c)), _f(a))
        if dist == "log_normal":
            r = _ew(b, "exp", r)
    elif dist == "exponential":
        r = _ew(b, "div", _ew(b, "log", _ew(b, "sub", Lit(1.0, _F32), u)), Lit(-float(a), _F32))
    elif dist == "cauchy":
        t = _ew(b, "tan", _ew(b, "mul", _ew(b, "sub", u, Lit(0.5, _F32)), Lit(math.pi, _F32)))
        r = _ew(b, "add", _ew(b, "mul", t, Lit(float(c), _F32)), Lit(float(a), _F32))
    else:  # geometric
        if not 0.0 < float(a) < 1.0:
            raise LoweringError(f"spyre: geometric with p={a} (0 < p < 1)")
        lg = _ew(b, "log", _ew(b, "sub", Lit(1.0, _F32), u))
        r = _ew(b, "ceil", _ew(b, "div", lg, Lit(math.log1p(-float(a)), _F32)))
        r = _ew(b, "max", r, Lit(1.0, _F32))
    return _convert(b, r, dtype)


def _bcast(b: Builder, v: Var, shape: tuple[int, ...]) -> Var:
    if v.shape == shape:
        return v
    dims = tuple(range(len(shape) - len(v.shape), len(shape)))
    return b.emit("broadcast", [v], shape, v.dtype, shape=shape, dims=dims)


def _multinomial(b: Builder, state: Var, x: Var | None, n: int, replacement: bool) -> Var:
    """``n`` category indices (int32) per row of the weights ``x`` (``[V]`` or ``[R, V]``)."""
    if x is None or len(x.shape) not in (1, 2) or not x.shape[-1]:
        raise LoweringError("spyre: multinomial needs weights of shape [V] or [R, V], V > 0")
    one_d = len(x.shape) == 1
    p = _convert(b, x if not one_d else b.reshape(x, (1, x.shape[0])), _F32)
    R, V = p.shape
    if n == 0:
        out = b.full((R, 0), 0, _I32)
    elif replacement or n == 1:
        cdf = b.emit("reduce", [p], (R, V), _F32, kind="cumsum", axes=(1,))
        total = b.slice_dim(cdf, 1, V - 1, V)  # [R, 1]
        u = _unit(b, _words(b, state, (R, n))[0], 23)
        t = _ew(b, "mul", u, _bcast(b, total, (R, n)))  # [R, n]
        cube = (R, n, V)
        le = b.elementwise(
            "le",
            [
                b.emit("broadcast", [cdf], cube, _F32, shape=cube, dims=(0, 2)),
                b.emit("broadcast", [t], cube, _F32, shape=cube, dims=(0, 1)),
            ],
            cube,
            "bool",
        )
        out = b.emit("reduce", [_convert(b, le, _I32)], (R, n), _I32, kind="sum", axes=(2,))
        # rounding may put u * total on the total: the last category of non-zero weight then
        pos = b.const(np.broadcast_to(np.arange(V, dtype=np.int32), (R, V)).copy(), _I32)
        live = _ew(b, "gt", p, Lit(0.0, _F32), dt="bool")
        at = b.elementwise("select_n", [live, Lit(0, _I32), pos], (R, V), _I32)
        last = b.emit("reduce", [at], (R,), _I32, kind="max", axes=(1,))
        out = _ew(b, "min", out, _bcast(b, b.reshape(last, (R, 1)), (R, n)), dt=_I32)
    else:
        if n > V:
            raise LoweringError(f"spyre: multinomial of {n} samples from {V} without replacement")
        # u in (0, 1) (the top 23 bits and a half): -log(u) finite and positive; a category of
        # weight 0 gets the key -inf
        u = _ew(b, "add", _unit(b, _words(b, state, (R, V))[0], 23), Lit(2.0**-24, _F32))
        gumbel = _ew(b, "log", _ew(b, "neg", _ew(b, "log", u)))
        keys = _ew(b, "sub", _ew(b, "log", p), gumbel)
        out = sort_ops.argsort(b, [keys], 1, k=n, descending=True)
    return b.reshape(out, (n,)) if one_d else out

"""Operators and methods of ``spyre_jax.Array``: what a ``jax.Array`` answers, run on the card.

Each operator or method is a small function of ``jax.numpy`` compiled once per signature by
:func:`spyre_jax.jit` (one kernel per op, shapes and dtypes, and static arguments such as an
axis or a slice) and launched on the card's lazy trace (``device_model.deferred``, as the torch
eager device's ops are): the result is a new :class:`~spyre_jax.Array` in device memory, its
values computed when the host reads them. Python numbers are weakly typed as in JAX
(``x_f16 + 1.5`` stays fp16; ``x_i32 * 2.5`` is fp32) and are kernel arguments, not constants,
so ``x + 1.0`` and ``x + 2.0`` share one kernel; ``x ** 2`` with an integer exponent is JAX's
``integer_pow`` (the exponent is static). Indices are static (ints, slices, ``None``,
``...``) or traced (integer or boolean arrays).

Reading values (``float()``, ``int()``, ``bool()``, ``.item()``, ``.tolist()``, printing,
``jax.device_get``) copies to the host. ``jnp.*`` functions take an Array through
``__jax_array__`` (a host copy: JAX has no dispatch hook, so outside a jit they run on the CPU).
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ArrayOps", "install", "kernel_count"]

_lock = threading.Lock()
#: the jitted function of each (op, static arguments)
_KERNELS: dict[Any, Any] = {}


def kernel_count() -> int:
    """How many (op, static arguments) functions the Array methods have made."""
    return len(_KERNELS)


#: ``spyre_jax.jit`` (set by :func:`install`: this module imports nothing of the API)
_JIT: list[Callable[[Callable], Any]] = []


def _jitted(key: Any, make: Callable[[], Callable]) -> Any:
    fn = _KERNELS.get(key)
    if fn is None:
        f = make()
        f.__name__ = f"array_{key[0]}".replace(".", "_")
        fn = _JIT[0](f)
        with _lock:
            _KERNELS[key] = fn
    return fn


def _is_array(x: Any) -> bool:
    return isinstance(x, _ARRAY_TYPES)


def _weak(v: Any, like: Any) -> np.ndarray:
    """A Python number as a 0-d array of the dtype JAX's weak typing gives it beside an array
    of dtype ``like``."""
    dt = np.dtype(like) if not isinstance(like, np.dtype) else like
    if dt == jnp.bfloat16 or dt.kind == "f":
        return np.asarray(v, dt)
    if isinstance(v, float):
        return np.asarray(v, np.float32)
    if dt.kind in "iu":
        return np.asarray(v, dt)
    return np.asarray(v, np.bool_ if isinstance(v, bool) else np.int32)


def _run(fn: Any, args: list[Any]) -> Any:
    return fn._apply(args, defer=True)


def _binary(name: str, op: Callable[[Any, Any], Any]) -> tuple[Callable, Callable]:
    def forward(self: Any, other: Any) -> Any:
        return _apply2(name, op, self, other, False)

    def reflected(self: Any, other: Any) -> Any:
        return _apply2(name, op, self, other, True)

    return forward, reflected


def _apply2(name: str, op: Callable, a: Any, b: Any, swap: bool) -> Any:
    if isinstance(b, bool | int | float) and not isinstance(b, np.generic):
        if name == "pow" and isinstance(b, int) and not isinstance(b, bool) and not swap:
            fn = _jitted(("integer_pow", b), lambda: lambda x: x**b)
            return _run(fn, [a])
        b = _weak(b, a.dtype)
    elif not _is_array(b) and not isinstance(b, np.generic):
        return NotImplemented
    fn = _jitted((name,), lambda: lambda x, y: op(x, y))
    return _run(fn, [b, a] if swap else [a, b])


def _unary(name: str, fun: Callable[[Any], Any]) -> Callable:
    def method(self: Any) -> Any:
        return _run(_jitted((name,), lambda: lambda x: fun(x)), [self])

    return method


def _static(x: Any) -> Any:
    """A hashable form of a static argument (slices, lists and dtypes included)."""
    if isinstance(x, slice):
        return ("slice", x.start, x.stop, x.step)
    if isinstance(x, list | tuple):
        return (type(x).__name__, *(_static(v) for v in x))
    if isinstance(x, np.dtype) or (isinstance(x, type) and issubclass(x, np.generic)):
        return ("dtype", np.dtype(x).name)
    hash(x)
    return x


def _method(name: str) -> Callable:
    """``x.name(*args, **kwargs)`` as ``jnp.name(x, ...)``: array arguments traced, the rest
    static (in the kernel's key)."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        traced = [a for a in args if _is_array(a)]
        slots = tuple("<array>" if _is_array(a) else _static(a) for a in args)
        skw = tuple(sorted((k, _static(v)) for k, v in kwargs.items()))
        plain = [None if _is_array(a) else a for a in args]

        def make() -> Callable:
            def f(x: Any, *arrs: Any) -> Any:
                it = iter(arrs)
                full = [
                    next(it) if s == "<array>" else p for s, p in zip(slots, plain, strict=True)
                ]
                return getattr(jnp, name)(x, *full, **kwargs)

            return f

        return _run(_jitted((name, slots, skw), make), [self, *traced])

    method.__name__ = name
    method.__doc__ = f"``jnp.{name}`` of this array, on the card."
    return method


def _index_key(key: Any) -> tuple[Any, list[Any]]:
    """An index as (a static template, the arrays in it, traced)."""
    parts = key if isinstance(key, tuple) else (key,)
    arrays: list[Any] = []
    tmpl: list[Any] = []
    for p in parts:
        if isinstance(p, list):
            p = np.asarray(p)
        if isinstance(p, np.ndarray) and p.dtype == np.int64:
            p = p.astype(np.int32)  # as JAX indexes (64-bit types off), without a warning
        if _is_array(p):
            arrays.append(p)
            tmpl.append("<array>")
        else:
            tmpl.append(_static(p))
    return ("tuple" if isinstance(key, tuple) else "one", *tmpl), arrays


def _rebuild(tmpl: tuple, arrays: tuple) -> Any:
    it = iter(arrays)
    out = []
    for t in tmpl[1:]:
        if t == "<array>":
            out.append(next(it))
        elif isinstance(t, tuple) and t and t[0] == "slice":
            out.append(slice(*t[1:]))
        else:
            out.append(t)
    return tuple(out) if tmpl[0] == "tuple" else out[0]


class ArrayOps:
    """The operators and ``jax.Array`` methods of :class:`spyre_jax.Array`."""

    __slots__ = ()
    __array_priority__ = 100
    __hash__ = None  # type: ignore[assignment]  # as jax.Array: == is elementwise

    __add__, __radd__ = _binary("add", operator.add)
    __sub__, __rsub__ = _binary("sub", operator.sub)
    __mul__, __rmul__ = _binary("mul", operator.mul)
    __truediv__, __rtruediv__ = _binary("truediv", operator.truediv)
    __floordiv__, __rfloordiv__ = _binary("floordiv", operator.floordiv)
    __mod__, __rmod__ = _binary("mod", operator.mod)
    __pow__, __rpow__ = _binary("pow", operator.pow)
    __matmul__, __rmatmul__ = _binary("matmul", operator.matmul)
    __and__, __rand__ = _binary("and", operator.and_)
    __or__, __ror__ = _binary("or", operator.or_)
    __xor__, __rxor__ = _binary("xor", operator.xor)
    __lshift__, __rlshift__ = _binary("lshift", operator.lshift)
    __rshift__, __rrshift__ = _binary("rshift", operator.rshift)
    __lt__ = _binary("lt", operator.lt)[0]  # (3 < x is x.__gt__(3))
    __le__ = _binary("le", operator.le)[0]
    __gt__ = _binary("gt", operator.gt)[0]
    __ge__ = _binary("ge", operator.ge)[0]
    __eq__ = _binary("eq", operator.eq)[0]  # type: ignore[assignment]
    __ne__ = _binary("ne", operator.ne)[0]  # type: ignore[assignment]
    __neg__ = _unary("neg", operator.neg)
    __pos__ = _unary("pos", operator.pos)
    __abs__ = _unary("abs", abs)
    __invert__ = _unary("invert", operator.invert)

    def __getitem__(self, key: Any) -> Any:
        tmpl, arrays = _index_key(key)
        fn = _jitted(("getitem", tmpl), lambda: lambda x, *arrs: x[_rebuild(tmpl, arrs)])
        return _run(fn, [self, *arrays])

    def __iter__(self) -> Any:
        if not self.shape:  # type: ignore[attr-defined]
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self.shape[0]))  # type: ignore[attr-defined]

    def reshape(self, *shape: Any, order: str = "C") -> Any:
        """``jnp.reshape``: a tuple or the sizes as arguments."""
        if len(shape) == 1 and isinstance(shape[0], tuple | list):
            shape = tuple(shape[0])
        return _method("reshape")(self, tuple(int(s) for s in shape), order=order)

    def transpose(self, *axes: Any) -> Any:
        """``jnp.transpose``: a tuple of axes, the axes as arguments, or none (reversed)."""
        if len(axes) == 1 and isinstance(axes[0], tuple | list):
            axes = tuple(axes[0])
        return _method("transpose")(self, tuple(axes) if axes else None)

    def flatten(self) -> Any:
        return self.reshape(-1)

    def astype(self, dtype: Any) -> Any:
        """A copy converted to ``dtype`` (on the card)."""
        dt = np.dtype(dtype)
        return _run(_jitted(("astype", dt.name), lambda: lambda x: x.astype(dt)), [self])

    def copy(self) -> Any:
        return _run(_jitted(("copy",), lambda: lambda x: jnp.array(x, copy=True)), [self])

    @property
    def T(self) -> Any:  # noqa: N802  (jax.Array's name)
        return self.transpose()

    @property
    def mT(self) -> Any:  # noqa: N802
        return _run(_jitted(("mT",), lambda: lambda x: jnp.matrix_transpose(x)), [self])

    # --- host reads
    def item(self, *args: Any) -> Any:
        return np.asarray(self).item(*args)

    def tolist(self) -> Any:
        return np.asarray(self).tolist()

    def __float__(self) -> float:
        return float(np.asarray(self))

    def __int__(self) -> int:
        return int(np.asarray(self))

    def __index__(self) -> int:
        return operator.index(np.asarray(self)[()])

    def __bool__(self) -> bool:
        return bool(np.asarray(self))

    def __complex__(self) -> complex:
        return complex(np.asarray(self))

    def __jax_array__(self) -> jax.Array:
        """A JAX array of the values (a host copy): how ``jnp.*`` functions take this array."""
        return jnp.asarray(np.asarray(self))

    def __format__(self, spec: str) -> str:
        if not self.shape:  # type: ignore[attr-defined]
            return format(np.asarray(self)[()], spec)
        return format(str(self), spec)


#: ``jax.Array`` methods that are ``jnp`` functions of the array (``x.sum(axis=0)``)
METHODS = (
    "sum mean max min prod argmax argmin any all std var cumsum cumprod clip round squeeze "
    "ravel dot swapaxes repeat sort argsort trace diagonal take ptp"
).split()
for _name in METHODS:
    setattr(ArrayOps, _name, _method(_name))


_ARRAY_TYPES: tuple[type, ...] = (np.ndarray, jax.Array)


def install(cls: type, jit: Callable[[Callable], Any]) -> None:
    """Give ``cls`` (``spyre_jax.Array``) the operators and methods of :class:`ArrayOps`, each
    compiled by ``jit``."""
    global _ARRAY_TYPES
    _JIT[:] = [jit]
    _ARRAY_TYPES = (cls, np.ndarray, jax.Array)
    for name, value in vars(ArrayOps).items():
        if name not in ("__module__", "__qualname__", "__doc__", "__slots__", "__dict__"):
            setattr(cls, name, value)

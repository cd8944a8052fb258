"""What the JAX importer's rule modules share: the registry of rules (:data:`RULES`, filled by
``@rule``), the type of a jaxpr variable (:func:`aval`), and the importer of a body graph (set by
:mod:`lowering.from_jaxpr`: the rules of loops and branches import their bodies with it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.extend.random as jax_random
import numpy as np

from device_model.layout import check_dtype

from .builder import Builder
from .errors import PRNGKeyError
from .graph import Graph, Var

__all__ = [
    "RULES",
    "Rule",
    "rule",
    "aval",
    "dtype_name",
    "import_body",
    "inline",
    "key_impl",
    "PRNGKeyError",
    "INLINED",
]

Rule = Callable[[Builder, Any, list[Any]], list[Var]]

#: primitives whose body the importer inlines (their equations are imported one by one)
INLINED = frozenset(
    {
        "pjit",
        "jit",
        "closed_call",
        "core_call",
        "remat",
        "remat2",
        "checkpoint",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "spyre_call",  # a spyre_jax.jit function called inside another (spyre_jax.transforms)
    }
)
RULES: dict[str, Rule] = {}


def rule(*names: str) -> Callable[[Rule], Rule]:
    """Register a rule for the JAX primitives ``names``."""

    def deco(fn: Rule) -> Rule:
        for n in names:
            RULES[n] = fn
        return fn

    return deco


def key_impl(dt: Any) -> Any:
    """The PRNG implementation of a key dtype (``key<fry>``), or None for any other dtype.
    PRNGKeyError for a key of an implementation other than threefry2x32.

    JAX keeps a key dtype's implementation in a private attribute (``_impl``); this is the one
    place the importer reads it (tests/test_random.py checks it on the pinned JAX range)."""
    if not jax.dtypes.issubdtype(dt, jax.dtypes.prng_key):
        return None
    impl = getattr(dt, "_impl", None)
    if impl is not jax_random.threefry_prng_impl:
        name = getattr(impl, "name", str(dt))
        raise PRNGKeyError(
            f"spyre: PRNG implementation {name!r} ({dt}) is not supported on the card; only "
            "threefry2x32 (JAX's default, jax.random.key / PRNGKey without impl=) is"
        )
    return impl


def dtype_name(dt: Any) -> str:
    """The card dtype name of a jaxpr value's dtype (TypeError for one the card lacks). A
    threefry key is its data: uint32 (:func:`aval` adds the key's trailing dim)."""
    if key_impl(dt) is not None:
        return "uint32"
    name = np.dtype(dt).name
    return check_dtype(name, "a value in the traced program")


def aval(v: Any) -> tuple[tuple[int, ...], str]:
    """(shape, card dtype) of a jaxpr variable; an array of threefry keys is its key data,
    uint32 with the key's shape (2,) after its own."""
    dt = v.aval.dtype
    impl = key_impl(dt)
    shape = tuple(int(d) for d in v.aval.shape)
    if impl is not None:
        return (*shape, *impl.key_shape), "uint32"
    return shape, dtype_name(dt)


def _unset(closed: Any, name: str = "main", source: str = "") -> Graph:
    raise RuntimeError("lowering.from_jaxpr sets the body importer when it is imported")


#: ``import_body(closed_jaxpr, name, source) -> Graph``: :func:`lowering.from_jaxpr.from_jaxpr`
import_body: Callable[..., Graph] = _unset

#: ``inline(builder, closed_jaxpr, args) -> outputs``: a jaxpr's equations imported into the
#: builder's graph (set by :mod:`lowering.from_jaxpr`)
inline: Callable[..., list[Any]] = _unset

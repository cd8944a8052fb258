"""What the JAX importer's rule modules share: the registry of rules (:data:`RULES`, filled by
``@rule``), the type of a jaxpr variable (:func:`aval`), and the importer of a body graph (set by
:mod:`lowering.from_jaxpr`: the rules of loops and branches import their bodies with it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from device_model.layout import check_dtype

from .builder import Builder
from .graph import Graph, Var

__all__ = ["RULES", "Rule", "rule", "aval", "dtype_name", "import_body"]

Rule = Callable[[Builder, Any, list[Any]], list[Var]]
RULES: dict[str, Rule] = {}


def rule(*names: str) -> Callable[[Rule], Rule]:
    """Register a rule for the JAX primitives ``names``."""

    def deco(fn: Rule) -> Rule:
        for n in names:
            RULES[n] = fn
        return fn

    return deco


def dtype_name(dt: Any) -> str:
    """The card dtype name of a jaxpr value's dtype (TypeError for one the card lacks)."""
    name = np.dtype(dt).name
    return check_dtype(name, "a value in the traced program")


def aval(v: Any) -> tuple[tuple[int, ...], str]:
    """(shape, card dtype) of a jaxpr variable."""
    return tuple(int(d) for d in v.aval.shape), dtype_name(v.aval.dtype)


def _unset(closed: Any, name: str = "main", source: str = "") -> Graph:
    raise RuntimeError("lowering.from_jaxpr sets the body importer when it is imported")


#: ``import_body(closed_jaxpr, name, source) -> Graph``: :func:`lowering.from_jaxpr.from_jaxpr`
import_body: Callable[..., Graph] = _unset

"""The compiler as one readable function of named passes.

Set ``SPYRE_DUMP=1`` to print the IR after every pass; ``SPYRE_CHECK=0`` skips the checkers
(they run by default, and always in the tests).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

from device_model.card import CardSpec
from device_model.kernel import Kernel, check_kernel, format_kernel

from .graph import Graph, check_graph
from .passes import dce, fuse_maps, to_maps
from .schedule import map_fits, schedule

__all__ = ["compile_graph", "graph_passes"]


def graph_passes(card: CardSpec) -> tuple[tuple[str, Callable[[Graph], Graph]], ...]:
    """The graph passes in order, each bound to ``card`` where it looks at device layouts.
    Fusion asks the tiler whether each map it merges still fits ``card``'s scratchpad (a
    row-resident softmax needs its whole rows there)."""
    fits = functools.partial(map_fits, card=card)
    return (
        ("to_maps", functools.partial(to_maps, card=card)),
        ("fuse_maps", functools.partial(fuse_maps, fits=fits, card=card)),
        ("dce", dce),
    )


def compile_graph(g: Graph, card: CardSpec, *, check: bool | None = None) -> Kernel:
    """Graph IR -> fused graph -> tiled schedule (a :class:`Kernel` for ``card``: its layouts,
    core count, scratchpad and DL16 rounding are the card's)."""
    check = os.environ.get("SPYRE_CHECK", "1") != "0" if check is None else check
    dump = os.environ.get("SPYRE_DUMP", "") not in ("", "0")
    if check:
        check_graph(g)
    if dump:
        print(f"=== {g.name}: imported\n{g}")
    for name, fn in graph_passes(card):
        g = fn(g)
        if check:
            check_graph(g)
        if dump:
            print(f"=== {g.name}: after {name}\n{g}")
    k = schedule(g, card)
    if check:
        check_kernel(k)
    if dump:
        print(f"=== {g.name}: schedule\n{format_kernel(k)}")
    return k

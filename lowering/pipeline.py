"""The compiler as one readable function of named passes.

The IR after every pass is logged at DEBUG on the ``lowering`` logger (Python's ``logging``; one
logger per package of ours). ``SPYRE_DUMP=1`` shows it on stderr without configuring logging;
``SPYRE_CHECK=0`` skips the checkers (they run by default, and always in the tests).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from device_model.card import CardSpec
from device_model.kernel import Kernel, check_kernel, format_kernel
from device_model.timing import kernel_cost

from .graph import Graph, Var, check_graph
from .indexing import expand_updates
from .layout_pass import sink_transposes
from .matmul_passes import (
    fuse_epilogue,
    narrow_matmul,
    nt_matmul,
    sink_and_fuse,
    swap_matmul,
)
from .passes import dce, fuse_maps, to_maps
from .prologue import fuse_prologue
from .schedule import map_fits, schedule
from .unfuse import explicit_convs, unfuse

__all__ = ["compile_graph", "graph_passes"]

log = logging.getLogger("lowering")


def _dump_handler() -> None:
    """``SPYRE_DUMP=1``: the ``lowering`` logger shows DEBUG on stderr (one handler, once)."""
    if not any(getattr(h, "_spyre_dump", False) for h in log.handlers):
        h = logging.StreamHandler()
        h._spyre_dump = True  # type: ignore[attr-defined]
        log.addHandler(h)
    log.setLevel(logging.DEBUG)


#: simulated times of the small graphs a pass asks about, by their structure and card (a
#: model's identical layers ask the same question): at most this many, then it starts over
TIMES_KEPT = 4096
_times: dict[Any, float] = {}


def _structure(g: Graph) -> tuple:
    """``g`` up to the identity of its values: each node's op and parameters, and
    its inputs and outputs as (first appearance, shape, dtype)."""
    seen: dict[int, int] = {}

    def ref(v: Var) -> tuple:
        return (seen.setdefault(v.id, len(seen)), v.shape, v.dtype)

    return tuple(
        (n.op, n.params, tuple(ref(v) for v in n.inputs), tuple(ref(v) for v in n.outputs))
        for n in g.nodes
    ) + (tuple(ref(v) for v in g.inputs), tuple(ref(v) for v in g.outputs))


def _timer(card: CardSpec) -> Callable[[Graph], float]:
    """The simulated time of a graph as the scheduler tiles it on ``card`` (remembered by its
    structure)."""

    def time_of(g: Graph) -> float:
        key = (_structure(g), card)
        t = _times.get(key)
        if t is None:
            t = float(kernel_cost(schedule(unfuse(g, card), card), card)["sim_time_us"])
            if len(_times) >= TIMES_KEPT:
                _times.clear()
            _times[key] = t
        return t

    return time_of


def graph_passes(card: CardSpec) -> tuple[tuple[str, Callable[[Graph], Graph]], ...]:
    """The graph passes in order, each bound to ``card`` where it looks at device layouts.
    Fusion asks the tiler whether each map it merges still fits ``card``'s scratchpad (a
    row-resident softmax needs its whole rows there); a norm's fusion into the matmuls after
    it asks the scheduler and the timing model whether it saves time. A convolution with no
    window that fits becomes an explicit im2col first. The last pass splits a fused matmul
    that the tiler cannot fit in whole blocks back into its map and matmul."""
    fits = functools.partial(map_fits, card=card)
    return (
        ("expand_updates", expand_updates),
        ("explicit_convs", functools.partial(explicit_convs, card=card)),
        ("nt_matmul", nt_matmul),
        ("swap_matmul", swap_matmul),
        ("sink_transposes", sink_transposes),
        ("narrow_matmul", narrow_matmul),
        ("to_maps", functools.partial(to_maps, card=card)),
        ("fuse_maps", functools.partial(fuse_maps, fits=fits, card=card)),
        ("sink_and_fuse", functools.partial(sink_and_fuse, fits=fits, card=card)),
        ("fuse_epilogue", fuse_epilogue),
        ("fuse_prologue", functools.partial(fuse_prologue, card=card, time_of=_timer(card))),
        ("dce", dce),
        ("unfuse", functools.partial(unfuse, card=card)),
    )


def compile_graph(g: Graph, card: CardSpec, *, check: bool | None = None) -> Kernel:
    """Graph IR -> fused graph -> tiled schedule (a :class:`Kernel` for ``card``: its layouts,
    core count, scratchpad and DL16 rounding are the card's)."""
    check = os.environ.get("SPYRE_CHECK", "1") != "0" if check is None else check
    if os.environ.get("SPYRE_DUMP", "") not in ("", "0"):
        _dump_handler()
    dump = log.isEnabledFor(logging.DEBUG)
    t0 = time.perf_counter()
    if check:
        check_graph(g)
    if dump:
        log.debug("=== %s: imported\n%s", g.name, g)
    for name, fn in graph_passes(card):
        g = fn(g)
        if check:
            check_graph(g)
        if dump:
            log.debug("=== %s: after %s\n%s", g.name, name, g)
    k = schedule(g, card)
    if check:
        check_kernel(k)
    if dump:
        log.debug("=== %s: schedule\n%s", g.name, format_kernel(k))
    log.debug(
        "compiled %s: %d nodes -> %d stages in %.3f s",
        g.name,
        len(g.nodes),
        len(k.stages),
        time.perf_counter() - t0,
    )
    return k

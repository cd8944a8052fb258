"""Donated arguments: a launch's output takes the device memory of an argument the caller gave
up (``spyre_jax.jit(..., donate_argnums=...)``), as XLA aliases a donated input to an output.

An output takes a donated argument's region when their stick layouts are equal (a parameter
updated by a training step: same shape and dtype); no new region is allocated for it, and the
argument's buffer is deleted without freeing the region, which the output now owns. The
kernel's program reads the argument's values before it runs (they are values of the
simulation, not the bytes of the region), so the step reads and writes the same region, as an
in-place update on the card does. A donated argument no output takes is the caller's to delete
(its region is then free for the next allocation).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .payload import DELETED

__all__ = ["plan", "addresses", "consume"]


def plan(
    out_layouts: Sequence[Any], nregions: int, bufs: Sequence[Any], donate: Sequence[int]
) -> list[Any]:
    """Per region a launch allocates (its outputs, then a workspace): the donated buffer whose
    region it takes, or None. A buffer is given to at most one output; views (which own no
    region) and buffers of another layout are not taken."""
    taken: list[Any] = [None] * nregions
    pool = []
    for i in dict.fromkeys(donate):
        b = bufs[i]
        if getattr(b, "_base", 0) is None and b.alive:
            pool.append(b)
    for j, lay in enumerate(out_layouts):
        for b in pool:
            if b.layout == lay:
                taken[j] = b
                pool.remove(b)
                break
    return taken


def addresses(taken: Sequence[Any], fresh: Sequence[int]) -> list[int]:
    """The regions' addresses: a taken buffer's, else the next freshly allocated one."""
    it = iter(fresh)
    return [next(it) if t is None else t.addr for t in taken]


def consume(taken: Sequence[Any]) -> None:
    """The launch succeeded: each taken buffer is deleted, its region kept (an output's now)."""
    for b in taken:
        if b is not None:
            b.state = DELETED

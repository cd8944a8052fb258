"""The work behind ``spyre-jax coverage`` (:func:`spyre_jax.tools.cli.main_coverage` parses the
command line): run one frontend's coverage, render the result as the table or one JSON object."""

from __future__ import annotations

import json
from collections.abc import Sequence

from .coverage_common import format_table
from .coverage_jax import PATHS as JAX_PATHS
from .coverage_jax import coverage_jax
from .coverage_torch import coverage_torch
from .jax_ops import JAX_OPS
from .jax_ops_31 import ISSUE31_OPS

__all__ = ["report", "jax_entries"]


def report(
    frontend: str,
    *,
    as_json: bool = False,
    notes: bool = False,
    ops: Sequence[str] | None = None,
    samples: int = 3,
    paths: Sequence[str] | None = None,
    limit: int | None = None,
    time_limit_s: float | None = None,
) -> str:
    """Run ``frontend`` (``"torch"`` or ``"jax"``) and return what the command prints.

    ``ops``: OpInfo names (torch) or table entry names (jax); ``samples`` is PyTorch's only;
    ``paths``: ``backend``/``device`` (torch, default both) or ``jit``/``grad``/``vmap`` (jax,
    default all)."""
    if frontend == "torch":
        res = coverage_torch(
            ops=ops,
            limit_samples=samples,
            paths=tuple(paths or ("backend", "device")),
            limit=limit,
            time_limit_s=time_limit_s,
        )
    else:
        res = coverage_jax(
            limit=limit,
            names=ops,
            paths=tuple(paths or JAX_PATHS),
            time_limit_s=time_limit_s,
        )
    return json.dumps(res) if as_json else format_table(res, notes=notes)


def jax_entries(spec: str) -> list[str]:
    """The JAX table's entries named in ``spec``, comma-separated (a name holding a comma,
    ``jnp.einsum(ij,jk)``, is matched whole); ValueError for a piece that names none."""
    names = [c.name for c in (*JAX_OPS, *ISSUE31_OPS)]
    padded = f",{spec},"
    chosen = [n for n in names if f",{n}," in padded]
    covered = ",".join(chosen)
    left = [p for p in spec.split(",") if p and p not in covered.split(",")]
    if left:
        raise ValueError(f"no JAX table entry named {left[0]!r}")
    return chosen

"""The work behind ``spyre-jax coverage`` (:func:`spyre_jax.tools.cli.main_coverage` parses the
command line): run one frontend's coverage, render the result as the table or one JSON object."""

from __future__ import annotations

import json
from collections.abc import Sequence

from .coverage_common import format_table
from .coverage_jax import coverage_jax
from .coverage_torch import coverage_torch

__all__ = ["report"]


def report(
    frontend: str,
    *,
    as_json: bool = False,
    notes: bool = False,
    ops: Sequence[str] | None = None,
    samples: int = 3,
    paths: Sequence[str] = ("backend", "device"),
    limit: int | None = None,
    time_limit_s: float | None = None,
) -> str:
    """Run ``frontend`` (``"torch"`` or ``"jax"``; ``ops``, ``samples`` and ``paths`` are
    PyTorch's only) and return what the command prints."""
    if frontend == "torch":
        res = coverage_torch(
            ops=ops,
            limit_samples=samples,
            paths=tuple(paths),
            limit=limit,
            time_limit_s=time_limit_s,
        )
    else:
        res = coverage_jax(limit=limit, time_limit_s=time_limit_s)
    return json.dumps(res) if as_json else format_table(res, notes=notes)

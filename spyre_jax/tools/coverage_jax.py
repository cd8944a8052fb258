"""``spyre-jax coverage jax``: the JAX op table through ``spyre_jax.jit``, beside ``jax.jit``.

:func:`coverage_jax` runs the table of :mod:`spyre_jax.tools.jax_ops` (:data:`JAX_OPS`, about 250
entries: ``jax.numpy`` unary math, binary arithmetic and comparisons, reductions over axes with
``keepdims``, cumulative ops, shape and indexing ops, linear algebra, ``jax.nn`` and ``jax.lax``
ops, control flow; then :data:`~spyre_jax.tools.jax_ops_31.ISSUE31_OPS`, the rows issue 31 added,
counted apart in the result's ``groups``), each with 2-3 samples at odd shapes in float32 and
float16 (ints and bools where the op needs them), through ``spyre_jax.jit`` and compares with
``jax.jit`` on the CPU. Outcomes are classified as :mod:`spyre_jax.tools.coverage_common` says.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

import spyre_jax

from .coverage_common import TOLERANCE, Book, classify, close_np, time_guard
from .jax_ops import JAX_OPS, SHAPES, make_samples
from .jax_ops_31 import ISSUE31_OPS

__all__ = ["coverage_jax"]


def _jax_close(got: Any, want: Any) -> str | None:
    gl, gs = jax.tree_util.tree_flatten(got)
    wl, ws = jax.tree_util.tree_flatten(want)
    if len(gl) != len(wl):
        return f"{len(gl)} outputs, expected {len(wl)}"
    if gs != ws:
        return f"output structure {gs} != {ws}"
    for i, (g, w) in enumerate(zip(gl, wl, strict=True)):
        why = close_np(np.asarray(g), np.asarray(w))
        if why is not None:
            return f"output {i}: {why}"
    return None


def coverage_jax(
    limit: int | None = None,
    *,
    names: Sequence[str] | None = None,
    seed: int = 0,
    sample_timeout_s: float | None = 120.0,
    time_limit_s: float | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The JAX table (:data:`~spyre_jax.tools.jax_ops.JAX_OPS`) through ``spyre_jax.jit`` vs
    ``jax.jit`` on the CPU.

    ``limit``: the first ``limit`` entries only; ``names``: these entries only. One path,
    ``"jit"``. The result has the shape of ``coverage_torch``'s (``"frontend": "jax"``).
    """
    t0 = time.perf_counter()
    cases = list(JAX_OPS) + list(ISSUE31_OPS)
    if names is not None:
        want = set(names)
        cases = [c for c in cases if c.name in want]
    if limit is not None:
        cases = cases[:limit]
    book = Book(["jit"])
    truncated = False
    config = {
        "cases": len(cases),
        "shapes": [list(s) for s in SHAPES],
        "tolerance": TOLERANCE,
        "sample_timeout_s": sample_timeout_s,
        "jax": jax.__version__,
    }

    def snapshot() -> dict[str, Any]:
        return book.result(
            "jax",
            paths={"jit": {"status": "ok", "available": True, "reason": ""}},
            elapsed_s=round(time.perf_counter() - t0, 1),
            truncated=truncated,
            config=config,
            # the table issue 31 started from, and the rows it added, counted apart
            groups={
                "table": book.totals({c.name for c in JAX_OPS}),
                "issue 31 rows": book.totals({c.name for c in ISSUE31_OPS}),
            },
        )

    cpu = jax.devices("cpu")[0]
    for i, case in enumerate(cases):
        if time_limit_s is not None and time.perf_counter() - t0 > time_limit_s:
            truncated = True
            break
        book.op(case.name)
        for dt in case.dtypes:
            rng = np.random.default_rng([seed, i, case.dtypes.index(dt)])
            try:
                samples = make_samples(case, rng, dt)
            except Exception as e:
                book.add(case.name, "jit", "skipped", note=f"samples failed: {e!r}"[:160])
                continue
            for fn, args in samples:
                try:
                    with time_guard(sample_timeout_s), jax.default_device(cpu):
                        want = jax.device_get(jax.jit(fn)(*args))
                except Exception as e:
                    book.add(
                        case.name, "jit", "skipped", note=f"jax.jit reference failed ({e!r})"[:160]
                    )
                    continue
                try:
                    with time_guard(sample_timeout_s), warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        out = spyre_jax.jit(fn)(*args)
                        got = jax.tree_util.tree_map(np.asarray, out)
                    why = _jax_close(got, want)
                except Exception as e:
                    status, key, note = classify(e)
                    book.add(case.name, "jit", status, key, note)
                    continue
                if why is None:
                    book.add(case.name, "jit", "passed")
                else:
                    book.add(case.name, "jit", "wrong", note=why)
        if progress is not None:
            progress(snapshot())
    return snapshot()

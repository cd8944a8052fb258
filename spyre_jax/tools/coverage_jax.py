"""``spyre-jax coverage jax``: the JAX op table through ``spyre_jax.jit``, beside ``jax.jit``.

:func:`coverage_jax` runs the table of :mod:`spyre_jax.tools.jax_ops` (:data:`JAX_OPS`, about 250
entries: ``jax.numpy`` unary math, binary arithmetic and comparisons, reductions over axes with
``keepdims``, cumulative ops, shape and indexing ops, linear algebra, ``jax.nn`` and ``jax.lax``
ops, control flow; then :data:`~spyre_jax.tools.jax_ops_31.ISSUE31_OPS`, the rows issue 31 added,
counted apart in the result's ``groups``), each with 2-3 samples at odd shapes in float32 and
float16 (ints and bools where the op needs them), through ``spyre_jax.jit`` and compares with
``jax.jit`` on the CPU (path ``jit``); then each sample's gradient (``grad``) and the sample
batched (``vmap``) through ``spyre_jax.jit`` and ``jax.jit``, as
:mod:`spyre_jax.tools.coverage_transforms` builds them. Outcomes are classified as
:mod:`spyre_jax.tools.coverage_common` says. An entry's generator is seeded with its index in
the whole table (``names=`` subsets draw the same samples as the full run).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

import spyre_jax

from .coverage_common import STATUSES, TOLERANCE, Book, classify, close_np, time_guard
from .coverage_transforms import BATCH, GRAD_CHAIN, Case, batched_samples, grad_case, vmap_case
from .jax_ops import JAX_OPS, SHAPES, JaxOp, make_samples
from .jax_ops_31 import ISSUE31_OPS

__all__ = ["coverage_jax", "PATHS", "transform_summary"]


#: the paths of the run: the sample itself, its gradient, and the sample batched
PATHS = ("jit", "grad", "vmap")


def _jax_close(got: Any, want: Any, chain: Mapping[str, int] | None = None) -> str | None:
    gl, gs = jax.tree_util.tree_flatten(got)
    wl, ws = jax.tree_util.tree_flatten(want)
    if len(gl) != len(wl):
        return f"{len(gl)} outputs, expected {len(wl)}"
    if gs != ws:
        return f"output structure {gs} != {ws}"
    for i, (g, w) in enumerate(zip(gl, wl, strict=True)):
        w = np.asarray(w)
        why = close_np(np.asarray(g), w, chain=(chain or {}).get(w.dtype.name, 1))
        if why is not None:
            return f"output {i}: {why}"
    return None


def _on_cpu(thunk: Callable[[], Any], timeout_s: float | None) -> Any:
    with time_guard(timeout_s), jax.default_device(jax.devices("cpu")[0]):
        return jax.device_get(thunk())


def _check(book: Book, name: str, path: str, case: Case, timeout_s: float | None) -> bool:
    """Run one sample of ``path`` on the CPU and on the card, and book the outcome. True when
    it passed by the case's alternate reference (not its first)."""
    if case.skip or case.card is None or case.reference is None:
        book.add(name, path, "skipped", note=case.skip)
        return False
    try:
        want = _on_cpu(case.reference, timeout_s)
    except Exception as e:
        book.add(name, path, "skipped", note=f"{path} reference failed ({e!r})"[:160])
        return False
    try:
        with time_guard(timeout_s), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = jax.tree_util.tree_map(np.asarray, case.card())
        why = _jax_close(got, want, case.chain)
        alt = why is not None and case.alternate is not None
        if alt:
            wide = _on_cpu(case.alternate, timeout_s)  # type: ignore[arg-type]
            narrow = jax.tree_util.tree_map(lambda a, w: np.asarray(a, w.dtype), wide, want)
            if _jax_close(got, narrow, case.chain) is None:
                why = None
    except Exception as e:
        status, key, note = classify(e)
        book.add(name, path, status, key, note)
        return False
    book.add(name, path, "passed" if why is None else "wrong", note=why or "")
    return alt and why is None


def _jit_case(fn: Callable, args: tuple) -> Case:
    return Case(card=lambda: spyre_jax.jit(fn)(*args), reference=lambda: jax.jit(fn)(*args))


def _run_op(
    book: Book, case: JaxOp, index: int, paths: Sequence[str], seed: int, timeout_s: float | None
) -> int:
    """Every sample of one table entry, in each of its dtypes, through ``paths``; how many
    ``grad`` samples passed by the float32 reference."""
    wide = 0
    book.op(case.name)
    for di, dt in enumerate(case.dtypes):
        try:
            samples = make_samples(case, np.random.default_rng([seed, index, di]), dt)
            batched = batched_samples(case, seed, index, dt) if "vmap" in paths else []
        except Exception as e:
            for p in paths:
                book.add(case.name, p, "skipped", note=f"samples failed: {e!r}"[:160])
            continue
        for j, (fn, args) in enumerate(samples):
            if "jit" in paths:
                _check(book, case.name, "jit", _jit_case(fn, args), timeout_s)
            if "grad" in paths:
                rng = np.random.default_rng([seed, index, di, j, 2000])
                wide += _check(book, case.name, "grad", grad_case(fn, args, rng), timeout_s)
            if "vmap" in paths:
                _check(book, case.name, "vmap", vmap_case(*batched[j]), timeout_s)
    return wide


def transform_summary(book: Book) -> dict[str, Any]:
    """Over the ops passing every forward (``jit``) sample: how many pass every sample of
    ``grad`` and of ``vmap`` that was tried (an op whose samples a path skipped entirely, an op
    JAX cannot differentiate, counts as passing it: ``*_untried``), how many pass both, and that
    as a fraction of the forward's."""
    forward = [
        r
        for r in book.ops.values()
        if r["jit"]["passed"] > 0
        and r["jit"]["passed"] == sum(r["jit"][s] for s in STATUSES if s != "skipped")
    ]
    out: dict[str, Any] = {"forward_ops_passed": len(forward)}
    ok_all = [True] * len(forward)
    for p in ("grad", "vmap"):
        if p not in book.paths:
            continue
        tried = [sum(r[p][s] for s in STATUSES if s != "skipped") for r in forward]
        ok = [t == 0 or r[p]["passed"] == t for r, t in zip(forward, tried, strict=True)]
        out[f"{p}_tried"] = sum(t > 0 for t in tried)
        out[f"{p}_untried"] = sum(t == 0 for t in tried)
        out[f"{p}_passed"] = sum(o and t > 0 for o, t in zip(ok, tried, strict=True))
        ok_all = [a and b for a, b in zip(ok_all, ok, strict=True)]
    out["all_passed"] = sum(ok_all)
    out["fraction"] = round(sum(ok_all) / len(forward), 4) if forward else None
    return out


def coverage_jax(
    limit: int | None = None,
    *,
    names: Sequence[str] | None = None,
    paths: Sequence[str] = PATHS,
    seed: int = 0,
    sample_timeout_s: float | None = 120.0,
    time_limit_s: float | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The JAX table (:data:`~spyre_jax.tools.jax_ops.JAX_OPS`) through ``spyre_jax.jit`` vs
    ``jax.jit`` on the CPU.

    ``limit``: the first ``limit`` entries only; ``names``: these entries only. ``paths``: some
    of :data:`PATHS` (default all): ``"jit"`` (the sample), ``"grad"`` and ``"vmap"``
    (:mod:`spyre_jax.tools.coverage_transforms`). The result has the shape of
    ``coverage_torch``'s (``"frontend": "jax"``), with ``"transforms"``
    (:func:`transform_summary`) when ``"jit"`` ran.
    """
    unknown = set(paths) - set(PATHS)
    if unknown or not paths:
        raise ValueError(f"coverage_jax: paths must be some of {PATHS}, not {sorted(unknown)}")
    paths = [p for p in PATHS if p in paths]
    t0 = time.perf_counter()
    cases = list(JAX_OPS) + list(ISSUE31_OPS)
    if names is not None:
        want = set(names)
        cases = [c for c in cases if c.name in want]
    if limit is not None:
        cases = cases[:limit]
    book = Book(paths)
    by_float32: dict[str, int] = {}
    truncated = False
    config = {
        "cases": len(cases),
        "shapes": [list(s) for s in SHAPES],
        "tolerance": TOLERANCE,
        "grad_chain": GRAD_CHAIN,
        "vmap_batch": BATCH,
        "sample_timeout_s": sample_timeout_s,
        "jax": jax.__version__,
    }

    def snapshot() -> dict[str, Any]:
        extra = {"transforms": transform_summary(book)} if "jit" in paths else {}
        if "grad" in paths:  # float16 gradient samples that matched the float32 one only
            extra["grad_by_float32_reference"] = dict(by_float32)
        return book.result(
            "jax",
            paths={p: {"status": "ok", "available": True, "reason": ""} for p in paths},
            elapsed_s=round(time.perf_counter() - t0, 1),
            truncated=truncated,
            config=config,
            # the table issue 31 started from, and the rows it added, counted apart
            groups={
                "table": book.totals({c.name for c in JAX_OPS}),
                "issue 31 rows": book.totals({c.name for c in ISSUE31_OPS}),
            },
            **extra,
        )

    index = {c.name: i for i, c in enumerate(list(JAX_OPS) + list(ISSUE31_OPS))}
    for case in cases:
        if time_limit_s is not None and time.perf_counter() - t0 > time_limit_s:
            truncated = True
            break
        wide = _run_op(book, case, index[case.name], paths, seed, sample_timeout_s)
        if wide:
            by_float32[case.name] = wide
        if progress is not None:
            progress(snapshot())
    return snapshot()

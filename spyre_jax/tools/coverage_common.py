"""``spyre-jax coverage``: how much of PyTorch and JAX runs on the simulated card, and right.

The frontends: :mod:`spyre_jax.tools.coverage_torch` (PyTorch's OpInfo samples through the
compile backend and the ``spyre`` device) and :mod:`spyre_jax.tools.coverage_jax` (the table of
:mod:`spyre_jax.tools.jax_ops` through ``spyre_jax.jit``). This module holds what they share:
how a sample's outcome is classified and booked, the comparison with the reference, the time
guard, the worker processes that isolate crashes, and the text table.

Every sample is classified as

- ``passed``: same result within tolerance: the test oracle's
  (:mod:`spyre_jax.tools.oracle`) table at ``k = UNKNOWN_K`` (a sample's reductions are not
  known: it is checked as one reduction of 100 terms, the table times 10), ``rtol = atol /
  scale`` = 1e-4 for float32, 2e-2 for float16, 1.6e-1 for bfloat16 (``scale`` = the largest
  finite magnitude of the expected output, at least 1: the card sums in another order, with
  fp32 accumulation, and rounds where it stores), exact for integers and bools;
- ``wrong``: a result that differs (shape, dtype class, structure or values);
- ``unsupported``: the compiler refused it: ``UnsupportedPrimitiveError``, ``LoweringError``,
  ``TilingError``, or a ``TypeError`` naming a dtype the card does not have (through Dynamo's
  ``BackendCompilerFailed.inner_exception``); Dynamo refused to capture it whole before our
  backend saw it (``torch._dynamo.exc.Unsupported``/``UserError``, data-dependent shapes); or,
  on the device, a CPU fallback;
- ``error``: anything else (the exception type and its first line are kept);
- ``skipped``: not a test of the card: non-deterministic ops (names with ``rand``, ``normal``,
  ``bernoulli``, ``dropout``, ``empty``, ``uniform``, ``multinomial``), in-place ops (names
  ending in ``_`` or samples that mutate their inputs), samples whose outputs are not tensors or
  differ between two eager runs, samples with more than :data:`MAX_ELEMENTS` elements, samples
  whose reference run fails.

Each sample runs under a time guard (``SIGALRM``, on the main thread) and inside a catch-all, so
one op cannot abort the run. Results are plain dicts (``json.dumps`` works); :func:`format_table`
prints them; ``spyre_jax.tools.cli.main_coverage`` is the ``spyre-jax coverage`` command line.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from lowering.errors import LoweringError, TilingError, UnsupportedPrimitiveError

from .oracle import TOLERANCES, UNKNOWN_K, compare
from .oracle import dtype_name as _dtype_name

__all__ = [
    "STATUSES",
    "MAX_ELEMENTS",
    "TOLERANCE",
    "SampleTimeout",
    "time_guard",
    "classify",
    "first_line",
    "Book",
    "PipeBook",
    "close_np",
    "run_isolated",
    "format_table",
]

#: how a sample can end (the keys of every per-op, per-path count)
STATUSES = ("passed", "wrong", "unsupported", "error", "skipped")

#: samples with more tensor elements than this (all inputs together) are skipped
MAX_ELEMENTS = 100_000

#: rtol (and atol relative to the output's magnitude) by the expected output's dtype name: the
#: oracle's table (:data:`spyre_jax.tools.oracle.TOLERANCES`) at ``k = UNKNOWN_K``
TOLERANCE = {name: TOLERANCES[name] * UNKNOWN_K**0.5 for name in TOLERANCES}

_NOTES_PER_OP = 3  # distinct non-pass reasons kept per op and path


# ---------------------------------------------------------------------------------------------
# classification and the time guard


class SampleTimeout(Exception):
    """A sample ran past its time guard."""


@contextlib.contextmanager
def time_guard(seconds: float | None) -> Iterator[None]:
    """Raise :class:`SampleTimeout` in the body after ``seconds`` (main thread only; else none)."""
    usable = (
        seconds is not None
        and seconds > 0
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
    )
    if not usable:
        yield
        return

    def fire(signum: int, frame: Any) -> None:
        raise SampleTimeout(f"sample ran past {seconds:g} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, float(seconds))  # type: ignore[arg-type]
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and the exceptions it wraps (Dynamo's ``inner_exception``, causes, contexts)."""
    out: list[BaseException] = []
    todo: list[BaseException | None] = [e]
    while todo and len(out) < 16:
        x = todo.pop(0)
        if x is None or any(x is y for y in out):
            continue
        out.append(x)
        todo += [getattr(x, "inner_exception", None), x.__cause__, x.__context__]
    return out


def first_line(e: BaseException, n: int = 160) -> str:
    """The first line of ``str(e)``, at most ``n`` characters."""
    s = str(e).strip()
    return (s.splitlines()[0] if s else "")[:n]


def _is_dtype_type_error(e: BaseException) -> bool:
    s = str(e)
    return isinstance(e, TypeError) and "spyre" in s and "dtype" in s and "support" in s


#: errors of torch's symbolic shapes when an op's output shape depends on its data
_DATA_DEP = frozenset({"GuardOnDataDependentSymNode", "DataDependentOutputException"})


def classify(e: BaseException) -> tuple[str, str, str]:
    """``(status, key, note)`` of an exception: ``unsupported`` for the compiler's refusals
    (``key`` names the primitive, dtype or error), else ``error`` (``key`` is the type)."""
    chain = _chain(e)
    for x in chain:
        if isinstance(x, UnsupportedPrimitiveError):
            return "unsupported", str(x.primitive), f"no lowering rule for {x.primitive}"
    for x in chain:
        if _is_dtype_type_error(x):
            m = re.search(r"dtype (?:torch\.)?([A-Za-z0-9_]+)", str(x))
            key = f"dtype {m.group(1)}" if m else "dtype"
            return "unsupported", key, first_line(x)
        if type(x).__name__ == "UnsupportedLayoutError":  # torch_bridge.errors': no torch here
            return "unsupported", "layout", first_line(x)
        if isinstance(x, TilingError):
            return "unsupported", "TilingError", first_line(x)
        if isinstance(x, LoweringError):
            line = first_line(x, 80).removeprefix("spyre: ")
            return "unsupported", f"LoweringError: {line}", first_line(x)
    dynamo = sys.modules.get("torch._dynamo.exc")
    ours = dynamo is not None and any(isinstance(x, dynamo.BackendCompilerFailed) for x in chain)
    for x in chain:  # Dynamo refused to capture the op whole (data-dependent shapes, ...)
        if ours or dynamo is None:
            break
        if isinstance(x, dynamo.Unsupported | dynamo.UserError) or type(x).__name__ in _DATA_DEP:
            return "unsupported", f"Dynamo: {first_line(x, 60)}", first_line(x)
    for x in chain:
        if isinstance(x, SampleTimeout):
            return "error", "SampleTimeout", first_line(x)
    # the innermost exception says most (Dynamo's wrappers repeat it with a traceback)
    inner = e
    for x in chain:
        if getattr(x, "inner_exception", None) is not None:
            inner = x.inner_exception  # type: ignore[assignment]
    return "error", type(inner).__name__, f"{type(inner).__name__}: {first_line(inner)}"


# ---------------------------------------------------------------------------------------------
# bookkeeping


def _counts() -> dict[str, int]:
    return dict.fromkeys(STATUSES, 0)


class Book:
    """Per-op, per-path counts, notes, and the unsupported/error tallies of one run."""

    def __init__(self, paths: Sequence[str]):
        self.paths = list(paths)
        self.ops: dict[str, dict[str, Any]] = {}
        self.unsupported: dict[str, collections.Counter[str]] = {
            p: collections.Counter() for p in paths
        }
        self.errors: dict[str, collections.Counter[str]] = {p: collections.Counter() for p in paths}

    def op(self, name: str) -> dict[str, Any]:
        if name not in self.ops:
            self.ops[name] = {p: _counts() for p in self.paths} | {
                "notes": {p: [] for p in self.paths}
            }
        return self.ops[name]

    def add(self, name: str, path: str, status: str, key: str = "", note: str = "") -> None:
        rec = self.op(name)
        rec[path][status] += 1
        if status == "unsupported" and key:
            self.unsupported[path][key] += 1
        if status == "error" and key:
            self.errors[path][note or key] += 1
        if status != "passed" and note:
            notes = rec["notes"][path]
            text = f"{status}: {note}"
            if text not in notes and len(notes) < _NOTES_PER_OP:
                notes.append(text)

    def count_unsupported(self, path: str, key: str) -> None:
        """Count ``key`` (an ATen op that fell back, ...) once more among ``path``'s unsupported."""
        self.unsupported[path][key] += 1

    def at(self, name: str, what: str) -> None:
        """Where the run is (a worker process reports it, to name what it crashed on)."""

    def add_all(self, name: str, status: str, note: str) -> None:
        for p in self.paths:
            self.add(name, p, status, note=note)

    def totals(self, names: Any = None) -> dict[str, dict[str, int]]:
        """Per path: the counts of each status, and the ops tried, passing every sample and
        passing some, over the ops ``names`` (None: all of them)."""
        recs = [r for n, r in self.ops.items() if names is None or n in names]
        totals = {}
        for p in self.paths:
            t = _counts()
            ops_tried = ops_passed = ops_some = 0
            for rec in recs:
                c = rec[p]
                for s in STATUSES:
                    t[s] += c[s]
                tried = sum(c[s] for s in STATUSES if s != "skipped")
                if tried:
                    ops_tried += 1
                    ops_passed += c["passed"] == tried
                    ops_some += c["passed"] > 0
            t.update(
                samples_tried=sum(t[s] for s in STATUSES if s != "skipped"),
                samples_passed=t["passed"],
                ops_tried=ops_tried,
                ops_passed=ops_passed,
                ops_partly_passed=ops_some,
            )
            totals[p] = t
        return totals

    def result(self, frontend: str, **extra: Any) -> dict[str, Any]:
        totals = self.totals()
        return {
            "frontend": frontend,
            **extra,
            "totals": totals,
            "unsupported": {p: dict(self.unsupported[p].most_common()) for p in self.paths},
            "errors": {p: dict(self.errors[p].most_common(30)) for p in self.paths},
            "ops": self.ops,
        }


# ---------------------------------------------------------------------------------------------
# comparing with the reference


def close_np(
    got: np.ndarray, want: np.ndarray, dtype_name: str | None = None, *, chain: int = 1
) -> str | None:
    """None when ``got`` matches ``want``, else why not: the oracle's
    :func:`~spyre_jax.tools.oracle.compare` at ``k = UNKNOWN_K`` and ``chain``, by the dtype
    ``dtype_name`` (default ``want``'s; a float dtype the table lacks is met at float32's), a
    dtype of the same class passing (float32 for an expected float16 is not wrong), exact for
    integers and bools, complex values part by part."""
    name = _dtype_name(dtype_name or want.dtype)
    if name not in TOLERANCES and "float" in name:
        name = "float32"
    return compare(got, want, k=UNKNOWN_K, chain=chain, dtype=name, check_dtype=False)


# ---------------------------------------------------------------------------------------------
# worker processes: a crash or a hang costs one sample, not the run


class PipeBook(Book):
    """A worker process's book: every booking is sent to the parent, which keeps the real one."""

    def __init__(self, paths: Sequence[str], conn: Any):
        super().__init__(paths)
        self.conn = conn

    def op(self, name: str) -> dict[str, Any]:
        self.conn.send(("op", name))
        return super().op(name)

    def add(self, name: str, path: str, status: str, key: str = "", note: str = "") -> None:
        self.conn.send(("add", name, path, status, key, note))

    def count_unsupported(self, path: str, key: str) -> None:
        self.conn.send(("unsup", path, key))

    def at(self, name: str, what: str) -> None:
        self.conn.send(("at", name, what))
        if os.environ.get("SPYRE_COVERAGE_TEST_CRASH") == f"{name}:{what}":  # tests: a segfault
            os.kill(os.getpid(), signal.SIGSEGV)


def run_isolated(
    book: Book,
    worker: str,
    names: list[str],
    run_paths: list[str],
    job: list[Any],
    timeout: float | None,
    deadline: float | None,
    on_done: Callable[[], None],
) -> bool:
    """Run ``names`` in worker processes; a worker that crashes (a segfault in native code) or
    hangs past the time guard is killed, the sample it was on is booked as an ``error`` and a
    fresh worker goes on with the next op. False when the deadline stopped the run.

    ``worker``: the module whose ``worker_main(job_json)`` a worker runs; it gets the JSON of
    ``[fd, names still to run, *job]`` and books through a :class:`PipeBook` on the pipe ``fd``
    (``multiprocessing.connection.Connection(fd, readable=False)``), sending ``("done", name)``
    after each op and ``("end",)`` at the end.
    """
    todo = list(names)
    silent = 0  # workers in a row that died before saying anything
    hard = (timeout or 600.0) + 120.0  # the worker's own guard fires first; this is for hangs
    startup = 300.0
    while todo:
        rfd, wfd = os.pipe()
        spec = json.dumps([wfd, todo, *job])
        proc = subprocess.Popen(
            [sys.executable, "-c", f"import {worker} as w; w.worker_main({spec!r})"],
            pass_fds=(wfd,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(wfd)
        parent = Connection(rfd, writable=False)
        current: tuple[str, str] | None = None
        finished = heard = False
        wait = startup
        try:
            while True:
                if not parent.poll(wait):
                    why = f"no progress for {wait:.0f} s (killed)"
                    break
                try:
                    msg = parent.recv()
                except EOFError:
                    try:
                        code = proc.wait(10)
                    except subprocess.TimeoutExpired:
                        code = None
                    sig = -code if code is not None and code < 0 else None
                    why = (
                        f"the process died of {signal.Signals(sig).name}"
                        if sig
                        else f"the process exited ({code})"
                    )
                    break
                wait, heard = hard, True
                kind = msg[0]
                if kind == "op":
                    book.op(msg[1])
                elif kind == "add":
                    book.add(*msg[1:])
                elif kind == "unsup":
                    book.count_unsupported(*msg[1:])
                elif kind == "at":
                    current = (msg[1], msg[2])
                elif kind == "done":
                    todo.remove(msg[1])
                    current = None
                    on_done()
                    if deadline is not None and time.perf_counter() > deadline:
                        return not todo
                elif kind == "end":
                    finished = True
                    break
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
            parent.close()
        if finished:
            break
        silent = 0 if heard else silent + 1
        if silent >= 2:
            raise RuntimeError(
                f"{worker.rsplit('.', 1)[-1]}: the worker process does not start: {why}"
            )
        if current is None:  # died between ops (or while starting): skip the next op
            if not todo:
                break
            current = (todo[0], "startup")
        name, what = current
        book.op(name)
        if what in run_paths:
            book.add(name, what, "error", "WorkerCrash", f"WorkerCrash: {why} ({what})")
        else:
            book.add_all(name, "skipped", f"{what} crashed: {why}")
        if name in todo:
            todo.remove(name)
            on_done()
        if deadline is not None and time.perf_counter() > deadline:
            return not todo
    return True


# ---------------------------------------------------------------------------------------------
# printing


def format_table(result: dict[str, Any], *, top: int = 15, notes: bool = False) -> str:
    """A coverage result as a text table: one row per op (counts per path), the totals, and the
    ``top`` most common unsupported ops/primitives per path."""
    paths = list(result["totals"])
    short = {
        "passed": "pass",
        "wrong": "wrong",
        "unsupported": "unsup",
        "error": "err",
        "skipped": "skip",
    }
    width = max([len("op"), *(len(n) for n in result["ops"])]) + 2
    width = min(width, 48)
    cell = "".join(f"{short[s]:>6}" for s in STATUSES)
    head = f"{'op':<{width}}" + " | ".join(f"{p + ':':<8}{cell}" for p in paths)
    lines = [head, "-" * len(head)]
    for name, rec in result["ops"].items():
        row = " | ".join(f"{'':<8}" + "".join(f"{rec[p][s]:>6}" for s in STATUSES) for p in paths)
        lines.append(f"{name[: width - 1]:<{width}}{row}")
        if notes:
            for p in paths:
                for n in rec["notes"][p]:
                    lines.append(f"    [{p}] {n}")
    lines.append("")
    for p in paths:
        info = result.get("paths", {}).get(p, {})
        t = result["totals"][p]
        if info and not info.get("available", True):
            lines.append(f"{p}: unavailable ({info.get('reason', '')})")
            continue
        lines.append(
            f"{p}: ops passed {t['ops_passed']}/{t['ops_tried']} "
            f"(some samples passed: {t['ops_partly_passed']}), "
            f"samples passed {t['samples_passed']}/{t['samples_tried']}  ("
            + ", ".join(f"{s} {t[s]}" for s in STATUSES)
            + ")"
        )
    for group, gt in result.get("groups", {}).items():
        for p, t in gt.items():
            lines.append(
                f"  {group} ({p}): ops passed {t['ops_passed']}/{t['ops_tried']}, samples "
                f"passed {t['samples_passed']}/{t['samples_tried']}"
            )
    tr = result.get("transforms")
    if tr and tr.get("fraction") is not None:
        parts = [
            f"{p} {tr[p + '_passed']}/{tr[p + '_tried']} (+{tr[p + '_untried']} untried)"
            for p in ("grad", "vmap")
            if p + "_tried" in tr
        ]
        lines.append(
            f"of the {tr['forward_ops_passed']} ops passing forward: "
            + ", ".join(parts)
            + f"; passing all: {tr['all_passed']} ({100 * tr['fraction']:.1f}%)"
        )
    for p in paths:
        uns = list(result["unsupported"].get(p, {}).items())[:top]
        if uns:
            lines.append(f"most common unsupported ({p}): " + ", ".join(f"{k} {v}" for k, v in uns))
    if result.get("truncated"):
        lines.append("(truncated: the time limit stopped the run)")
    lines.append(f"elapsed {result.get('elapsed_s', 0)} s")
    return "\n".join(lines)

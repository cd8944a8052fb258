"""Deferred kernel runs: the eager device's lazy trace.

An eager op on the ``spyre`` device (``torch_bridge.eager``) does its bookkeeping when it is
called: the race check, the result's place in device memory, the step on the stream's
timeline (its simulated time), the result tensor. Only the card program that computes the
result's values, a JAX program the host runs, waits: the launch records it in its card's
:class:`Trace` and gets :class:`Deferred` results, which the next launches take as arguments
like any card array. The trace runs, its programs one after another, when a value is needed
(the host reads a result, a program outside the trace takes one, ``synchronize()``, a host
write to bytes a recorded run reads) or when it holds :data:`MAX_RUNS` runs.

Why: calling an XLA program costs the host a few microseconds when the calls come back to
back, twice that when each comes between the Python of an eager op, whose code and data it
pushes out of the CPU's caches (and the op's Python runs slower after it). Run together, the
calls of a step of a serving loop, or of a run of small ops, stay in the caches (``spyre-jax
bench eager`` measures the small op's host cost; docs/benchmarks.md has the figures).

Values are the same: each run is the kernel's own program with the same arguments; only when
the host computes them changes. A program runs on its own the first time it is launched
(:meth:`Trace.call`): it compiles, and an error in it is raised by the launch that made it. A
later error (none is known) is raised where the trace runs, and again by each result of the
run that failed and of the runs after it when read.

This module imports no JAX (the card model's runtime must load without it).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["Batch", "Deferred", "DeferredRunError", "Trace", "MAX_RUNS", "card_array"]

#: a trace runs when it holds this many kernel runs (a decode step of the 2-layer Llama of
#: ``bench serve`` launches about 110)
MAX_RUNS = 256


class DeferredRunError(RuntimeError):
    """A deferred kernel run failed (or one before it did) where its trace ran; its results
    raise this when read."""


class Batch:
    """The runs a trace holds between two of its runs: what a launch that reads host memory
    leaves with that memory's owner, whose writer waits for it (:meth:`block_until_ready`)."""

    __slots__ = ("trace", "values")

    def __init__(self, trace: Trace):
        self.trace = trace
        #: the arrays the batch's runs computed (None before they ran)
        self.values: list[Any] | None = None

    def is_ready(self) -> bool:
        return self.values is not None and all(v.is_ready() for v in self.values)

    def block_until_ready(self) -> Batch:
        if self.values is None:
            self.trace.flush()
        for v in self.values or ():
            v.block_until_ready()
        return self


class Deferred:
    """One result of a kernel run recorded in a :class:`Trace`: a card array once the trace
    has run. It answers what the card model asks of a card array: :meth:`is_ready`,
    :meth:`block_until_ready`, ``numpy.asarray``; :meth:`value` is the array itself."""

    __slots__ = ("_trace", "_value", "_error", "__weakref__")

    def __init__(self, trace: Trace):
        self._trace = trace
        self._value: Any = None
        self._error: BaseException | None = None

    def value(self) -> Any:
        """The card array (its trace runs first if it has not)."""
        v = self._value
        if v is None:
            if self._error is None:
                self._trace.flush()
            v = self._value
            if v is None:
                raise DeferredRunError(
                    "spyre: the deferred kernel run that computes this result failed, or one "
                    f"before it did ({type(self._error).__name__}: {self._error})"
                ) from self._error
        return v

    def is_ready(self) -> bool:
        v = self._value
        return v is not None and v.is_ready()

    def block_until_ready(self) -> Deferred:
        self.value().block_until_ready()
        return self

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = np.asarray(self.value())
        return a if dtype is None else a.astype(dtype, copy=False)

    def __repr__(self) -> str:
        state = "run" if self._value is not None else "failed" if self._error else "recorded"
        return f"<spyre Deferred result ({state})>"


def card_array(x: Any) -> Any:
    """``x`` with a :class:`Deferred` (or one inside a tuple argument) replaced by its value."""
    t = type(x)
    if t is Deferred:
        return x._value if x._value is not None else x.value()
    if t is tuple:
        return tuple(card_array(v) for v in x)
    return x


class Trace:
    """One card's kernel runs recorded and not yet run, in launch order: ``(program,
    arguments, results)``, an argument a card or host array, a :class:`Deferred` result of an
    earlier run, or a tuple of them (a view's source and sizes)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        #: the runs recorded since the trace last ran
        self.batch = Batch(self)
        self._runs: list[tuple[Callable[..., Any], Sequence[Any], list[Deferred]]] = []
        #: programs that have run on their own (their launches may be deferred)
        self._ran: weakref.WeakSet = weakref.WeakSet()
        #: runs recorded, and times the trace ran (``device_model.runtime`` statistics)
        self.counts = {"runs": 0, "traces": 0}

    def __len__(self) -> int:
        return len(self._runs)

    def call(self, program: Callable[..., Any], args: Sequence[Any], nout: int) -> list[Any]:
        """``program(*args)``'s first ``nout`` results (a jitted program returning a list of
        them, or one array): deferred once the program has run on its own, else run now."""
        if program in self._ran:
            return self.record(program, args, nout)
        res = _results(program(*[card_array(a) for a in args]), nout)
        self._ran.add(program)
        return res

    def record(self, program: Callable[..., Any], args: Sequence[Any], nout: int) -> list[Any]:
        """:meth:`call` of a program known to have run on its own here: recorded, its
        ``nout`` results :class:`Deferred` (the trace runs when it holds :data:`MAX_RUNS`)."""
        outs = [Deferred(self)] if nout == 1 else [Deferred(self) for _ in range(nout)]
        with self.lock:
            self._runs.append((program, args, outs))
            self.counts["runs"] += 1
            if len(self._runs) >= MAX_RUNS:
                self.flush()
        return outs

    def flush(self) -> None:
        """Run every recorded run, in order; each result gets its value (or the error). Each
        run's arguments and results are let go of as it runs, so a result nobody holds any
        more is dropped when the next run starts: the trace never holds more than the eager
        ops would have."""
        with self.lock:
            runs = self._runs
            if not runs:
                return
            self._runs = []
            batch, self.batch = self.batch, Batch(self)
            self.counts["traces"] += 1
            running: list[Any] = []
            for k in range(len(runs)):
                program, args, outs = runs[k]
                runs[k] = None  # type: ignore[call-overload]
                try:
                    res = program(*[card_array(a) if type(a) in _HELD else a for a in args])
                    if type(res) is not list and type(res) is not tuple:
                        res = [res]
                except BaseException as e:
                    for later in [outs] + [r[2] for r in runs[k + 1 :]]:
                        for d in later:
                            d._error = e
                    batch.values = running
                    raise
                for m, d in enumerate(outs):
                    v = d._value = res[m]
                    if not v.is_ready():  # still running (JAX's asynchronous dispatch, if on)
                        running.append(v)
            batch.values = running


#: argument types that hold a card array (:func:`card_array`)
_HELD = frozenset({Deferred, tuple})


def _results(res: Any, nout: int) -> list[Any]:
    """A program's first ``nout`` results (a program of one result may return it bare)."""
    return list(res[:nout]) if type(res) in (list, tuple) else [res]

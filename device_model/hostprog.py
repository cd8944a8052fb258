"""The host program: a compiled function's kernels and the loops and branches between them.

A straight-line function is one kernel and one launch. A function with control flow is a
:class:`Program`: steps over values named by id, each a :class:`Call` (one launch of a
kernel), a :class:`ScanLoop` (a body program run a static number of times), a
:class:`WhileLoop` (a cond program and a body program, the predicate read back by the host
each iteration) or a :class:`Branch` (the index read back, the taken branch run). Bodies are
programs themselves, compiled once; every iteration launches the same loaded kernels.

Values live in device memory between steps: a loop's carry stays there from one iteration to
the next (a carried value the body does not change is the same buffer), the slices of a scan's
stacked inputs are views of the stacked buffer (no copy), and each iteration's stacked outputs
are written into the stacked buffer, allocated once before the loop.

The host's part is on the timeline: a predicate or an index read back is a ``copy_out`` step,
then a ``host_sync`` step of ``CardSpec.host_round_trip_s + CardSpec.host_launch_s`` (the host
learns the value, then launches the next kernel, which it could not enqueue ahead). A static
loop's launches are enqueued ahead; where a body kernel is shorter than ``host_launch_s``, the
stream waits for the host between iterations (a ``host_sync`` step of the difference).

``SPYRE_MAX_ITERATIONS`` (default 1,000,000) bounds a while loop: a runaway one stops with
:class:`LoopLimitError` naming the loop and the user's line.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import runtime as rtm
from .card import CardSpec
from .deferred import card_array
from .kernel import Kernel, format_kernel
from .layout import TensorLayout, layout_for, np_dtype
from .payload import to_device_layout
from .timing import kernel_cost

__all__ = [
    "Call",
    "ScanLoop",
    "WhileLoop",
    "Branch",
    "Program",
    "LoopLimitError",
    "max_iterations",
    "format_program",
    "program_cost",
    "ProgramRunner",
]


#: a loop's first iterations are recorded in a profile's trace step by step; the rest as one
#: ``loop_summary`` span (their steps still run and take their time on the timeline)
TRACE_ITERATIONS = 32


class LoopLimitError(RuntimeError):
    """A while loop ran more iterations than ``SPYRE_MAX_ITERATIONS`` allows."""


def max_iterations() -> int:
    """``SPYRE_MAX_ITERATIONS`` (default 1,000,000; ValueError unless a positive integer)."""
    raw = os.environ.get("SPYRE_MAX_ITERATIONS", "").strip()
    if not raw:
        return 1_000_000
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n <= 0:
        raise ValueError(f"spyre: SPYRE_MAX_ITERATIONS={raw!r} is not a positive integer")
    return n


@dataclass(frozen=True, slots=True, eq=False)
class Call:
    """One launch of ``kernel``: its arguments the values ``inputs``, its results ``outputs``."""

    kernel: Kernel
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


@dataclass(frozen=True, slots=True, eq=False)
class ScanLoop:
    """``body`` (consts, carry, one slice of each stacked input) -> (carry, one slice of each
    stacked output), ``length`` times (from the end when ``reverse``). ``outputs``: the final
    carry, then the stacked outputs."""

    body: Program
    length: int
    reverse: bool
    consts: tuple[int, ...]
    carry: tuple[int, ...]
    xs: tuple[int, ...]
    outputs: tuple[int, ...]
    source: str = ""


@dataclass(frozen=True, slots=True, eq=False)
class WhileLoop:
    """While ``cond`` (cond consts, carry) gives True, ``body`` (body consts, carry) -> carry."""

    cond: Program
    body: Program
    cond_consts: tuple[int, ...]
    body_consts: tuple[int, ...]
    carry: tuple[int, ...]
    outputs: tuple[int, ...]
    source: str = ""


@dataclass(frozen=True, slots=True, eq=False)
class Branch:
    """The program ``branches[index]`` (the index clamped to the branches) on ``operands``."""

    index: int
    operands: tuple[int, ...]
    branches: tuple[Program, ...]
    outputs: tuple[int, ...]
    source: str = ""


Step = Call | ScanLoop | WhileLoop | Branch


@dataclass(frozen=True, slots=True, eq=False)
class Program:
    """Steps over values by id: ``inputs`` (the arguments), ``consts`` (arrays loaded once),
    ``outputs`` (any value, an input included); ``layouts``: every value's stick layout."""

    name: str
    inputs: tuple[int, ...]
    consts: tuple[tuple[int, np.ndarray], ...]
    steps: tuple[Step, ...]
    outputs: tuple[int, ...]
    layouts: dict[int, TensorLayout] = field(hash=False)

    def __str__(self) -> str:
        return format_program(self)

    def kernels(self) -> list[Kernel]:
        """Every kernel it launches, its bodies' included, each once."""
        out: list[Kernel] = []
        for st in self.steps:
            if isinstance(st, Call):
                out.append(st.kernel)
            else:
                for sub in _subprograms(st):
                    out += [k for k in sub.kernels() if all(k is not o for o in out)]
        return out


def _subprograms(st: Step) -> tuple[Program, ...]:
    if isinstance(st, ScanLoop):
        return (st.body,)
    if isinstance(st, WhileLoop):
        return (st.cond, st.body)
    if isinstance(st, Branch):
        return st.branches
    return ()


def _ids(ids: Sequence[int]) -> str:
    return ", ".join(f"%{i}" for i in ids)


def format_program(p: Program, indent: str = "") -> str:
    """The program, readable: each launch's kernel and each loop's or branch's programs."""
    lines = [f"{indent}program {p.name}({_ids(p.inputs)}) {{"]
    for vid, arr in p.consts:
        lines.append(f"{indent}  %{vid} = constant {arr.dtype}{list(arr.shape)}")
    inner = indent + "    "
    for st in p.steps:
        src = f"   # {st.source}" if getattr(st, "source", "") else ""
        if isinstance(st, Call):
            k = st.kernel
            lines.append(f"{indent}  {_ids(st.outputs)} = launch {k.name}({_ids(st.inputs)})")
            lines += [inner + ln for ln in format_kernel(k).splitlines()]
        elif isinstance(st, ScanLoop):
            rev = ", reverse" if st.reverse else ""
            lines.append(
                f"{indent}  {_ids(st.outputs)} = scan[length={st.length}{rev}](consts=("
                f"{_ids(st.consts)}), carry=({_ids(st.carry)}), xs=({_ids(st.xs)})){src}"
            )
            lines.append(format_program(st.body, inner))
        elif isinstance(st, WhileLoop):
            lines.append(
                f"{indent}  {_ids(st.outputs)} = while(cond_consts=({_ids(st.cond_consts)}), "
                f"body_consts=({_ids(st.body_consts)}), carry=({_ids(st.carry)})){src}"
            )
            lines += [format_program(st.cond, inner), format_program(st.body, inner)]
        else:
            lines.append(
                f"{indent}  {_ids(st.outputs)} = branch(%{st.index}; {_ids(st.operands)}){src}"
            )
            lines += [format_program(b, inner) for b in st.branches]
    lines.append(f"{indent}  return {_ids(p.outputs)}")
    lines.append(f"{indent}}}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# figures


def _launch_gap(kernel_s: float, card: CardSpec) -> float:
    """The stream's wait for the host between two enqueued launches of a kernel of
    ``kernel_s`` (the host launches one kernel per ``host_launch_s``)."""
    return max(0.0, card.host_launch_s - kernel_s)


def program_cost(p: Program, card: CardSpec, trips: dict[int, int] | None = None) -> dict:
    """Figures of a program: ``sim_time_us`` (its kernels, the loops' iterations and the
    host's waits), ``kernel_time_us`` (its kernels' time alone, without the host's waits),
    ``kernels`` (launches per run), ``host_round_trips`` and per loop or
    branch a row of ``control``: kind, source, iterations (a while loop's: those of its last
    run in ``trips``, by the step's id, else unknown), per-iteration and total time.
    """
    trips = trips or {}
    total, launches, rts, kern_us = 0.0, 0, 0, 0.0
    flops, dev_bytes, peak = 0, 0, 0
    rows: list[dict[str, Any]] = []
    for st in p.steps:
        if isinstance(st, Call):
            c = kernel_cost(st.kernel, card)
            total += c["sim_time_us"]
            kern_us += c["sim_time_us"]
            launches += 1
            flops += c["flops"]
            dev_bytes += c["device_bytes"]
            peak = max(peak, c["scratchpad_peak_bytes"])
            continue
        row, sub = _control_cost(st, card, trips)
        rows.append(row)
        rows += sub["control"]
        total += row["total_us"]
        launches += row["launches"]
        rts += row["host_round_trips"]
        n = row["iterations"] if isinstance(row["iterations"], int) else 1
        kern_us += sub["kernel_time_us"] * n
        flops += sub["flops"] * n
        dev_bytes += sub["device_bytes"] * n
        peak = max(peak, sub["scratchpad_peak_bytes"])
    return {
        "sim_time_us": total,
        "kernel_time_us": kern_us,
        "kernels": launches,
        "host_round_trips": rts,
        "flops": flops,
        "device_bytes": dev_bytes,
        "scratchpad_peak_bytes": peak,
        "control": rows,
    }


def _control_cost(st: Step, card: CardSpec, trips: dict[int, int]) -> tuple[dict, dict]:
    """A loop's or a branch's row of ``program_cost`` and the figures of one iteration."""
    rt_us = (card.host_round_trip_s + card.host_launch_s) * 1e6
    if isinstance(st, ScanLoop):
        body = program_cost(st.body, card, trips)
        kern = body["sim_time_us"]
        gap = 0.0
        if body["kernels"] == 1 and not body["control"]:
            gap = _launch_gap(kern * 1e-6, card) * 1e6  # (none before the first iteration)
        n = st.length
        row = {"kind": "scan", "iterations": n, "iteration_us": kern + gap}
        row["kernel_us"] = body["kernel_time_us"]
        row["total_us"] = max(0.0, (kern + gap) * n - gap)
        row |= {"launches": body["kernels"] * n, "host_round_trips": body["host_round_trips"] * n}
    elif isinstance(st, WhileLoop):
        cond, body = program_cost(st.cond, card, trips), program_cost(st.body, card, trips)
        it = cond["sim_time_us"] + body["sim_time_us"] + rt_us
        n = trips.get(id(st))
        k = n if n is not None else 1
        row = {"kind": "while", "iterations": n if n is not None else "unknown"}
        row |= {"iteration_us": it, "total_us": it * k + cond["sim_time_us"] + rt_us}
        row |= {
            "launches": (cond["kernels"] + body["kernels"]) * k + cond["kernels"],
            "host_round_trips": k + 1,
        }
        body = _merge_figures(cond, body)
    else:
        costs = [program_cost(b, card, trips) for b in st.branches]
        worst = max(costs, key=lambda c: c["sim_time_us"])
        row = {"kind": "branch", "iterations": 1, "iteration_us": worst["sim_time_us"] + rt_us}
        row |= {"total_us": worst["sim_time_us"] + rt_us, "launches": worst["kernels"]}
        row |= {"host_round_trips": 1, "branches_us": [c["sim_time_us"] for c in costs]}
        body = worst
    row["source"] = st.source
    return row, body


def _merge_figures(a: dict, b: dict) -> dict:
    return {
        "kernel_time_us": a["kernel_time_us"] + b["kernel_time_us"],
        "flops": a["flops"] + b["flops"],
        "device_bytes": a["device_bytes"] + b["device_bytes"],
        "scratchpad_peak_bytes": max(a["scratchpad_peak_bytes"], b["scratchpad_peak_bytes"]),
        "control": a["control"] + b["control"],
    }


# ---------------------------------------------------------------------------------------------
# running


@dataclass
class ProgramRunner:
    """Runs a program on a card: ``launch(kernel, buffers) -> buffers`` (one launch of a loaded
    kernel), ``read_scalar(buffer) -> value`` (a host read, with its ``copy_out``),
    ``host_sync(name, seconds)`` (the stream waits for the host), ``const(vid, array, layout)``
    (a constant's buffer, loaded once), ``view(buffer, layout, payload)`` (a buffer over
    another's bytes), ``allocate(layout)`` and ``store(buffer, payload)`` (the stacked outputs)."""

    card: CardSpec
    launch: Callable[[Kernel, list[Any]], list[Any]]
    read_scalar: Callable[[Any], Any]
    host_sync: Callable[[str, float], None]
    const: Callable[[int, np.ndarray, TensorLayout], Any]
    view: Callable[[Any, TensorLayout, Any], Any]
    allocate: Callable[[TensorLayout], Any]
    store: Callable[[Any, Any], None]
    #: ``trace(on)``: recording of the timeline's steps resumed (True) or paused (False);
    #: returns the current stream's time. ``note(name, start, end)``: a summary span.
    trace: Callable[[bool], float] = lambda on: 0.0
    note: Callable[[str, float, float], None] = lambda name, start, end: None
    #: iterations of each while loop's last run, by the step's id
    trips: dict[int, int] = field(default_factory=dict)
    _gaps: dict[int, float] = field(default_factory=dict)

    def _gap(self, body: Program) -> float:
        """The stream's wait for the host between iterations of a one-kernel body."""
        if not (len(body.steps) == 1 and isinstance(body.steps[0], Call)):
            return 0.0
        k = body.steps[0].kernel
        g = self._gaps.get(id(k))
        if g is None:
            g = self._gaps[id(k)] = _launch_gap(
                kernel_cost(k, self.card)["sim_time_us"] * 1e-6, self.card
            )
        return g

    def _traced(self, n: int, muted_at: list[float]) -> None:
        """Before iteration ``n`` of a loop: past :data:`TRACE_ITERATIONS`, stop recording."""
        if n == TRACE_ITERATIONS:
            muted_at.append(self.trace(False))

    def _summary(self, what: str, n: int, muted_at: list[float]) -> None:
        """After a loop of ``n`` iterations: the unrecorded ones as one span of the trace."""
        if muted_at:
            end = self.trace(True)
            left = n - TRACE_ITERATIONS
            self.note(f"{what}: iterations {TRACE_ITERATIONS}-{n - 1} ({left})", muted_at[0], end)

    def run(self, p: Program, args: Sequence[Any]) -> list[Any]:
        """The program's outputs (buffers) for ``args`` (buffers, one per input)."""
        env: dict[int, Any] = dict(zip(p.inputs, args, strict=True))
        for vid, arr in p.consts:
            env[vid] = self.const(vid, arr, p.layouts[vid])
        for st in p.steps:
            if isinstance(st, Call):
                outs = self.launch(st.kernel, [env[i] for i in st.inputs])
            elif isinstance(st, ScanLoop):
                outs = self._scan(st, env)
            elif isinstance(st, WhileLoop):
                outs = self._while(st, env)
            else:
                outs = self._branch(st, env)
            env.update(zip(st.outputs, outs, strict=True))
        return [env[o] for o in p.outputs]

    def _scan(self, st: ScanLoop, env: dict[int, Any]) -> list[Any]:
        body, nk = st.body, len(st.carry)
        consts = [env[i] for i in st.consts]
        carry = [env[i] for i in st.carry]
        xs = [(env[i], _array(env[i])) for i in st.xs]
        x_lays = [body.layouts[v] for v in body.inputs[len(consts) + nk :]]
        y_lays = [body.layouts[v] for v in body.outputs[nk:]]
        ys = [self.allocate(_stacked(lay, st.length)) for lay in y_lays]
        parts: list[list[Any]] = [[] for _ in ys]
        gap = self._gap(body)
        order = range(st.length - 1, -1, -1) if st.reverse else range(st.length)
        muted: list[float] = []
        try:
            for n, i in enumerate(order):
                self._traced(n, muted)
                xv = [
                    self.view(b, lay, _slice(a, i, lay))
                    for (b, a), lay in zip(xs, x_lays, strict=True)
                ]
                if gap and n:
                    self.host_sync(f"host launches iteration {n} of the scan", gap)
                outs = self.run(body, consts + carry + xv)
                carry = outs[:nk]
                for j, y in enumerate(outs[nk:]):
                    parts[j].append(_array(y))
        finally:
            self._summary(f"scan at {st.source}", st.length, muted)
        for buf, lay, got in zip(ys, y_lays, parts, strict=True):
            self.store(buf, _stack(got[::-1] if st.reverse else got, lay, st.length))
        return carry + ys

    def _while(self, st: WhileLoop, env: dict[int, Any]) -> list[Any]:
        cc = [env[i] for i in st.cond_consts]
        bc = [env[i] for i in st.body_consts]
        carry = [env[i] for i in st.carry]
        limit = max_iterations()
        rt = self.card.host_round_trip_s + self.card.host_launch_s
        n = 0
        muted: list[float] = []
        try:
            while True:
                self._traced(n, muted)
                (pred,) = self.run(st.cond, cc + carry)
                go = bool(self.read_scalar(pred))
                self.host_sync(f"host reads the while loop's predicate ({n})", rt)
                if not go:
                    break
                if n >= limit:
                    raise LoopLimitError(
                        f"spyre: the while loop at {st.source or '<unknown source line>'} ran "
                        f"{n} iterations, the most SPYRE_MAX_ITERATIONS={limit} allows; it "
                        "may never end (raise the limit if it is meant to run longer)"
                    )
                carry = self.run(st.body, bc + carry)
                n += 1
        finally:
            self._summary(f"while loop at {st.source}", n + 1, muted)
        self.trips[id(st)] = n
        return carry

    def _branch(self, st: Branch, env: dict[int, Any]) -> list[Any]:
        i = int(self.read_scalar(env[st.index]))
        self.host_sync(
            "host reads the branch index", self.card.host_round_trip_s + self.card.host_launch_s
        )
        i = min(max(i, 0), len(st.branches) - 1)  # clamped, as JAX does
        return self.run(st.branches[i], [env[o] for o in st.operands])


def _stacked(lay: TensorLayout, n: int) -> TensorLayout:
    return layout_for((n, *lay.shape), lay.dtype, lay.stick_bytes)


def _array(buf: Any) -> Any:
    """A buffer's contents as a card (or host) array in its device layout."""
    p = card_array(buf.payload())
    if isinstance(p, tuple):  # a view of another buffer's bytes: its host bytes
        p = buf.materialize()
    return p


def _slice(stacked: Any, i: int, lay: TensorLayout) -> Any:
    """Slice ``i`` of a stacked array (device layout) in the slice's own device layout."""
    if lay.shape:
        return stacked[i]
    import jax.numpy as jnp  # (the card program's arrays are JAX arrays)

    one = jnp.zeros(lay.device_shape, np_dtype(lay.dtype))
    return one.at[0].set(stacked[i])


def _stack(parts: list[Any], lay: TensorLayout, n: int) -> Any:
    """The stacked outputs' device array from each iteration's slice (device layouts)."""
    import jax.numpy as jnp

    stacked = _stacked(lay, n)
    if not parts:
        return jnp.zeros(stacked.device_shape, np_dtype(lay.dtype))
    if lay.shape:
        return jnp.stack([jnp.asarray(p) for p in parts])
    vals = jnp.stack([jnp.asarray(p)[0] for p in parts])
    return jnp.zeros(stacked.device_shape, vals.dtype).at[:n].set(vals)


# ---------------------------------------------------------------------------------------------
# loaded on a card


def _programs(p: Program) -> list[Program]:
    out = [p]
    for st in p.steps:
        for sub in _subprograms(st):
            out += _programs(sub)
    return out


class LoadedProgram:
    """A program loaded on a card: each kernel an :class:`~device_model.runtime.Executable`
    (its constants copied in once), each constant of the program's in device memory, and
    :meth:`run`, which takes the program's arguments (buffers or host arrays) and launches
    on the current stream."""

    def __init__(self, program: Program, rt: Any = None):
        self.rt = rt = rt or rtm.runtime()
        self.program = program
        #: (what a straight-line function's executable has: one kernel and its recipe)
        self.kernel: Kernel | None = None
        self.recipe = None
        self.card: CardSpec = rt.card
        self._exes: dict[int, Any] = {}
        self._consts: dict[int, Any] = {}
        try:
            for k in program.kernels():
                self._exes[id(k)] = rtm.Executable(k, rt)
            for p in _programs(program):
                for vid, arr in p.consts:
                    lay = p.layouts[vid]
                    self._consts[id(arr)] = rtm.DeviceBuffer.allocate(
                        lay.nbytes, lay, rt=rt, tag="constant", payload=_device(arr, lay)
                    )
        except BaseException:
            self.delete()
            raise
        self.runner = ProgramRunner(
            self.card,
            launch=lambda k, bufs: rtm.launch(self._exes[id(k)], bufs),
            read_scalar=lambda b: rtm.copy_out(b)[()],
            host_sync=self._host_sync,
            const=lambda vid, arr, lay: self._consts[id(arr)],
            view=lambda b, lay, payload: rtm.DeviceBuffer.view(b, lay, payload, shared=False),
            allocate=lambda lay: rtm.DeviceBuffer.allocate(lay.nbytes, lay, rt=rt, tag="stacked"),
            store=lambda b, payload: b.store(payload, shared=False),
            trace=self._trace,
            note=self._note,
        )

    def _note(self, name: str, start: float, end: float) -> None:
        q = self.rt.queues
        if not q.muted:  # (inside an outer loop's unrecorded iterations: nothing to show)
            q.note(rtm.current_stream_id(), "loop_summary", name, start, end)

    def _trace(self, on: bool) -> float:
        q = self.rt.queues
        q.muted += 1 if not on else -1
        return q.stream_time(rtm.current_stream_id())

    def _host_sync(self, name: str, seconds: float) -> None:
        self.rt.queues.submit(rtm.current_stream_id(), "host_sync", name, duration=seconds)

    def delete(self) -> None:
        """Free the constants (the executables free theirs when they go)."""
        for b in self._consts.values():
            b.delete()
        self._consts.clear()

    @property
    def in_layouts(self) -> tuple[TensorLayout, ...]:
        return tuple(self.program.layouts[i] for i in self.program.inputs)

    def run(self, args: Sequence[Any]) -> list[Any]:
        """The outputs (buffers) for ``args``: buffers used in place, host arrays copied in
        first. An output that is an argument is a copy of it (results never alias the
        caller's buffers)."""
        bufs = []
        for a, lay in zip(args, self.in_layouts, strict=True):
            bufs.append(a if type(a) is rtm.DeviceBuffer else rtm.copy_in(a, lay, rt=self.rt))
        outs = self.runner.run(self.program, bufs)
        given = {id(b) for b in bufs} | {id(b) for b in self._consts.values()}
        return [_copy_of(b) if id(b) in given else b for b in outs]

    def as_text(self) -> str:
        return format_program(self.program)

    def cost_analysis(self) -> dict[str, Any]:
        """:func:`program_cost`, with the iterations of each while loop's last run."""
        return program_cost(self.program, self.card, self.runner.trips)


def _device(arr: np.ndarray, lay: TensorLayout) -> np.ndarray:
    return to_device_layout(arr, lay)


def _copy_of(b: Any) -> Any:
    new = rtm.DeviceBuffer.allocate(b.nbytes, b.layout, rt=b.rt, tag="launch", payload=_array(b))
    rtm.device_copy(f"copy {b.layout.dtype}{list(b.layout.shape)}", [b], [new], b.nbytes)
    return new

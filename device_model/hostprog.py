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
from .launching import launch
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
    #: positions in ``carry + xs`` of buffers an enclosing loop hands over (nothing reads them
    #: after): written in place without a copy on entry
    donated: frozenset[int] = frozenset()


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
    #: positions in ``carry`` handed over by an enclosing loop (see :class:`ScanLoop`)
    donated: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True, eq=False)
class Branch:
    """The program ``branches[index]`` (the index clamped to the branches) on ``operands``."""

    index: int
    operands: tuple[int, ...]
    branches: tuple[Program, ...]
    outputs: tuple[int, ...]
    source: str = ""


@dataclass(frozen=True, slots=True, eq=False)
class UpdateInPlace:
    """``update`` written over ``target``'s buffer at the starts (per dim a static start, or
    None: the next of ``traced``, int32 scalars on the card), each clamped so the update fits:
    the buffer is the result ``output`` (a loop's own buffer; a device-side copy of the
    update's bytes only)."""

    target: int
    update: int
    starts: tuple[int | None, ...]
    traced: tuple[int, ...]
    output: int

    @property
    def outputs(self) -> tuple[int, ...]:
        return (self.output,)


Step = Call | ScanLoop | WhileLoop | Branch | UpdateInPlace


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
        elif isinstance(st, UpdateInPlace):
            lines.append(
                f"{indent}  %{st.output} = update_in_place(%{st.target}, %{st.update}; "
                f"starts={_starts_text(st)})"
            )
        else:
            lines.append(
                f"{indent}  {_ids(st.outputs)} = branch(%{st.index}; {_ids(st.operands)}){src}"
            )
            lines += [format_program(b, inner) for b in st.branches]
    lines.append(f"{indent}  return {_ids(p.outputs)}")
    lines.append(f"{indent}}}")
    return "\n".join(lines)


def _starts_text(st: UpdateInPlace) -> str:
    traced = iter(st.traced)
    return "(" + ", ".join(str(s) if s is not None else f"%{next(traced)}" for s in st.starts) + ")"


# ---------------------------------------------------------------------------------------------
# figures


def _update_us(nbytes: int, card: CardSpec) -> float:
    """A device-side write of ``nbytes`` (read once, written once) at the streaming rate."""
    return 2 * nbytes / card.memory_bw(0.5) * 1e6


def _host_gap_us(body: dict, card: CardSpec) -> float:
    """The stream's wait for the host per iteration of a static loop whose body (its
    ``program_cost``) launches ``kernels`` kernels: the host launches one per
    ``host_launch_s`` and enqueues ahead, so an iteration takes the longer of the two."""
    return max(0.0, body["kernels"] * card.host_launch_s * 1e6 - body["sim_time_us"])


def _while_gap_us(cond: dict, body: dict, card: CardSpec) -> float:
    """A while loop's iteration: after the predicate is read (its round trip covers the first
    launch) the host launches the rest of the iteration's kernels one per ``host_launch_s``."""
    launches = cond["kernels"] + body["kernels"] - 1
    return max(0.0, launches * card.host_launch_s * 1e6 - cond["sim_time_us"] - body["sim_time_us"])


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
        if isinstance(st, UpdateInPlace):
            t = _update_us(p.layouts[st.update].nbytes, card)
            total += t
            kern_us += t
            launches += 1
            dev_bytes += 2 * p.layouts[st.update].nbytes
            continue
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
        gap = _host_gap_us(body, card)  # (none before the first iteration)
        n = st.length
        row = {"kind": "scan", "iterations": n, "iteration_us": kern + gap}
        row["kernel_us"] = body["kernel_time_us"]
        row["total_us"] = max(0.0, (kern + gap) * n - gap)
        row |= {"launches": body["kernels"] * n, "host_round_trips": body["host_round_trips"] * n}
    elif isinstance(st, WhileLoop):
        cond, body = program_cost(st.cond, card, trips), program_cost(st.body, card, trips)
        it = cond["sim_time_us"] + body["sim_time_us"] + rt_us + _while_gap_us(cond, body, card)
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
    copied = _entry_copies(st)
    if copied:  # the buffers the loop writes in place: copied once on entry
        t = sum(_update_us(st_bytes, card) for st_bytes in copied)
        row["entry_copy_us"] = t
        row["total_us"] += t
    row["source"] = st.source
    return row, body


def _copied(st: ScanLoop | WhileLoop) -> frozenset[int]:
    """The loop's own inputs (positions in ``carry`` + ``xs``) it copies on entry: those its body
    writes in place and no enclosing loop handed over."""
    first = len(st.consts) if isinstance(st, ScanLoop) else len(st.body_consts)
    return frozenset(
        k - first for k in _in_place_inputs(st.body) if k >= first and k - first not in st.donated
    )


def _entry_copies(st: Step) -> list[int]:
    """The bytes of each buffer a loop copies on entry (:func:`_copied`)."""
    if not isinstance(st, ScanLoop | WhileLoop):
        return []
    first = len(st.consts) if isinstance(st, ScanLoop) else len(st.body_consts)
    return [st.body.layouts[st.body.inputs[first + k]].nbytes for k in sorted(_copied(st))]


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
    #: ``write(buffer, payload, reads, nbytes)``: ``nbytes`` written over a buffer in place on
    #: the card (a device-side step); ``copy(buffer)``: a copy of a buffer the loop may change
    write: Callable[[Any, Any, list[Any], int], None] = lambda b, p, r, n: None
    copy: Callable[[Any], Any] = lambda b: b
    #: ``trace(on)``: recording of the timeline's steps resumed (True) or paused (False);
    #: returns the current stream's time. ``note(name, start, end)``: a summary span.
    trace: Callable[[bool], float] = lambda on: 0.0
    note: Callable[[str, float, float], None] = lambda name, start, end: None
    #: iterations of each while loop's last run, by the step's id
    trips: dict[int, int] = field(default_factory=dict)
    _gaps: dict[tuple[int, int], float] = field(default_factory=dict)
    #: a scan's slice views -> (the stacked buffer, the slice): an in-place write goes through
    _views: dict[int, tuple[Any, int]] = field(default_factory=dict)

    def _gap(self, body: Program, cond: Program | None = None) -> float:
        """Seconds the stream waits for the host per iteration of a loop of ``body`` (a while
        loop: after its predicate's round trip, ``cond`` and ``body`` launched)."""
        key = (id(body), id(cond))
        g = self._gaps.get(key)
        if g is None:
            b = program_cost(body, self.card)
            if cond is None:
                g = _host_gap_us(b, self.card) * 1e-6
            else:
                g = _while_gap_us(program_cost(cond, self.card), b, self.card) * 1e-6
            self._gaps[key] = g
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
            elif isinstance(st, UpdateInPlace):
                outs = [self._update(st, env, p)]
            else:
                outs = self._branch(st, env)
            env.update(zip(st.outputs, outs, strict=True))
        return [env[o] for o in p.outputs]

    def _update(self, st: UpdateInPlace, env: dict[int, Any], p: Program) -> Any:
        """``st`` on the card: the target buffer, now holding the update."""
        buf, upd = env[st.target], env[st.update]
        traced = iter(st.traced)
        starts = [s if s is not None else env[next(traced)] for s in st.starts]
        new = _updated(_array(buf), _array(upd), starts, p.layouts[st.target], p.layouts[st.update])
        reads = [upd] + [env[t] for t in st.traced]
        self.write(buf, new, reads, p.layouts[st.update].nbytes)
        through = self._views.get(id(buf))
        if through is not None:  # a slice of a stacked buffer: the stacked buffer changes too
            import jax.numpy as jnp

            base, i = through
            self.store(base, jnp.asarray(_array(base)).at[i].set(new))
        return buf

    def _scan(self, st: ScanLoop, env: dict[int, Any]) -> list[Any]:
        body, nk = st.body, len(st.carry)
        nc = len(st.consts)
        consts = [env[i] for i in st.consts]
        own = _copied(st)  # the buffers the body writes in place: the loop's own copies
        carry = [self.copy(env[v]) if k in own else env[v] for k, v in enumerate(st.carry)]
        xs_bufs = [self.copy(env[v]) if nk + k in own else env[v] for k, v in enumerate(st.xs)]
        x_lays = [body.layouts[v] for v in body.inputs[nc + nk :]]
        y_lays = [body.layouts[v] for v in body.outputs[nk:]]
        alias = _stacked_aliases(body, nc, nk)  # ys written in place into a stacked input
        ys = [
            xs_bufs[alias[j]] if j in alias else self.allocate(_stacked(lay, st.length))
            for j, lay in enumerate(y_lays)
        ]
        parts: list[list[Any]] = [[] for _ in ys]
        gap = self._gap(body)
        order = range(st.length - 1, -1, -1) if st.reverse else range(st.length)
        muted: list[float] = []
        try:
            for n, i in enumerate(order):
                self._traced(n, muted)
                xv = []
                for b, lay in zip(xs_bufs, x_lays, strict=True):
                    v = self.view(b, lay, _slice(_array(b), i, lay))
                    self._views[id(v)] = (b, i)
                    xv.append(v)
                if gap and n:
                    self.host_sync(f"host launches iteration {n} of the scan", gap)
                try:
                    outs = self.run(body, consts + carry + xv)
                finally:
                    for v in xv:
                        self._views.pop(id(v), None)
                carry = outs[:nk]
                for j, y in enumerate(outs[nk:]):
                    if j not in alias:
                        parts[j].append(_array(y))
        finally:
            self._summary(f"scan at {st.source}", st.length, muted)
        for j, (buf, lay, got) in enumerate(zip(ys, y_lays, parts, strict=True)):
            if j not in alias:
                self.store(buf, _stack(got[::-1] if st.reverse else got, lay, st.length))
        return carry + ys

    def _while(self, st: WhileLoop, env: dict[int, Any]) -> list[Any]:
        cc = [env[i] for i in st.cond_consts]
        bc = [env[i] for i in st.body_consts]
        own = _copied(st)
        carry = [self.copy(env[v]) if k in own else env[v] for k, v in enumerate(st.carry)]
        limit = max_iterations()
        rt = self.card.host_round_trip_s + self.card.host_launch_s
        n = 0
        muted: list[float] = []
        try:
            while True:
                self._traced(n, muted)
                (pred,) = self.run(st.cond, cc + carry)
                go = bool(self.read_scalar(pred))
                gap = self._gap(st.body, st.cond) if go else 0.0
                self.host_sync(f"host reads the while loop's predicate ({n})", rt + gap)
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


def _in_place_inputs(p: Program) -> frozenset[int]:
    """The positions of ``p``'s inputs it writes in place (the loop running it copies them)."""
    pos = {v: k for k, v in enumerate(p.inputs)}
    return frozenset(
        pos[st.target] for st in p.steps if isinstance(st, UpdateInPlace) and st.target in pos
    )


def _stacked_aliases(p: Program, nc: int, nk: int) -> dict[int, int]:
    """A scan body's stacked outputs that are its slices of a stacked input written in place
    (``nc`` consts, ``nk`` carries): output ``j`` after the carry -> the stacked input's index.
    Such an output is the stacked input's buffer itself: nothing is stacked for it."""
    root: dict[int, int] = {}
    for st in p.steps:
        if isinstance(st, UpdateInPlace):
            root[st.output] = root.get(st.target, st.target)
    xs = {v: k for k, v in enumerate(p.inputs[nc + nk :])}
    out: dict[int, int] = {}
    for j, y in enumerate(p.outputs[nk:]):
        k = xs.get(root.get(y, -1))
        if k is not None and k not in out.values():
            out[j] = k
    return out


def _updated(x: Any, u: Any, starts: list[Any], lx: TensorLayout, lu: TensorLayout) -> Any:
    """``x`` (device layout) with ``u`` (device layout) written at ``starts`` (ints or scalar
    buffers), each clamped so that the update's logical extent fits ``x``'s."""
    import jax.numpy as jnp
    from jax import lax

    if not lx.shape:
        return jnp.asarray(u)
    st = []
    for s, n, w in zip(starts, lx.shape, lu.shape, strict=True):
        v = s if isinstance(s, int) else jnp.asarray(_array(s))[0]
        st.append(jnp.clip(jnp.asarray(v, jnp.int32), 0, n - w))
    body = jnp.asarray(u)[..., : lu.shape[-1]]
    return lax.dynamic_update_slice(jnp.asarray(x), body.astype(jnp.asarray(x).dtype), st)


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
            launch=lambda k, bufs: launch(self._exes[id(k)], bufs),
            read_scalar=lambda b: rtm.copy_out(b)[()],
            host_sync=self._host_sync,
            const=lambda vid, arr, lay: self._consts[id(arr)],
            view=lambda b, lay, payload: rtm.DeviceBuffer.view(b, lay, payload, shared=False),
            allocate=lambda lay: rtm.DeviceBuffer.allocate(lay.nbytes, lay, rt=rt, tag="stacked"),
            store=lambda b, payload: b.store(payload, shared=False),
            trace=self._trace,
            note=self._note,
            write=self._write,
            copy=_copy_of,
        )

    def _write(self, buf: Any, payload: Any, reads: list[Any], nbytes: int) -> None:
        lay = buf.layout
        buf.store(payload, shared=False)
        rtm.device_copy(f"update in place {lay.dtype}{list(lay.shape)}", reads, [buf], nbytes)

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

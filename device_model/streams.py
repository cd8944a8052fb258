"""Streams, events and effect tokens: the card's ordered queues, as data.

The card runs a launch as a *recipe* of typed steps (copy in, run kernel, copy out, record event,
wait event) submitted to ordered streams. This module is that machinery, with no frontend in it.

Effect tokens. Each stream's order is a :class:`Token`, an immutable value. Submitting a step
takes the tokens it depends on (its stream's current token and the tokens of the events it
waits on) and gives back its stream's new token. A token carries

* a *vector clock* (for every stream, how many of its steps are known to have happened before),
  which is what ordering means: step ``b`` is ordered after step ``a`` exactly when ``b``'s clock
  has seen ``a``;
* the simulated time at which what it stands for has completed.

An :class:`Event` is a token handed from one stream to another: ``record`` stores the recording
stream's token in it, ``wait`` merges it into the waiting stream's token. Host synchronization
merges tokens into the host's clock, which every later submission starts from.

Races. Every device buffer remembers the step that wrote it (stream, position). A step that reads
a buffer written by another stream's step that its own clock has not seen -- no event, no host
synchronization between them -- is a race: :class:`RaceError` names both steps (or, with
``race_mode="warn"``, a :class:`RaceWarning`). Checks happen before anything changes, so a refused
step leaves the streams, the buffers and the timeline as they were.

Pipelines. Copy-in steps run on the copy-in pipeline, copy-out steps on the copy-out pipeline and
kernel steps on the one compute queue that all streams share; the three overlap each other
wherever the dependences allow. A step starts at the latest of: its stream's previous step, the
events it waits on, its pipeline becoming free, and the host having submitted it (host time only
advances when the host synchronizes). Each pipeline serves its steps in submission order.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = [
    "Token",
    "Event",
    "StepRecord",
    "Queues",
    "RaceError",
    "RaceWarning",
    "StreamError",
    "PIPELINE_OF",
    "DEFAULT_STREAM",
    "priority_ids",
]

#: stream 0 is the default stream (CARD.md); the others come from the card's priority ranges
DEFAULT_STREAM = 0


def priority_ids(priority: str, per_priority: int) -> range:
    """The stream ids of a priority: low ``1..n``, high ``n+1..2n`` with ``n`` streams per
    priority (``CardSpec.streams_per_priority``; 1-32 and 33-64 on the card)."""
    return (
        range(per_priority + 1, 2 * per_priority + 1)
        if priority == "high"
        else range(1, per_priority + 1)
    )


#: which pipeline runs each kind of step (None: a marker, no pipeline time)
PIPELINE_OF = {
    "copy_in": "copy in",
    "run_kernel": "compute",
    "copy_out": "copy out",
    "record_event": None,
    "wait_event": None,
    "host_sync": None,  # the stream waits for the host (a value read back, a launch)
    "loop_summary": None,  # iterations of a loop recorded as one span (device_model.hostprog)
}


class RaceError(RuntimeError):
    """A step reads a buffer that another stream may still be writing (no event between them)."""


class RaceWarning(UserWarning):
    """The warning form of :class:`RaceError` (``race_mode="warn"``)."""


class StreamError(RuntimeError):
    """Misuse of streams or events: a destroyed stream, an event never recorded, ..."""


Clock = tuple[tuple[int, int], ...]  # sorted (stream id, steps seen) pairs


def _merge(*clocks: Clock) -> Clock:
    first = clocks[0]
    if len(clocks) == 2 and len(first) == 1:  # one stream's clock and the host's (eager ops)
        other = clocks[1]
        if len(other) == 1 and other[0][0] == first[0][0]:
            return first if first[0][1] >= other[0][1] else other
    for c in clocks:
        if c and c != first:
            break
    else:  # the common case (every step submits): nothing new to learn
        return first
    d: dict[int, int] = {}
    for c in clocks:
        for s, n in c:
            if n > d.get(s, 0):
                d[s] = n
    return tuple(sorted(d.items()))


def _seen(clock: Clock, stream: int) -> int:
    for s, n in clock:
        if s == stream:
            return n
    return 0


def _bump(clock: Clock, stream: int, seq: int) -> Clock:
    if len(clock) == 1 and clock[0][0] == stream:
        return ((stream, seq),)
    d = dict(clock)
    d[stream] = seq
    return tuple(sorted(d.items()))


class Token(NamedTuple):
    """An effect token: what a stream has done, in order (immutable; see the module docstring;
    a named tuple: one is made by every step, and a tuple is the cheapest immutable value).

    ``seq`` counts the stream's steps so far; ``clock`` is the vector clock; ``time`` the
    simulated time (s) at which all of it has completed; ``step`` the id of the step that
    produced it (-1 for a stream's initial token).
    """

    stream: int
    seq: int
    clock: Clock
    time: float
    step: int = -1

    def __repr__(self) -> str:
        return f"Token(stream {self.stream} #{self.seq}, done at {self.time * 1e6:.3f} us)"


class Event:
    """A point in one stream's order that other streams can wait on."""

    __slots__ = ("token", "name")
    _count = 0

    def __init__(self) -> None:
        Event._count += 1
        self.name = f"event{Event._count}"
        self.token: Token | None = None

    @property
    def recorded(self) -> bool:
        return self.token is not None

    def __repr__(self) -> str:
        state = f"recorded on stream {self.token.stream}" if self.token else "never recorded"
        return f"<spyre Event {self.name} {state}>"


class StepRecord(NamedTuple):
    """One submitted step, as the timeline keeps it (what the trace shows; an immutable named
    tuple, made by every step)."""

    id: int
    kind: str
    name: str
    stream: int
    pipeline: str | None
    start: float
    end: float
    nbytes: int = 0
    args: tuple[tuple[str, Any], ...] = ()
    detail: Any = None  # run_kernel: the kernel's cost analysis (per-stage, per-step timing)

    def describe(self) -> str:
        return f"step {self.id} '{self.name}' ({self.kind}) on stream {self.stream}"


@dataclass(slots=True)
class _StreamState:
    token: Token
    priority: str
    alive: bool = True
    last_step: StepRecord | None = None


@dataclass(slots=True)
class _Writer:
    stream: int
    seq: int
    step: StepRecord


@dataclass
class Queues:
    """The card's streams, pipelines, buffer writers and timeline (one per simulated card)."""

    race_mode: str = "raise"
    #: streams of each priority (``CardSpec.streams_per_priority``)
    per_priority: int = 32
    streams: dict[int, _StreamState] = field(default_factory=dict)
    pipe_free: dict[str, float] = field(
        default_factory=lambda: {"compute": 0.0, "copy in": 0.0, "copy out": 0.0}
    )
    host_clock: Clock = ()
    host_time: float = 0.0
    writers: dict[int, _Writer] = field(default_factory=dict)
    recording: list[list[StepRecord]] = field(default_factory=list)
    #: while above 0, steps are submitted but not recorded (a long loop's later iterations)
    muted: int = 0
    next_id: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock)

    def __post_init__(self) -> None:
        self.streams[DEFAULT_STREAM] = _StreamState(Token(DEFAULT_STREAM, 0, (), 0.0), "default")

    # ---- streams
    def open_stream(self, priority: str) -> int:
        """A new stream id from the priority's range (:func:`priority_ids`)."""
        ids = priority_ids(priority, self.per_priority)
        with self.lock:
            for i in ids:
                st = self.streams.get(i)
                if st is None or not st.alive:
                    # a reused id continues its count: clocks that saw its old steps must not
                    # take the new ones as seen (destroy synchronized the host with it)
                    seq = _seen(self.host_clock, i)
                    self.streams[i] = _StreamState(
                        Token(i, seq, self.host_clock, self.host_time), priority
                    )
                    return i
        raise StreamError(
            f"spyre: all {len(ids)} {priority}-priority streams ({ids.start}-{ids.stop - 1}) are "
            "in use; destroy one first"
        )

    def state(self, stream: int) -> _StreamState:
        st = self.streams.get(stream)
        if st is None:
            raise StreamError(f"spyre: stream {stream} does not exist")
        if not st.alive:
            raise StreamError(f"spyre: stream {stream} was destroyed")
        return st

    def destroy(self, stream: int) -> None:
        if stream == DEFAULT_STREAM:
            raise StreamError("spyre: the default stream (0) cannot be destroyed")
        with self.lock:
            st = self.state(stream)
            self.synchronize(stream)  # its work completes first, as on the card
            st.alive = False

    # ---- submission
    def submit(
        self,
        stream: int,
        kind: str,
        name: str,
        *,
        reads: Iterable[int] = (),
        writes: Iterable[int] = (),
        duration: float = 0.0,
        waits: Iterable[Token] = (),
        nbytes: int = 0,
        args: tuple[tuple[str, Any], ...] = (),
        detail: Any = None,
        checked: bool = False,
    ) -> Token:
        """Submit one step; returns the stream's new token. Raises before changing anything.

        ``checked``: the caller ran :meth:`check_reads` for these reads just before (a launch
        refuses a race before allocating), so the check is not repeated."""
        if kind not in PIPELINE_OF:
            raise ValueError(f"unknown step kind {kind!r}")
        with self.lock:
            st = self.streams.get(stream)
            if st is None or not st.alive:
                st = self.state(stream)  # raises
            tok = st.token
            if waits:
                waits = tuple(waits)
                clock = _merge(tok.clock, self.host_clock, *(w.clock for w in waits))
                start = max(tok.time, self.host_time, *(w.time for w in waits))
            else:
                clock = _merge(tok.clock, self.host_clock)
                start = max(tok.time, self.host_time)
            if reads and not checked:
                self._check_races(stream, kind, name, clock, reads)
            pipe = PIPELINE_OF[kind]
            if pipe is not None and self.pipe_free[pipe] > start:
                start = self.pipe_free[pipe]
            end = start + duration
            seq = tok.seq + 1
            rec = StepRecord(
                self.next_id, kind, name, stream, pipe, start, end, nbytes, args, detail
            )
            self.next_id += 1
            if pipe is not None:
                self.pipe_free[pipe] = end
            new = Token(stream, seq, _bump(clock, stream, seq), end, rec.id)
            st.token = new
            st.last_step = rec
            for b in writes:
                self.writers[b] = _Writer(stream, seq, rec)
            if not self.muted:
                for r in self.recording:
                    r.append(rec)
            return new

    def stream_time(self, stream: int) -> float:
        """When the stream's last submitted step ends."""
        return self.state(stream).token.time

    def note(self, stream: int, kind: str, name: str, start: float, end: float) -> None:
        """Record a span that is no step of its own (what a run of unrecorded steps did);
        nothing is submitted, no time passes."""
        with self.lock:
            rec = StepRecord(self.next_id, kind, name, stream, None, start, end)
            self.next_id += 1
            for r in self.recording:
                r.append(rec)

    def _check_races(
        self, stream: int, kind: str, name: str, clock: Clock, reads: tuple[int, ...]
    ) -> None:
        if self.race_mode == "off":
            return
        for b in reads:
            w = self.writers.get(b)
            if w is None or w.stream == stream or _seen(clock, w.stream) >= w.seq:
                continue
            msg = (
                f"spyre: race: {kind} '{name}' on stream {stream} reads device buffer "
                f"0x{b:x}, which {w.step.describe()} writes, with no event or synchronization "
                f"between them. Record an event on stream {w.stream} after that step and wait "
                f"on it in stream {stream} (s.wait_event(e)), or synchronize."
            )
            if self.race_mode == "warn":
                warnings.warn(msg, RaceWarning, stacklevel=5)
            elif self.race_mode == "raise":
                raise RaceError(msg)

    def check_reads(
        self, stream: int, kind: str, name: str, reads: Iterable[int], waits: Iterable[Token] = ()
    ) -> None:
        """The race check of :meth:`submit`, alone (to refuse a launch before allocating)."""
        writers = self.writers
        for b in reads:
            w = writers.get(b)
            if w is not None and w.stream != stream:
                break
        else:
            return  # every argument was written by this stream (or by nobody): no race possible
        with self.lock:
            st = self.state(stream)
            clock = _merge(st.token.clock, self.host_clock, *(w.clock for w in waits))
            self._check_races(stream, kind, name, clock, tuple(reads))

    def forget(self, buffer: int) -> None:
        """A buffer was freed: its next occupant starts with no writer."""
        self.writers.pop(buffer, None)

    # ---- events
    def record(self, stream: int, event: Event) -> Token:
        tok = self.submit(stream, "record_event", f"record {event.name}")
        event.token = tok
        return tok

    def wait(self, stream: int, event: Event) -> Token:
        if event.token is None:
            raise StreamError(
                f"spyre: stream {stream} waits on {event.name}, which was never recorded"
            )
        return self.submit(stream, "wait_event", f"wait {event.name}", waits=(event.token,))

    # ---- host synchronization
    def synchronize(self, stream: int | None = None) -> float:
        """The host waits for one stream (or all); returns the simulated host time after."""
        with self.lock:
            ids = (
                [stream] if stream is not None else [s for s, v in self.streams.items() if v.alive]
            )
            toks = [self.state(s).token for s in ids]
            self.host_clock = _merge(self.host_clock, *(t.clock for t in toks))
            self.host_time = max([self.host_time, *(t.time for t in toks)])
            return self.host_time

    def wait_for_writer(self, buffer: int) -> None:
        """The host waits for the step that wrote ``buffer`` (``block_until_ready``)."""
        w = self.writers.get(buffer)
        if w is not None and _seen(self.host_clock, w.stream) < w.seq:
            with self.lock:
                self.host_clock = _merge(self.host_clock, ((w.stream, w.seq),))
                self.host_time = max(self.host_time, w.step.end)

    def writer_stream(self, buffer: int) -> int:
        w = self.writers.get(buffer)
        if w is None or not self.streams.get(w.stream, _DEAD).alive:
            return DEFAULT_STREAM
        return w.stream


_DEAD = _StreamState(Token(-1, 0, (), 0.0), "", alive=False)

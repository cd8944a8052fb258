"""The card's runtime: device memory, device buffers, streams, executables and the steps.

Both frontends stand on this module and ``device_model.launching`` (the one launch path) and
nothing else of ours: ``spyre_jax.Array`` wraps a :class:`DeviceBuffer`, a torch ``spyre``
storage wraps one too, and both run compiled kernels with ``device_model.launching.launch``.
This module and that one are the only code that submits steps to the card's streams
(``device_model.streams.Queues``): copies in and out, kernel runs, device-side copies, events.

* :class:`Runtime`: one simulated card (its :class:`~device_model.card.CardSpec`, its
  :class:`~device_model.memory.DeviceMemory` and its streams). :func:`runtime` is the current
  card; :func:`set_card` starts a new one.
* :class:`DeviceBuffer`: one region of device memory holding one tensor (in stick layout, or raw
  bytes for torch storages), its contents one payload state (:mod:`device_model.payload`), with
  :meth:`~DeviceBuffer.materialize` before a host read and :meth:`~DeviceBuffer.settle_readers`
  before a host write. Freed when deleted or garbage-collected.
* :class:`Executable`: a :class:`~device_model.kernel.Kernel` loaded on a card: its constants
  copied into device memory, its :class:`~device_model.recipe.Recipe`, its cost analysis, and the
  vectorized card program (``device_model.execute``), built on first launch.
* The steps besides a kernel run: :func:`copy_in`, :func:`copy_out` (a host read of a result),
  :func:`device_copy`, events, :func:`synchronize`. Races, destroyed streams and a full device
  memory are refused before anything changes.

Importing this module does not import JAX (``import torch`` loads the ``spyre`` device, which
stands on it); the card program is built, and JAX imported, by the first launch.
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .card import DEFAULT_CARD, CardSpec
from .deferred import Deferred, Trace, card_array
from .kernel import Kernel, format_kernel
from .layout import TensorLayout
from .memory import DeviceMemory
from .payload import (
    DELETED,
    UNWRITTEN,
    XLA_ALIGN,
    Deleted,
    HostBytes,
    OnCard,
    PendingRun,
    State,
    aligned_copy,
    state_of,
    to_device_layout,
)
from .recipe import Recipe, copy_seconds
from .streams import DEFAULT_STREAM, Event, Queues, Token
from .timing import kernel_cost

__all__ = [
    "Runtime",
    "runtime",
    "set_card",
    "DeviceBuffer",
    "Executable",
    "card_array",
    "copy_in",
    "copy_out",
    "host_wrote",
    "host_reads",
    "device_copy",
    "check_reads",
    "to_device_layout",
    "push_stream",
    "pop_stream",
    "current_stream",
    "current_stream_id",
    "record_event",
    "wait_event",
    "synchronize",
    "DEFAULT_STREAM",
]


class Runtime:
    """One card: its spec, its device memory, and its streams (``device_model.streams``)."""

    def __init__(self, card: CardSpec, race_mode: str = "raise"):
        self.card = card
        self.memory = DeviceMemory.for_card(card)
        self.queues = Queues(race_mode=race_mode, per_priority=card.streams_per_priority)
        self.lock = threading.RLock()
        #: eager launches' card programs not run yet (``device_model.deferred``)
        self.trace = Trace()
        #: the device-memory bandwidth of a device-side copy (half reads, half writes)
        self.copy_bw = card.memory_bw(0.5)

    def __repr__(self) -> str:
        return f"<spyre Runtime {self.memory.stats()['bytes_in_use']} B in use>"


_current = Runtime(DEFAULT_CARD)


def runtime() -> Runtime:
    """The card launches go to now."""
    return _current


def set_card(card: CardSpec) -> Runtime:
    """Simulate ``card`` from now on: a new, empty device memory and fresh streams (the race mode
    is kept). Buffers of the previous card keep its memory alive."""
    global _current
    if not isinstance(card, CardSpec):
        raise TypeError(f"spyre: set_card expects a CardSpec, got {type(card).__name__}")
    _current = Runtime(card, _current.queues.race_mode)
    return _current


# ---------------------------------------------------------------------------------------------
# which stream steps go to: a per-thread stack of (runtime, stream id, the frontend's handle)

_local = threading.local()


def _stack() -> list[tuple[Runtime, int, Any]]:
    st = getattr(_local, "stack", None)
    if st is None:
        st = _local.stack = []
    return st


def push_stream(rt: Runtime, stream: int, handle: Any = None) -> None:
    """Steps of this thread go to ``stream`` of ``rt`` until :func:`pop_stream`. A destroyed
    stream is refused here (``StreamError``)."""
    rt.queues.state(stream)
    _stack().append((rt, stream, handle))


def pop_stream() -> None:
    _stack().pop()


def current_stream() -> tuple[int, Any]:
    """(id, frontend handle) of the stream this thread's steps go to on the current card; the
    default stream (0, None) outside any pushed stream of this card."""
    st = getattr(_local, "stack", None)
    if st and st[-1][0] is _current:
        return st[-1][1], st[-1][2]
    return DEFAULT_STREAM, None


def current_stream_id() -> int:
    st = getattr(_local, "stack", None)
    if st and st[-1][0] is _current:
        return st[-1][1]
    return DEFAULT_STREAM


# ---------------------------------------------------------------------------------------------
# device buffers


def _free_quiet(rt: Runtime, addr: int) -> None:
    if rt.memory.release(addr):
        rt.queues.forget(addr)


class DeviceBuffer:
    """A region of one card's device memory holding one tensor.

    ``layout`` is the tensor's stick layout (``None`` for raw bytes, as torch storages keep
    them); ``nbytes`` the bytes it holds. ``state`` is what the simulation keeps for its
    contents: exactly one of the frozen states of :mod:`device_model.payload` (unwritten, host
    bytes, a card array, a pending run of the lazy trace, deleted). ``version`` counts the
    writes to it after it was filled (host copies in and device-side copies: :func:`host_wrote`,
    :func:`device_copy`). Freed by :meth:`delete` or when the last reference goes.

    Two operations serve the host: :meth:`materialize` (its host bytes, before a host read: a
    card array or a pending run is converted) and :meth:`settle_readers` (before a host write:
    the launches in flight that read its host-visible bytes finish first). A buffer keeps a
    record of such *readers* once :meth:`track_readers` is called (the owner of bytes the host
    writes in place: a torch storage); a launch reading shared host bytes of a buffer without
    a record waits for its run instead.

    A *view* (:meth:`view`) is a tensor's stick layout seen over bytes of another buffer that
    already hold it (a torch storage whose bytes are the tensor in device layout): it allocates
    nothing and frees nothing, and it is alive while its base is. Its readers are its base's
    (or those of the buffer given as ``readers_of``).

    The states to come (a donated buffer, one aliased by an in-place update, one carried by a
    loop) are further states of :mod:`device_model.payload`; the class keeps its shape.
    """

    __slots__ = (
        "rt",
        "addr",
        "layout",
        "nbytes",
        "version",
        "state",
        "_readers",
        "_base",
        "_owns",
        "__weakref__",
    )

    def __init__(
        self,
        rt: Runtime,
        addr: int,
        nbytes: int,
        layout: TensorLayout | None = None,
        state: State = UNWRITTEN,
    ):
        self.rt = rt
        self.addr = addr
        self.nbytes = nbytes
        self.layout = layout
        self.version = 0
        self.state: State = state
        #: results of launches in flight that read its host-visible bytes (None: no record)
        self._readers: list[Any] | None = None
        self._base: DeviceBuffer | None = None
        self._owns = False

    @classmethod
    def allocate(
        cls,
        nbytes: int,
        layout: TensorLayout | None = None,
        *,
        rt: Runtime | None = None,
        tag: str = "",
        payload: Any = None,
    ) -> DeviceBuffer:
        """A new region of ``nbytes`` (DeviceOOMError when none fits; nothing changes then)
        holding ``payload`` (:func:`device_model.payload.state_of`; unwritten when None)."""
        rt = rt or _current
        state = state_of(payload)
        with rt.lock:
            addr = rt.memory.alloc(nbytes, tag=tag)
        return cls(rt, addr, nbytes, layout, state)

    @classmethod
    def view(
        cls,
        base: DeviceBuffer,
        layout: TensorLayout,
        payload: Any,
        *,
        shared: bool = True,
        owns: bool = False,
        readers_of: DeviceBuffer | None = None,
    ) -> DeviceBuffer:
        """``payload`` (an array over ``base``'s bytes, in ``layout``) as a buffer of its own
        that shares ``base``'s address: steps that read it read ``base``. ``shared``: the
        payload is memory the host writes (not an immutable card array). ``owns``: deleting the
        view frees ``base``. ``readers_of``: the buffer whose record of readers a launch
        reading the view joins (``base`` unless given)."""
        v = cls.__new__(cls)
        v.rt, v.addr, v.nbytes, v.layout, v.version = base.rt, base.addr, layout.nbytes, layout, 0
        t = type(payload)  # state_of, inlined: a view is made for every eager operand
        v.state = PendingRun(payload) if t is Deferred else state_of(payload, shared)
        v._base, v._owns = base, owns
        v._readers = (readers_of or base)._readers
        return v

    @property
    def is_view(self) -> bool:
        return self._base is not None

    @property
    def alive(self) -> bool:
        base = self._base
        if base is not None:
            return base.alive
        return type(self.state) is not Deleted

    @property
    def shared_with_host(self) -> bool:
        """Whether its contents are memory the host reads and writes in place."""
        return self.state.shared

    def payload(self) -> Any:
        """The state's value (a NumPy or card array, a pending result, a view's source);
        RuntimeError once the buffer has been freed."""
        s = self.state
        base = self._base
        if type(s) is not Deleted and (
            base is None
            or (base._base is None and type(base.state) is not Deleted)  # (alive, inlined)
            or base.alive
        ):
            return s.value
        raise RuntimeError(f"spyre: device buffer at {self.addr:#x} has been deleted")

    def store(self, payload: Any, shared: bool | None = None) -> None:
        """Hold ``payload`` from now on (the same bytes as another array, or new contents);
        ``shared`` as the state it replaces unless given."""
        self.state = state_of(payload, self.state.shared if shared is None else shared)

    def materialize(self, to_host: Callable[[np.ndarray], np.ndarray] | None = None) -> Any:
        """The contents as host bytes, before a host read: a card array or a pending run (its
        trace runs first) is copied to the host, through ``to_host`` where given (a frontend's
        own byte layout, e.g. a torch storage's), and held as shared host bytes from then on.
        Launches in flight that read the old bytes are not waited for."""
        s = self.state
        t = type(s)
        if t is HostBytes:
            return s.value
        if t is OnCard or t is PendingRun:
            host = np.asarray(card_array(s.value))
            if to_host is not None:
                host = to_host(host)
            self.state = HostBytes(host, True)
            return host
        return self.payload()  # unwritten (None) or deleted (raises)

    def track_readers(self) -> None:
        """Keep a record of the launches in flight that read its host-visible bytes (and
        those of views made of it from now on), which :meth:`settle_readers` waits for."""
        if self._readers is None:
            self._readers = []

    def add_reader(self, result: Any) -> None:
        """A run in flight (anything with ``block_until_ready``) reads its host bytes."""
        rd = self._readers
        if rd is None:
            result.block_until_ready()
        else:
            rd.append(result)

    def settle_readers(self) -> None:
        """Before a host write: wait for every launch in flight that reads its host bytes."""
        rd = self._readers
        while rd:
            rd.pop().block_until_ready()

    def has_readers(self) -> bool:
        """Whether launches that read its host bytes may still be in flight."""
        return bool(self._readers)

    def delete(self) -> None:
        """Free the region now (idempotent; a view frees nothing, unless it owns its base)."""
        if self._base is None:
            if type(self.state) is not Deleted:
                self.state = DELETED
                _free_quiet(self.rt, self.addr)
        elif self._owns:
            self._base.delete()

    def __del__(self) -> None:  # the last reference went: the region goes with it
        try:
            if self._base is None and type(self.state) is not Deleted:
                self.state = DELETED
                _free_quiet(self.rt, self.addr)
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to free into
            pass

    def __repr__(self) -> str:
        what = self.layout if self.layout is not None else f"{self.nbytes} bytes"
        state = "" if self.alive else ", freed"
        kind = "DeviceBuffer view" if self._base is not None else "DeviceBuffer"
        return f"<{kind} {self.addr:#x} {what}{state}>"


# ---------------------------------------------------------------------------------------------
# steps: copies, device-side copies, events, synchronization


def copy_in(
    host: Any,
    layout: TensorLayout,
    *,
    rt: Runtime | None = None,
    tag: str = "copy_in",
    alias: bool = False,
):
    """Copy host values into a new buffer of ``layout`` on the current stream (a ``copy_in``
    step). A destroyed stream or a full memory is refused before anything changes.

    The buffer owns its bytes: a later write to ``host`` does not reach it. With ``alias`` the
    simulation may keep ``host``'s own memory as the payload (no second copy of a model's
    weights on the host) when the bytes are already in device layout; the caller then answers
    for ``host`` not changing behind the card's back (``torch_bridge`` copies a parameter in
    again when its version counter moves).
    """
    rt = rt or _current
    sid = current_stream_id() if rt is _current else DEFAULT_STREAM
    rt.queues.state(sid)
    data = to_device_layout(host, layout)
    shared = isinstance(host, np.ndarray) and np.may_share_memory(data, host)
    if (shared and not alias) or (not shared and data.ctypes.data % XLA_ALIGN):
        data = aligned_copy(data)
        shared = False
    n = layout.nbytes
    buf = DeviceBuffer.allocate(n, layout, rt=rt, tag=tag)
    buf.state = HostBytes(data, shared and alias)
    rt.queues.submit(
        sid,
        "copy_in",
        f"copy in {layout.dtype}{list(layout.shape)}",
        writes=(buf.addr,),
        duration=copy_seconds(n, rt.card),
        nbytes=n,
    )
    return buf


def host_wrote(buf: DeviceBuffer, name: str, nbytes: int) -> None:
    """The host wrote ``nbytes`` of ``buf`` in place (torch's copies in): a ``copy_in`` step on
    the current stream."""
    rt = buf.rt
    buf.version += 1
    rt.queues.submit(
        current_stream_id(),
        "copy_in",
        name,
        writes=(buf.addr,),
        duration=copy_seconds(nbytes, rt.card),
        nbytes=nbytes,
    )


def host_reads(buf: DeviceBuffer, name: str, nbytes: int) -> None:
    """The host reads ``nbytes`` of ``buf``: a ``copy_out`` step on the stream that wrote it, and
    the host waits for it."""
    q = buf.rt.queues
    sid = q.writer_stream(buf.addr)
    q.submit(
        sid,
        "copy_out",
        name,
        reads=(buf.addr,),
        duration=copy_seconds(nbytes, buf.rt.card),
        nbytes=nbytes,
    )
    q.synchronize(sid)


def copy_out(buf: DeviceBuffer) -> np.ndarray:
    """The logical values of a stick-layout buffer, copied to the host (a ``copy_out`` step)."""
    data = np.asarray(buf.payload())
    lay = buf.layout
    host_reads(buf, f"copy out {lay.dtype}{list(lay.shape)}", lay.nbytes)
    if not lay.shape:
        return np.array(data[0])
    return np.array(data[..., : lay.shape[-1]])


def device_copy(
    name: str, reads: Sequence[DeviceBuffer], writes: Sequence[DeviceBuffer], nbytes: int
) -> None:
    """A device-side copy, fill or re-layout of ``nbytes`` (read and written at the card's
    streaming device-memory bandwidth): a ``run_kernel`` step on the current stream."""
    rt = writes[0].rt if writes else _current
    for b in writes:
        b.version += 1
    rt.queues.submit(
        current_stream_id(),
        "run_kernel",
        name,
        reads=tuple(b.addr for b in reads),
        writes=tuple(b.addr for b in writes),
        duration=2 * nbytes / rt.copy_bw,  # one read and one write of each byte
        nbytes=nbytes,
    )


def check_reads(name: str, reads: Sequence[DeviceBuffer]) -> None:
    """Refuse (RaceError) a kernel on the current stream reading ``reads`` while another stream
    may still write them; changes nothing."""
    if reads:
        reads[0].rt.queues.check_reads(
            current_stream_id(), "run_kernel", name, [b.addr for b in reads]
        )


def wait_until_written(buf: DeviceBuffer) -> None:
    """The host waits (in simulated time) for the step that wrote ``buf``."""
    buf.rt.queues.wait_for_writer(buf.addr)


def record_event(rt: Runtime, stream: int, event: Event) -> Token:
    """A ``record_event`` step on ``stream``: ``event`` now stands for everything before it."""
    return rt.queues.record(stream, event)


def wait_event(rt: Runtime, stream: int, event: Event) -> Token:
    """A ``wait_event`` step: later steps of ``stream`` start after ``event``'s point."""
    return rt.queues.wait(stream, event)


def synchronize(rt: Runtime | None = None, stream: int | None = None) -> float:
    """The host waits for one stream of ``rt`` (or all); the simulated host time after. The
    card programs of deferred launches run first (``device_model.deferred``)."""
    rt = rt or _current
    rt.trace.flush()
    return rt.queues.synchronize(stream)


# ---------------------------------------------------------------------------------------------
# executables and the launch


class Executable:
    """A card program loaded on a card: constants in device memory, recipe, figures, program.

    Usually a compiled :class:`~device_model.kernel.Kernel` (``kernel.inputs`` are the
    arguments followed by the constants, ``kernel.consts``; the constants are copied in once and
    live as long as the executable). :meth:`for_program` loads a data movement given as a JAX
    program instead (no kernel, no constants; its time on the card is given per launch).
    """

    def __init__(self, kernel: Kernel, rt: Runtime | None = None):
        rt = rt or _current
        self.kernel: Kernel | None = kernel
        self.rt = rt
        self._cost = kernel_cost(kernel, rt.card)
        decls = {t.name: t for t in kernel.tensors}
        n_in = len(kernel.inputs) - len(kernel.consts)
        self.consts: list[DeviceBuffer] = []
        try:
            for name, arr in kernel.consts:
                lay = decls[name].layout
                self.consts.append(
                    DeviceBuffer.allocate(
                        lay.nbytes, lay, rt=rt, tag="constant", payload=to_device_layout(arr, lay)
                    )
                )
        except BaseException:
            for c in self.consts:
                c.delete()
            raise
        temp = sum(t.layout.nbytes for t in kernel.tensors if t.role == "temp")
        self._setup(
            kernel.name,
            tuple(decls[n].layout for n in kernel.inputs[:n_in]),
            tuple(decls[o].layout for o in kernel.outputs),
            self._cost["sim_time_us"] * 1e-6,
            temp,
        )
        self._runner: Any = None
        #: it is one jitted program (a staged one runs stage by stage: never deferred)
        self._jitted = False

    @classmethod
    def for_program(
        cls,
        name: str,
        program: Callable[..., Any],
        in_layouts: Sequence[TensorLayout],
        out_layouts: Sequence[TensorLayout],
        rt: Runtime | None = None,
    ) -> Executable:
        """A data movement (a concatenation, a re-layout) as an executable: ``program`` (a
        jitted JAX program) takes one card array per argument, then the launch's ``params``,
        and returns the outputs. On the timeline it is a ``run_kernel`` step whose time the
        launch gives (``seconds``)."""
        ex = cls.__new__(cls)
        ex.kernel, ex.rt, ex._cost, ex.consts = None, rt or _current, {}, []
        ex._setup(name, tuple(in_layouts), tuple(out_layouts), 0.0, 0)
        ex._runner = program
        ex._jitted = hasattr(program, "lower")
        ex._load_jax()
        return ex

    def _setup(
        self,
        name: str,
        in_layouts: tuple[TensorLayout, ...],
        out_layouts: tuple[TensorLayout, ...],
        seconds: float,
        workspace: int,
    ) -> None:
        self.name = name
        self.in_layouts = in_layouts
        self.out_layouts = out_layouts
        self._const_addrs = tuple(c.addr for c in self.consts)
        # the outputs, then (if any) one workspace for the intermediates
        self._out_sizes = [lay.nbytes for lay in out_layouts] + ([workspace] if workspace else [])
        self.kernel_seconds = seconds
        self.step_name = f"run {name}"
        self.recipe = Recipe.for_kernel(
            name, list(in_layouts), list(out_layouts), seconds, len(self.consts), self.rt.card
        )
        #: the recipe as (kind, index) pairs, the order ``launch`` executes them in
        self.plan = tuple((st.kind, st.index) for st in self.recipe.steps)
        self._out_nbytes = tuple(lay.nbytes for lay in out_layouts)
        self._device_array: Any = None
        self._block: Any = None
        #: what every launch of it shares (``device_model.launching.LaunchRecord``), made by
        #: its first launch
        self.launch_record: Any = None
        #: its variants with other card programs (:meth:`with_runner`), kept by their user
        #: (``torch_bridge.eager``: one per combination of operand gathers folded in)
        self.variants: dict[Any, Executable] = {}

    @property
    def num_inputs(self) -> int:
        return len(self.in_layouts)

    def cost_analysis(self) -> dict[str, Any]:
        """Figures of the schedule: flops, device_bytes, scratchpad_peak_bytes, padding_bytes,
        cores_used, sim_time_us (simulated time on the card), and a per-stage breakdown."""
        return dict(self._cost)

    def as_text(self) -> str:
        """The schedule, readable."""
        return format_kernel(self.kernel) if self.kernel is not None else self.step_name

    def _load_jax(self) -> None:
        # imported here: the card program needs JAX, which ``import torch`` must not load
        import jax

        # a resident buffer's payload becomes a card (JAX) array once, over the same bytes:
        # payloads own their memory (copy_in) or alias it on purpose (copy_in(alias=True))
        self._device_array = functools.partial(jax.device_put, may_alias=True)
        self._block = jax.block_until_ready

    def runner(self) -> Any:
        """The jitted card program (``device_model.execute``), built on first use."""
        if self._runner is None:
            from . import program

            self._runner = program.build_runner(self.kernel)
            self._jitted = hasattr(self._runner, "lower")
            self._load_jax()
        return self._runner

    def with_runner(self, runner: Any) -> Executable:
        """This executable (its recipe, figures and constants) with another card program of the
        same signature, e.g. one that also gathers its operands from their sources."""
        self.runner()
        ex = copy.copy(self)
        ex._runner = runner
        ex._jitted = hasattr(runner, "lower")
        ex.launch_record = None
        return ex

    def __repr__(self) -> str:
        return f"<spyre Executable {self.name}: {self.num_inputs} args>"

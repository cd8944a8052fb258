"""The card's runtime: device memory, device buffers, streams and the one launch path.

Both frontends stand on this module and nothing else of ours: ``spyre_jax.Array`` wraps a
:class:`DeviceBuffer`, a torch ``spyre`` storage wraps one too, and both run compiled kernels with
:func:`launch`. This module is the only code that submits steps to the card's streams
(``device_model.streams.Queues``): copies in and out, kernel runs, device-side copies, events.

* :class:`Runtime`: one simulated card (its :class:`~device_model.card.CardSpec`, its
  :class:`~device_model.memory.DeviceMemory` and its streams). :func:`runtime` is the current
  card; :func:`set_card` starts a new one.
* :class:`DeviceBuffer`: one region of device memory holding one tensor (in stick layout, or raw
  bytes for torch storages). Freed when deleted or garbage-collected.
* :class:`Executable`: a :class:`~device_model.kernel.Kernel` loaded on a card: its constants
  copied into device memory, its :class:`~device_model.recipe.Recipe`, its cost analysis, and the
  vectorized card program (``device_model.execute``), built on first launch.
* :func:`launch`: executes an executable's recipe on the current stream: a ``copy_in`` step for
  every host argument, the ``run_kernel`` step; ``copy_out`` steps are taken when the host reads
  a result (:func:`copy_out`). Races, destroyed streams and a full device memory are refused
  before anything changes.

Importing this module does not import JAX (``import torch`` loads the ``spyre`` device, which
stands on it); the card program is built, and JAX imported, by the first launch.
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .card import DEFAULT_CARD, CardSpec
from .deferred import Deferred, Trace, card_array
from .kernel import Kernel, format_kernel
from .layout import TensorLayout, layout_for, np_dtype
from .memory import DeviceMemory, DeviceOOMError
from .recipe import Recipe, copy_seconds
from .streams import DEFAULT_STREAM, Event, Queues, Token
from .timing import kernel_cost

__all__ = [
    "Runtime",
    "runtime",
    "set_card",
    "DeviceBuffer",
    "Executable",
    "launch",
    "card_array",
    "copy_in",
    "copy_out",
    "host_wrote",
    "host_reads",
    "device_copy",
    "check_reads",
    "check_fits",
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
    if addr in rt.memory:
        rt.memory.free(addr)
        rt.queues.forget(addr)


class DeviceBuffer:
    """A region of one card's device memory holding one tensor.

    ``layout`` is the tensor's stick layout (``None`` for raw bytes, as torch storages keep
    them); ``nbytes`` the bytes it holds. The payload (a NumPy or JAX array of the region's
    contents) lives in :class:`~device_model.memory.DeviceMemory`. Freed by :meth:`delete` or
    when the last reference goes. ``version`` counts the writes to it after it was filled (host
    copies in and device-side copies: :func:`host_wrote`, :func:`device_copy`).

    A *view* (:meth:`view`) is a tensor's stick layout seen over bytes of another buffer that
    already hold it (a torch storage whose bytes are the tensor in device layout): it allocates
    nothing and frees nothing, and it is alive while its base is.
    """

    __slots__ = (
        "rt",
        "addr",
        "layout",
        "nbytes",
        "version",
        "shares_host",
        "readers",
        "_freed",
        "_base",
        "_view",
        "_owns",
        "__weakref__",
    )

    def __init__(self, rt: Runtime, addr: int, nbytes: int, layout: TensorLayout | None = None):
        self.rt = rt
        self.addr = addr
        self.nbytes = nbytes
        self.layout = layout
        self.version = 0
        #: the payload is memory the host also writes (a view, ``copy_in(alias=True)``): a
        #: launch reading it finishes before the host goes on
        self.shares_host = False
        #: where its owner tracks launches in flight that read its host bytes (a list the
        #: owner waits on before the host touches them), or None: such a launch then waits
        self.readers: list[Any] | None = None
        self._base: DeviceBuffer | None = None
        self._view: Any = None
        self._owns = False
        self._freed = False

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
        """A new region of ``nbytes`` (DeviceOOMError when none fits; nothing changes then)."""
        rt = rt or _current
        with rt.lock:
            addr = rt.memory.alloc(nbytes, tag=tag)
            buf = cls(rt, addr, nbytes, layout)
            if payload is not None:
                rt.memory.store(addr, payload)
        return buf

    @classmethod
    def view(
        cls,
        base: DeviceBuffer,
        layout: TensorLayout,
        payload: Any,
        *,
        shares_host: bool = True,
        owns: bool = False,
    ) -> DeviceBuffer:
        """``payload`` (an array over ``base``'s bytes, in ``layout``) as a buffer of its own
        that shares ``base``'s address: steps that read it read ``base``. ``shares_host``: the
        payload is memory the host writes (not an immutable card array). ``owns``: deleting the
        view frees ``base``."""
        v = cls.__new__(cls)
        v.rt, v.addr, v.nbytes, v.layout, v.version = base.rt, base.addr, layout.nbytes, layout, 0
        v._base, v._view, v.shares_host, v._owns = base, payload, shares_host, owns
        v.readers = None
        v._freed = False
        return v

    @property
    def is_view(self) -> bool:
        return self._base is not None

    @property
    def alive(self) -> bool:
        return self._base.alive if self._base is not None else not self._freed

    def payload(self) -> Any:
        """The region's contents; RuntimeError once the buffer has been freed."""
        base = self._base
        if base is not None:
            if base.alive:
                return self._view
        elif not self._freed:
            return self.rt.memory.load(self.addr)
        raise RuntimeError(f"spyre: device buffer at {self.addr:#x} has been deleted")

    def store(self, payload: Any) -> None:
        if self._base is not None:
            self._view = payload  # the same bytes, as another array (a card array of them)
        else:
            self.rt.memory.store(self.addr, payload)

    def delete(self) -> None:
        """Free the region now (idempotent; a view frees nothing, unless it owns its base)."""
        if self._base is None:
            if not self._freed:
                self._freed = True
                _free_quiet(self.rt, self.addr)
        elif self._owns:
            self._base.delete()

    def __del__(self) -> None:  # the last reference went: the region goes with it
        try:
            if self._base is None and not self._freed:
                self._freed = True
                _free_quiet(self.rt, self.addr)
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to free into
            pass

    def __repr__(self) -> str:
        what = self.layout if self.layout is not None else f"{self.nbytes} bytes"
        state = "" if self.alive else ", freed"
        kind = "DeviceBuffer view" if self._base is not None else "DeviceBuffer"
        return f"<{kind} {self.addr:#x} {what}{state}>"


def to_device_layout(host: Any, layout: TensorLayout) -> np.ndarray:
    """Host values -> the padded device-layout array (padding zero-filled; rank 0 takes one
    element)."""
    a = np.asarray(host).astype(np_dtype(layout.dtype), copy=False)
    if not layout.shape:
        a = a.reshape(1)
    pad = layout.device_shape[-1] - a.shape[-1]
    if pad:
        a = np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])
    return a


#: XLA's CPU client adopts host memory aligned to this many bytes as a card array without a copy
_XLA_ALIGN = 64


def _aligned_copy(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` in memory aligned to :data:`_XLA_ALIGN`: the launch that first reads it
    adopts those bytes instead of holding a second copy of them while it converts."""
    raw = np.empty(a.nbytes + _XLA_ALIGN, np.uint8)
    off = -raw.ctypes.data % _XLA_ALIGN
    out = raw[off : off + a.nbytes].view(a.dtype).reshape(a.shape)
    np.copyto(out, a)
    return out


def check_fits(
    tensors: Iterable[tuple[tuple[int, ...], str]],
    rt: Runtime | None = None,
    *,
    together: Iterable[tuple[tuple[int, ...], str]] = (),
    what: str = "",
) -> None:
    """DeviceOOMError, before anything is compiled or allocated, when one of ``tensors``
    ((shape, dtype) pairs) cannot fit the card's device memory at all, or when the tensors of
    ``together`` (a model's weights and inputs: what must be in device memory at once) exceed it
    in sum (the error names ``what``)."""
    rt = rt or _current
    st = rt.memory.stats()
    for shape, dtype in tensors:
        need = layout_for(tuple(shape), dtype, rt.card.stick_bytes).nbytes
        if need > st["bytes_limit"]:
            raise DeviceOOMError(
                need, st["bytes_in_use"], st["bytes_limit"], st["largest_free_block"], what
            )
    total = sum(layout_for(tuple(s), d, rt.card.stick_bytes).nbytes for s, d in together)
    if total > st["bytes_limit"]:
        raise DeviceOOMError(
            total, st["bytes_in_use"], st["bytes_limit"], st["largest_free_block"], what
        )


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
    if (shared and not alias) or (not shared and data.ctypes.data % _XLA_ALIGN):
        data = _aligned_copy(data)
        shared = False
    n = layout.nbytes
    buf = DeviceBuffer.allocate(n, layout, rt=rt, tag=tag, payload=data)
    buf.shares_host = shared and alias
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
    card = rt.card
    for b in writes:
        b.version += 1
    rt.queues.submit(
        current_stream_id(),
        "run_kernel",
        name,
        reads=tuple(b.addr for b in reads),
        writes=tuple(b.addr for b in writes),
        duration=2 * nbytes / card.memory_bw(0.5),  # one read and one write of each byte
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
    """A kernel loaded on a card: constants in device memory, recipe, figures, card program.

    ``kernel.inputs`` are the arguments followed by the constants (``kernel.consts``). The
    constants are copied in once and live as long as the executable.
    """

    def __init__(self, kernel: Kernel, rt: Runtime | None = None):
        rt = rt or _current
        self.kernel = kernel
        self.rt = rt
        self._cost = kernel_cost(kernel, rt.card)
        decls = {t.name: t for t in kernel.tensors}
        n_in = len(kernel.inputs) - len(kernel.consts)
        self.in_layouts = tuple(decls[n].layout for n in kernel.inputs[:n_in])
        self.out_layouts = tuple(decls[o].layout for o in kernel.outputs)
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
        self._const_addrs = tuple(c.addr for c in self.consts)
        temp = sum(t.layout.nbytes for t in kernel.tensors if t.role == "temp")
        # the outputs, then (if any) one workspace for the intermediates
        self._out_sizes = [lay.nbytes for lay in self.out_layouts] + ([temp] if temp else [])
        self.kernel_seconds = self._cost["sim_time_us"] * 1e-6
        self.step_name = f"run {kernel.name}"
        self.recipe = Recipe.for_kernel(
            kernel.name,
            list(self.in_layouts),
            list(self.out_layouts),
            self.kernel_seconds,
            len(self.consts),
            rt.card,
        )
        #: the recipe as (kind, index) pairs, the order ``launch`` executes them in
        self.plan = tuple((st.kind, st.index) for st in self.recipe.steps)
        self._out_nbytes = tuple(lay.nbytes for lay in self.out_layouts)
        self._runner: Any = None
        #: it is one jitted program (a staged one runs stage by stage: never deferred)
        self._jitted = False
        self._device_array: Any = None
        self._block: Any = None
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
        return format_kernel(self.kernel)

    def runner(self) -> Any:
        """The jitted card program (``device_model.execute``), built on first use."""
        if self._runner is None:
            # imported here: the card program needs JAX, which ``import torch`` must not load
            import jax

            from . import program

            self._runner = program.build_runner(self.kernel)
            self._jitted = hasattr(self._runner, "lower")
            # a resident buffer's payload becomes a card (JAX) array once, over the same bytes:
            # payloads own their memory (copy_in) or alias it on purpose (copy_in(alias=True))
            self._device_array = functools.partial(jax.device_put, may_alias=True)
            self._block = jax.block_until_ready
        return self._runner

    def with_runner(self, runner: Any) -> Executable:
        """This executable (its recipe, figures and constants) with another card program of the
        same signature, e.g. one that also gathers its operands from their sources."""
        self.runner()
        ex = copy.copy(self)
        ex._runner = runner
        ex._jitted = hasattr(runner, "lower")
        return ex

    def __repr__(self) -> str:
        return f"<spyre Executable {self.kernel.name}: {self.num_inputs} args>"


#: a buffer's record of launches in flight that read it drops the finished ones past this many
_READERS_PRUNE = 64


def launch(exe: Executable, args: Sequence[Any], *, defer: bool = False) -> list[DeviceBuffer]:
    """Run ``exe``'s recipe once on the current stream; one output buffer per kernel output.

    ``defer``: the card program that computes the outputs may be recorded in the card's trace
    (:mod:`device_model.deferred`) and run later, with the next ones, when a value is needed;
    everything else (checks, memory, the timeline) happens now either way.

    ``args``: one per kernel argument, a :class:`DeviceBuffer` (used in place) or host values
    (copied in for this launch, freed after it). Refused before anything changes on: a buffer of
    another card (ValueError), a race on a device-resident argument (RaceError), a destroyed
    stream (StreamError), a full device memory (DeviceOOMError).
    """
    rt = exe.rt
    q = rt.queues
    st = getattr(_local, "stack", None)  # current_stream_id(), inlined: the launch is hot
    sid = st[-1][1] if st and st[-1][0] is rt and rt is _current else DEFAULT_STREAM
    if len(args) != len(exe.in_layouts):
        raise TypeError(
            f"spyre: {exe.kernel.name} takes {len(exe.in_layouts)} arguments, got {len(args)}"
        )
    resident = []
    for a in args:
        if type(a) is DeviceBuffer:
            if a.rt is not rt:
                raise ValueError(
                    "spyre: an argument lives on a previous card (before set_card); "
                    "copy it to the host and back"
                )
            resident.append(a.addr)
    if resident:
        q.check_reads(sid, "run_kernel", exe.step_name, resident)
    bufs: list[DeviceBuffer] = list(args)
    temps: list[DeviceBuffer] = []
    outs: list[DeviceBuffer] = []
    try:
        for kind, index in exe.plan:
            if kind == "copy_in":
                if type(args[index]) is not DeviceBuffer:
                    b = copy_in(args[index], exe.in_layouts[index], rt=rt, tag="launch_arg")
                    temps.append(b)
                    bufs[index] = b
            elif kind == "run_kernel":
                outs = _run_kernel(exe, bufs, temps, sid, defer)
            # copy_out steps are taken when the host reads a result (copy_out)
    finally:
        for t in temps:
            t.delete()
    return outs


def _run_kernel(
    exe: Executable, bufs: list[DeviceBuffer], temps: list[DeviceBuffer], sid: int, defer: bool
) -> list[DeviceBuffer]:
    rt = exe.rt
    runner = exe._runner or exe.runner()
    payloads = [b.payload() for b in bufs]
    for i, p in enumerate(payloads):
        if type(p) is np.ndarray and bufs[i] not in temps:
            p = payloads[i] = exe._device_array(p)  # a resident host payload: a card array once
            bufs[i].store(p)
    if exe.consts:
        payloads += [c.payload() for c in exe.consts]
    # one jitted program may wait in the trace; a staged one takes its arguments' values now
    defer = defer and exe._jitted
    if not defer:
        payloads = [card_array(p) for p in payloads]
    with rt.lock:
        addrs = rt.memory.allocate_many(exe._out_sizes, tag="launch")
    try:
        if defer:
            results: list[Any] = rt.trace.call(runner, payloads, len(exe.out_layouts))
        else:
            results = runner(*payloads)
        # the host may write the bytes of inputs that share its memory next: unless the run has
        # finished (it ran where called; the outputs of one run are ready together), each such
        # input's storage records the launch (its writer waits for it), or where one keeps no
        # record the launch waits here (and then no record is needed)
        if results and not results[0].is_ready():
            shared = [b for b in bufs if b.shares_host]
            lists = [b._base.readers if b._base is not None else None for b in shared]
            if None in lists:
                exe._block([card_array(r) for r in results])
            else:
                # a deferred run is waited for as its trace's batch (its results may die first)
                mark = rt.trace.batch if type(results[0]) is Deferred else None
                for rd in lists:
                    if len(rd) >= _READERS_PRUNE:
                        rd[:] = [r for r in rd if not r.is_ready()]
                    if mark is None:
                        rd.extend(results)
                    elif not rd or rd[-1] is not mark:
                        rd.append(mark)
    except BaseException:
        for a in addrs:
            rt.memory.free(a)
        raise
    nout = len(exe.out_layouts)
    if len(addrs) > nout:
        rt.memory.free(addrs[-1])  # the workspace of intermediates
    outs = []
    for a, lay, n, r in zip(addrs, exe.out_layouts, exe._out_nbytes, results, strict=False):
        rt.memory.store(a, r, n)
        outs.append(DeviceBuffer(rt, a, n, lay))
    rt.queues.submit(
        sid,
        "run_kernel",
        exe.step_name,
        reads=tuple([b.addr for b in bufs]) + exe._const_addrs,
        writes=addrs[:nout],
        duration=exe.kernel_seconds,
        detail=exe._cost,
        checked=True,  # launch checked every device-resident argument; copies-in are ours
    )
    return outs

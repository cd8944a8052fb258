"""The launch: one run of an executable on the current stream, the one launch of both frontends.

``spyre_jax.jit``, torch's compiled graphs, eager ops and the data movements of
``torch_bridge.card_cat`` all launch through :func:`launch`. It executes the executable's
recipe (:class:`~device_model.recipe.Recipe`) on the current stream: a ``copy_in`` step for
every host argument, then the ``run_kernel`` step; ``copy_out`` steps are taken when the host
reads a result (``device_model.runtime.copy_out``). A race on a device-resident argument, a
destroyed stream and a full device memory are refused before anything changes.

What a launch of one executable needs that does not change from one launch to the next (its
layouts and sizes, its program, its step's name, time and cost, its constants' addresses) is
worked out once, in the executable's :class:`LaunchRecord`: an eager op launches the same small
kernel again and again, and its host cost is the figure a user of the ``spyre`` device meets
first (``spyre-jax bench eager``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import donation
from . import runtime as rtm
from .deferred import Deferred, card_array
from .payload import OnCard, PendingRun
from .runtime import (
    DEFAULT_STREAM,
    DeviceBuffer,
    Executable,
    Runtime,
    current_stream_id,
    runtime,
)

__all__ = ["launch", "LaunchRecord", "record_readers"]

#: a buffer's record of launches in flight that read it drops the finished ones past this many
READERS_PRUNE = 64


def launch(
    exe: Executable,
    args: Sequence[Any],
    *,
    defer: bool = False,
    params: Sequence[Any] = (),
    seconds: float | None = None,
    donate: Sequence[int] = (),
) -> list[DeviceBuffer]:
    """Run ``exe``'s recipe once on the current stream; one output buffer per output.

    ``defer``: the card program that computes the outputs may be recorded in the card's trace
    (:mod:`device_model.deferred`) and run later, with the next ones, when a value is needed;
    everything else (checks, memory, the timeline) happens now either way.

    ``args``: one per argument, a :class:`DeviceBuffer` (used in place) or host values (copied
    in for this launch, freed after it). ``params``: values the program takes after them as
    they are (a data movement's offsets: no copy, no step). ``seconds``: the step's time on
    the card where the executable has none of its own (:meth:`Executable.for_program`).
    ``donate``: indices of device-resident arguments whose regions outputs may take
    (:mod:`device_model.donation`); each taken one is deleted by the launch.
    Refused before anything changes on: a buffer of another card (ValueError), a race on a
    device-resident argument (RaceError), a destroyed stream (StreamError), a full device
    memory (DeviceOOMError: nothing stays allocated).
    """
    rec = exe.launch_record
    if rec is None:
        rec = exe.launch_record = LaunchRecord(exe)
    return rec(args, defer, params, seconds, donate)


class LaunchRecord:
    """What every launch of one executable shares, worked out at its first launch; calling it
    is :func:`launch`. A variant of the executable (``Executable.with_runner``) has its own."""

    __slots__ = (
        "exe",
        "rt",
        "runner",
        "jitted",
        "nin",
        "in_layouts",
        "outs",
        "sizes",
        "name",
        "seconds",
        "cost",
        "consts",
        "const_addrs",
        "to_card",
        "trace",
    )

    def __init__(self, exe: Executable):
        self.exe = exe
        self.rt: Runtime = exe.rt
        self.runner = exe.runner()
        self.jitted = exe._jitted
        self.nin = len(exe.in_layouts)
        self.in_layouts = exe.in_layouts
        #: each output's (layout, bytes)
        self.outs = tuple(zip(exe.out_layouts, exe._out_nbytes, strict=True))
        #: the regions a launch allocates: the outputs, then a workspace of intermediates if any
        self.sizes = list(exe._out_sizes)
        self.name = exe.step_name
        self.seconds = exe.kernel_seconds
        self.cost = exe._cost
        self.consts = tuple(exe.consts)
        self.const_addrs = exe._const_addrs
        #: a resident host payload's card array (over the same bytes)
        self.to_card = exe._device_array
        #: the card's trace this program has run in on its own (later runs are recorded there)
        self.trace: Any = None

    def __call__(self, args: Sequence[Any], *options: Any) -> list[DeviceBuffer]:
        """:func:`launch`: ``options`` are its ``defer``, ``params``, ``seconds``, ``donate``."""
        defer, params, seconds, donate = options
        rt = self.rt
        sid = current_stream_id() if rt is runtime() else DEFAULT_STREAM
        if len(args) != self.nin:
            raise TypeError(f"spyre: {self.exe.name} takes {self.nin} arguments, got {len(args)}")
        resident = []
        copied = False
        for a in args:
            if type(a) is DeviceBuffer:
                if a.rt is not rt:
                    raise ValueError(
                        "spyre: an argument lives on a previous card (before set_card); "
                        "copy it to the host and back"
                    )
                resident.append(a.addr)
            else:
                copied = True
        if resident:
            rt.queues.check_reads(sid, "run_kernel", self.name, resident)
        if not copied:
            return self._run(args, (), sid, defer, params, seconds, donate)
        bufs = list(args)
        temps: list[DeviceBuffer] = []
        try:
            for i, a in enumerate(args):  # the recipe's copy_in steps, in argument order
                if type(a) is not DeviceBuffer:
                    b = rtm.copy_in(a, self.in_layouts[i], rt=rt, tag="launch_arg")
                    temps.append(b)
                    bufs[i] = b
            return self._run(bufs, temps, sid, defer, params, seconds, donate)
        finally:
            for t in temps:
                t.delete()

    def _run(
        self,
        bufs: Sequence[DeviceBuffer],
        temps: Sequence[DeviceBuffer],
        sid: int,
        defer: bool,
        params: Sequence[Any],
        seconds: float | None,
        donate: Sequence[int],
    ) -> list[DeviceBuffer]:
        """The recipe's ``run_kernel`` step over device buffers (``temps``: the copies in)."""
        rt = self.rt
        payloads = []
        for b in bufs:
            p = b.payload()
            if type(p) is np.ndarray and b not in temps:
                p = self.to_card(p)  # a resident host payload: a card array once
                b.store(p)
            payloads.append(p)
        if params:
            payloads += params
        for c in self.consts:
            payloads.append(c.payload())
        # one jitted program may wait in the trace; a staged one takes its arguments' values now
        defer = defer and self.jitted
        if not defer:
            payloads = [card_array(p) for p in payloads]
        nout = len(self.outs)
        sizes = self.sizes
        taken = donation.plan([o[0] for o in self.outs], len(sizes), bufs, donate) if donate else ()
        if taken:
            sizes = [n for n, t in zip(sizes, taken, strict=True) if t is None]
        with rt.lock:
            fresh = rt.memory.allocate_many(sizes, tag="launch")
        addrs = donation.addresses(taken, fresh) if taken else fresh
        try:
            if not defer:
                results = self.runner(*payloads)
            else:
                trace = rt.trace
                if self.trace is trace:  # it has run on its own there: recorded
                    results = trace.record(self.runner, payloads, nout)
                else:
                    results = trace.call(self.runner, payloads, nout)
                    self.trace = trace
            if results and (type(results[0]) is Deferred or not results[0].is_ready()):
                record_readers(self.exe, rt, bufs, results)
        except BaseException:
            for a in fresh:
                rt.memory.free(a)
            raise
        if taken:
            donation.consume(taken)
        if len(addrs) > nout:
            rt.memory.free(addrs[-1])  # the workspace of intermediates
        state = PendingRun if results and type(results[0]) is Deferred else OnCard
        if nout == 1:
            lay, n = self.outs[0]
            outs = [DeviceBuffer(rt, addrs[0], n, lay, state(results[0]))]
        else:
            outs = [
                DeviceBuffer(rt, a, n, lay, state(r))
                for a, (lay, n), r in zip(addrs, self.outs, results, strict=False)
            ]
        rt.queues.submit(
            sid,
            "run_kernel",
            self.name,
            reads=tuple([b.addr for b in bufs]) + self.const_addrs,
            writes=addrs[:nout],
            duration=self.seconds if seconds is None else seconds,
            detail=self.cost,
            checked=True,  # the launch checked every device-resident argument; copies-in are ours
        )
        return outs


def record_readers(
    exe: Executable, rt: Runtime, bufs: Sequence[DeviceBuffer], results: list[Any]
) -> None:
    """The host may write the bytes of inputs that share its memory next: unless the run has
    finished (it ran where called; the outputs of one run are ready together), each such input
    records the launch among its readers (its writer waits for it), or where one keeps no
    record the launch waits here (and then no record is needed)."""
    mark: Any = None
    for b in bufs:
        if not b.state.shared:
            continue
        rd = b._readers
        if rd is None:  # (a record made before for another input is of a run now finished)
            exe._block([card_array(r) for r in results])
            return
        if mark is None:  # a deferred run is waited for as its trace's batch (its results
            # may die first)
            mark = rt.trace.batch if type(results[0]) is Deferred else False
        if len(rd) >= READERS_PRUNE:
            rd[:] = [r for r in rd if not r.is_ready()]
        if mark is False:
            rd.extend(results)
        elif not rd or rd[-1] is not mark:
            rd.append(mark)

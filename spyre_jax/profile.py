"""``spyre_jax.profile``: record what runs on the simulated card and export it as a trace.

>>> import jax, numpy as np, spyre_jax
>>> f = spyre_jax.jit(lambda x, w: jax.nn.gelu(x @ w))
>>> x, w = np.ones((64, 128), np.float16), np.ones((128, 256), np.float16)
>>> with spyre_jax.profile(print_summary=False) as prof:   # or profile("trace.json")
...     y = np.asarray(f(x, w))
>>> [r.kind for r in prof.records]
['copy_in', 'copy_in', 'run_kernel', 'copy_out']
>>> prof.summary["bound"] in ("copy in", "copy out", "PE", "SFU", "load/store", "ring")
True

Open the written JSON in https://ui.perfetto.dev or ``chrome://tracing``: one track per stream
and per pipeline (``copy in``, ``compute``, ``copy out``) and, per core, its PE/SFU, load/store
and ring activity inside each kernel (``device_model.trace``). All times are simulated.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path
from types import TracebackType
from typing import Any

from device_model.runtime import runtime
from device_model.streams import Queues, StepRecord
from device_model.trace import chrome_trace, format_summary, summary

from . import jax_private

__all__ = ["profile", "Profile"]


class Profile:
    """A recording of the steps submitted to the card while its ``with`` block runs.

    Made by :func:`profile`. Inside the block ``records`` grows as steps are submitted; after
    it, ``trace`` (the Chrome trace-event dict) and ``summary`` (busy fractions per unit, the
    bounding unit, the total simulated time) describe them.
    """

    def __init__(self, path: str | os.PathLike[str] | None, print_summary: bool):
        self.path: Path | None = Path(path) if path is not None else None
        self.print_summary = print_summary
        self.records: list[StepRecord] = []
        self._queues: Queues | None = None
        self._num_cores = runtime().card.num_cores
        self._trace: dict[str, Any] | None = None
        self._summary: dict[str, Any] | None = None
        #: JAX primitives evaluated eagerly on the CPU inside the block, by name (what JAX
        #: computes between card programs: a gradient's glue, a ``jnp`` call on device arrays)
        self.cpu_primitives: Counter[str] = Counter()

    @property
    def recording(self) -> bool:
        """Whether steps are being recorded now (inside the ``with`` block)."""
        return self._queues is not None

    @property
    def trace(self) -> dict[str, Any]:
        """The Chrome trace-event JSON object of the recorded steps."""
        if self._trace is None or self.recording:
            self._trace = chrome_trace(self.records, num_cores=self._num_cores)
        return self._trace

    @property
    def summary(self) -> dict[str, Any]:
        """Busy fraction per unit, the bounding unit and total simulated time (see
        ``device_model.trace.summary``)."""
        if self._summary is None or self.recording:
            self._summary = summary(self.records)
        return self._summary

    def format_summary(self) -> str:
        """The summary as a short text table, and the JAX primitives run on the CPU."""
        cpu = sum(self.cpu_primitives.values())
        names = ", ".join(f"{k} x{v}" for k, v in self.cpu_primitives.most_common(8))
        return (
            format_summary(self.summary)
            + f"\nJAX primitives on the CPU: {cpu}"
            + (f" ({names})" if cpu else "")
        )

    def __enter__(self) -> Profile:
        if self._queues is not None:
            raise RuntimeError("spyre_jax.profile: this profile is already recording")
        rt = runtime()
        self._num_cores = rt.card.num_cores
        q = rt.queues
        with q.lock:
            q.recording.append(self.records)
        self._queues = q
        jax_private.add_cpu_listener(self.cpu_primitives)
        self._trace = self._summary = None
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        q, self._queues = self._queues, None
        jax_private.remove_cpu_listener(self.cpu_primitives)
        if q is not None:
            with q.lock:
                # by identity: another profile's list may compare equal to ours
                q.recording[:] = [r for r in q.recording if r is not self.records]
        if exc_type is not None:
            return  # the error propagates; records stay readable, nothing is written
        if self.path is not None:
            with open(self.path, "w", encoding="utf-8") as fh:
                json.dump(self.trace, fh, separators=(",", ":"))
        if self.print_summary:
            print(self.format_summary(), file=sys.stdout)

    def __repr__(self) -> str:
        state = "recording" if self.recording else "done"
        return f"<spyre Profile {state}, {len(self.records)} steps>"


def profile(path: str | os.PathLike[str] | None = None, *, print_summary: bool = True) -> Profile:
    """Record the card's steps inside a ``with`` block; write a trace and print a summary.

    >>> with spyre_jax.profile("trace.json") as prof:  # doctest: +SKIP
    ...     y = f(x)                  # copy in, run kernel (on the current stream)
    ...     np.asarray(y)             # copy out
    >>> prof.summary["bound"], prof.summary["total_s"]  # doctest: +SKIP

    Every step submitted to the card while the block runs, on any stream and from any thread,
    is recorded (``prof.records``). When the block ends normally, the Chrome trace-event JSON
    (``prof.trace``) is written to ``path`` (if given; open it in https://ui.perfetto.dev or
    ``chrome://tracing``) and the summary table is printed to stdout (if ``print_summary``).
    When the block raises, recording stops and the error propagates; nothing is written.
    Profiles nest. Recording follows the card current at entry (``set_card`` inside the block
    starts a new card, which is not recorded).
    """
    return Profile(path, print_summary)

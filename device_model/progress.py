"""Progress of long work (a whole model's compile): a bar on a terminal, ``logging`` otherwise.

Nothing shows for work that ends within :data:`QUIET_SECONDS`. After that, a :class:`Progress`
redraws one line on stderr when stderr is a terminal, and otherwise logs at INFO on its logger
about every :data:`LOG_EVERY_SECONDS` and at the end. ``SPYRE_PROGRESS=0`` turns it off,
``SPYRE_PROGRESS=1`` shows it from the start (bar or log as above).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, TextIO

__all__ = ["Progress", "QUIET_SECONDS", "LOG_EVERY_SECONDS"]

#: work that ends sooner shows nothing
QUIET_SECONDS = 3.0
#: how often a log line is written when stderr is not a terminal
LOG_EVERY_SECONDS = 5.0


class Progress:
    """``done`` of ``total`` units of ``what``, with named counts (e.g. compiled and reused).

    Use as a context manager, calling :meth:`update` per unit; the final line (or log record)
    is written on exit when anything was shown.
    """

    def __init__(
        self,
        what: str,
        total: int,
        logger: logging.Logger,
        *,
        stream: TextIO | None = None,
        clock: Any = time.perf_counter,
    ):
        self.what, self.total, self.log, self.clock = what, total, logger, clock
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.counts: dict[str, int] = {}
        mode = os.environ.get("SPYRE_PROGRESS", "")
        self.enabled = mode != "0"
        self.quiet_until = 0.0 if mode == "1" else QUIET_SECONDS
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = clock()
        self.last_log = -LOG_EVERY_SECONDS
        self.shown = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def line(self) -> str:
        counts = ", ".join(f"{v} {k}" for k, v in self.counts.items())
        extra = f" ({counts})" if counts else ""
        return f"{self.what}: {self.done}/{self.total}{extra} {self.clock() - self.t0:.1f} s"

    def update(self, n: int = 1, **counts: int) -> None:
        """``n`` more units done; ``counts`` add to the named counts."""
        self.done += n
        for k, v in counts.items():
            self.counts[k] = self.counts.get(k, 0) + v
        if not self.enabled:
            return
        t = self.clock() - self.t0
        if t < self.quiet_until:
            return
        if self.tty:
            width = 24
            fill = width * self.done // max(self.total, 1)
            bar = "#" * fill + "." * (width - fill)
            self.stream.write(f"\r[{bar}] {self.line()}")
            self.stream.flush()
            self.shown = True
        elif t - self.last_log >= LOG_EVERY_SECONDS:
            self.log.info("%s", self.line())
            self.last_log = t
            self.shown = True

    def close(self) -> None:
        """The final state, when anything was shown."""
        if not self.shown:
            return
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
        else:
            self.log.info("%s (done)", self.line())
        self.shown = False

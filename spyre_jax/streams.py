"""Streams and events on the simulated card (the user's side of ``device_model.streams``).

>>> import spyre_jax
>>> s = spyre_jax.Stream(priority="high")
>>> with spyre_jax.stream(s):
...     pass                      # launches here go to stream s
>>> e = s.record_event()
>>> spyre_jax.default_stream().wait_event(e)
>>> s.synchronize()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from device_model import runtime as card_runtime
from device_model.runtime import DEFAULT_STREAM, runtime
from device_model.streams import Event, RaceError, RaceWarning, StreamError

__all__ = [
    "Stream",
    "Event",
    "stream",
    "current_stream",
    "default_stream",
    "synchronize",
    "set_race_mode",
    "RaceError",
    "RaceWarning",
    "StreamError",
]

_PRIORITIES = {"low": "low", "high": "high", 0: "low", -1: "high"}


class Stream:
    """An ordered queue of steps on the card.

    ``priority``: ``"low"`` (or 0, the default) takes an id in 1-32, ``"high"`` (or -1) an id
    in 33-64, as on the card. ``Stream.default()`` is stream 0. A stream's steps complete in
    order; steps of different streams are ordered only by events and host synchronization.
    """

    __slots__ = ("id", "priority", "_rt")

    def __init__(self, priority: str | int = "low", *, _id: int | None = None):
        rt = runtime()
        self._rt = rt
        if _id is not None:
            self.id, self.priority = _id, "default"
            return
        try:
            p = _PRIORITIES[priority]
        except (KeyError, TypeError):
            raise ValueError(
                f"spyre: stream priority must be 'low' (or 0) or 'high' (or -1), got {priority!r}"
            ) from None
        self.priority = p
        self.id = rt.queues.open_stream(p)

    @staticmethod
    def default() -> Stream:
        return Stream(_id=DEFAULT_STREAM)

    # ---- events and synchronization
    def record_event(self, event: Event | None = None) -> Event:
        """Record an event at this point of the stream (a new one, or ``event`` again)."""
        e = Event() if event is None else event
        card_runtime.record_event(self._rt, self.id, e)
        return e

    def wait_event(self, event: Event) -> None:
        """Later steps of this stream start after the step ``event`` was recorded behind."""
        card_runtime.wait_event(self._rt, self.id, event)

    def synchronize(self) -> None:
        """The host waits until everything submitted to this stream has completed."""
        card_runtime.synchronize(self._rt, self.id)

    def destroy(self) -> None:
        """Finish this stream's work and release its id; using it afterwards raises."""
        self._rt.queues.destroy(self.id)

    @property
    def token(self):  # noqa: ANN201 - device_model.streams.Token
        """The stream's current effect token."""
        return self._rt.queues.state(self.id).token

    def __enter__(self) -> Stream:
        card_runtime.push_stream(self._rt, self.id, self)
        return self

    def __exit__(self, *exc: object) -> None:
        card_runtime.pop_stream()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.id == self.id and other._rt is self._rt

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"<spyre Stream {self.id} ({self.priority})>"


def current_stream() -> Stream:
    """The stream launches go to: the innermost ``with spyre_jax.stream(s)``, else stream 0."""
    sid, handle = card_runtime.current_stream()
    if sid == DEFAULT_STREAM or not isinstance(handle, Stream):
        return Stream.default()
    return handle


def default_stream() -> Stream:
    return Stream.default()


@contextlib.contextmanager
def stream(s: Stream) -> Iterator[Stream]:
    """``with spyre_jax.stream(s):`` launches (jitted calls, device_put) go to stream ``s``."""
    if not isinstance(s, Stream):
        raise TypeError(f"spyre_jax.stream expects a spyre_jax.Stream, got {type(s).__name__}")
    card_runtime.push_stream(s._rt, s.id, s)  # a destroyed stream is refused here
    try:
        yield s
    finally:
        card_runtime.pop_stream()


def synchronize() -> None:
    """The host waits until every stream's work has completed."""
    card_runtime.synchronize()


def set_race_mode(mode: str) -> str:
    """``"raise"`` (default): a race raises :class:`RaceError`; ``"warn"``: a RaceWarning;
    ``"off"``: no check. Returns the previous mode."""
    if mode not in ("raise", "warn", "off"):
        raise ValueError(f"spyre: race mode must be 'raise', 'warn' or 'off', got {mode!r}")
    q = runtime().queues
    old, q.race_mode = q.race_mode, mode
    return old

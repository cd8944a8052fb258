"""The card's device memory (LPDDR5): an address-space allocator that also holds the payloads.

:class:`DeviceMemory` hands out ``alignment``-aligned regions of ``[0, capacity)`` by best fit
over a free list kept sorted by address (neighbours coalesce on free). It never allocates host
memory proportional to the capacity: the free list is a list of ``(start, size)`` pairs, with a
second ``(size, start)`` index so best fit is a bisection. Each live region may carry a payload
(the jax array holding its contents), which :meth:`DeviceMemory.free` drops.
"""

from __future__ import annotations

import threading
from bisect import bisect_left, insort

from .card import DEFAULT_CARD, CardSpec

__all__ = ["DeviceMemory", "DeviceOOMError", "format_bytes"]


def format_bytes(n: int) -> str:
    """``n`` bytes in decimal units with two decimals, e.g. ``"112.00 GB"``."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


class DeviceOOMError(MemoryError):
    """No free block of device memory fits a request. The allocator's state is unchanged."""

    def __init__(
        self, requested: int, in_use: int, limit: int, largest_free: int, what: str = ""
    ) -> None:
        self.requested = requested
        self.in_use = in_use
        self.limit = limit
        self.largest_free = largest_free
        for_what = f" for {what}" if what else ""
        super().__init__(
            f"spyre device memory: cannot allocate {format_bytes(requested)} ({requested} bytes)"
            f"{for_what}: {format_bytes(in_use)} in use of {format_bytes(limit)},"
            f" largest free block {format_bytes(largest_free)}"
        )


class DeviceMemory:
    """Best-fit allocator and store over the device address space ``[0, capacity)``.

    Sizes are rounded up to ``alignment`` (a zero-byte request takes one unit, so every
    allocation has a distinct address). A capacity that is not a multiple of ``alignment`` is
    rounded down. All public methods are thread-safe.
    """

    def __init__(self, capacity: int, alignment: int | None = None) -> None:
        if alignment is None:
            alignment = DEFAULT_CARD.stick_bytes
        if alignment <= 0:
            raise ValueError(f"alignment must be positive, got {alignment}")
        capacity -= capacity % alignment
        if capacity <= 0:
            raise ValueError(f"capacity must hold at least one {alignment}-byte unit")
        self.capacity = capacity
        self.alignment = alignment
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (start, size), sorted by start
        self._by_size: list[tuple[int, int]] = [(capacity, 0)]  # (size, start), sorted
        self._live: dict[int, int] = {}
        self._tags: dict[int, str] = {}
        self._payload: dict[int, object] = {}
        self._in_use = 0
        self._peak = 0
        self._num_allocs = 0
        self._largest_alloc = 0

    @classmethod
    def for_card(cls, card: CardSpec) -> DeviceMemory:
        """The usable (non-ECC) device memory of ``card``, aligned to its stick size."""
        return cls(card.device_memory_usable_bytes, card.stick_bytes)

    # ---- free-list primitives (caller holds the lock) ----
    def _largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def _alloc_locked(self, nbytes: int, tag: str) -> int:
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative size ({nbytes} bytes)")
        a = self.alignment
        size = (-(-nbytes // a) or 1) * a  # whole alignment units, at least one
        by_size = self._by_size
        i = bisect_left(by_size, (size, -1))
        if i == len(by_size):
            raise DeviceOOMError(nbytes, self._in_use, self.capacity, self._largest_free())
        block, start = by_size.pop(i)
        free = self._free
        j = bisect_left(free, (start, block))
        if block > size:  # the rest stays free where the block was (the list stays sorted)
            free[j] = (start + size, block - size)
            insort(by_size, (block - size, start + size))
        else:
            free.pop(j)
        self._live[start] = size
        self._tags[start] = tag
        self._in_use += size
        if self._in_use > self._peak:
            self._peak = self._in_use
        self._num_allocs += 1
        if size > self._largest_alloc:
            self._largest_alloc = size
        return start

    def _free_locked(self, addr: int) -> None:
        size = self._live.pop(addr, None)
        if size is None:
            raise ValueError(
                f"spyre device memory: free of address {addr:#x}, which is not a live allocation"
                " (double free or unknown address)"
            )
        del self._tags[addr]
        if self._payload:
            self._payload.pop(addr, None)
        self._in_use -= size
        free, by_size = self._free, self._by_size
        start, end = addr, addr + size
        j = bisect_left(free, (addr, 0))
        left = free[j - 1] if j > 0 and sum(free[j - 1]) == start else None
        if j < len(free) and free[j][0] == end:  # right neighbour is free: merged
            right = free[j][1]
            by_size.pop(bisect_left(by_size, (right, end)))
            end += right
            if left is not None:  # and the left one: the three are one block
                free.pop(j)
        if left is not None:
            by_size.pop(bisect_left(by_size, (left[1], left[0])))
            start = left[0]
            free[j - 1] = (start, end - start)
        elif end != addr + size:
            free[j] = (start, end - start)
        else:
            free.insert(j, (start, size))
        insort(by_size, (end - start, start))

    # ---- public API ----
    def alloc(self, nbytes: int, *, tag: str = "") -> int:
        """Allocate ``nbytes`` (rounded up to the alignment); return the region's address.

        Raises :class:`DeviceOOMError` when no free block fits (nothing changes) and
        ``ValueError`` for a negative size.
        """
        with self._lock:
            return self._alloc_locked(nbytes, tag)

    def allocate_many(self, sizes: list[int], *, tag: str = "") -> list[int]:
        """Allocate every size in ``sizes`` or none: on failure, undo and re-raise.

        After a failure the allocator is exactly as before, counters included.
        """
        with self._lock:
            if len(sizes) == 1:  # one region: refused before anything changes
                return [self._alloc_locked(sizes[0], tag)]
            saved = (self._peak, self._num_allocs, self._largest_alloc)
            made: list[int] = []
            try:
                for n in sizes:
                    made.append(self._alloc_locked(n, tag))
            except BaseException:
                for addr in reversed(made):
                    self._free_locked(addr)
                self._peak, self._num_allocs, self._largest_alloc = saved
                raise
            return made

    def free(self, addr: int) -> None:
        """Release the region at ``addr`` and its payload; ``ValueError`` if it is not live."""
        with self._lock:
            self._free_locked(addr)

    def release(self, addr: int) -> bool:
        """:meth:`free` if ``addr`` is a live region (True), else nothing (False)."""
        with self._lock:
            if addr not in self._live:
                return False
            self._free_locked(addr)
            return True

    def store(self, addr: int, data: object, nbytes: int | None = None) -> None:
        """Attach ``data`` (a jax array with the region's contents) to the live region ``addr``.

        ``nbytes``: the payload's size when the caller knows it (saves asking the array)."""
        with self._lock:
            size = self._require_live(addr, "store to")
            if nbytes is None:
                nbytes = getattr(data, "nbytes", None)
            if isinstance(nbytes, int) and nbytes > size:
                raise ValueError(
                    f"spyre device memory: {nbytes}-byte payload does not fit the {size}-byte"
                    f" region at {addr:#x}"
                )
            self._payload[addr] = data

    def load(self, addr: int) -> object:
        """The payload stored at the live region ``addr`` (``None`` if nothing was stored)."""
        with self._lock:
            self._require_live(addr, "load from")
            return self._payload.get(addr)

    def _require_live(self, addr: int, what: str) -> int:
        size = self._live.get(addr)
        if size is None:
            raise ValueError(
                f"spyre device memory: {what} address {addr:#x}, which is not a live allocation"
            )
        return size

    def size_of(self, addr: int) -> int:
        """The (rounded) size of the live region at ``addr``."""
        with self._lock:
            return self._require_live(addr, "size of")

    def tag_of(self, addr: int) -> str:
        """The tag given when the live region at ``addr`` was allocated."""
        with self._lock:
            self._require_live(addr, "tag of")
            return self._tags[addr]

    def live(self) -> dict[int, int]:
        """A copy of the live regions, address -> rounded size."""
        with self._lock:
            return dict(self._live)

    def __contains__(self, addr: object) -> bool:
        return addr in self._live

    def stats(self) -> dict[str, int]:
        """Counters named as in JAX's ``Device.memory_stats()`` (``num_allocs`` is cumulative)."""
        with self._lock:
            largest_free = self._largest_free()
            return {
                "bytes_in_use": self._in_use,
                "peak_bytes_in_use": self._peak,
                "bytes_limit": self.capacity,
                "bytes_reserved": 0,
                "num_allocs": self._num_allocs,
                "num_live_allocs": len(self._live),
                "largest_alloc_size": self._largest_alloc,
                "largest_free_block_bytes": largest_free,
                "largest_free_block": largest_free,
            }

    def reset_peak(self) -> None:
        """Restart the peak from the bytes in use now."""
        with self._lock:
            self._peak = self._in_use

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` unless live and free regions tile ``[0, capacity)`` exactly,
        aligned, with the free list sorted and coalesced and the counters consistent."""
        with self._lock:
            al = self.alignment
            _check(self._free == sorted(self._free), "free list not sorted by address")
            _check(sorted((s, a) for a, s in self._free) == self._by_size, "size index stale")
            regions = sorted(
                [(a, s, "live") for a, s in self._live.items()]
                + [(a, s, "free") for a, s in self._free]
            )
            pos, prev = 0, ""
            for start, size, kind in regions:
                _check(
                    start == pos, f"{kind} region at {start:#x}: expected {pos:#x} (gap/overlap)"
                )
                _check(
                    size > 0 and start % al == 0 and size % al == 0,
                    f"{kind} region ({start:#x}, {size}) empty or not {al}-aligned",
                )
                _check(not (kind == prev == "free"), f"adjacent free blocks at {start:#x}")
                pos, prev = start + size, kind
            _check(pos == self.capacity, f"regions end at {pos:#x}, capacity {self.capacity:#x}")
            total = sum(self._live.values())
            _check(self._in_use == total, f"bytes_in_use {self._in_use} != live sum {total}")
            _check(self._in_use <= self._peak, "peak below bytes in use")
            _check(set(self._payload) <= set(self._live), "payload on a dead region")


def _check(cond: bool, msg: str) -> None:
    """``assert`` that survives ``python -O``."""
    if not cond:
        raise AssertionError(f"spyre device memory invariant: {msg}")

"""Device marks from CUDA events: when a device call's work started and completed.

A group on a CUDA device marks each device call with a :class:`CudaMarks`
(made by the group's :class:`CudaMarker`), which the flight recorder keeps in
the call's entry (:class:`coordinator.trace.recorder.DeviceMarks`) and the
watchdog (:mod:`coordinator.trace.watchdog`) reads:

* **eager calls**: a *start* event is recorded on the current stream before
  the call is issued, an *end* event after it (:meth:`CudaMarks.finish`).
  Nothing waits for them: the call is *started* the first time someone sees
  the start event complete (everything queued before the call is done), and
  *completed* the first time someone sees the end event complete; the times
  are when it was seen (``time.monotonic_ns()``), so they are late by up to
  the time between two looks. An event is queried (``cudaEventQuery``), never
  synchronised on.
* **calls captured into a CUDA graph** (the current stream is capturing when
  the marks are made): no event is recorded; the call counts as started and
  completed at capture (it ran nothing then). :meth:`CudaMarks.finish`
  captures one increment of the call's slot in a device counter block into
  the graph, so each replay adds one; :meth:`CudaMarks.replays` reads the block
  (one copy to pinned memory on a private stream, waited for at most
  :data:`READ_WAIT_S`, never a synchronisation) when a dump asks. The block
  has :data:`COUNTER_SLOTS` slots per group, allocated with the marker
  (outside any capture: an allocation inside one would belong to the graph);
  calls captured after the slots ran out report ``replays`` None (unknown).
  Only the recorder's dumps read the counts: a marker made with
  ``count_replays=False`` (the recorder is off) has no block and captures no
  increment. A replayed call is not watched: its state stays what capture made it.
  A read of the block that finds another read in progress (a dump on a
  signal that interrupted one on the same thread, or another thread's) does not
  wait for it: it reports the counts unknown (None).

**Capture on another thread.** A query from the watchdog's thread while
another thread captures in CUDA's default (``global``) mode would invalidate
that capture. Each query therefore runs under the thread-local capture mode
(``cudaThreadExchangeStreamCaptureMode``, switched before the query and back
after, as PyTorch's own NCCL watchdog does), through the CUDA runtime library
this process already loaded. Where that library cannot be found (a static
runtime), queries run in the thread's own mode: capture with
``capture_error_mode="thread_local"`` then.

Importing this module touches no GPU and imports no CUDA library: torch's
CUDA functions run only when a marker is made (a group on a CUDA device).
Verified on one H200: eager marks follow their events, captured calls count
their replays, and the watchdog reads the marks of a stuck call
(``tests/gpu/test_watchdog_cuda.py``); a capture on another thread while the
watchdog queries is not.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from time import monotonic, monotonic_ns, sleep
from typing import Any

import torch

__all__ = ["COUNTER_SLOTS", "READ_WAIT_S", "CudaMarker", "CudaMarks"]

#: Captured calls per group whose replays are counted.
COUNTER_SLOTS = 8192
#: Seconds :meth:`CudaMarks.replays` waits for the counter block's copy.
READ_WAIT_S = 0.05
#: How long one copy of the counter block serves later reads (a dump reads
#: every captured call's count: one copy serves them all).
_READ_FRESH_NS = 500_000_000
_THREAD_LOCAL_MODE = 1  # cudaStreamCaptureModeThreadLocal


class CudaMarker:
    """Makes the :class:`CudaMarks` of one group's device calls (call it per call).

    Args:
        device: The group's CUDA device.
        count_replays: Count the replays of captured calls (see the module docstring).
    """

    def __init__(self, device: torch.device, count_replays: bool = True) -> None:
        self.device = torch.device(device)
        self._counters: torch.Tensor | None = (
            torch.zeros(COUNTER_SLOTS, dtype=torch.int64, device=self.device)
            if count_replays else None)
        self._next_slot = 0
        self._lock = threading.Lock()  # guards the counter block's reads (never waited for)
        self._host: torch.Tensor | None = None
        self._stream: Any = None
        self._read_at = 0
        self._read: list[int] | None = None

    def __call__(self) -> CudaMarks:
        """Marks for the device call about to be issued on the current stream."""
        stream = torch.cuda.current_stream(self.device)
        if torch.cuda.is_current_stream_capturing():
            if self._counters is None:
                return CudaMarks(self, stream, -1)
            slot = self._next_slot
            self._next_slot = slot + 1
            return CudaMarks(self, stream, slot if slot < COUNTER_SLOTS else -1)
        return CudaMarks(self, stream, None)

    def increment(self, slot: int) -> None:
        """Add one to counter ``slot`` on the current stream (captured: at each replay)."""
        if self._counters is not None:
            self._counters[slot].add_(1)

    def counts(self) -> list[int] | None:
        """The counter block as last read (a fresh read when older than half a
        second); None when there is no block, another read is in progress, or
        the copy did not land within :data:`READ_WAIT_S`."""
        if self._counters is None or not self._lock.acquire(blocking=False):
            return None
        try:
            now = monotonic_ns()
            if self._read is not None and now - self._read_at < _READ_FRESH_NS:
                return self._read
            if self._host is None:
                self._host = torch.empty(COUNTER_SLOTS, dtype=torch.int64, pin_memory=True)
                self._stream = torch.cuda.Stream(self.device)
            done = torch.cuda.Event()
            with thread_local_capture_mode(), torch.cuda.stream(self._stream):
                self._host.copy_(self._counters, non_blocking=True)
                done.record(self._stream)
            deadline = monotonic() + READ_WAIT_S
            while not _query(done):
                if monotonic() > deadline:
                    return None
                sleep(0.001)
            self._read, self._read_at = self._host.tolist(), now
            return self._read
        finally:
            self._lock.release()


class CudaMarks:
    """When one device call's work started and completed (see the module docstring).

    Made by :class:`CudaMarker`; ``slot`` is None for an eager call, the
    counter slot of a captured one (-1: none left, or none counted).
    ``marker`` may be None for marks of eager work only (a CUDA group's
    asynchronous point-to-point calls, :mod:`coordinator.p2p.cuda_p2p`).
    """

    __slots__ = ("_marker", "_stream", "_slot", "_start", "_end", "_started", "_done")

    def __init__(self, marker: CudaMarker | None, stream: Any, slot: int | None) -> None:
        self._marker = marker
        self._stream = stream
        self._slot = slot
        self._end: Any = None
        self._started: int | None = None
        self._done: int | None = None
        if slot is None:
            self._start: Any = torch.cuda.Event()
            self._start.record(stream)
        else:
            self._start = None

    @property
    def captured(self) -> bool:
        """Whether the call was captured into a CUDA graph."""
        return self._slot is not None

    def finish(self) -> None:
        """The call returned (or raised): record its end event, or capture its
        replay counter's increment. Called once, on the calling thread."""
        if self._slot is None:
            end = torch.cuda.Event()
            end.record(self._stream)
            self._end = end
            return
        if self._slot >= 0 and self._marker is not None:
            self._marker.increment(self._slot)
        self._started = self._done = monotonic_ns()

    def started_ns(self) -> int | None:
        """When the start event was first seen complete; None if not yet."""
        if self._started is None and self._start is not None and _query(self._start):
            self._started = monotonic_ns()
        return self._started

    def completed_ns(self) -> int | None:
        """When the end event was first seen complete; None if not yet (or not finished)."""
        if self._done is None and self._end is not None and _query(self._end):
            self._done = monotonic_ns()
            if self._started is None:
                self._started = self._done
        return self._done

    def replays(self) -> int | None:
        """How often the captured call ran in graph replays; None for an eager
        call, a call without a counter slot, or a counter block that could not
        be read in time."""
        if self._slot is None or self._slot < 0 or self._marker is None:
            return None
        counts = self._marker.counts()
        return None if counts is None else counts[self._slot]


def _query(event: Any) -> bool:
    """``event.query()`` under the thread-local capture mode (see the module docstring)."""
    with thread_local_capture_mode():
        return bool(event.query())


@contextlib.contextmanager
def thread_local_capture_mode() -> Iterator[None]:
    """This thread's CUDA calls inside run under ``cudaStreamCaptureModeThreadLocal``
    (other threads' captures do not restrict them); the thread's mode is restored
    after. Does nothing where the CUDA runtime library is not found."""
    fn = _exchange_mode()
    if fn is None:
        yield
        return
    mode = ctypes.c_int(_THREAD_LOCAL_MODE)
    if fn(ctypes.byref(mode)) != 0:
        yield
        return
    try:
        yield
    finally:
        fn(ctypes.byref(mode))  # the previous mode, which the first exchange wrote back


_EXCHANGE: list[Any] = []  # [function or None], found once


def _exchange_mode() -> Any:
    """``cudaThreadExchangeStreamCaptureMode`` of the CUDA runtime this process
    loaded (found in ``/proc/self/maps``; opening a loaded library returns it),
    or None."""
    if _EXCHANGE:
        return _EXCHANGE[0]
    fn = None
    with contextlib.suppress(OSError, AttributeError):
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
        for path in sorted(paths):
            with contextlib.suppress(OSError, AttributeError):
                lib = ctypes.CDLL(path)
                fn = lib.cudaThreadExchangeStreamCaptureMode
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
                break
    _EXCHANGE.append(fn)
    return fn

"""Emptying a writer's socket monitors while the writer is idle.

libzmq reports every TCP connection to the writer's public ports on their
monitors: a failed handshake for each one without a key (a port scan, a
health probe, an attacker), a disconnect for each one that ends. The
monitors' pipes are unbounded (:func:`~shm_broadcast.queue.transport.
open_monitor` says why a bound stops libzmq), so what nobody takes in stays
in memory. The writer takes them in with its control traffic, which is
often enough while it sends; a writer that sends nothing for hours (an
engine without requests) would keep every event of a connection flood.

:class:`MonitorDrain` empties the monitors from a daemon thread every
:data:`PERIOD_S` and keeps only what the writer needs of them: the number of
failed handshakes, and the set of descriptors whose connection ended (a set:
descriptors are reused, so it is no larger than the process's descriptor
table). The writer's :meth:`MonitorDrain.take` drains the sockets itself
before it answers, so what it returns includes every event libzmq reported
before the call (the writer relies on that when it maps a new connection's
descriptor: the end of an earlier connection on the same descriptor must
not be taken for the new one's).

Thread safety: a zmq socket may be used by several threads one at a time,
with a full memory barrier between them. Every use of the monitor sockets,
the writer's ``zmq.Poller`` on one included (:meth:`MonitorDrain.holding`),
happens under one lock; :meth:`MonitorDrain.stop` ends the thread before the
sockets are closed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import zmq

from shm_broadcast.queue.transport import count_failed_handshakes

__all__ = ["MonitorDrain", "PERIOD_S"]

#: Seconds between the thread's drains (a flood of a few thousand connections a
#: second leaves at most a few MB of events between two).
PERIOD_S = 0.2


class MonitorDrain:
    """Counts a writer's failed handshakes and ended connections in the background.

    Args:
        ctl_mon: Monitor of the control socket: failed handshakes and ended
            connections.
        pub_mon: Monitor of the data socket: failed handshakes.
        period: Seconds between the background drains.
    """

    def __init__(self, ctl_mon: zmq.SyncSocket, pub_mon: zmq.SyncSocket,
                 period: float = PERIOD_S) -> None:
        self._ctl_mon, self._pub_mon = ctl_mon, pub_mon
        self._period = period
        self._lock = threading.Lock()
        self._failed = 0
        self._gone: dict[int, None] = {}  # an ordered set of descriptors
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="groupcoord-monitor-drain",
                                        daemon=True)
        self._thread.start()

    def take(self) -> tuple[int, list[int]]:
        """Failed handshakes and ended connections' descriptors since the last call.

        Includes every event libzmq reported before this call.
        """
        with self._lock:
            self._drain_locked()
            failed, gone = self._failed, list(self._gone)
            self._failed = 0
            self._gone.clear()
        return failed, gone

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Keep the thread off the monitor sockets (while the caller polls them)."""
        with self._lock:
            yield

    def stop(self) -> None:
        """End the thread (idempotent); the monitor sockets may be closed after."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            with self._lock:
                if self._stop.is_set():
                    return
                try:
                    self._drain_locked()
                except zmq.ZMQError:  # the context is ending: the writer is closing
                    return

    def _drain_locked(self) -> None:
        if self._ctl_mon.closed or self._pub_mon.closed:
            return
        failed, gone = count_failed_handshakes(self._ctl_mon)
        failed_pub, _ = count_failed_handshakes(self._pub_mon)
        self._failed += failed + failed_pub
        for fd in gone:
            self._gone.pop(fd, None)  # re-inserted last: the set keeps the latest order
            self._gone[fd] = None

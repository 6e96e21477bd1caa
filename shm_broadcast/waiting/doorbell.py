"""Doorbells: how a parked queue side is woken, with one kernel wake-up.

A parked side (a reader waiting for a message, or the writer waiting for a
free chunk) sleeps in ``poll(2)`` on its own :class:`Doorbell`, a Unix
datagram socket bound to a file in the queue's private *channel directory*
(``0700``, created by the writer; see :func:`shm_broadcast.queue.transport.new_channel_dir`).
The other side rings it through a :class:`BellRinger` line -- one
non-blocking ``send`` on a datagram socket *connected* to that doorbell --
and only when the sleeper declared itself parked in shared memory, so the hot
path (a spinning peer) makes no syscall at all.

Protocol changes for private channels (what holds):

* A doorbell's path is ``<channel dir>/w`` (writer) or ``<channel dir>/r<i>``
  (reader slot ``i``). Another user can neither bind such a path nor send to
  it: the directory denies them search permission. (Abstract names, used
  before, have no permissions at all.)
* A ringer connects each line once (lazily, at the first ring that finds the
  doorbell bound, or eagerly through ``line.connect()``). A connected Unix
  datagram socket refers to the receiving *socket*, not to its path, so the
  writer can delete the whole directory once every reader is attached, and a
  line never reaches a socket bound later at the same path. Ringing a
  connected socket also skips the path lookup ``sendto`` would make.
* :meth:`Doorbell.ring_self` wakes the doorbell's own sleeper (``shutdown``
  from another thread) through a socket connected at bind time, so it too
  works after the path is gone.

Why not a zmq socket? A zmq message crosses two I/O threads before it reaches
the application (writer app -> writer I/O thread -> reader I/O thread ->
reader app), i.e. three sleeping threads to wake where a datagram wakes the
sleeper itself, once (docs/performance.md compares the two). zmq still
carries everything that has a payload (overflow messages, remote readers,
control).

Ringing is idempotent and lossy by design: a full socket buffer means the
sleeper has unread bells and will wake anyway; a dead sleeper is noticed by
the liveness checks, not here. Every park is bounded by
``WaitPolicy.park_poll_s``, so even a lost bell costs latency, never a hang.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
from collections.abc import Callable
from typing import Protocol, cast

__all__ = ["Doorbell", "BellRinger", "BellLine", "bell_address"]

_BELL = b"!"
#: ``select(2)`` handles descriptors below this (glibc's FD_SETSIZE).
_FD_SETSIZE = 1024


def bell_address(prefix: str, tag: str) -> str:
    """Return the path of doorbell ``tag`` (``"w"``, ``"r0"``...) of a queue.

    Args:
        prefix: The queue's channel directory followed by ``/`` (the handle's
            ``bell_prefix``).
        tag: The doorbell's name in it.
    """
    return prefix + tag


def _dgram() -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.setblocking(False)
    return s


class Doorbell:
    """The receiving end: one per sleeper.

    Args:
        address: From :func:`bell_address`; its directory must exist and be ours.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._self_line: socket.socket | None = None
        try:
            self._sock.bind(address)
            self._sock.setblocking(False)
            self._self_line = _dgram()
            self._self_line.connect(address)  # stays valid once the path is removed
        except BaseException:
            self.close()
            raise
        self._poller = select.poll()
        self._poller.register(self._sock.fileno(), select.POLLIN)

    def wait(self, timeout_s: float) -> bool:
        """Sleep until rung or ``timeout_s`` passed.

        Pending rings are *not* consumed (that would put a syscall on the
        woken side's critical path): call :meth:`drain` before declaring
        yourself parked, so that only rings sent after that wake you.

        Returns:
            Whether the bell was rung (now or before, and not yet drained).
        """
        return bool(self._poller.poll(max(1, int(timeout_s * 1000))))

    def sleep(self, timeout_s: float) -> bool:
        """Like :meth:`wait`, but to the microsecond (a planned sleep).

        ``poll(2)`` takes whole milliseconds; ``select(2)`` takes microseconds
        (the kernel adds the thread's timer slack, 50 us unless changed). A
        descriptor beyond ``select``'s limit falls back to ``poll`` rounded
        *down* to whole milliseconds: the caller's loop polls the rest, never
        oversleeps.

        Returns:
            Whether the bell was rung (not yet drained).
        """
        fd = self._sock.fileno()
        if fd < _FD_SETSIZE:
            return bool(select.select((fd,), (), (), timeout_s if timeout_s > 0 else 0)[0])
        return bool(self._poller.poll(int(timeout_s * 1000) if timeout_s > 0 else 0))

    def drain(self) -> None:
        """Discard rings received so far."""
        try:
            while True:
                self._sock.recv(16)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            pass

    def ring_self(self) -> None:
        """Wake this doorbell's sleeper (any thread; never blocks, never raises)."""
        line = self._self_line
        if line is not None:
            with contextlib.suppress(OSError):  # full (already rung) or closed
                line.send(_BELL)

    def close(self) -> None:
        """Close the socket and unlink its path (if still there). Idempotent.

        The channel directory may already be gone (the writer removes it once
        everyone is connected): that is not an error.
        """
        if self._self_line is not None:
            self._self_line.close()
            self._self_line = None
        if self._sock.fileno() < 0:
            return
        self._sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.address)


class BellLine(Protocol):
    """A line to one doorbell (:meth:`BellRinger.line`): call it to ring."""

    #: Connect now if not yet connected; returns whether the line is connected.
    connect: Callable[[], bool]

    def __call__(self) -> None:
        """Ring (a no-op until the doorbell is bound); never blocks, never raises."""


class BellRinger:
    """The sending end: one line per doorbell; lines never block and never raise."""

    def __init__(self) -> None:
        self._socks: list[socket.socket] = []

    def line(self, address: str) -> BellLine:
        """Return a function that rings the doorbell at ``address``.

        The function connects on its first call that finds the doorbell bound
        (earlier calls are no-ops) and from then on only sends; its attribute
        ``connect()`` connects now and says whether the line is connected. A
        plain closure, not an object with ``__call__``: ringing is on the
        writer's publish path, where a closure call is the cheapest call.
        """
        sock = _dgram()
        self._socks.append(sock)
        send = sock.send
        connected = [False]

        def connect() -> bool:
            if not connected[0]:
                try:
                    sock.connect(address)
                    connected[0] = True
                except OSError:  # not bound yet, gone, or the ringer is closed
                    pass
            return connected[0]

        def ring() -> None:
            if connected[0] or connect():
                try:  # noqa: SIM105 - the publish path: no context manager per ring
                    send(_BELL)
                except OSError:  # buffer full (already rung), peer closed, ringer closed
                    pass

        line = cast(BellLine, ring)
        line.connect = connect
        return line

    def close(self) -> None:
        """Close every line. Idempotent; rings after this are no-ops."""
        for s in self._socks:
            s.close()

"""The exit reaper: a tiny process that removes its owner's files once the owner is gone.

Started by :mod:`shm_broadcast.lifecycle.exit_cleanup` with the owner's first segment or
channel directory, as ``python -I -S reaper.py --groupcoord-reaper <owner pid>
<owner start ticks>`` (standard library only; it loads
:mod:`shm_broadcast.lifecycle.leftovers` by path, never the package). It is *detached*:
started in the background by a ``/bin/sh`` that exits at once, so it is not a
child of its owner (nothing for the owner to reap, nothing in the owner's
process tree) and runs in its own session. It ignores ``SIGINT``,
``SIGTERM`` and ``SIGHUP``, so the signal that ends its owner (a terminal's
Ctrl-C or hangup, ``kill`` of the owner's process group, a service manager's
``SIGTERM`` to every process of the unit) does not end it first. Without
``/bin/sh`` or a readable ``/proc`` it is started as the owner's child
instead (no start ticks on its command line).

Protocol (owner -> reaper, on the reaper's stdin; one line per change, each
written with a single ``write`` of less than ``PIPE_BUF`` bytes, so lines
never interleave)::

    +s <segment name>     the owner created a segment
    -s <segment name>     the owner removed it
    +d <directory path>   the owner created a channel directory
    -d <directory path>   the owner removed it

What holds:

* The owner is gone once it has exited. A detached reaper opens a pidfd of
  the owner's pid (Linux >= 5.3) and then checks that pid's start time
  (clock ticks since boot) against the owner's, given on its command line:
  if they differ, or the pid is gone or a zombie, the owner exited before
  the reaper got going (the pid may even name another process by then).
  Otherwise the pidfd names the owner itself and becomes readable when it
  exits, whatever happens to the pid afterwards.
  Without pidfds it polls ``/proc/<pid>/stat`` every half second: gone when
  the pid is missing, a zombie, or has another start time. A reaper started
  as the owner's child sleeps on the same pidfd and knows the owner gone when
  its parent pid changes (the kernel re-parents a child when its parent
  exits, and the parent cannot exit and come back).
* After the owner is gone, every line it wrote is already in the pipe: the
  reaper reads what is left without blocking (a child the owner forked
  without ``exec`` may still hold the write end, so it does not wait for
  end-of-file), then removes every segment (and owner record) and channel
  directory still registered, with the checks of
  :mod:`shm_broadcast.lifecycle.leftovers`, and exits.
* While the owner lives it removes nothing. End-of-file on stdin (the owner
  exec'd or closed the pipe) only stops reading; the reaper still waits for
  the owner's exit.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import select
import signal
import sys
from types import ModuleType

__all__ = ["MARKER", "OwnerWatch", "Registry", "main"]

#: First argument of a reaper's command line (how tests and ``ps`` recognise one).
MARKER = "--groupcoord-reaper"
_POLL_NO_PIDFD_S = 0.5
_MAX_LINE = 4096


def _load_leftovers() -> ModuleType:
    """:mod:`shm_broadcast.lifecycle.leftovers`, imported by path (the package is not on
    ``sys.path`` in isolated mode, and importing it would load zmq and msgspec)."""
    if __package__:
        from shm_broadcast.lifecycle import leftovers
        return leftovers
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "leftovers.py")
    spec = importlib.util.spec_from_file_location("_groupcoord_leftovers", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Registry:
    """What the owner still holds, rebuilt from its lines."""

    def __init__(self) -> None:
        self.segments: set[str] = set()
        self.dirs: set[str] = set()
        self._partial = b""

    def feed(self, data: bytes) -> None:
        """Apply the complete lines of ``data`` (a partial last line waits for more)."""
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        if len(self._partial) > _MAX_LINE:
            self._partial = b""  # not a line of ours; never grows without bound
        for raw in lines:
            self.apply(raw)

    def apply(self, raw: bytes) -> None:
        """Apply one line (without its newline); malformed lines are ignored."""
        if len(raw) < 4 or raw[2:3] != b" ":
            return
        op, what = raw[:2], os.fsdecode(raw[3:])
        target = {b"+s": self.segments, b"-s": self.segments,
                  b"+d": self.dirs, b"-d": self.dirs}.get(op)
        if target is None:
            return
        if op[:1] == b"+":
            target.add(what)
        else:
            target.discard(what)

    def remove_all(self, leftovers: ModuleType) -> None:
        """Remove every registered segment, record and channel directory."""
        for name in sorted(self.segments):
            leftovers.unlink_segment(name)
        for path in sorted(self.dirs):
            leftovers.remove_channel_dir(path)
        self.segments.clear()
        self.dirs.clear()


class OwnerWatch:
    """Tells whether the owner process has exited (see the module docstring).

    Args:
        owner: The owner's pid.
        start_ticks: Its start time in clock ticks since boot, for a detached
            reaper; None for a reaper that is the owner's child.
    """

    def __init__(self, owner: int, start_ticks: int | None) -> None:
        self.owner = owner
        self.start_ticks = start_ticks
        self.fd = -1
        self._exited = False
        try:
            self.fd = os.pidfd_open(owner)
        except ProcessLookupError:
            self._exited = True
        except (AttributeError, OSError):
            pass
        if start_ticks is not None and not self._exited and self._identity_changed():
            self._exited = True  # the pid already names another process

    def _identity_changed(self) -> bool:
        state_ticks = _state_and_ticks(self.owner)
        return state_ticks is None or state_ticks[0] == b"Z" or state_ticks[1] != self.start_ticks

    def gone(self) -> bool:
        """Whether the owner has exited (checked now, without blocking)."""
        if self._exited:
            return True
        if self.start_ticks is None:
            self._exited = os.getppid() != self.owner
        elif self.fd >= 0:
            self._exited = bool(select.select([self.fd], [], [], 0)[0])
        else:
            self._exited = self._identity_changed()
        return self._exited

    def poll_timeout_ms(self) -> int | None:
        """How long one wait may block: forever on a pidfd, else the polling period."""
        return None if self.fd >= 0 else int(_POLL_NO_PIDFD_S * 1000)


def _state_and_ticks(pid: int) -> tuple[bytes, int] | None:
    """``(state letter, start ticks)`` of process ``pid``, or None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        fields = raw[raw.rindex(b")") + 2:].split()
        return fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _read_available(fd: int, reg: Registry) -> bool:
    """Feed what can be read now; returns False at end-of-file."""
    while True:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return True
        except InterruptedError:
            continue
        except OSError:
            return False
        if not data:
            return False
        reg.feed(data)


def run(watch: OwnerWatch, stdin_fd: int = 0) -> Registry:
    """Follow the owner's lines until it is gone, then remove what it left.

    Returns:
        The (now empty) registry.
    """
    leftovers = _load_leftovers()
    reg = Registry()
    os.set_blocking(stdin_fd, False)
    reading = True
    poller = select.poll()
    poller.register(stdin_fd, select.POLLIN)
    if watch.fd >= 0:
        poller.register(watch.fd, select.POLLIN)
    while not watch.gone():
        try:
            events = poller.poll(watch.poll_timeout_ms())
        except InterruptedError:
            continue
        if reading and any(fd == stdin_fd for fd, _ in events):
            reading = _read_available(stdin_fd, reg)
            if not reading:
                poller.unregister(stdin_fd)
    if reading:
        _read_available(stdin_fd, reg)
    reg.remove_all(leftovers)
    return reg


def main(argv: list[str]) -> int:
    """``reaper.py --groupcoord-reaper <owner pid> [<owner start ticks>]``."""
    if (len(argv) not in (2, 3) or argv[0] != MARKER
            or not all(a.isdigit() for a in argv[1:])):
        print(f"usage: reaper.py {MARKER} <owner pid> [<owner start ticks>]", file=sys.stderr)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    watch = OwnerWatch(int(argv[1]), int(argv[2]) if len(argv) == 3 else None)
    if watch.fd < 0:
        os.closerange(3, 65536)  # inherited descriptors are not ours to hold
    else:
        _close_all_but(watch.fd)
    with contextlib.suppress(OSError):
        os.chdir("/")  # hold no directory busy
    run(watch)
    return 0


def _close_all_but(keep: int) -> None:
    """Close inherited descriptors (they are not ours to hold), keeping ``keep``."""
    os.closerange(3, keep)
    os.closerange(keep + 1, 65536)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

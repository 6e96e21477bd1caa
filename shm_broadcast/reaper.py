"""The exit reaper: a tiny process that removes its owner's files once the owner is gone.

Started by :mod:`shm_broadcast.exit_cleanup` with the owner's first segment or
channel directory, as ``python -I -S reaper.py --groupcoord-reaper <owner pid>``
(standard library only; it loads :mod:`shm_broadcast.leftovers` by path, never
the package). It runs in its own session and ignores ``SIGINT``, ``SIGTERM``
and ``SIGHUP``, so the signal that ends its owner (a terminal's Ctrl-C or
hangup, ``kill`` of the owner's process group, a service manager's
``SIGTERM`` to every process of the unit) does not end it first.

Protocol (owner -> reaper, on the reaper's stdin; one line per change, each
written with a single ``write`` of less than ``PIPE_BUF`` bytes, so lines
never interleave)::

    +s <segment name>     the owner created a segment
    -s <segment name>     the owner removed it
    +d <directory path>   the owner created a channel directory
    -d <directory path>   the owner removed it

What holds:

* The owner is gone exactly when this process's parent pid is no longer
  the owner's pid (the kernel re-parents a child when its parent exits, and
  the parent cannot exit and come back). The reaper sleeps on a pidfd of the
  owner (Linux >= 5.3), which becomes readable when the owner exits, and
  re-checks the parent pid; without pidfds it polls the parent pid every
  half second.
* After the owner is gone, every line it wrote is already in the pipe: the
  reaper reads what is left without blocking (a child the owner forked
  without ``exec`` may still hold the write end, so it does not wait for
  end-of-file), then removes every segment (and owner record) and channel
  directory still registered, with the checks of
  :mod:`shm_broadcast.leftovers`, and exits.
* While the owner lives it removes nothing. End-of-file on stdin (the owner
  exec'd or closed the pipe) only stops reading; the reaper still waits for
  the owner's exit.
"""

from __future__ import annotations

import importlib.util
import os
import select
import signal
import sys
from types import ModuleType

__all__ = ["MARKER", "Registry", "main"]

#: First argument of a reaper's command line (how tests and ``ps`` recognise one).
MARKER = "--groupcoord-reaper"
_POLL_NO_PIDFD_S = 0.5
_MAX_LINE = 4096


def _load_leftovers() -> ModuleType:
    """:mod:`shm_broadcast.leftovers`, imported by path (the package is not on
    ``sys.path`` in isolated mode, and importing it would load zmq and msgspec)."""
    if __package__:
        from shm_broadcast import leftovers
        return leftovers
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "leftovers.py")
    spec = importlib.util.spec_from_file_location("_groupcoord_leftovers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
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


def _owner_gone(owner: int) -> bool:
    return os.getppid() != owner


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


def run(owner: int, stdin_fd: int = 0) -> Registry:
    """Follow the owner's lines until it is gone, then remove what it left.

    Returns:
        The (now empty) registry.
    """
    leftovers = _load_leftovers()
    reg = Registry()
    try:
        pidfd = os.pidfd_open(owner)
    except (AttributeError, OSError):
        pidfd = -1
    os.set_blocking(stdin_fd, False)
    reading = True
    poller = select.poll()
    poller.register(stdin_fd, select.POLLIN)
    if pidfd >= 0:
        poller.register(pidfd, select.POLLIN)
    while not _owner_gone(owner):
        timeout = None if pidfd >= 0 else int(_POLL_NO_PIDFD_S * 1000)
        try:
            events = poller.poll(timeout)
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
    """``reaper.py --groupcoord-reaper <owner pid>``."""
    if len(argv) != 2 or argv[0] != MARKER or not argv[1].isdigit():
        print(f"usage: reaper.py {MARKER} <owner pid>", file=sys.stderr)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    os.closerange(3, 65536)  # descriptors the owner let it inherit are not ours to hold
    try:
        os.chdir("/")  # hold no directory busy
    except OSError:
        pass
    run(int(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

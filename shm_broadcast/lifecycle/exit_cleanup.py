"""Every segment and channel directory a process creates goes away when it ends.

The process-wide registry of what this process owns (``/dev/shm`` segments
with their owner records, queue channel directories with the sockets in
them), and the three paths that remove it:

1. **At interpreter exit** (``atexit``): normal exit, ``sys.exit``, an
   uncaught exception, an uncaught ``KeyboardInterrupt`` (the default
   ``SIGINT``), and an application signal handler that raises or calls
   ``sys.exit``. Synchronous: done before the process ends.
2. **On a fatal signal whose disposition is the default** (``SIGTERM``,
   ``SIGHUP``, ``SIGINT`` set to ``SIG_DFL``): a handler removes everything,
   restores ``SIG_DFL`` and re-raises the signal, so the process still dies
   by that signal (same exit status). Synchronous. Handlers can only be set
   from the main thread: they are installed at the first registration made
   there, and every later registration or removal there re-checks (a *safe
   point*; :func:`install_signal_hooks` is one more). A registration in
   another thread queues the installation for the main thread
   (``Py_AddPendingCall``), which runs it at its next bytecode boundary, as
   it would a signal handler. The handler itself runs in the main thread
   between bytecodes: a main thread blocked in one long C call when the
   signal comes (taken by another thread) delays it, and the death, until
   that call returns (``docs/lifecycle.md``, "Limits"). A signal that already
   has a handler (the application's, Python's ``SIGINT`` handler raising
   ``KeyboardInterrupt``) or is ignored is left alone: the application's
   handler decides whether the process ends (then path 1 or 3 cleans up) or
   carries on (then nothing may be removed: the queue is still in use). Not
   in a pid namespace's init (pid 1), which ignores default-action signals:
   there a handler would remove the files of a process that carries on.
3. **After the process is gone, however it ended** -- ``SIGKILL``, the OOM
   killer, ``os._exit``, a crash, a signal whose handler was replaced by the
   application after ours, a process whose main thread ran no Python code
   between a registration in another thread and the signal: the *reaper*
   (:mod:`shm_broadcast.lifecycle.reaper`), a small standard-library-only
   process started with the first registration, learns
   every registration and removal over a pipe and removes what is left when
   its owner exits (it waits on a pidfd; typically within milliseconds, not
   before the owner's exit).

Callers register a name before they create the file (see
:mod:`shm_broadcast.lifecycle.segment` and
:mod:`shm_broadcast.lifecycle.channel_dirs`), so no moment of a creation is
unknown here. Limits (documented in ``docs/security-channels.md``): when the
owner *and* its reaper die together (``SIGKILL`` to a whole cgroup or session
by hand, ``docker kill``), files can remain: ``groupcoord cleanup --yes``
removes them once their owner is provably gone. If the reaper cannot be started (no
``sys.executable``, no processes left), a ``RuntimeWarning`` says so and
paths 1 and 2 remain.

Only the creating process removes (a forked child inherits the registry
empty, and its copy of the reaper pipe is closed). Removal goes through
:mod:`shm_broadcast.lifecycle.leftovers`, which touches nothing but our own files.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any

from shm_broadcast.lifecycle import leftovers
from shm_broadcast.lifecycle.owner_identity import own_start_ticks
from shm_broadcast.lifecycle.reaper import MARKER

__all__ = ["EXIT_SIGNALS", "add_segment", "discard_segment", "add_dir", "discard_dir",
           "owns_dir", "remove_all", "install_signal_hooks", "reaper_pid"]

#: Fatal signals whose default action is handled (path 2 above).
EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
_REAPER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reaper.py")
_SH = "/bin/sh"
_FIND_S = 2.0  # how long reaper_pid() looks for a just-started detached reaper


class _ReaperLink:
    """This process's end of the pipe to its reaper.

    The reaper is started detached (see :mod:`shm_broadcast.lifecycle.reaper`): a
    ``/bin/sh`` started with ``posix_spawn`` puts it in the background and
    exits at once, so the reaper is not our child. Without ``/bin/sh`` or our
    start time (no ``/proc``) it is started as our child instead.
    """

    def __init__(self, owner: int) -> None:
        r, w = os.pipe()
        reaper = [sys.executable, "-I", "-S", _REAPER_PATH, MARKER, str(owner)]
        ticks = own_start_ticks()
        detached = ticks is not None and os.access(_SH, os.X_OK)
        if detached:  # $0 "$@" = the reaper's command; fd 3 becomes its stdin
            argv = [_SH, "-c", 'exec "$0" "$@" <&3 3<&- &', *reaper, str(ticks)]
            stdin = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                     (os.POSIX_SPAWN_DUP2, r, 3)]
        else:
            argv, stdin = reaper, [(os.POSIX_SPAWN_DUP2, r, 0)]
        try:
            pid = os.posix_spawn(
                argv[0], argv, dict(os.environ),
                file_actions=[*stdin, (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                              (os.POSIX_SPAWN_DUP2, 1, 2)],
                setsid=True, setsigmask=())
            if detached:
                os.waitpid(pid, 0)  # the shell exits once the reaper is started
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
        #: The reaper's pid when it is our child (None when detached).
        self.child_pid = None if detached else pid
        self.fd = w

    def send(self, line: bytes) -> bool:
        """Write one line; False if the reaper is gone (the pipe is broken)."""
        try:
            os.write(self.fd, line)
            return True
        except OSError:
            return False

    def close(self) -> None:
        """Close our end (the reaper keeps waiting for the owner's exit)."""
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def reap(self) -> None:
        """Collect the exit status of a reaper child that died while we live."""
        if self.child_pid is None:
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.child_pid, os.WNOHANG)


class ExitCleanup:
    """The registry (one per process: :data:`_REGISTRY`)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # re-entered by a signal handler in the main thread
        self._segments: dict[str, int] = {}  # name -> creating pid
        self._dirs: dict[str, int] = {}  # path -> creating pid
        self._atexit = False
        self._link: _ReaperLink | None = None
        self._reaper_failed = False
        self._pending = False  # a main-thread call is queued
        # (Py_AddPendingCall, the C callback that runs _pending_call)
        self._main_call: tuple[Callable[..., Any], object] | None = None

    # ------------------------------------------------------------ registry
    def add(self, kind: str, item: str) -> None:
        """Register a segment (``kind="s"``) or channel directory (``"d"``) just created."""
        table = self._segments if kind == "s" else self._dirs
        with self._lock:
            table[item] = os.getpid()
            if not self._atexit:
                self._atexit = True
                atexit.register(self.remove_all)
            self._tell(f"+{kind} {item}\n")
        if threading.current_thread() is threading.main_thread():
            self.install_signal_hooks()
        else:
            self._hooks_from_main_thread()

    def discard(self, kind: str, item: str) -> None:
        """Forget an item its owner has just removed."""
        table = self._segments if kind == "s" else self._dirs
        with self._lock:
            if table.pop(item, None) is not None:
                self._tell(f"-{kind} {item}\n")
        self.install_signal_hooks()

    def owns(self, kind: str, item: str) -> bool:
        """Whether this very process (not a parent it was forked from) created ``item``."""
        table = self._segments if kind == "s" else self._dirs
        return table.get(item) == os.getpid()

    def remove_all(self) -> None:
        """Remove everything this very process (not a parent) created.

        The names stay registered, and the reaper keeps them: another thread
        may be inside a creation when this runs at exit (between registering a
        name and writing its owner record, say) and finish it afterwards. The
        reaper removes such late files once the process is gone; for the names
        removed here its second attempt finds nothing, which is harmless since
        names are never reused.
        """
        me = os.getpid()
        with self._lock:
            segs = [n for n, pid in self._segments.items() if pid == me]
            dirs = [p for p, pid in self._dirs.items() if pid == me]
            for n in segs:
                leftovers.unlink_segment(n)
            for p in dirs:
                leftovers.remove_channel_dir(p)

    def reaper_pid(self) -> int | None:
        """Pid of this process's reaper (None before the first registration).

        A detached reaper is found by its command line, which it has once its
        shell's fork has exec'd Python: a moment after the start, so the search
        retries for up to ``_FIND_S``.
        """
        link = self._link
        if link is None:
            return None
        if link.child_pid is not None:
            return link.child_pid
        deadline = time.monotonic() + _FIND_S
        while True:
            pid = _find_reaper(os.getpid())
            if pid is not None or time.monotonic() > deadline:
                return pid
            time.sleep(0.005)

    # ------------------------------------------------------------ reaper
    def _tell(self, line: str) -> None:
        """Pass a change to the reaper, starting (or restarting) it as needed."""
        if "\n" in line[:-1]:
            return  # never registered: paths with newlines are refused at creation
        data = os.fsencode(line)
        if self._link is not None and self._link.send(data):
            return
        if self._link is not None:  # it died while we live: start another, tell it all
            self._link.close()
            self._link.reap()
            self._link = None
        me = os.getpid()
        lines = [f"+s {n}\n" for n, pid in self._segments.items() if pid == me]
        lines += [f"+d {p}\n" for p, pid in self._dirs.items() if pid == me]
        link = self._start_reaper() if lines else None
        if link is None:
            return  # nothing left to watch (a removal at exit needs no new reaper)
        for ln in lines:
            link.send(os.fsencode(ln))

    def _start_reaper(self) -> _ReaperLink | None:
        """Start a reaper and link to it; None if that failed (now or before)."""
        if self._reaper_failed:
            return None
        try:
            if not sys.executable:
                raise OSError("sys.executable is empty")
            self._link = _ReaperLink(os.getpid())
            return self._link
        except (OSError, NotImplementedError, ValueError) as e:
            self._reaper_failed = True
            warnings.warn(
                f"groupcoord could not start its exit reaper ({e}); shared-memory segments "
                f"and channel directories are removed at exit and on default fatal signals, "
                f"but not after SIGKILL or os._exit (run `groupcoord cleanup --yes`)",
                RuntimeWarning, stacklevel=3)
            return None

    def after_fork_in_child(self) -> None:
        """A forked child owns nothing yet; the parent's reaper is not its own."""
        self._lock = threading.RLock()  # another thread may have held it at fork time
        self._segments.clear()
        self._dirs.clear()
        if self._link is not None:
            self._link.close()
            self._link = None
        self._reaper_failed = False
        self._pending = False

    # ------------------------------------------------------------ signals
    def install_signal_hooks(self) -> None:
        """Handle every signal of :data:`EXIT_SIGNALS` whose disposition is ``SIG_DFL``.

        A safe point: no-op outside the main thread, and for signals that are
        ignored or have another handler.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        if os.getpid() == 1:
            # A namespace's init ignores default-action signals: a handler would
            # remove the files and the process would carry on without them.
            return
        for sig in EXIT_SIGNALS:
            try:
                if signal.getsignal(sig) is signal.SIG_DFL:
                    signal.signal(sig, self._on_signal)
            except (ValueError, OSError):  # pragma: no cover - embedded interpreters
                pass

    def _hooks_from_main_thread(self) -> None:
        """Have the main thread install the hooks at its next bytecode boundary.

        ``Py_AddPendingCall`` (CPython's C API, through ctypes) runs a function
        in the main thread at the point where it would run a signal handler.
        Best effort: elsewhere (another Python, the call queue full) the
        hooks wait for the next safe point in the main thread, and the reaper
        covers the exit meanwhile.
        """
        with self._lock:
            if self._pending:
                return  # already queued
            try:
                if self._main_call is None:
                    import ctypes

                    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
                    add = ctypes.pythonapi.Py_AddPendingCall
                    add.argtypes = [proto, ctypes.c_void_p]
                    add.restype = ctypes.c_int
                    # Kept for the life of the process: the C side calls it later.
                    self._main_call = (add, proto(self._pending_call))
                add_pending, callback = self._main_call
                self._pending = add_pending(callback, None) == 0
            except (ImportError, AttributeError, OSError, TypeError):
                self._pending = False

    def _pending_call(self, _arg: int | None) -> int:
        """Run by the main thread (see :meth:`_hooks_from_main_thread`)."""
        self._pending = False
        self.install_signal_hooks()
        return 0

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Remove what we own, then die by the signal as without us."""
        self.remove_all()
        signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})  # delivered right here
        signal.raise_signal(signum)


def _find_reaper(owner: int) -> int | None:
    """Pid of the detached reaper of ``owner`` (found by its command line in ``/proc``)."""
    want = [MARKER.encode(), str(owner).encode()]
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        for i in range(len(args) - 1):
            if args[i : i + 2] == want:
                return int(entry)
    return None


_REGISTRY = ExitCleanup()
os.register_at_fork(after_in_child=lambda: _REGISTRY.after_fork_in_child())


def add_segment(name: str) -> None:
    """Register segment ``name`` (in ``/dev/shm``), just created by this process."""
    _REGISTRY.add("s", name)


def discard_segment(name: str) -> None:
    """Forget segment ``name``: its owner unlinked it."""
    _REGISTRY.discard("s", name)


def add_dir(path: str) -> None:
    """Register channel directory ``path``, just created by this process."""
    _REGISTRY.add("d", path)


def discard_dir(path: str) -> None:
    """Forget channel directory ``path``: its owner removed it."""
    _REGISTRY.discard("d", path)


def owns_dir(path: str) -> bool:
    """Whether this process created channel directory ``path`` (and has not removed it)."""
    return _REGISTRY.owns("d", path)


def remove_all() -> None:
    """Remove every segment and channel directory this process created (idempotent)."""
    _REGISTRY.remove_all()


def install_signal_hooks() -> None:
    """Install the fatal-signal handlers now (call from the main thread).

    For an application whose queues are all created in other threads: after
    this, a default ``SIGTERM``/``SIGHUP``/``SIGINT`` removes them before the
    process dies instead of a few milliseconds after (by the reaper).
    """
    _REGISTRY.install_signal_hooks()


def reaper_pid() -> int | None:
    """Pid of this process's reaper, or None if none was started."""
    return _REGISTRY.reaper_pid()

"""A dump on a signal: ``GROUPCOORD_TRACE_SIGNAL=SIGUSR1``, then ``kill -USR1 <pid>``.

With ``GROUPCOORD_TRACE_SIGNAL`` set (a name, ``SIGUSR1`` or ``USR1``, or a
number), the first ``GroupCoordinator`` created on the main thread installs a
handler for that signal that writes this process's flight-recorder dump
(as :func:`coordinator.dump_trace` does, to
``<GROUPCOORD_TRACE_DUMP prefix><global rank>``), so a hung job can be dumped
from outside, rank by rank, without stopping it.

The application keeps its own handler: the one installed before is called
after the dump when it is a Python callable (``SIGINT``'s
``default_int_handler`` included). When it was ``SIG_DFL`` or ``SIG_IGN``
only the dump happens: ``SIGUSR1``'s default action would end the process,
which is not what asking for a dump means. A handler the application installs
later replaces this one (Python keeps one per signal).

Python runs signal handlers on the main thread only, and only the main thread
may install one: a group created on another thread installs nothing and logs
a warning (once); the next group created on the main thread installs it. An
unknown signal name or number, or a signal no handler can catch (``SIGKILL``,
``SIGSTOP``), raises ``ValueError`` naming ``GROUPCOORD_TRACE_SIGNAL`` when a
group is created, before it makes anything.

The handler never chains to itself: when the handler found at install time is
this module's own (installed again after an :func:`uninstall` that could not
put the previous one back), only the dump happens. :func:`uninstall`, like
:func:`install`, changes handlers on the main thread only.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

from coordinator.trace.dump import write_dump

__all__ = ["SIGNAL_ENV", "signal_from_env", "install_from_env", "install", "uninstall",
           "installed"]

logger = logging.getLogger(__name__)

SIGNAL_ENV = "GROUPCOORD_TRACE_SIGNAL"

_lock = threading.Lock()
#: The installed signal and the handler it had before, while installed.
_installed: tuple[int, Any] | None = None
_warned_thread = False


def signal_from_env() -> int | None:
    """The signal ``GROUPCOORD_TRACE_SIGNAL`` names; None when unset or empty.

    Raises:
        ValueError: The value names no signal of this platform.
    """
    raw = os.environ.get(SIGNAL_ENV, "").strip()
    if not raw:
        return None
    return _parse(raw)


#: Signals no handler can catch.
_UNCATCHABLE = frozenset(int(getattr(signal, n)) for n in ("SIGKILL", "SIGSTOP")
                         if hasattr(signal, n))


def _parse(raw: str) -> int:
    valid = signal.valid_signals()
    found: int | None = None
    if raw.lstrip("-").isdigit():
        num = int(raw)
        if num in valid and num != 0:
            found = num
    else:
        name = raw.upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        sig = getattr(signal.Signals, name, None) if name.isidentifier() else None
        if isinstance(sig, signal.Signals) and sig in valid:
            found = int(sig)
    if found is None:
        raise ValueError(f"{SIGNAL_ENV} must name a signal (SIGUSR1, USR1 or its number), "
                         f"got {raw!r}")
    if found in _UNCATCHABLE:
        raise ValueError(f"{SIGNAL_ENV} must name a signal a handler can catch (SIGUSR1, "
                         f"USR1 or its number), got {raw!r} ({_name(found)}, which cannot "
                         f"be caught)")
    return found


def installed() -> int | None:
    """The signal whose handler dumps, None when none is installed."""
    got = _installed
    return None if got is None else got[0]


def install_from_env() -> int | None:
    """Install the dump handler for ``GROUPCOORD_TRACE_SIGNAL`` if set and not yet
    installed (see the module docstring). Called at every group creation.

    Returns:
        The signal handled, or None.

    Raises:
        ValueError: ``GROUPCOORD_TRACE_SIGNAL`` names no signal.
    """
    signum = signal_from_env()
    if signum is None or installed() is not None:
        return installed()
    return install(signum)


def install(signum: int) -> int | None:
    """Make ``signum`` write a dump, chaining to the handler it had (see the module
    docstring). Does nothing off the main thread (a warning, once) or when a
    signal is already installed.

    Returns:
        The signal handled, or None when nothing could be installed.
    """
    global _installed, _warned_thread
    with _lock:
        if _installed is not None:
            return _installed[0]
        if threading.current_thread() is not threading.main_thread():
            if not _warned_thread:
                _warned_thread = True
                logger.warning("%s: a group was created off the main thread, where Python "
                               "cannot install signal handlers; the dump handler is "
                               "installed at the next group created on the main thread",
                               SIGNAL_ENV)
            return None
        previous = signal.getsignal(signum)
        if previous is _handler:  # never chain to itself
            previous = None
        signal.signal(signum, _handler)
        _installed = (signum, previous)
        return signum


def uninstall() -> bool:
    """Put back the handler the signal had before :func:`install` (for tests).

    Only the main thread may change handlers: elsewhere this does nothing.

    Returns:
        Whether the handler was put back (False: nothing installed, or not on
        the main thread).
    """
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return False
    with _lock:
        got, _installed = _installed, None
        if got is None:
            return False
        signal.signal(got[0], got[1] if got[1] is not None else signal.SIG_DFL)
        return True


def _handler(signum: int, frame: FrameType | None) -> None:
    """Dump, then call the handler installed before when it is a callable."""
    try:
        path = write_dump(reason=f"signal {_name(signum)}")
        logger.warning("flight recorder: signal %s, dump written to %s", _name(signum), path)
    except Exception as e:  # a dump that fails must not kill the process
        logger.warning("flight recorder: signal %s, the dump failed (%s: %s)", _name(signum),
                       type(e).__name__, e)
    got = _installed
    previous = got[1] if got is not None else None
    if callable(previous) and previous is not _handler:
        previous(signum, frame)


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:  # a real-time signal has a number only
        return str(signum)

"""Dumps the recorder writes by itself: when a call fails in a way worth a post-mortem,
and on demand (:func:`dump_trace`; on a signal: :mod:`coordinator.trace.signals`).

A group call that raises one of :data:`DUMPED_ERRORS` (a timeout, a dead peer, a
mismatch between ranks or a peer's rejection, a broken communicator) writes
this process's dump (:func:`coordinator.trace.dump.write_dump`) to
``<GROUPCOORD_TRACE_DUMP prefix><global rank>``, the reason naming the group,
the op, the call number and the error's class. Every rank of a group that
diverged raises, so every rank writes its file, and ``torchfrtrace DIR`` (or
``groupcoord trace DIR``) reads them together.

Once per error: the error is marked with the dump's path
(``error.trace_dump``, and a note that tracebacks show), and an error that
carries the mark, itself or through the errors it was raised from
(``raise ... from``), is not dumped again as it
passes up through an enclosing call. A dump that fails (a full disk, a
directory that cannot be created) is logged as a warning and never replaces
the call's own error. Argument errors (``TypeError`` / ``ValueError`` from a
rank's own checks) write nothing.
"""

from __future__ import annotations

import logging

from coordinator.trace.dump import write_dump
from coordinator.trace.recorder import GroupTrace
from device_comms.errors import add_note
from shm_broadcast.errors import CollectiveMismatch, CommTimeout, PeerDiedError

__all__ = ["DUMPED_ERRORS", "DUMP_ATTR", "dump_for_error", "dump_trace"]

logger = logging.getLogger(__name__)

#: The errors whose call writes a dump (``PeerRejectedError`` is a ``CollectiveMismatch``).
#: ``BrokenCommunicator`` is not one of them: it repeats, on every later call, a
#: failure whose own call dumped already (a timeout, a peer's death, the
#: watchdog's abort), and a dump per later call would replace that dump.
DUMPED_ERRORS = (CommTimeout, PeerDiedError, CollectiveMismatch)
#: The attribute a dumped error carries: the dump's path ("" when writing it failed).
DUMP_ATTR = "trace_dump"
#: Causes followed when looking for an earlier dump of the same failure.
_CHAIN_LIMIT = 8


def dump_for_error(trace: GroupTrace, op: str, seq: int, error: BaseException) -> str | None:
    """Write this process's dump for ``error``, raised by call ``seq`` (``op``) of
    ``trace``'s group, unless it is not one of :data:`DUMPED_ERRORS` or was
    dumped already. Never raises.

    Returns:
        The path written, or None when nothing was written.
    """
    if not isinstance(error, DUMPED_ERRORS) or _dumped(error):
        return None
    reason = (f"group {trace.name!r}, op {op}, call #{seq}: {type(error).__name__}")
    try:
        path = write_dump(trace.recorder, reason=reason)
    except Exception as e:  # the call's own error matters more than its dump
        logger.warning("flight recorder: could not write the dump for %s (%s: %s)", reason,
                       type(e).__name__, e)
        _mark(error, "")
        return None
    _mark(error, path)
    add_note(error, f"flight recorder dump of this rank: {path}")
    return path


def dump_trace(path: str | None = None) -> str:
    """Write this process's flight-recorder dump now; returns its path.

    Args:
        path: Where to write it; None: ``<GROUPCOORD_TRACE_DUMP prefix><global rank>``
            (default prefix ``<tempdir>/groupcoord-trace-<uid>/rank_``).

    The file is PyTorch's flight-recorder format (``torchfrtrace DIR`` reads a
    directory of them), owner-only, replaced atomically.
    """
    if path is not None and not isinstance(path, str):
        raise TypeError(f"path must be a str or None, got {type(path).__name__}")
    return write_dump(path=path, reason="on demand (coordinator.dump_trace)")


def _dumped(error: BaseException) -> bool:
    """Whether ``error``, or an error it was raised from, has been dumped."""
    seen: BaseException | None = error
    for _ in range(_CHAIN_LIMIT):
        if seen is None:
            return False
        if getattr(seen, DUMP_ATTR, None) is not None:
            return True
        seen = seen.__cause__  # a wrapped error; an error's context is another failure
    return False


def _mark(error: BaseException, path: str) -> None:
    setattr(error, DUMP_ATTR, path)

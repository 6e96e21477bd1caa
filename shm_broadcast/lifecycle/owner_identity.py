"""Who owns a file, recorded robustly enough to tell later whether the owner is gone.

Every segment (``/dev/shm/<name>.owner``) and queue channel directory
(``<dir>/owner``) gets an owner record at creation: a small JSON file, mode
``0600``, created with ``O_EXCL | O_NOFOLLOW``, holding the creator's
:class:`OwnerIdentity`: pid, pid-namespace inode (``/proc/self/ns/pid``),
start time (``/proc/self/stat``, clock ticks since boot), boot id
(``/proc/sys/kernel/random/boot_id``), uid and time-namespace inode.

:func:`judge_owner` decides, from the caller's point of view, whether that
owner is provably gone: the machine has rebooted since (other boot id), or,
seen from the same pid namespace, its pid does not exist or belongs to a
process with another start time (compared within one time namespace). When
that cannot be decided (the owner ran in another pid or time namespace, there
is no trustworthy record, ``/proc`` is not this process's) the answer is
``"unknown"`` with the reason, and callers keep the file.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["OwnerIdentity", "write_owner_record", "read_owner_record", "judge_owner",
           "own_start_ticks", "pid_exists", "PID_MAX"]

#: The largest process id there can be: ``pid_t`` is a C ``int`` (Linux hands
#: out at most ``2**22``). A larger number, in a file name or a record, names
#: no process, and ``os.kill`` refuses it with ``OverflowError``.
PID_MAX = 2**31 - 1

#: The integer fields of a record and the values each can hold: a pid, inode
#: numbers and start ticks (``unsigned long long``), a uid (``uid_t``).
_INT_FIELDS = (("pid", 1, PID_MAX), ("pidns", 0, 2**64 - 1), ("start_ticks", 0, 2**64 - 1),
               ("uid", 0, 2**32 - 1), ("timens", 0, 2**64 - 1))


@dataclass(frozen=True)
class OwnerIdentity:
    """Who created a segment, precisely enough to tell later whether it is gone.

    Attributes:
        pid: Process id, in the owner's pid namespace.
        pidns: Inode of the owner's pid namespace (``/proc/self/ns/pid``);
            0 when it could not be read.
        start_ticks: Process start time, clock ticks since boot (``/proc/<pid>/stat``).
        boot_id: ``/proc/sys/kernel/random/boot_id`` of the machine ('' if unknown).
        uid: Effective uid of the owner.
        timens: Inode of the owner's time namespace (``/proc/self/ns/time``;
            0 where the kernel has none): start times are comparable only
            within one.
    """

    pid: int
    pidns: int
    start_ticks: int
    boot_id: str
    uid: int
    timens: int = 0

    @classmethod
    def of_self(cls) -> OwnerIdentity:
        """This process's identity (fields it cannot read are 0 or '')."""
        pid = os.getpid()
        own_proc = _proc_is_ours()
        return cls(pid, _ns_inode("pid") if own_proc else 0,
                   (_start_ticks(pid) or 0) if own_proc else 0, _boot_id(), os.geteuid(),
                   _ns_inode("time") if own_proc else 0)


def write_owner_record(path: str, dir_fd: int | None = None) -> None:
    """Write this process's :class:`OwnerIdentity` to a new file ``path`` (0600).

    ``O_EXCL | O_NOFOLLOW``: never through a planted file or link. Best
    effort: without a record the owner's files are never removed by
    ``groupcoord cleanup``, only by the owner and its reaper.

    Args:
        path: The record's path (relative to ``dir_fd`` when given).
        dir_fd: Directory descriptor ``path`` is relative to.
    """
    ident = OwnerIdentity.of_self()
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        fd = os.open(path, flags, 0o600, dir_fd=dir_fd)
    except OSError:
        return
    try:
        os.write(fd, json.dumps(ident.__dict__).encode())
    except OSError:
        pass
    finally:
        os.close(fd)


def read_owner_record(path: str, owner_uid: int,
                      dir_fd: int | None = None) -> OwnerIdentity | str:
    """Read an owner record, or say why there is no trustworthy one.

    Args:
        path: The record's path (relative to ``dir_fd`` when given).
        owner_uid: Uid of the file the record describes; the record must be
            a regular file of that user, unreadable and unwritable by others.
        dir_fd: Directory descriptor ``path`` is relative to.

    Returns:
        The record's identity, or the reason there is none to trust (no
        record, not the owner's, malformed: see :func:`_identity_of`). Never
        raises for what the file holds.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return "no owner record (made by an older groupcoord, or the record was lost)"
    except OSError as e:
        return f"owner record unreadable ({e.strerror})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != owner_uid or st.st_mode & 0o077:
            return "owner record not written privately by the owner"
        raw = os.read(fd, 4096)
    finally:
        os.close(fd)
    try:
        d = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return "owner record malformed (not JSON)"
    return _identity_of(d)


def _identity_of(d: object) -> OwnerIdentity | str:
    """The :class:`OwnerIdentity` a decoded record states, or why it states none.

    Every integer field must be a JSON integer (``int`` exactly: no bool, no
    float, so neither ``Infinity`` nor ``1.5``) within its range, and
    ``boot_id`` a string; ``timens`` may be missing (records of releases before
    it was recorded), and means 0 then.
    """
    if not isinstance(d, dict):
        return f"owner record malformed (a JSON {type(d).__name__}, not an object)"
    fields = {"timens": 0, **d}
    values: dict[str, int] = {}
    for key, lo, hi in _INT_FIELDS:
        v = fields.get(key, _MISSING)
        if type(v) is not int:
            return f"owner record malformed ({key} is {_kind(v)}, not an integer)"
        if not lo <= v <= hi:
            shown = str(v) if len(str(v)) <= 30 else f"{str(v)[:20]}... ({len(str(v))} digits)"
            return f"owner record malformed ({key} {shown} is out of range ({lo} to {hi}))"
        values[key] = v
    boot_id = fields.get("boot_id", _MISSING)
    if type(boot_id) is not str:
        return f"owner record malformed (boot_id is {_kind(boot_id)}, not a string)"
    return OwnerIdentity(values["pid"], values["pidns"], values["start_ticks"], boot_id,
                         values["uid"], values["timens"])


_MISSING = object()


def _kind(v: object) -> str:
    """How a record's value is described in a reason: missing, or its type."""
    return "missing" if v is _MISSING else f"a {type(v).__name__}"


def judge_owner(pid: int, rec: OwnerIdentity | str, me: OwnerIdentity | None = None,
                exists: Callable[[int], bool] | None = None) -> tuple[str, str]:
    """``(status, reason)`` of an owner, seen from this process.

    Args:
        pid: The owner's pid as the file's name states it.
        rec: Its record (:func:`read_owner_record`), or why there is none.
        me: This process's identity (default: read now).
        exists: Whether a pid exists in this pid namespace (default ``kill(pid, 0)``).

    Returns:
        ``("gone" | "alive" | "unknown", reason)``; only ``"gone"`` may be removed.
        A ``pid`` no process can have (above :data:`PID_MAX`: not a name
        groupcoord made) is ``"unknown"``.
    """
    if not 0 < pid <= PID_MAX:
        # Checked before ``exists`` is asked, which need not take such a number.
        return "unknown", (f"pid {pid} is not a process id (1 to {PID_MAX}): groupcoord "
                           f"did not make this name")
    if me is None:
        me = OwnerIdentity.of_self()
    if exists is None:
        exists = pid_exists
    if isinstance(rec, OwnerIdentity) and rec.pid != pid:
        rec = f"owner record names pid {rec.pid}, the segment name pid {pid}"
    if isinstance(rec, str):
        if me.pidns and exists(pid):
            return "alive", f"pid {pid} exists ({rec})"
        return "unknown", rec
    if rec.boot_id and me.boot_id and rec.boot_id != me.boot_id:
        return "gone", f"created before the last reboot (boot id {rec.boot_id[:8]}...)"
    if not me.pidns or not rec.pidns:
        return "unknown", "pid namespace unknown (is /proc mounted for this pid namespace?)"
    if rec.pidns != me.pidns:
        return "unknown", (f"owner ran in another pid namespace (pid:[{rec.pidns}], this "
                           f"process is in pid:[{me.pidns}]); its pid cannot be checked from here")
    if not exists(pid):
        return "gone", f"no process {pid} in this pid namespace"
    if rec.timens != me.timens:
        return "unknown", (f"pid {pid} exists, but its start time cannot be compared from "
                           f"another time namespace (time:[{rec.timens}], ours time:[{me.timens}])")
    stat = _state_and_ticks(pid)
    if stat is None:
        return "unknown", f"cannot read the start time of process {pid}"
    state, now = stat
    if now != rec.start_ticks:
        return "gone", f"pid {pid} now belongs to another process (started at tick {now})"
    if state in (b"Z", b"X"):  # exited, waiting to be reaped: it can run no code
        return "gone", f"process {pid} has exited (a zombie its parent has not reaped yet)"
    return "alive", f"process {pid} (started at tick {now}) is running"


def own_start_ticks() -> int | None:
    """This process's start time in clock ticks since boot, or None without a
    ``/proc`` of this process's own pid namespace."""
    return _start_ticks(os.getpid()) if _proc_is_ours() else None


def pid_exists(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts).

    Never raises: a ``pid`` outside 1 to :data:`PID_MAX` names no process (and
    ``os.kill`` would raise ``OverflowError`` for one beyond a C ``int``).
    """
    if not 0 < pid <= PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _proc_is_ours() -> bool:
    """Whether ``/proc`` shows this process's pid namespace."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def _ns_inode(kind: str) -> int:
    """Inode of this process's ``kind`` namespace (0 if the kernel has none)."""
    try:
        return os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError:
        return 0


def _state_and_ticks(pid: int) -> tuple[bytes, int] | None:
    """``(state letter, start ticks since boot)`` of process ``pid`` from
    ``/proc/<pid>/stat``, or None if there is no such process to read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        fields = raw[raw.rindex(b")") + 2:].split()
        return fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _start_ticks(pid: int) -> int | None:
    stat = _state_and_ticks(pid)
    return None if stat is None else stat[1]


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""

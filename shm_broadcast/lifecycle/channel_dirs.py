"""Queue channel directories: create them with an owner, remove them, find the orphans.

A writer with local readers keeps its Unix sockets (doorbells ``w`` and
``r<i>``, overflow PUB ``p``, control ROUTER ``c``) in a private directory
(see :mod:`shm_broadcast.queue.transport` and ``docs/security-channels.md``):

* :func:`new_channel_dir` registers a fresh name with
  :mod:`shm_broadcast.lifecycle.exit_cleanup` (removed at exit, on a default fatal
  signal, and by the reaper after any death), makes the directory (``gc`` + 8
  random characters, ``0700``, under ``$XDG_RUNTIME_DIR``, the temp directory or
  ``/tmp``; ``mkdir`` fails on an existing name), and
  writes the owner record ``owner`` in it (mode ``0600``, the same
  :class:`~shm_broadcast.lifecycle.segment.OwnerIdentity` as a segment's record).
* :func:`remove_channel_dir` removes it (the writer, once its readers are
  connected or on close).
* :func:`list_channel_dirs` / :func:`remove_dead_channel_dirs`
  (``groupcoord cleanup``) find the directories whose owner and reaper were
  both killed, judge the owner exactly as for segments
  (:func:`~shm_broadcast.lifecycle.segment.judge_owner`: removed only when provably
  gone; another pid namespace, no record or an unreadable one: kept, with the
  reason), and remove them only through
  :func:`shm_broadcast.lifecycle.leftovers.remove_channel_dir`: our name pattern, a real
  directory of this user with mode ``0700``, holding only a queue's sockets
  and its owner record, never following a link. Directories of other users
  and look-alikes without our contents are not even listed.
"""

from __future__ import annotations

import os
import secrets
import stat
from dataclasses import dataclass

from shm_broadcast.errors import SegmentError
from shm_broadcast.lifecycle import exit_cleanup, leftovers
from shm_broadcast.lifecycle.owner_identity import (
    OwnerIdentity,
    judge_owner,
    read_owner_record,
    write_owner_record,
)

__all__ = [
    "ChannelDirInfo",
    "check_private_dir",
    "new_channel_dir",
    "remove_channel_dir",
    "remove_dead_channel_dir",
    "list_channel_dirs",
    "remove_dead_channel_dirs",
]

#: ``sun_path`` holds 108 bytes with the NUL; the longest name we put in a
#: channel directory is ``r`` + 6 digits.
_SUN_PATH_MAX = 107
_LONGEST_SOCKET = 7


def _dir_base() -> str:
    """The first usable base of :func:`shm_broadcast.lifecycle.leftovers.channel_dir_bases`."""
    for base in leftovers.channel_dir_bases():
        if os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
            return base
    raise OSError("no writable directory with a short path for the queue's local sockets "
                  "(tried $XDG_RUNTIME_DIR, the temp directory, /tmp)")


#: The characters of a channel directory's random part (as ``mkdtemp``'s).
_NAME_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_"


def _random_suffix() -> str:
    return "".join(secrets.choice(_NAME_CHARS) for _ in range(8))


def new_channel_dir() -> str:
    """Create a fresh private directory (``0700``, ours) for one queue's local sockets.

    It is made (``mkdir``, mode ``0700``, which fails on an existing name) under a
    random name, so it cannot be a directory another user prepared; owner and
    mode are checked again, and the owner record is written inside. The name is
    registered for removal before the directory exists, so a process that ends
    in between (another thread exiting it) leaves nothing behind.

    Returns:
        Its absolute path (every socket path in it fits ``sun_path``).

    Raises:
        OSError: No usable base directory, or the new directory is not private.
    """
    base = _dir_base()
    for _ in range(100):
        path = os.path.join(base, leftovers.CHANNEL_DIR_PREFIX + _random_suffix())
        exit_cleanup.add_dir(path)
        try:
            os.mkdir(path, 0o700)
            break
        except FileExistsError:
            exit_cleanup.discard_dir(path)
        except BaseException:
            exit_cleanup.discard_dir(path)
            raise
    else:  # pragma: no cover - 100 collisions of random names
        raise FileExistsError(f"no free channel directory name in {base}")
    try:
        st = os.lstat(path)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
            raise OSError(f"channel directory {path} is not private (mode {st.st_mode:o})")
        if len(os.fsencode(path)) + 1 + _LONGEST_SOCKET > _SUN_PATH_MAX:
            raise OSError(f"channel directory {path} is too long for Unix socket paths")
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            write_owner_record(leftovers.CHANNEL_OWNER_FILE, dir_fd=fd)
        finally:
            os.close(fd)
    except BaseException:
        remove_channel_dir(path)
        raise
    return path


def check_private_dir(path: str) -> None:
    """``path`` is a directory of this user that no one else may enter (``0700``),
    not a link: a queue's channel directory, before a reader binds or connects in it.

    Raises:
        SegmentError: It is missing, or not such a directory (another user may
            have re-created the name after its writer left).
    """
    try:
        st = os.lstat(path)
    except OSError as e:
        raise SegmentError(f"channel directory {path!r} is unusable: {e.strerror}") from e
    if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid()
            or stat.S_IMODE(st.st_mode) != 0o700):
        raise SegmentError(
            f"channel directory {path!r} is not private to this user (owner uid {st.st_uid}, "
            f"mode {stat.S_IMODE(st.st_mode):o}); refusing to use it: it is not the directory "
            f"its queue's handle names (another user may have re-created the name)")


def remove_channel_dir(path: str | None) -> None:
    """Remove this process's channel directory and the sockets in it; never raises.

    Only the process that created it removes it: a child forked from the
    writer (whose exit runs the writer's inherited finalizers) leaves it
    alone. Only what a queue puts there is removed (see
    :func:`shm_broadcast.lifecycle.leftovers.remove_channel_dir`); a directory holding
    anything else stays registered, so the reaper tries again after exit.
    """
    if not path or not exit_cleanup.owns_dir(path):
        return
    if leftovers.remove_channel_dir(path) is None:
        exit_cleanup.discard_dir(path)


def remove_dead_channel_dir(path: str) -> None:
    """Remove a dead writer's channel directory (for a reader cleaning up after it).

    Removes it only when its own owner record shows its owner provably gone
    (judged as ``groupcoord cleanup`` does), whatever the handle said about the
    writer, and touches only what a queue puts there (sockets ``w``, ``p``,
    ``c``, ``r<n>`` and the owner record) in a directory that looks exactly
    like one of ours: a wrong path in a handle, or a handle naming a dead
    writer with a live queue's directory, cannot make it delete anything
    else. Never raises.

    Args:
        path: The directory named by the writer's handle.
    """
    try:
        # What the directory and its record hold never raises here (a malformed
        # record, or one naming a pid no process can have, is judged "unknown");
        # left are the system's errors and a path with a NUL byte.
        info = _judge_dir(path, OwnerIdentity.of_self())
    except (OSError, ValueError):
        return
    if info is not None and info.status == "gone":
        leftovers.remove_channel_dir(path)


@dataclass(frozen=True)
class ChannelDirInfo:
    """One of our channel directories found on disk.

    Attributes:
        path: Absolute path.
        pid: Owner pid from its record (0 when there is no record).
        status: ``"alive"``, ``"gone"`` or ``"unknown"``; only ``"gone"`` is removed.
        reason: Why (for ``"unknown"``: why it cannot be decided).
        entries: Its entries (socket names and ``owner``).
    """

    path: str
    pid: int
    status: str
    reason: str
    entries: tuple[str, ...] = ()


def list_channel_dirs() -> list[ChannelDirInfo]:
    """Our channel directories under every base directory, with their owner judged.

    Listed: directories named ``gc`` + 8 characters, owned by this user with
    mode ``0700``, that hold our owner record or only a queue's sockets.
    Others are skipped silently (not ours to judge).

    Returns:
        One :class:`ChannelDirInfo` per directory, sorted by path.
    """
    me = OwnerIdentity.of_self()
    out = []
    for base in leftovers.channel_dir_bases():
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for n in names:
            if leftovers.CHANNEL_DIR_RE.match(n):
                info = _judge_dir(os.path.join(base, n), me)
                if info is not None:
                    out.append(info)
    return sorted(out, key=lambda i: i.path)


def _judge_dir(path: str, me: OwnerIdentity) -> ChannelDirInfo | None:
    """Judge one candidate; None if it is not recognisably ours."""
    entries, why = leftovers.inspect_channel_dir(path)
    rec = _record_of(path)
    if why is not None:
        if why == "gone" or not isinstance(rec, OwnerIdentity):
            return None  # vanished, or not ours: another user's, a link, a look-alike
        return ChannelDirInfo(path, rec.pid, "unknown", why)
    if isinstance(rec, str):
        if not any(leftovers.CHANNEL_SOCKET_RE.match(e) for e in entries):
            return None  # an empty look-alike
        return ChannelDirInfo(path, 0, "unknown", rec, tuple(entries))
    status, reason = judge_owner(rec.pid, rec, me)
    return ChannelDirInfo(path, rec.pid, status, reason, tuple(entries))


def _record_of(path: str) -> OwnerIdentity | str:
    """The directory's owner record, read without following any link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        return f"directory unreadable ({e.strerror})"
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            return "not this user's directory"
        return read_owner_record(leftovers.CHANNEL_OWNER_FILE, st.st_uid, dir_fd=fd)
    finally:
        os.close(fd)


def remove_dead_channel_dirs(dry_run: bool = False) -> list[tuple[ChannelDirInfo, str | None]]:
    """Remove every channel directory whose owner is provably gone.

    Args:
        dry_run: Only report; remove nothing.

    Returns:
        ``(info, None)`` for each removed (or, with ``dry_run``, removable)
        directory, ``(info, reason)`` for one that could not be removed.
    """
    out = []
    for info in list_channel_dirs():
        if info.status != "gone":
            continue
        out.append((info, None if dry_run else leftovers.remove_channel_dir(info.path)))
    return out

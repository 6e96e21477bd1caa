"""Removing this project's files safely: segments, owner records, channel directories.

The one place that deletes files on behalf of an owner that is gone (or
going). Three callers: the owner itself (``close``, exit, a fatal signal),
the owner's reaper process (:mod:`shm_broadcast.lifecycle.reaper`, after the owner
died) and ``groupcoord cleanup`` (after judging the owner gone). The module
uses the standard library only, because the reaper loads it by path without
importing the package.

What a removal touches, and what it never touches:

* **Segments** ``/dev/shm/gc_<kind>_<pid>_<hex>`` and their owner record
  ``<name>.owner``: only names of that exact form, each unlinked by name
  (``unlink`` never follows a symlink; a symlink planted under a record's
  name is itself removed, never its target).
* **Channel directories** ``gc<8 random chars>`` under a base directory
  (``$XDG_RUNTIME_DIR``, the temp directory, ``/tmp``): removed only when the
  name has that form, it is a real directory (``lstat``, never followed),
  owned by this effective uid, mode exactly ``0700``, and holds nothing but
  what a queue puts there: Unix sockets named ``w``, ``p``, ``c``, ``r<n>``
  and the regular file ``owner``. Everything is done relative to directory
  descriptors opened with ``O_NOFOLLOW``, and the directory opened is checked
  to be the one examined (same device and inode), so a path component
  swapped in between cannot redirect a removal. Anything unexpected keeps the
  directory, and the reason is returned.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import tempfile

__all__ = [
    "SHM_DIR",
    "SEGMENT_RE",
    "RECORD_SUFFIX",
    "CHANNEL_DIR_PREFIX",
    "CHANNEL_DIR_RE",
    "CHANNEL_SOCKET_RE",
    "CHANNEL_OWNER_FILE",
    "channel_dir_bases",
    "unlink_segment",
    "remove_channel_dir",
    "inspect_channel_dir",
]

SHM_DIR = "/dev/shm"
#: A segment's file name: ``gc_<kind>_<owner pid>_<random hex>``. The pid part
#: is any run of digits, so a name of this form may state a number no process
#: has (a file the user made by hand); whoever judges the owner checks it
#: (:func:`shm_broadcast.lifecycle.owner_identity.judge_owner` keeps such a file,
#: as one whose owner cannot be told).
SEGMENT_RE = re.compile(r"^gc_(?P<kind>[a-z0-9]+)_(?P<pid>\d+)_(?P<token>[0-9a-f]+)$")
RECORD_SUFFIX = ".owner"
#: ``tempfile.mkdtemp(prefix=CHANNEL_DIR_PREFIX)`` names: the prefix and 8
#: characters of ``[a-z0-9_]``.
CHANNEL_DIR_PREFIX = "gc"
CHANNEL_DIR_RE = re.compile(r"^gc[a-z0-9_]{8}$")
#: The sockets a queue binds in its channel directory: writer doorbell,
#: overflow PUB, control ROUTER, reader doorbells.
CHANNEL_SOCKET_RE = re.compile(r"^(w|p|c|r\d{1,6})$")
#: The owner record inside a channel directory.
CHANNEL_OWNER_FILE = "owner"
#: Longest base directory accepted (every socket path must fit ``sun_path``).
BASE_MAX = 64

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def channel_dir_bases() -> list[str]:
    """Where channel directories are made, in order of preference, without duplicates.

    ``$XDG_RUNTIME_DIR`` (per user, tmpfs), the temp directory, ``/tmp``;
    each only if it is short enough for socket paths and has no newline.
    """
    out: list[str] = []
    for base in (os.environ.get("XDG_RUNTIME_DIR"), tempfile.gettempdir(), "/tmp"):
        if not base or "\n" in base or len(os.fsencode(base)) > BASE_MAX:
            continue
        base = os.path.abspath(base)
        if base not in out:
            out.append(base)
    return out


def unlink_segment(name: str) -> bool:
    """Unlink segment ``name`` from ``/dev/shm`` and its owner record.

    Args:
        name: A segment name (``gc_<kind>_<pid>_<hex>``); anything else is
            refused.

    Returns:
        Whether the segment itself was still there and is now gone.
    """
    if not isinstance(name, str) or not SEGMENT_RE.match(name):
        return False
    removed = _unlink(os.path.join(SHM_DIR, name))
    _unlink(os.path.join(SHM_DIR, name + RECORD_SUFFIX))
    return removed


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def inspect_channel_dir(path: str) -> tuple[list[str], str | None]:
    """What a channel directory holds, or why it must not be touched.

    Returns:
        ``(entries, None)`` when ``path`` passes every check of the module
        docstring, else ``([], reason)``; ``reason`` is ``"gone"`` when the
        directory does not exist.
    """
    fds, reason = _open_checked(path)
    if fds is None:
        return [], reason
    base_fd, dir_fd = fds
    try:
        return _entries(dir_fd)
    finally:
        os.close(dir_fd)
        os.close(base_fd)


def remove_channel_dir(path: str | None) -> str | None:
    """Remove a channel directory that passes every check of the module docstring.

    Entries appearing while it runs (a reader binding its doorbell) are
    retried twice; the directory is kept if it still cannot be emptied.

    Args:
        path: The directory (None: nothing to do).

    Returns:
        None when the directory is gone (removed now or before), else the
        reason it was kept. Never raises.
    """
    if not path:
        return None
    for _ in range(3):
        fds, reason = _open_checked(path)
        if fds is None:
            return None if reason == "gone" else reason
        base_fd, dir_fd = fds
        try:
            entries, reason = _entries(dir_fd)
            if reason is not None:
                return reason
            for e in entries:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e, dir_fd=dir_fd)
            try:
                os.rmdir(os.path.basename(path), dir_fd=base_fd)
                return None
            except FileNotFoundError:
                return None
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    return f"cannot remove it: {e.strerror}"
        except OSError as e:
            return f"cannot remove it: {e.strerror}"
        finally:
            os.close(dir_fd)
            os.close(base_fd)
    return "entries keep appearing in it"


def _open_checked(path: str) -> tuple[tuple[int, int] | None, str | None]:
    """Open the base and the directory (``O_NOFOLLOW``) after checking name, type,
    owner and mode; ``(None, reason)`` if any check fails."""
    base, name = os.path.split(os.path.abspath(path))
    if not CHANNEL_DIR_RE.match(name):
        return None, f"{name!r} is not a channel directory name (gc + 8 characters)"
    try:
        base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        return None, "gone" if e.errno == errno.ENOENT else f"base unreadable: {e.strerror}"
    try:
        st = os.stat(name, dir_fd=base_fd, follow_symlinks=False)
        why = _check_dir_stat(st)
        if why is not None:
            os.close(base_fd)
            return None, why
        dir_fd = os.open(name, _DIR_FLAGS, dir_fd=base_fd)
    except OSError as e:
        os.close(base_fd)
        if e.errno == errno.ENOENT:
            return None, "gone"
        if e.errno == errno.ELOOP:
            return None, "is a symbolic link"
        return None, f"unreadable: {e.strerror}"
    st2 = os.fstat(dir_fd)
    if (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino) or _check_dir_stat(st2) is not None:
        os.close(dir_fd)
        os.close(base_fd)
        return None, "changed while it was examined"
    return (base_fd, dir_fd), None


def _check_dir_stat(st: os.stat_result) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if stat.S_IMODE(st.st_mode) != 0o700:
        return f"mode {stat.S_IMODE(st.st_mode):o}, not 700"
    return None


def _entries(dir_fd: int) -> tuple[list[str], str | None]:
    """The directory's entries if each is a queue socket or our owner record."""
    try:
        names = os.listdir(dir_fd)
    except OSError as e:
        return [], f"unreadable: {e.strerror}"
    for n in names:
        try:
            st = os.stat(n, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if CHANNEL_SOCKET_RE.match(n) and stat.S_ISSOCK(st.st_mode):
            continue
        if (n == CHANNEL_OWNER_FILE and stat.S_ISREG(st.st_mode)
                and st.st_uid == os.geteuid()):
            continue
        return [], f"holds {n!r}, which a queue does not create"
    return names, None

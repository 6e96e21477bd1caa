"""Named POSIX shared-memory segments that are never lost.

Every segment this project creates goes through :class:`SharedSegment`, which
gives the guarantees the rest of the code relies on:

* **Recognisable names.** ``gc_<kind>_<owner pid>_<random token>`` (for example
  ``/dev/shm/gc_mq_4242_1f0e9a2b``), so ``groupcoord cleanup`` can tell our
  segments from anyone else's and find those whose owner has died.
* **Private.** Created with mode ``0600`` and ``O_EXCL``.
* **No bus errors.** Before creating, free space in ``/dev/shm`` is checked and
  the pages are reserved with ``posix_fallocate``; a full ``/dev/shm`` raises
  :class:`ShmSpaceError` at creation instead of ``SIGBUS`` on a later write.
* **One owner unlinks.** Only the creating process (same pid, so not a forked
  child) unlinks: on :meth:`SharedSegment.close`, when the owning object is
  collected without a close (a queue nobody closed), and however the process
  ends -- at interpreter exit, on a fatal signal, and after ``SIGKILL`` or
  ``os._exit`` through its reaper process (:mod:`shm_broadcast.lifecycle.exit_cleanup`
  has the exact guarantee). Attaching processes never unlink and never
  register with :mod:`multiprocessing.resource_tracker` (which would warn
  about, or even unlink, segments it does not own).
* **Crash recovery that cannot hurt the living.** When an owner and its
  reaper were killed together, :func:`list_segments` and
  :func:`remove_orphans` (``groupcoord cleanup``) find and remove segments
  whose owner is *provably* gone (and :func:`list_orphan_records` the owner
  records left without their segment). Next to each segment the owner writes
  a record ``<name>.owner`` (mode 0600) of its identity; how an owner is
  judged gone, or undecidable (then the segment is kept and the reason
  reported), is in :mod:`shm_broadcast.lifecycle.owner_identity`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import stat
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from shm_broadcast.checks import check_int
from shm_broadcast.errors import SegmentError, ShmSpaceError
from shm_broadcast.lifecycle import exit_cleanup, leftovers
from shm_broadcast.lifecycle.owner_identity import (  # re-exported: the segment API names them
    OwnerIdentity,
    judge_owner,
    read_owner_record,
    write_owner_record,
)

try:  # CPython's own binding of shm_open/shm_unlink (POSIX only).
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX platforms
    _posixshmem = None

__all__ = [
    "PREFIX",
    "SHM_DIR",
    "SharedSegment",
    "SegmentInfo",
    "OwnerIdentity",
    "list_segments",
    "list_orphan_records",
    "remove_orphans",
    "remove_orphan_records",
    "remove_segment",
    "shm_free_bytes",
    "shm_total_bytes",
    "judge_owner",
    "read_owner_record",
    "write_owner_record",
]

PREFIX = "gc_"
SHM_DIR = leftovers.SHM_DIR
_NAME_RE = leftovers.SEGMENT_RE
_KIND_RE = re.compile(r"^[a-z0-9]{1,16}$")
# Headroom kept free in /dev/shm beyond the requested size.
_SPACE_MARGIN = 1 << 20


def shm_free_bytes() -> int:
    """Return the bytes available to unprivileged users in ``/dev/shm``.

    Returns:
        Free bytes, or ``-1`` when ``/dev/shm`` does not exist (non-Linux).
    """
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


def shm_total_bytes() -> int:
    """Return the size of the file system holding ``/dev/shm`` (-1 if there is none)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return -1
    return st.f_blocks * st.f_frsize


def _space_error(kind: str, size: int, free: int, cause: str = "") -> ShmSpaceError:
    total = shm_total_bytes()
    return ShmSpaceError(
        f"/dev/shm is too small: a {kind!r} segment needs {size / 2**20:.1f} MiB (plus "
        f"{_SPACE_MARGIN >> 20} MiB kept free), but /dev/shm holds {total / 2**20:.1f} MiB in "
        f"all and {free / 2**20:.1f} MiB are free{cause}. "
        f"Enlarge /dev/shm (docker: --shm-size=1g; a mount: `mount -o remount,size=1G "
        f"/dev/shm`), use smaller queues (max_chunk_bytes/max_chunks), or free space "
        f"(`groupcoord cleanup --yes` removes segments of dead processes).")


def _shm_open(name: str, flags: int, mode: int = 0o600) -> int:
    if _posixshmem is None:  # pragma: no cover
        raise SegmentError("POSIX shared memory is not available on this platform")
    fd: int = _posixshmem.shm_open("/" + name, flags, mode)
    return fd


def _check_private(name: str, st: os.stat_result) -> None:
    """A segment to attach is a regular file of this user that nobody else may
    open (segments are made ``0600``): anything else is not one of ours."""
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise SegmentError(
            f"shared memory segment {name!r} is not private to this user (owner uid "
            f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); refusing to attach: it is not "
            f"the segment its handle names (another user may have re-created the name)"
        )


class SharedSegment:
    """A mapped POSIX shared-memory segment.

    Create one with :meth:`create` (the owner) or :meth:`attach` (everyone
    else). Use as a context manager or call :meth:`close`.

    Attributes:
        name: Segment name without the leading slash (file in ``/dev/shm``).
        size: Size in bytes.
        is_owner: Whether this object created the segment and will unlink it.
        buf: A writable ``memoryview`` over the whole segment.
    """

    def __init__(self, name: str, size: int, mm: mmap.mmap, is_owner: bool) -> None:
        self.name = name
        self.size = size
        self._mmap: mmap.mmap | None = mm
        self.buf: memoryview = memoryview(mm)
        self.is_owner = is_owner
        self._owner_pid = os.getpid()
        self._dropped: weakref.finalize | None = None  # type: ignore[type-arg]

    @classmethod
    def create(cls, kind: str, size: int) -> SharedSegment:
        """Create and map a new segment owned by this process.

        Args:
            kind: Short lowercase tag naming the user (``"mq"``, ``"cpucomm"``...).
            size: Size in bytes, > 0.

        Returns:
            The owning :class:`SharedSegment`, zero-filled.

        Raises:
            ValueError: ``kind`` or ``size`` is malformed.
            ShmSpaceError: ``/dev/shm`` cannot hold ``size`` bytes.
            SegmentError: Creation failed for another reason.
        """
        if not isinstance(kind, str) or not _KIND_RE.match(kind):
            raise ValueError(f"kind must be 1-16 lowercase letters/digits, got {kind!r}")
        size = check_int(size, "size", minimum=1)
        free = shm_free_bytes()
        if free >= 0 and free < size + _SPACE_MARGIN:
            raise _space_error(kind, size, free)
        for _ in range(8):
            name = f"{PREFIX}{kind}_{os.getpid()}_{secrets.token_hex(4)}"
            # Registered before it exists: a process that ends between the two
            # steps (another thread exiting it) leaves nothing its exit paths do
            # not know of; removing a name that was never made is harmless.
            exit_cleanup.add_segment(name)
            try:
                fd = _shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                break
            except FileExistsError:
                exit_cleanup.discard_segment(name)
                continue
            except OSError as e:
                exit_cleanup.discard_segment(name)
                raise SegmentError(f"cannot create shared memory segment {name!r}: {e}") from e
        else:  # pragma: no cover - 8 collisions of a 32-bit token
            raise SegmentError("could not find a free shared memory segment name")
        try:
            write_owner_record(_record_path(name))
            os.ftruncate(fd, size)
            try:
                # Reserve every page now: a full tmpfs fails here (ENOSPC)
                # rather than with SIGBUS at the first write to a missing page.
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise _space_error(kind, size, max(shm_free_bytes(), 0),
                                   f" (reserving the pages failed: {e.strerror})") from e
            mm = mmap.mmap(fd, size)
        except BaseException:
            leftovers.unlink_segment(name)
            exit_cleanup.discard_segment(name)
            raise
        finally:
            os.close(fd)
        seg = cls(name, size, mm, is_owner=True)
        # An owner dropped without close() (a writer nobody closed) frees its name
        # when it is collected, not only when the process ends.
        seg._dropped = weakref.finalize(seg, _unlink_dropped, name, os.getpid())
        return seg

    @classmethod
    def attach(cls, name: str) -> SharedSegment:
        """Map an existing segment created by another process.

        Args:
            name: The owner's :attr:`name`.

        Returns:
            A non-owning :class:`SharedSegment`.

        Raises:
            SegmentError: The segment does not exist (its owner may have exited),
                or it is not private to this user: another user made it (a
                name re-created after its owner left) or others may write it.
        """
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"name must be a segment name without '/', got {name!r}")
        try:
            fd = _shm_open(name, os.O_RDWR, 0o600)
        except FileNotFoundError as e:
            raise SegmentError(
                f"shared memory segment {name!r} does not exist; its owner has probably "
                f"exited or closed it"
            ) from e
        try:
            st = os.fstat(fd)
            _check_private(name, st)
            size = st.st_size
            if size <= 0:
                raise SegmentError(f"shared memory segment {name!r} is empty")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, size, mm, is_owner=False)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._mmap is None

    def unlink(self) -> None:
        """Remove the name from ``/dev/shm`` (owner only; idempotent).

        The mapping stays valid for processes that already attached.
        """
        if self.is_owner and os.getpid() == self._owner_pid:
            if self._dropped is not None:
                self._dropped.detach()
            leftovers.unlink_segment(self.name)
            exit_cleanup.discard_segment(self.name)

    def close(self) -> None:
        """Unmap, and unlink if this process owns the segment. Idempotent."""
        if self._mmap is None:
            return
        self.unlink()
        mm, self._mmap = self._mmap, None
        self.buf.release()
        # Someone may still hold a view (a tensor over the buffer): the mapping
        # is then freed with the last reference. The name is already gone.
        with contextlib.suppress(BufferError):
            mm.close()

    def __enter__(self) -> SharedSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "owner" if self.is_owner else "attached"
        return f"SharedSegment({self.name!r}, size={self.size}, {role})"


def _unlink_dropped(name: str, owner_pid: int) -> None:
    """An owning :class:`SharedSegment` was collected without :meth:`~SharedSegment.close`:
    unlink its name (in the creating process only; a forked child's copy of the
    object owns nothing)."""
    if os.getpid() == owner_pid:
        leftovers.unlink_segment(name)
        exit_cleanup.discard_segment(name)


@dataclass(frozen=True)
class SegmentInfo:
    """One of our segments found in ``/dev/shm``.

    Attributes:
        name: File name in ``/dev/shm``.
        kind: The ``kind`` tag it was created with.
        pid: Owner process id.
        size: Size in bytes.
        owner_alive: False only when the owner is provably gone (so the
            segment may be removed); True when it is alive or undecidable.
        status: ``"alive"``, ``"gone"`` or ``"unknown"``.
        reason: Why ``status`` was decided (for ``"unknown"``: why it could not be).
    """

    name: str
    kind: str
    pid: int
    size: int
    owner_alive: bool
    status: str = "alive"
    reason: str = ""


def list_segments(pid_alive: Callable[[int], bool] | None = None) -> list[SegmentInfo]:
    """List this user's segments of this project in ``/dev/shm`` and judge whether their
    owners are gone (other users' files of the same form are not listed: not ours to judge).

    Args:
        pid_alive: Predicate deciding whether a pid exists in this process's
            pid namespace; None uses ``kill(pid, 0)``.

    Returns:
        One :class:`SegmentInfo` per segment, sorted by name.
    """
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    me = OwnerIdentity.of_self()
    out = []
    for n in sorted(names):
        m = _NAME_RE.match(n)
        if not m:
            continue
        try:
            st = os.lstat(os.path.join(SHM_DIR, n))
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            continue  # a segment is a regular file of ours: no planted link, no other user's
        pid = int(m.group("pid"))
        status, reason = judge_owner(pid, read_owner_record(_record_path(n), st.st_uid), me,
                                     pid_alive)
        out.append(SegmentInfo(n, m.group("kind"), pid, st.st_size, status != "gone",
                               status, reason))
    return out


def remove_segment(name: str) -> None:
    """Unlink one of our segments by name (no error if it is already gone).

    Raises:
        ValueError: ``name`` is not a groupcoord segment name.
    """
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"name must be a groupcoord segment name (gc_<kind>_<pid>_<hex>), got {name!r}")
    leftovers.unlink_segment(name)


def remove_orphans(dry_run: bool = False) -> list[SegmentInfo]:
    """Unlink every segment of ours whose owner is provably gone.

    Segments whose owner cannot be judged (``status == "unknown"``) are kept;
    :func:`list_segments` reports them with the reason.

    Args:
        dry_run: Only report; remove nothing.

    Returns:
        The orphaned segments (removed unless ``dry_run``).
    """
    orphans = [s for s in list_segments() if s.status == "gone"]
    if not dry_run:
        for s in orphans:
            leftovers.unlink_segment(s.name)
    return orphans


# ---------------------------------------------------------------------- orphan records
def list_orphan_records() -> list[str]:
    """Owner records in ``/dev/shm`` whose segment is gone (their owner died
    between unlinking the segment and its record, or an older release left
    them).

    Only regular files of this user named ``gc_<kind>_<pid>_<hex>.owner`` are
    listed. A record is written after its segment exists and removed after
    the segment is unlinked, and segment names are never reused, so a record
    without its segment never gets one back: removing it cannot hurt a live
    owner.

    Returns:
        The record file names, sorted.
    """
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    out = []
    for n in sorted(names):
        if not n.endswith(leftovers.RECORD_SUFFIX):
            continue
        seg = n[: -len(leftovers.RECORD_SUFFIX)]
        if not _NAME_RE.match(seg):
            continue
        try:
            st = os.lstat(os.path.join(SHM_DIR, n))
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            continue
        if not os.path.lexists(os.path.join(SHM_DIR, seg)):  # checked after the record
            out.append(n)
    return out


def remove_orphan_records(dry_run: bool = False) -> list[str]:
    """Remove the records :func:`list_orphan_records` finds.

    Returns:
        The records found (removed unless ``dry_run``).
    """
    found = list_orphan_records()
    if not dry_run:
        for n in found:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, n))
    return found


# ---------------------------------------------------------------------- owner identity
def _record_path(name: str) -> str:
    return os.path.join(SHM_DIR, name + leftovers.RECORD_SUFFIX)

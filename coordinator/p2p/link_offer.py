"""The offer that settles a link: what a sender sends, what a receiver accepts.

The first call of a direction (a tensor dict or a tensor) begins with ``[MAGIC, handle bytes]``
(a shared-memory link) or ``[MAGIC, None]`` (the CPU group) over the CPU
group (:mod:`coordinator.p2p.shm_links`). The receiver accepts a handle only
when it describes exactly what an honest sender of this library makes, so a
hostile group member cannot point it anywhere else (a TCP endpoint, another
host, a socket outside the queue's private directory, a ring of another
shape):

* this receiver's communicator shares memory with the sender;
* one reader, this rank, served through shared memory; no TCP endpoints;
* the ring's shape is the library's (:data:`CHUNK_BYTES`, :data:`CHUNKS`) and
  it has a segment name;
* both ``ipc://`` endpoints lie in the handle's channel directory;
* the writer is the sender's process: its pid as gathered when the group was
  built, on this host;
* the segment and the channel directory are the writer's own: the segment's
  name carries the writer's pid, the directory's owner record names it (a
  sender cannot point this rank at another process's queue);
* once mapped, the ring's own header describes the same shape (the queue's
  reader refuses any other).

Anything else raises :class:`~coordinator.errors.DecodeError` naming the
group and the sender, before anything is opened.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any

from coordinator.calls.group_view import GroupView
from coordinator.errors import DecodeError
from shm_broadcast.describe import describe

if TYPE_CHECKING:
    from shm_broadcast.queue.handle import Handle

__all__ = ["MAGIC", "MAX_HANDLE_BYTES", "CHUNK_BYTES", "CHUNKS", "offer",
           "check_offer"]

#: First element of every offer (and the link protocol's version).
MAGIC = "groupcoord-p2p-link/1"
#: Largest handle accepted (an honest one is a few hundred bytes).
MAX_HANDLE_BYTES = 1 << 16
#: Ring chunk of a link: a dict's message, or one part of its large tensors
#: (:mod:`coordinator.p2p.link_messages`), fits in one.
CHUNK_BYTES = 2 << 20
#: Chunks per link: how many dicts a sender may run ahead of its receiver.
CHUNKS = 2


def offer(handle: bytes | None) -> list[Any]:
    """The offer message: a link's handle bytes, or None for the CPU group."""
    return [MAGIC, handle]


def check_offer(got: Any, taker: GroupView, src: int, pid: int) -> Handle | None:
    """The handle of an acceptable offer from group rank ``src`` (None: the CPU group).

    ``pid``: the sender's process id as gathered when the group was built (0:
    unknown).

    Raises:
        DecodeError: ``got`` is not an offer, or its handle is not a link this
            library would make for this rank (see the module docstring).
    """
    where = f"group {taker.unique_name!r}: the first receive from rank {src}"
    if (type(got) is not list or len(got) != 2 or type(got[0]) is not str or got[0] != MAGIC
            or not (got[1] is None or type(got[1]) is bytes)):
        raise DecodeError(f"{where}: the first call of a direction begins with a link "
                          f"offer; got {type(got).__name__} {describe(got)}", peers=(src,))
    if got[1] is None:
        return None
    if len(got[1]) > MAX_HANDLE_BYTES:
        raise DecodeError(f"{where}: a link handle of {len(got[1])} bytes (at most "
                          f"{MAX_HANDLE_BYTES})", peers=(src,))
    from shm_broadcast.queue.handle import Handle

    try:
        handle = Handle.from_bytes(got[1])
    except ValueError as e:
        raise DecodeError(f"{where}: a malformed link handle ({e})", peers=(src,)) from None
    problem = _problem(handle, taker, src, pid)
    if problem:
        raise DecodeError(f"{where}: refused its link offer: {problem}", peers=(src,))
    return handle


def _problem(h: Handle, taker: GroupView, src: int, pid: int) -> str:
    """Why ``h`` is not a link an honest rank ``src`` makes for this rank ("": it is)."""
    if not taker.comm.shares_memory_with(src):
        return "this rank does not share memory with it"
    if h.n_reader != 1 or tuple(h.local_reader_ranks) != (taker.rank_in_group,):
        return f"readers {h.n_reader} / {tuple(h.local_reader_ranks)}, not this rank alone"
    if h.remote_pub is not None or h.remote_ctl is not None:
        return "it has TCP endpoints"
    if h.max_chunk_bytes != CHUNK_BYTES or h.max_chunks != CHUNKS or not h.segment:
        return f"a ring of {h.max_chunks} x {h.max_chunk_bytes} bytes ({h.segment!r:.60})"
    prefix = h.bell_prefix
    if not prefix or not prefix.startswith("/") or not all(
            type(e) is str and e.startswith("ipc://" + prefix) and ".." not in e
            for e in (h.local_pub, h.local_ctl)):
        return f"endpoints {h.local_pub!r:.80} / {h.local_ctl!r:.80} outside its channel directory"
    if h.writer_host != socket.gethostname() or (pid and h.writer_pid != pid):
        return (f"writer {h.writer_host!r:.60} pid {h.writer_pid}, not rank {src}'s process "
                f"(pid {pid or 'unknown'}) on this host")
    return _foreign(h)


def _foreign(h: Handle) -> str:
    """Why ``h``'s segment or channel directory belongs to a process other than its
    writer ("": both are the writer's), so that a sender cannot make this rank
    attach to, or connect into, another process's queue."""
    from shm_broadcast.lifecycle.leftovers import CHANNEL_DIR_RE, CHANNEL_OWNER_FILE, SEGMENT_RE
    from shm_broadcast.lifecycle.owner_identity import read_owner_record

    m = SEGMENT_RE.match(h.segment or "")
    if m is None or m.group("kind") != "mq" or int(m.group("pid")) != h.writer_pid:
        return f"segment {h.segment!r:.80} is not a queue ring of the writer (pid {h.writer_pid})"
    prefix = h.bell_prefix or ""
    where = prefix[:-1]
    endpoints = (f"ipc://{prefix}p", f"ipc://{prefix}c")
    if (not prefix.endswith("/") or not CHANNEL_DIR_RE.match(os.path.basename(where))
            or (h.local_pub, h.local_ctl) != endpoints):
        return f"channel directory {prefix!r:.80} or its endpoints are not a queue's"
    owner = read_owner_record(os.path.join(where, CHANNEL_OWNER_FILE), os.geteuid())
    if not isinstance(owner, str) and owner.pid != h.writer_pid:
        # (No record at all is accepted: a writer writes it on a best-effort basis.)
        return f"channel directory {where!r:.80} belongs to pid {owner.pid}, not the writer"
    return ""


"""Getting one ``ncclUniqueId`` to every rank of a group, without pickle.

Group rank 0 asks NCCL for the id (``ncclGetUniqueId``); the 128 bytes then
travel over the group's CPU side:

* a ``torch.distributed.ProcessGroup`` (a CPU group, e.g. gloo) broadcasts a
  ``uint8`` CPU tensor from the global rank of its rank 0: the 128 bytes and
  an 8-byte end mark. Gloo delivers a shorter message than a receiver posted
  without a word (a longer one aborts the receiver, so rank 0 never sends
  one): the receivers post a zero-filled buffer, and a message that stopped
  short leaves the end mark zero, which they refuse instead of taking the
  first bytes of an id with zeros (or, unfilled, old memory) after them;
* a stateless group (anything with ``rank``, ``world_size`` and
  ``broadcast_obj``, like :class:`coordinator.stateless.stateless_group.StatelessProcessGroup`)
  broadcasts the ``bytes`` object.

If rank 0 cannot create the id it still takes part in the broadcast, with
all-zero bytes (never a valid id), so the other ranks raise instead of waiting.
A rank that could not load NCCL at all takes part with an
:class:`UnusableLibrary`, and :func:`ranks_failed` then lets every rank give
up together.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from device_comms.cuda.pynccl.library import UNIQUE_ID_BYTES
from device_comms.errors import CommunicatorUnavailable

__all__ = ["exchange_unique_id", "group_rank_and_size", "ranks_failed", "UnusableLibrary"]

_FAILED = bytes(UNIQUE_ID_BYTES)  # what rank 0 sends when it has no id
# Ends a gloo broadcast of an id: a zero-filled receive buffer holds it only when the whole
# message came.
_END_MARK = b"NCCLUID\x01"
_MESSAGE_BYTES = UNIQUE_ID_BYTES + len(_END_MARK)


def group_rank_and_size(group: Any) -> tuple[int, int]:
    """``(rank, world_size)`` of this process in ``group`` (either kind of group).

    Raises:
        TypeError: ``group`` is neither a ProcessGroup nor a stateless group.
    """
    if isinstance(group, dist.ProcessGroup):
        return dist.get_rank(group), dist.get_world_size(group)
    if all(hasattr(group, a) for a in ("rank", "world_size", "broadcast_obj")):
        return int(group.rank), int(group.world_size)
    raise TypeError(
        f"group must be a torch.distributed.ProcessGroup (a CPU/gloo group) or a stateless "
        f"group with rank, world_size and broadcast_obj, got {type(group).__name__}"
    )


def exchange_unique_id(group: Any, lib: Any) -> bytes:
    """Create an NCCL unique id on group rank 0 and return it on every rank (collective).

    Args:
        group: A CPU ``ProcessGroup`` or a stateless group (see module doc).
        lib: An :class:`~device_comms.cuda.pynccl.library.NcclLibrary` (only rank 0 uses it).

    Returns:
        The same 128 bytes on every rank.

    Raises:
        TypeError: ``group`` is of neither kind.
        ValueError: ``group`` is a NCCL process group (it cannot carry CPU tensors).
        CommunicatorUnavailable: Rank 0 could not create the id, or the bytes
            received are not a unique id.
    """
    rank, _ = group_rank_and_size(group)
    if isinstance(group, dist.ProcessGroup):
        _check_cpu_group(group)
    uid, error = (_make_id(lib) if rank == 0 else (None, None))
    if isinstance(group, dist.ProcessGroup):
        got = _broadcast_tensor(group, uid if rank == 0 else None)
    else:
        got = group.broadcast_obj(uid if rank == 0 else None, src=0)
    if error is not None:
        raise error
    return _check_received(got, rank)


def _make_id(lib: Any) -> tuple[bytes, BaseException | None]:
    """Rank 0's id, or the failure marker and why; never bytes of another length
    (gloo would abort every receiver of a longer broadcast)."""
    try:
        uid = lib.unique_id()
    except Exception as e:  # still take part in the broadcast, then raise
        return _FAILED, e
    if not isinstance(uid, (bytes, bytearray)) or len(uid) != UNIQUE_ID_BYTES:
        size = f"{len(uid)} bytes" if isinstance(uid, (bytes, bytearray)) else type(uid).__name__
        return _FAILED, CommunicatorUnavailable(
            f"ncclGetUniqueId gave {size}, not a {UNIQUE_ID_BYTES}-byte id; nothing of it was "
            f"sent")
    return bytes(uid), None


def _check_cpu_group(group: dist.ProcessGroup) -> None:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        raise ValueError(
            f"group must be a CPU (gloo) process group to carry the NCCL unique id, got a "
            f"group with backend {backend!r}; pass the coordinator's cpu_group "
            f"(dist.new_group(ranks, backend='gloo'))"
        )


def _broadcast_tensor(group: dist.ProcessGroup, uid: bytes | None) -> bytes:
    """Rank 0's id (``uid`` there) on every rank; raises where the message stopped short."""
    if uid is not None:
        buf = torch.frombuffer(bytearray(uid + _END_MARK), dtype=torch.uint8)
    else:
        # Zero-filled: what a shorter message does not overwrite stays zero, end mark included.
        buf = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    src = dist.get_process_group_ranks(group)[0]  # global rank of group rank 0
    dist.broadcast(buf, src=src, group=group)
    got = buf.numpy().tobytes()
    if got[UNIQUE_ID_BYTES:] != _END_MARK:
        raise CommunicatorUnavailable(
            f"rank {dist.get_rank(group)}: the NCCL unique id from group rank 0 stopped short "
            f"of its end mark (a message shorter than the {_MESSAGE_BYTES} bytes an id takes "
            f"here, or not from this code); refused rather than used with a zero tail")
    return got[:UNIQUE_ID_BYTES]


def _check_received(got: Any, rank: int) -> bytes:
    if not isinstance(got, (bytes, bytearray)):
        raise CommunicatorUnavailable(
            f"rank {rank}: expected the NCCL unique id as bytes from group rank 0, "
            f"got {type(got).__name__}"
        )
    if len(got) != UNIQUE_ID_BYTES:
        raise CommunicatorUnavailable(
            f"rank {rank}: expected a {UNIQUE_ID_BYTES}-byte NCCL unique id from group rank 0, "
            f"got {len(got)} bytes"
        )
    if bytes(got) == _FAILED:
        raise CommunicatorUnavailable(
            f"rank {rank}: group rank 0 could not create an NCCL unique id "
            f"(ncclGetUniqueId failed there; see its error)"
        )
    return bytes(got)


def ranks_failed(group: Any, failed: bool) -> list[int]:
    """Group ranks whose ``failed`` is True (collective; same list on every rank).

    Lets every rank give up together when some rank cannot set up NCCL,
    instead of the others waiting in ``ncclCommInitRank``.
    """
    rank, n = group_rank_and_size(group)
    if isinstance(group, dist.ProcessGroup):
        flags = [torch.zeros(1, dtype=torch.int32) for _ in range(n)]
        dist.all_gather(flags, torch.tensor([int(failed)], dtype=torch.int32), group=group)
        return [r for r, f in enumerate(flags) if int(f.item())]
    if hasattr(group, "all_gather_obj"):
        got = group.all_gather_obj(bool(failed))
    else:
        got = [group.broadcast_obj(bool(failed) if r == rank else None, src=r) for r in range(n)]
    return [r for r, f in enumerate(got) if f]


class UnusableLibrary:
    """Stands in for the library on a rank that could not load it (setup only).

    Args:
        error: Why the library is unusable; :meth:`unique_id` (the one call
            setup makes on a rank's library) raises it.
    """

    def __init__(self, error: BaseException) -> None:
        self._error = error

    def unique_id(self) -> bytes:
        raise self._error

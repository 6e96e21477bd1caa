"""The shared-memory workspace of the CPU collective engine: layout, setup, views.

One segment per node and communicator, created by the node's first rank of the
group (its *leader*), attached by the node's other ranks, and **unlinked as
soon as every local rank has mapped it**. From then on the memory lives only
as long as some rank keeps it mapped, so nothing is left in ``/dev/shm`` even
if every rank is ``SIGKILL``-ed (the name is gone; the kernel frees the pages
with the last mapping). :class:`~shm_broadcast.lifecycle.segment.SharedSegment` still
unlinks at ``close()``/exit/``SIGTERM`` and ``groupcoord cleanup`` still finds
the segment should a rank die inside the short setup window.

Layout (``L`` local ranks, ``S`` = slot bytes)::

    offset 0     header: one 128-byte line per local rank (no false sharing)
                 +-----+--------+-------+-------+-------+-------+-------+-------+-----+--------+
    line of r:   | gen | closed | sigA0 | sigB0 | call0 | sigA1 | sigB1 | call1 | pid | parked |
                 +-----+--------+-------+-------+-------+-------+-------+-------+-----+--------+
                 (int64 words 0-9 of 16; only rank r writes its line; padded to 4 KiB)
    H            data, buffer parity 0: slot rank 0 | slot rank 1 | ... (L x S)
    H + L*S      data, buffer parity 1: slot rank 0 | slot rank 1 | ... (L x S)

Step ``s`` of the protocol (see :mod:`device_comms.cpu_shm.sync`) writes slots of
parity ``s % 2``; a rank writes only its own slot. Slots start on 4 KiB
boundaries, so a typed view of a whole slot is aligned for every dtype.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from device_comms.cpu_shm import futex
from shm_broadcast.errors import ShmBroadcastError
from shm_broadcast.lifecycle.segment import SharedSegment
from shm_broadcast.ranks.group_adapter import object_group

__all__ = [
    "LINE_WORDS",
    "GEN",
    "CLOSED",
    "SIG",
    "PID",
    "PARKED",
    "CALL",
    "PLACED",
    "ShmWorkspace",
    "WorkspacePlan",
    "open_workspace",
    "slot_bytes_for",
    "DEFAULT_SLOT_BYTES",
    "DEFAULT_WORKSPACE_BYTES",
    "workspace_segment_bytes",
]

SEGMENT_KIND = "cpucomm"
LINE_WORDS = 16  # int64 words per rank line (128 bytes: two cache lines)
GEN, CLOSED, PID, PARKED = 0, 1, 8, 9
PLACED = 10  # the CPU a rank waited on, and the step (device_comms.cpu_shm.placement)
SIG = (2, 5)  # word of (sigA, sigB, call number) for buffer parity 0 and 1
CALL = 2  # offset of the group's call number from a parity's SIG word
_PAGE = 4096


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


# Largest slot: large messages go through in pieces of this size. A piece must
# stay in cache between the writer's copy and the readers' reduction, so larger
# slots make large messages slower, not faster (measured in docs/performance.md).
DEFAULT_SLOT_BYTES = 2 << 20
# Default data bytes of one workspace, whatever the number of local ranks: a
# host holds one workspace per communicator (world, TP, PP, DP groups), all in
# /dev/shm. 8 MiB keeps 2 MiB slots for 2 ranks, 1 MiB for 4, 512 KiB for 8,
# so a TP=8 host's world and TP workspaces take 16 MiB of Docker's default
# 64 MiB /dev/shm (see docs/troubleshooting.md, "How much /dev/shm").
DEFAULT_WORKSPACE_BYTES = 8 << 20


def slot_bytes_for(total_bytes: int | None, local_size: int) -> int:
    """Bytes per slot when ``total_bytes`` of data are split into 2 x ``local_size`` slots.

    ``None`` means the default: :data:`DEFAULT_WORKSPACE_BYTES` in all, at
    most :data:`DEFAULT_SLOT_BYTES` per slot.
    """
    if total_bytes is None:
        per = DEFAULT_WORKSPACE_BYTES // (2 * local_size) // _PAGE * _PAGE
        return max(_PAGE, min(DEFAULT_SLOT_BYTES, per))
    return max(_PAGE, total_bytes // (2 * local_size) // _PAGE * _PAGE)


def workspace_segment_bytes(total_bytes: int | None, local_size: int) -> int:
    """Size of the segment :func:`open_workspace` creates for ``local_size`` ranks."""
    slot = slot_bytes_for(total_bytes, local_size)
    return _round_up(local_size * LINE_WORDS * 8, _PAGE) + 2 * local_size * slot


class ShmWorkspace:
    """Views into one mapped workspace segment for one local rank.

    Args:
        segment: The mapped segment (owned or attached).
        local_size: Ranks sharing the segment.
        local_rank: This rank's index among them.
        slot_bytes: Bytes of one slot.

    Attributes:
        hdr: The header as a writable ``memoryview`` of int64 words.
        local_size: Ranks sharing the segment.
        local_rank: This rank's index.
        slot_bytes: Bytes of one slot.
    """

    def __init__(
        self, segment: SharedSegment, local_size: int, local_rank: int, slot_bytes: int
    ) -> None:
        hdr_bytes = _round_up(local_size * LINE_WORDS * 8, _PAGE)
        need = hdr_bytes + 2 * local_size * slot_bytes
        if segment.size < need:
            raise ValueError(
                f"workspace segment {segment.name!r} has {segment.size} bytes, "
                f"the layout for {local_size} ranks x {slot_bytes}-byte slots needs {need}"
            )
        self.segment = segment
        self.local_size = local_size
        self.local_rank = local_rank
        self.slot_bytes = slot_bytes
        # Our own memoryviews (not segment.buf itself) so that segment.close()
        # can release its view even while a tensor still maps the memory.
        self._mv: memoryview | None = memoryview(segment.buf)
        self.hdr: memoryview = self._mv[:hdr_bytes].cast("q")
        self.hdr_address: int = futex.address_of(self._mv)
        self._data_address = self.hdr_address + hdr_bytes
        self._data_mv: memoryview | None = self._mv[hdr_bytes:need]
        data = torch.frombuffer(self._data_mv, dtype=torch.uint8)
        starts = [[(parity * local_size + rank) * slot_bytes for rank in range(local_size)]
                  for parity in (0, 1)]
        self._raw = [[data[start : start + slot_bytes] for start in row] for row in starts]
        self._typed: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def slot(self, parity: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """The whole slot of local ``rank`` in buffer ``parity`` as a flat ``dtype`` tensor."""
        key = (parity, rank, dtype)
        view = self._typed.get(key)
        if view is None:
            view = self._typed[key] = self._raw[parity][rank].view(dtype)
        return view

    def slot_address(self, parity: int, rank: int) -> int:
        """Address of the first byte of local ``rank``'s slot in buffer ``parity``.

        Valid while the workspace is mapped (until :meth:`close`).
        """
        return self._data_address + (parity * self.local_size + rank) * self.slot_bytes

    def slots(self, parity: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every rank's slot in buffer ``parity`` (flat ``dtype`` tensors, by local rank)."""
        return [self.slot(parity, rank, dtype) for rank in range(self.local_size)]

    def slot_elems(self, dtype: torch.dtype) -> int:
        """Elements of ``dtype`` one slot holds."""
        return self.slot_bytes // dtype.itemsize

    def line(self, rank: int) -> int:
        """Index in :attr:`hdr` of the first word of local ``rank``'s header line."""
        return rank * LINE_WORDS

    def close(self) -> None:
        """Drop every view and unmap (the name is already unlinked). Idempotent."""
        if self._mv is None:
            return
        self._typed.clear()
        self._raw = []
        mv, dmv = self._mv, self._data_mv
        self._mv = self._data_mv = None
        self.hdr.release()
        # The data view is still exported to the (now unreferenced) tensors;
        # dropping our references frees them, after which release succeeds.
        try:
            if dmv is not None:
                dmv.release()
            mv.release()
        except BufferError:  # a caller kept a tensor view; the mapping lives on with it
            pass
        self.segment.close()


@dataclass(frozen=True)
class WorkspacePlan:
    """Which ranks of a group share a workspace.

    Attributes:
        nodes: Node index of every group rank.
        local_ranks: Group ranks on this rank's node, ascending.
        local_rank: This rank's index in ``local_ranks``.
    """

    nodes: tuple[int, ...]
    local_ranks: tuple[int, ...]
    local_rank: int

    @classmethod
    def from_nodes(cls, nodes: Sequence[int], group_rank: int) -> WorkspacePlan:
        """Build the plan of ``group_rank`` from a node index per group rank."""
        mine = nodes[group_rank]
        local = tuple(rank for rank, node in enumerate(nodes) if node == mine)
        return cls(tuple(nodes), local, local.index(group_rank))


def open_workspace(
    cpu_group: Any, plan: WorkspacePlan, total_bytes: int | None
) -> tuple[ShmWorkspace | None, list[int], str | None]:
    """Create/attach this node's workspace. Collective over every rank of ``cpu_group``.

    The node leader creates the segment (``0600``), every rank learns the name
    through an object all-gather, attaches, and a second all-gather confirms;
    then the leader unlinks the name. If anything fails on any rank, every
    rank gets ``None`` (the caller falls back to gloo) and the reason.

    Args:
        cpu_group: The gloo group of the communicator.
        plan: Node membership from :meth:`WorkspacePlan.from_nodes`.
        total_bytes: Data bytes per workspace (split into ``2 x L`` slots);
            None for the default (:func:`slot_bytes_for`).

    Returns:
        ``(workspace or None, pid of every group rank, reason or None)``.
    """
    og = object_group(cpu_group)
    size = len(plan.local_ranks)
    leader = plan.local_ranks[0] == og.rank and size > 1
    seg: SharedSegment | None = None
    offer: tuple[str, Any, int] | None = None
    if leader:
        slot = slot_bytes_for(total_bytes, size)
        need = workspace_segment_bytes(total_bytes, size)
        try:
            seg = SharedSegment.create(SEGMENT_KIND, need)
            offer = ("ok", seg.name, slot)
        except (ShmBroadcastError, OSError, ValueError) as error:
            offer = ("err", f"rank {og.rank} could not create the workspace: {error}", 0)
    offers = og.all_gather(offer, op="open_workspace")
    ws: ShmWorkspace | None = None
    err: str | None = None
    if size > 1:
        kind, what, slot = offers[plan.local_ranks[0]]
        if kind != "ok":
            err = what
        else:
            try:
                mapped = seg if seg is not None else SharedSegment.attach(what)
                ws = ShmWorkspace(mapped, size, plan.local_rank, slot)
                ws.hdr[ws.line(plan.local_rank) + PID] = os.getpid()
            except (ShmBroadcastError, OSError, ValueError) as error:
                err = f"rank {og.rank} could not attach workspace {what!r}: {error}"
                if seg is not None:
                    seg.close()
    states = og.all_gather((err, os.getpid()), op="open_workspace")
    if seg is not None:
        seg.unlink()  # every local rank has it mapped (or gave up): drop the name
    errors = [error for error, _ in states if error is not None]
    pids = [int(pid) for _, pid in states]
    if errors:
        if ws is not None:
            ws.close()
        return None, pids, "; ".join(errors)
    return ws, pids, None

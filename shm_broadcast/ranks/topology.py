"""Which ranks of a group share a node (that is, can share ``/dev/shm``).

The test is direct: the source rank creates a small segment holding random
bytes, broadcasts its name, and every rank tries to attach and compare. Ranks
that see the same bytes share shared memory with the source, which is exactly
what the shared-memory transports need, whatever hostnames or network
namespaces say.

Override: when the environment variable ``GROUPCOORD_NODE_ID`` is set in a
process, that string is its node identity and the shared-memory test is
skipped for it. Tests use this to simulate several nodes on one machine
(``GROUPCOORD_NODE_ID=nodeA`` on some ranks, ``nodeB`` on others).
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from shm_broadcast.errors import DecodeError, SegmentError
from shm_broadcast.lifecycle.leftovers import SEGMENT_RE
from shm_broadcast.lifecycle.segment import SharedSegment
from shm_broadcast.ranks.agreement import agree
from shm_broadcast.ranks.group_adapter import object_group

__all__ = ["NODE_ID_ENV", "in_the_same_node_as", "node_assignment"]

NODE_ID_ENV = "GROUPCOORD_NODE_ID"
_MAGIC_LEN = 16
#: Longest node identity (``GROUPCOORD_NODE_ID``) a source may announce.
_MAX_NODE_ID = 4096
#: What a rank contributes to the verdict when it could not read the source's record.
_UNREADABLE = "unreadable"
#: First field of the source's record when it could not create its segment.
_FAILED = "!failed"


def in_the_same_node_as(group: Any, source_rank: int = 0, name: str | None = None) -> list[bool]:
    """Tell, for every rank of ``group``, whether it shares a node with ``source_rank``.

    Collective: every rank of the group must call it, with the same
    ``source_rank`` (the ranks agree on it first: a rank whose ``source_rank``
    is bad raises ``TypeError``/``ValueError`` and the others
    ``PeerRejectedError``; different ones raise ``CollectiveMismatch``).

    Args:
        group: torch ProcessGroup (CPU-capable) or StatelessProcessGroup.
        source_rank: Group rank to compare against.
        name: The group's name, for errors (default: the process group's).

    Returns:
        ``result[i]`` is True when group rank ``i`` is on the source's node.

    Raises:
        TypeError: ``source_rank`` is not an int.
        ValueError: ``source_rank`` is out of range.
        SegmentError: The source could not create its probe segment (on the
            source its own error, ``ShmSpaceError`` when ``/dev/shm`` is full;
            on the others a ``SegmentError`` naming the source and the cause).
    """
    og = object_group(group)
    label = name or getattr(group, "group_name", "") or "unnamed"
    problem: BaseException | None = None
    if not isinstance(source_rank, int) or isinstance(source_rank, bool):
        problem = TypeError(f"source_rank must be an int, got {type(source_rank).__name__}")
    elif not 0 <= source_rank < og.world_size:
        problem = ValueError(
            f"source_rank must be an int in [0, {og.world_size}), got {source_rank!r}")
    if og.world_size == 1:
        if problem is not None:
            raise problem
        return [True]
    agree(og, problem, "in_the_same_node_as", label, source_rank)
    override = os.environ.get(NODE_ID_ENV) or None
    seg: SharedSegment | None = None
    info: Any
    failure: BaseException | None = None
    try:
        if og.rank == source_rank:
            magic = secrets.token_bytes(_MAGIC_LEN)
            if override is None:
                try:
                    seg = SharedSegment.create("node", _MAGIC_LEN)
                    seg.buf[:_MAGIC_LEN] = magic
                    info = (seg.name, magic, None)
                except (SegmentError, OSError) as e:  # the others are told, then this raises
                    failure, info = e, (_FAILED, f"{type(e).__name__}: {e}"[:_MAX_NODE_ID])
            else:
                info = (None, magic, override)
        else:
            info = None
        raw = og.broadcast(info, src=source_rank, op="in_the_same_node_as", name=label)
        if failure is not None:
            raise failure
        if isinstance(raw, (list, tuple)) and len(raw) == 2 and raw[0] == _FAILED:
            why = raw[1] if isinstance(raw[1], str) else "no reason given"
            raise SegmentError(
                f"group {label!r}, op in_the_same_node_as: the source (rank {source_rank}) "
                f"could not create its probe segment ({why})")
        record = _checked_record(raw)
        same: bool | str
        if og.rank == source_rank:
            same = True
        elif record is None:
            same = _UNREADABLE  # every rank learns it from the verdict below
        else:
            name, magic, src_override = record
            if override is not None or src_override is not None:
                same = override == src_override
            else:
                same = _sees_segment(name, magic)
        flags = og.all_gather(same, op="in_the_same_node_as", name=label)
    finally:
        if seg is not None:
            seg.close()
    return _checked_flags(flags, source_rank)


def _checked_record(info: Any) -> tuple[str | None, bytes, str | None] | None:
    """The source's ``(segment name, magic, node id)``, or None when it is malformed.

    A name must be one of our segment names (so a peer cannot point
    :meth:`SharedSegment.attach` anywhere else), the magic exactly
    ``_MAGIC_LEN`` bytes, and a node id a str of at most ``_MAX_NODE_ID``
    characters.
    """
    if type(info) is not tuple or len(info) != 3:
        return None
    name, magic, node_id = info
    if name is not None and not (isinstance(name, str) and SEGMENT_RE.fullmatch(name)):
        return None
    if type(magic) is not bytes or len(magic) != _MAGIC_LEN:
        return None
    if node_id is not None and not (isinstance(node_id, str) and len(node_id) <= _MAX_NODE_ID):
        return None
    if (name is None) == (node_id is None):
        return None
    return name, magic, node_id


def _checked_flags(flags: list[Any], source_rank: int) -> list[bool]:
    """Every rank's verdict as bools; raises on every rank when one is not a bool.

    Raises:
        DecodeError: A rank could not read the source's record (the source
            sent a malformed one), or a rank's verdict is not a bool.
    """
    if all(type(f) is bool for f in flags):
        return list(flags)
    if any(f == _UNREADABLE for f in flags):
        raise DecodeError(
            f"in_the_same_node_as: the node record of source rank {source_rank} is malformed "
            f"(expected (segment name, {_MAGIC_LEN} random bytes, None) or (None, "
            f"{_MAGIC_LEN} random bytes, node id), a node id of at most {_MAX_NODE_ID} "
            f"characters: check {NODE_ID_ENV} on that rank); no rank used it")
    bad = [r for r, f in enumerate(flags) if type(f) is not bool]
    raise DecodeError(
        f"in_the_same_node_as: rank(s) {bad} answered something other than True/False "
        f"({', '.join(type(flags[r]).__name__ for r in bad)}); no rank used the answers")


def _sees_segment(name: str | None, magic: bytes) -> bool:
    if name is None:
        return False
    try:
        with SharedSegment.attach(name) as seg:
            return bytes(seg.buf[:_MAGIC_LEN]) == magic
    except (SegmentError, OSError):
        return False


def node_assignment(group: Any, name: str | None = None) -> list[int]:
    """Number the nodes of ``group`` and give each rank its node index.

    Collective. Node 0 is the node of rank 0; nodes are numbered in order of
    their lowest rank. Costs one :func:`in_the_same_node_as` round per node.

    Args:
        group: torch ProcessGroup (CPU-capable) or StatelessProcessGroup.
        name: The group's name, for errors.

    Returns:
        ``result[i]`` is the node index of group rank ``i``.

    Raises:
        SegmentError: A probe's source could not create its segment (every
            rank raises; see :func:`in_the_same_node_as`).
    """
    og = object_group(group)
    nodes = [-1] * og.world_size
    node = 0
    while -1 in nodes:
        src = nodes.index(-1)
        same = in_the_same_node_as(group, source_rank=src, name=name)
        for r, s in enumerate(same):
            if s and nodes[r] == -1:
                nodes[r] = node
        node += 1
    return nodes

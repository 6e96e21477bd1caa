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

from shm_broadcast.errors import SegmentError
from shm_broadcast.lifecycle.segment import SharedSegment
from shm_broadcast.ranks.group_adapter import object_group

__all__ = ["NODE_ID_ENV", "in_the_same_node_as", "node_assignment"]

NODE_ID_ENV = "GROUPCOORD_NODE_ID"
_MAGIC_LEN = 16


def in_the_same_node_as(group: Any, source_rank: int = 0) -> list[bool]:
    """Tell, for every rank of ``group``, whether it shares a node with ``source_rank``.

    Collective: every rank of the group must call it.

    Args:
        group: torch ProcessGroup (CPU-capable) or StatelessProcessGroup.
        source_rank: Group rank to compare against.

    Returns:
        ``result[i]`` is True when group rank ``i`` is on the source's node.

    Raises:
        TypeError: ``source_rank`` is not an int.
        ValueError: ``source_rank`` is out of range.
    """
    og = object_group(group)
    if not isinstance(source_rank, int) or isinstance(source_rank, bool):
        raise TypeError(f"source_rank must be an int, got {type(source_rank).__name__}")
    if not 0 <= source_rank < og.world_size:
        raise ValueError(
            f"source_rank must be an int in [0, {og.world_size}), got {source_rank!r}"
        )
    if og.world_size == 1:
        return [True]
    override = os.environ.get(NODE_ID_ENV) or None
    seg: SharedSegment | None = None
    info: tuple[str | None, bytes, str | None] | None
    try:
        if og.rank == source_rank:
            magic = secrets.token_bytes(_MAGIC_LEN)
            if override is None:
                seg = SharedSegment.create("node", _MAGIC_LEN)
                seg.buf[:_MAGIC_LEN] = magic
                info = (seg.name, magic, None)
            else:
                info = (None, magic, override)
        else:
            info = None
        name, magic, src_override = og.broadcast(info, src=source_rank, op="in_the_same_node_as")
        if og.rank == source_rank:
            same = True
        elif override is not None or src_override is not None:
            same = override == src_override
        else:
            same = _sees_segment(name, magic)
        flags = og.all_gather(same, op="in_the_same_node_as")
    finally:
        if seg is not None:
            seg.close()
    return [bool(f) for f in flags]


def _sees_segment(name: str | None, magic: bytes) -> bool:
    if name is None:
        return False
    try:
        with SharedSegment.attach(name) as seg:
            return bytes(seg.buf[:_MAGIC_LEN]) == magic
    except (SegmentError, OSError):
        return False


def node_assignment(group: Any) -> list[int]:
    """Number the nodes of ``group`` and give each rank its node index.

    Collective. Node 0 is the node of rank 0; nodes are numbered in order of
    their lowest rank. Costs one :func:`in_the_same_node_as` round per node.

    Args:
        group: torch ProcessGroup (CPU-capable) or StatelessProcessGroup.

    Returns:
        ``result[i]`` is the node index of group rank ``i``.
    """
    og = object_group(group)
    nodes = [-1] * og.world_size
    node = 0
    while -1 in nodes:
        src = nodes.index(-1)
        same = in_the_same_node_as(og, source_rank=src)
        for r, s in enumerate(same):
            if s and nodes[r] == -1:
                nodes[r] = node
        node += 1
    return nodes

"""A group without a GroupCoordinator, for testing its parts alone.

:class:`BareGroup` holds what the parts' protocols ask of a group (real gloo
process groups and a real communicator); :func:`bare_parts` builds the parts
on it the way ``GroupCoordinator`` does, each from the ones before it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass
class BareGroup:
    """The group state the parts read (``GroupCoordinator``'s attributes of those names)."""

    unique_name: str
    rank_in_group: int
    world_size: int
    ranks: list[int]
    cpu_group: Any
    device_group: Any
    device: torch.device
    comm: Any
    codec: Any
    timeout: float
    allow_pickle: bool = False
    mq_broadcaster: Any = None
    mq_writer_rank: int = 0

    def close(self) -> None:
        """Destroy the communicator and the process group."""
        import torch.distributed as dist

        self.comm.destroy()
        dist.destroy_process_group(self.cpu_group)


def bare_group(rank: int, world_size: int, name: str, timeout: float = 30.0,
               communicator: str | None = None) -> BareGroup:
    """A gloo group of the whole world with the registry's CPU communicator (or the
    one named by ``communicator``); every rank calls it."""
    import torch.distributed as dist

    from coordinator.group import setup
    from shm_broadcast.codec.message_codec import Codec

    ranks = list(range(world_size))
    pg = dist.new_group(ranks, backend="gloo")
    cpu = torch.device("cpu")
    comm = setup.build_communicator(communicator, pg, cpu, pg, name, timeout)
    return BareGroup(name, rank, world_size, ranks, pg, pg, cpu, comm, Codec(), timeout)


def bare_parts(group: BareGroup) -> tuple[Any, Any, Any, Any]:
    """``(book, objects, p2p, dicts)`` on ``group``, built as ``GroupCoordinator`` builds them."""
    from coordinator.calls.call_book import CallBook
    from coordinator.group.object_calls import ObjectCalls
    from coordinator.group.tensor_dict_calls import TensorDictCalls
    from coordinator.p2p.point_to_point import PointToPoint

    book = CallBook(group.unique_name, group.rank_in_group, group.world_size, group.timeout)
    book.learn_peers(group.cpu_group)
    group.comm.number_calls(lambda: book.collectives)
    objects = ObjectCalls(group, book)
    p2p = PointToPoint(group, book, objects)
    dicts = TensorDictCalls(group, book, objects, p2p, BareGroup)
    return book, objects, p2p, dicts

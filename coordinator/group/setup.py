"""Building the parts of a GroupCoordinator: process groups, device, communicator.

Kept apart from :mod:`coordinator.group.group_coordinator` so that module holds the
collectives and this one the construction rules:

* every process creates every group (``torch.distributed.new_group`` is
  collective over the world) and keeps the one it belongs to;
* with the gloo backend, the device group *is* the CPU group (no second set
  of connections);
* the device communicator comes from :mod:`device_comms`'s registry, by
  device, unless a name forces one;
* a destroyed group's communicator is replaced by :class:`DestroyedComm`,
  so later use fails loudly instead of falling back to the world group.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from coordinator.calls.call_book import destroyed_msg
from coordinator.errors import CommTimeout, NotInitializedError, PeerDiedError
from coordinator.group.gloo_interface import pinned_gloo
from coordinator.group.registry import REGISTRY
from device_comms import DeviceCommunicator, get_device_communicator, select_device_communicator

__all__ = [
    "check_backend",
    "check_group_ranks",
    "create_process_groups",
    "pick_device",
    "build_communicator",
    "mq_available",
    "DestroyedComm",
]


def check_backend(backend: Any, name: str) -> str:
    """``backend`` if torch.distributed knows it: a name (``"gloo"``, ``"nccl"``,
    ...) or ``"device:backend"`` pairs joined by commas (``"cpu:gloo,cuda:nccl"``).

    Raises:
        TypeError: Not a str (``dist.Backend`` is one).
        ValueError: A backend torch.distributed does not know.
    """
    if not isinstance(backend, str):
        raise TypeError(f"{name} must be a str such as 'gloo' or 'nccl', got "
                        f"{type(backend).__name__} {backend!r:.40}")
    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    parts = [p.split(":", 1)[-1].strip().lower() for p in backend.split(",")]
    if any(p not in known for p in parts):
        raise ValueError(f"{name} must be one of {known}, or 'device:backend' pairs of them "
                         f"joined by commas; got {backend!r:.80}")
    missing = [p for p in parts if p in _BUILT_IN and not _BUILT_IN[p]()]
    if missing:
        raise ValueError(f"{name} {backend!r:.80} names {missing}, which this build of torch "
                         f"lacks (torch {torch.__version__}); use 'gloo' for CPU groups")
    return str(backend)


# What torch's store and gloo say when new_group waited for a peer in vain.
_GONE_WORDS = ("reset by peer", "connection closed", "broken pipe", "eof")
_WAIT_WORDS = ("timeout", "timed out") + _GONE_WORDS

_BUILT_IN = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available,
             "mpi": dist.is_mpi_available, "ucc": dist.is_ucc_available,
             "xccl": getattr(dist, "is_xccl_available", lambda: False)}


def check_group_ranks(group_ranks: Any, world_size: int) -> None:
    """Validate ``group_ranks``: non-empty lists of distinct global ranks.

    Each list must be in ascending order: ``torch.distributed`` numbers a
    group's members by ascending global rank, and this group's ranks (``src``,
    ``dst``, sizes, result order) are that numbering.

    Raises:
        TypeError: Not a list of non-empty lists of ints.
        ValueError: A rank is out of range or appears twice, or a list is not
            in ascending order.
    """
    if not isinstance(group_ranks, (list, tuple)) or not group_ranks:
        raise TypeError(f"group_ranks must be a non-empty list of rank lists, got {group_ranks!r}")
    seen: set[int] = set()
    for ranks in group_ranks:
        if not isinstance(ranks, (list, tuple)) or not ranks:
            raise TypeError(f"each entry of group_ranks must be a non-empty list of ints, "
                            f"got {ranks!r}")
        for r in ranks:
            if not isinstance(r, int) or isinstance(r, bool):
                raise TypeError(f"group_ranks must hold int ranks, got {type(r).__name__} {r!r}")
            if not 0 <= r < world_size:
                raise ValueError(f"group_ranks holds {r!r}, not a global rank in [0, {world_size})")
            if r in seen:
                raise ValueError(f"rank {r} appears in more than one group of group_ranks")
            seen.add(r)
        if list(ranks) != sorted(ranks):
            raise ValueError(
                f"each list of group_ranks must be in ascending order (torch.distributed "
                f"numbers a group's members by ascending global rank, and group ranks follow "
                f"it), got {list(ranks)}; pass {sorted(ranks)}")


def create_process_groups(
    group_ranks: Sequence[Sequence[int]],
    backend: str,
    rank: int,
    timeout: datetime.timedelta | None,
    name: str = "",
) -> tuple[list[int], dist.ProcessGroup, dist.ProcessGroup]:
    """Create every group collectively; return this rank's ``(ranks, cpu, device)``.

    Raises:
        ValueError: ``rank`` is in none of the groups.
        CommTimeout: A group's ranks did not all arrive within ``timeout``.
        PeerDiedError: A rank's connection closed while the groups were made.
    """
    check_group_ranks(group_ranks, dist.get_world_size())
    kw: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
    mine: tuple[list[int], dist.ProcessGroup, dist.ProcessGroup] | None = None
    for ranks in group_ranks:
        ranks = list(ranks)
        try:
            with pinned_gloo(REGISTRY.gloo_pinned):
                cpu = dist.new_group(ranks, backend="gloo", **kw)
            dev = cpu if backend == "gloo" else dist.new_group(ranks, backend=backend, **kw)
        except RuntimeError as e:  # DistStoreError and gloo's errors are RuntimeErrors
            ours = _creation_error(name, ranks, rank, timeout, e)
            if ours is None:
                raise
            raise ours from e
        if rank in ranks:
            mine = (ranks, cpu, dev)
    if mine is None:
        raise ValueError(f"global rank {rank} is in none of group_ranks={group_ranks}")
    return mine


def _creation_error(name: str, ranks: list[int], rank: int,
                    timeout: datetime.timedelta | None, e: RuntimeError) -> Exception | None:
    """Our error for a ``new_group`` of global ``ranks`` that failed waiting for a
    peer (None for any other failure: it is re-raised as it is). Which ranks
    are missing is not known here (the store says only that a key never came)."""
    others = [r for r in ranks if r != rank]
    text = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
    if not any(w in text.lower() for w in _WAIT_WORDS):
        return None
    where = (f"group {name or 'unnamed'!r}, op new_group (global ranks {ranks}, created "
             f"by every rank of the world)")
    if any(w in text.lower() for w in _GONE_WORDS):
        return PeerDiedError(f"{where}: a rank's connection closed while the group was made, "
                             f"so one of ranks {others} exited. Detail: {text}",
                             queue=name or None, peers=others)
    limit = "its timeout" if timeout is None else f"{timeout.total_seconds():g}s"
    return CommTimeout(f"{where}: not every rank arrived within {limit}; any of ranks {others} "
                       f"may be missing (every rank must create the same groups in the same "
                       f"order). Detail: {text}", queue=name or None, peers=others)


def pick_device(backend: str, local_rank: int) -> torch.device:
    """This rank's device: ``cuda:<local_rank>`` for NCCL with GPUs, else CPU."""
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def build_communicator(
    name: str | None,
    cpu_group: dist.ProcessGroup,
    device: torch.device,
    device_group: dist.ProcessGroup,
    unique_name: str,
    timeout: float | None,
) -> DeviceCommunicator:
    """Construct the named communicator, or the registry's best for ``device`` (collective).

    ``timeout`` (the group's, when the caller gave one; else None for the
    communicator's own default, which its environment variable may set)
    bounds every wait of the communicator.
    """
    cls = get_device_communicator(name) if name else select_device_communicator(device)
    return cls(cpu_group, device, device_group, unique_name, timeout=timeout)


def mq_available() -> bool:
    """Whether the shared-memory message queue can be imported."""
    try:
        import shm_broadcast.queue.message_queue  # noqa: F401
    except ImportError:
        return False
    return True


class DestroyedComm:
    """Stands in for a destroyed group's communicator: any use raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        raise NotInitializedError(destroyed_msg(self._name, attr))



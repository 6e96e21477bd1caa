"""A uniform object-collective view over the groups this package accepts.

``shm_broadcast`` uses nothing else of this project, yet it must set itself up
over either a ``torch.distributed`` process group (usually the CPU/gloo one) or
a ``coordinator.StatelessProcessGroup``. :func:`object_group` wraps either in
an :class:`ObjectGroup` with ``rank``, ``world_size``, ``broadcast`` and
``all_gather`` of picklable Python objects. Stateless groups are recognised by
duck typing (attributes ``rank``, ``world_size`` and methods ``broadcast_obj``,
``all_gather_obj``), so no import of ``coordinator`` is needed.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["ObjectGroup", "StatelessLike", "object_group"]


@runtime_checkable
class StatelessLike(Protocol):
    """What a stateless (TCPStore-based) group must offer."""

    rank: int
    world_size: int

    def broadcast_obj(self, obj: Any | None, src: int) -> Any: ...

    def all_gather_obj(self, obj: Any) -> list[Any]: ...


class ObjectGroup:
    """Object collectives with group-local ranks, whatever the group type."""

    def __init__(self, group: Any) -> None:
        self._group = group
        self._stateless = isinstance(group, StatelessLike) and not _is_torch_group(group)
        if self._stateless:
            self.rank: int = int(group.rank)
            self.world_size: int = int(group.world_size)
        else:
            import torch.distributed as dist

            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            if self.rank < 0:
                raise ValueError("this process is not a member of the given process group")

    def broadcast(self, obj: Any | None, src: int) -> Any:
        """Broadcast ``obj`` from group rank ``src``; returns it on every rank."""
        if self._stateless:
            return self._group.broadcast_obj(obj, src=src)
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self._group, src), group=self._group)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Gather ``obj`` from every rank; returns the list ordered by group rank."""
        if self._stateless:
            return list(self._group.all_gather_obj(obj))
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out


def _is_torch_group(group: Any) -> bool:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return False
    return isinstance(group, dist.ProcessGroup)


def object_group(group: Any) -> ObjectGroup:
    """Wrap a torch ProcessGroup or a stateless group as an :class:`ObjectGroup`.

    Args:
        group: ``torch.distributed.ProcessGroup`` (CPU-capable, e.g. gloo) or an
            object shaped like ``coordinator.StatelessProcessGroup``.

    Raises:
        TypeError: ``group`` is neither.
    """
    if isinstance(group, ObjectGroup):
        return group
    if _is_torch_group(group) or isinstance(group, StatelessLike):
        return ObjectGroup(group)
    raise TypeError(
        "group must be a torch.distributed.ProcessGroup or a StatelessProcessGroup, "
        f"got {type(group).__name__}"
    )

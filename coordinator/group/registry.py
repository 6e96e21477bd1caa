"""The one piece of process-wide state: which groups exist and which are current.

The public API needs it: ``get_tp_group()`` must find the current tensor-parallel
group, and the traceable custom ops find a group by its unique name (strings
survive ``torch.compile`` tracing, objects do not). Everything lives in a single
:class:`GroupRegistry` instance, :data:`REGISTRY`.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coordinator.group.group_coordinator import GroupCoordinator

__all__ = ["GroupRegistry", "REGISTRY", "get_group_by_name"]


class GroupRegistry:
    """Current world/TP/PP/DP/PCP/DCP/EP groups plus a name -> group lookup.

    Attributes:
        world: The world group, set by ``init_distributed_environment``.
        tp: The current tensor-parallel group.
        pp: The current pipeline-parallel group.
        dp: The current data-parallel group.
        pcp: The current prefill-context-parallel group.
        dcp: The current decode-context-parallel group.
        ep: The current expert-parallel group (None unless expert parallelism is on).
        eplb: The expert-load-balancing group: the EP group's ranks in a group of
            their own (None unless asked for).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: weakref.WeakValueDictionary[str, GroupCoordinator] = (
            weakref.WeakValueDictionary()
        )
        self._counts: dict[str, int] = {}
        self.world: GroupCoordinator | None = None
        self.tp: GroupCoordinator | None = None
        self.pp: GroupCoordinator | None = None
        self.dp: GroupCoordinator | None = None
        self.pcp: GroupCoordinator | None = None
        self.dcp: GroupCoordinator | None = None
        self.ep: GroupCoordinator | None = None
        self.eplb: GroupCoordinator | None = None
        #: The EP group's token peers when no other group has their ranks (DP > 1,
        #: PCP > 1 and TP > 1); see ``GroupCoordinator.set_token_peers``.
        self.ep_tokens: GroupCoordinator | None = None
        #: The timeout given to ``init_distributed_environment`` (None: not
        #: given); the model-parallel groups inherit it.
        self.timeout: Any = None
        #: How many nodes the world group spans (set with the world group).
        self.node_count: int | None = None
        #: The interface the world's gloo groups listen on (a loopback world's;
        #: :mod:`coordinator.group.gloo_interface`), or None for gloo's own choice.
        self.gloo_pinned: str | None = None

    def unique_name(self, base: str) -> str:
        """Return ``base:<n>``, with ``n`` counting the groups created under ``base``."""
        with self._lock:
            n = self._counts.get(base, 0)
            self._counts[base] = n + 1
        return f"{base}:{n}"

    def add(self, group: GroupCoordinator) -> None:
        """Make ``group`` findable by its ``unique_name``."""
        with self._lock:
            self._by_name[group.unique_name] = group

    def remove(self, group: GroupCoordinator) -> None:
        """Forget ``group`` (called by ``GroupCoordinator.destroy``)."""
        with self._lock:
            if self._by_name.get(group.unique_name) is group:
                del self._by_name[group.unique_name]

    def get(self, name: str) -> GroupCoordinator:
        """Return the live group named ``name``.

        Raises:
            ValueError: No live group has that name.
        """
        with self._lock:
            g = self._by_name.get(name)
            known = sorted(self._by_name.keys())
        if g is None:
            raise ValueError(f"no live GroupCoordinator named {name!r}; live groups: {known}")
        return g


REGISTRY = GroupRegistry()


def get_group_by_name(name: str) -> GroupCoordinator:
    """Return the live :class:`GroupCoordinator` whose ``unique_name`` is ``name``."""
    return REGISTRY.get(name)

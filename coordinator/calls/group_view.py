"""What the parts of a group read of it: its name, ranks, device, communicator,
process groups, timeout and pickle opt-in.

:class:`~coordinator.group.group_coordinator.GroupCoordinator` has these
attributes; a part types its group as :class:`GroupView` (or a protocol that
adds the few more it reads), so it never imports the coordinator and a test
can hand it any object with these attributes.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from device_comms import DeviceCommunicator

__all__ = ["GroupView"]


class GroupView(Protocol):
    """The read-only state of a group that its parts use."""

    @property
    def unique_name(self) -> str: ...
    @property
    def rank_in_group(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def ranks(self) -> list[int]: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def comm(self) -> DeviceCommunicator: ...
    @property
    def cpu_group(self) -> Any: ...
    @property
    def device_group(self) -> Any: ...
    @property
    def timeout(self) -> float: ...
    @property
    def allow_pickle(self) -> bool: ...

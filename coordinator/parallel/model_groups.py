"""Groups beyond the standard ones: building them, listing them, counting nodes.

:mod:`coordinator.parallel_state` creates the world, TP, PP, DP and EP groups.
Engines that shard in other ways (a draft model's TP group, a context-parallel
group, a group of the expert ranks of a node) build their own with
:func:`init_model_parallel_group`, which takes the arguments vLLM's function of
that name takes and gives the group the world's timeout and pickle setting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from coordinator.errors import NotInitializedError
from coordinator.group.group_coordinator import GroupCoordinator
from coordinator.group.registry import REGISTRY
from shm_broadcast.ranks.topology import node_assignment

__all__ = [
    "init_world_group",
    "init_model_parallel_group",
    "get_all_model_groups",
    "prepare_communication_buffer_for_model",
    "get_node_count",
]


def init_world_group(ranks: Sequence[int], local_rank: int, backend: str, *,
                     use_device_communicator: bool = False, timeout: Any = None,
                     allow_pickle: bool = False) -> GroupCoordinator:
    """A group of every rank in ``ranks`` (collective over the default process group).

    As vLLM's function of this name, it has no device communicator unless asked
    (its collectives go through torch.distributed), and it is not registered as
    the world group: :func:`~coordinator.parallel_state.init_distributed_environment`
    builds and registers that one.

    Args:
        ranks: The global ranks of the group.
        local_rank: This process's rank on its node.
        backend: Backend of the device group.
        use_device_communicator: Give it the registry's best communicator.
        timeout: Seconds bounding every wait (None: the default).
        allow_pickle: Opt the group in to pickle (trusted peers only).
    """
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise TypeError(f"ranks must be a sequence of ints, got {type(ranks).__name__}")
    return GroupCoordinator([list(ranks)], local_rank, backend, use_device_communicator,
                            group_name="world", timeout=timeout, allow_pickle=allow_pickle)


def init_model_parallel_group(
    group_ranks: Sequence[Sequence[int]],
    local_rank: int,
    backend: str,
    use_message_queue_broadcaster: bool = False,
    group_name: str | None = None,
    use_device_communicator: bool = True,
    *,
    timeout: Any = None,
    allow_pickle: bool | None = None,
) -> GroupCoordinator:
    """Create one of the disjoint groups ``group_ranks`` lists (collective over the world).

    Every process calls it with the same ``group_ranks``; each gets the group
    holding its rank. The group is findable by name (``get_group_by_name``) but
    does not replace a standard group (use
    :func:`~coordinator.parallel_state.patch_tensor_parallel_group` for that).

    Args:
        group_ranks: Disjoint lists of global ranks, one per group.
        local_rank: This process's rank on its node (picks the GPU).
        backend: Backend of the device group (``gloo``, ``nccl``).
        use_message_queue_broadcaster: Give the group a shared-memory queue for
            ``broadcast_tensor_dict``/``broadcast_object`` from rank 0.
        group_name: Base of the group's unique name.
        use_device_communicator: Use the registry's best communicator.
        timeout: Seconds bounding every wait; None takes the world group's.
        allow_pickle: Opt in to pickle; None takes the world group's setting.
    """
    if allow_pickle is None:
        allow_pickle = REGISTRY.world.allow_pickle if REGISTRY.world is not None else False
    return GroupCoordinator(
        group_ranks, local_rank, backend, use_device_communicator,
        use_message_queue_broadcaster, group_name,
        timeout=REGISTRY.timeout if timeout is None else timeout, allow_pickle=allow_pickle)


def get_all_model_groups() -> list[GroupCoordinator]:
    """The model-parallel groups that exist: TP, PP, DP, PCP, DCP, then EP and EPLB."""
    return [g for g in (REGISTRY.tp, REGISTRY.pp, REGISTRY.dp, REGISTRY.pcp, REGISTRY.dcp,
                        REGISTRY.ep, REGISTRY.eplb) if g is not None]


def prepare_communication_buffer_for_model(model: Any) -> None:
    """Let every model-parallel group prepare its buffers for ``model``."""
    for group in get_all_model_groups():
        group.prepare_communication_buffer_for_model(model)


def count_nodes(world: GroupCoordinator) -> int:
    """How many nodes ``world``'s ranks are on (collective over ``world``).

    The CPU communicator numbered the nodes when it was built; other
    communicators leave it to one :func:`~shm_broadcast.ranks.topology.node_assignment`.
    """
    nodes = getattr(world.device_communicator, "nodes", None)
    if not nodes:
        nodes = node_assignment(world.cpu_group)
    return max(nodes) + 1


def get_node_count() -> int:
    """How many nodes the world group spans (1 before torch.distributed is set up).

    Raises:
        NotInitializedError: torch.distributed is initialised but
            ``init_distributed_environment`` has not created the world group.
    """
    if REGISTRY.node_count is not None:
        return REGISTRY.node_count
    if not dist.is_initialized():
        return 1
    raise NotInitializedError(
        "the node count is known once the world group exists; call "
        "coordinator.parallel_state.init_distributed_environment(...) first")

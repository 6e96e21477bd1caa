"""groupcoord's coordinator layer: GroupCoordinator, parallel state and tooling.

Start here::

    from coordinator import init_distributed_environment, initialize_model_parallel, get_tp_group
"""

from coordinator.errors import (
    BrokenCommunicator,
    ClosedError,
    CollectiveMismatch,
    CommTimeout,
    CommunicatorUnavailable,
    DistributedTimeout,
    GroupCoordError,
    NotInitializedError,
    PeerDiedError,
    PeerRejectedError,
    RankDiedError,
    RankFailedError,
    SegmentError,
)
from coordinator.group_coordinator import GraphCaptureContext, GroupCoordinator
from coordinator.group_registry import get_group_by_name
from coordinator.parallel_state import (
    broadcast_tensor_dict,
    destroy_distributed_environment,
    destroy_model_parallel,
    ensure_model_parallel_initialized,
    get_dp_group,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    get_world_group,
    graph_capture,
    in_the_same_node_as,
    init_distributed_environment,
    initialize_model_parallel,
    model_parallel_is_initialized,
    patch_tensor_parallel_group,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_gather,
    tensor_model_parallel_reduce_scatter,
)
from coordinator.stateless_group import StatelessProcessGroup
from device_comms import ReduceOp

__all__ = [
    "GroupCoordinator",
    "GraphCaptureContext",
    "StatelessProcessGroup",
    "ReduceOp",
    "GroupCoordError",
    "CommTimeout",
    "PeerDiedError",
    "ClosedError",
    "CollectiveMismatch",
    "PeerRejectedError",
    "CommunicatorUnavailable",
    "BrokenCommunicator",
    "SegmentError",
    "NotInitializedError",
    "RankFailedError",
    "RankDiedError",
    "DistributedTimeout",
    "get_group_by_name",
    "init_distributed_environment",
    "initialize_model_parallel",
    "ensure_model_parallel_initialized",
    "model_parallel_is_initialized",
    "get_world_group",
    "get_tp_group",
    "get_pp_group",
    "get_dp_group",
    "get_tensor_model_parallel_world_size",
    "get_tensor_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "get_pipeline_model_parallel_rank",
    "destroy_model_parallel",
    "destroy_distributed_environment",
    "graph_capture",
    "in_the_same_node_as",
    "patch_tensor_parallel_group",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_reduce_scatter",
    "tensor_model_parallel_gather",
    "broadcast_tensor_dict",
]

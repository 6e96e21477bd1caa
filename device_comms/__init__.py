"""Device communicators: one abstract base, a registry, and the transports.

Import-light: nothing GPU-related is imported at module load. The CPU
communicators register themselves here; CUDA ones register with a lazy
``is_available()`` that imports their libraries only when asked.
"""

from device_comms.base import DeviceCommunicator
from device_comms.cpu.communicator import CpuCommunicator
from device_comms.cuda.communicator import CudaCommunicator
from device_comms.errors import (
    BrokenCommunicator,
    ClosedError,
    CollectiveMismatch,
    CollectiveTimeout,
    CommTimeout,
    CommunicatorClosed,
    CommunicatorUnavailable,
    ConcurrentCallError,
    DeviceCommError,
    GroupCoordError,
    KernelCompileError,
    NcclError,
    PeerDiedError,
    PeerRejectedError,
)
from device_comms.reduce_op import ReduceOp, reduce_local
from device_comms.registry import (
    get_device_communicator,
    list_device_communicators,
    register_device_communicator,
    select_device_communicator,
    unregister_device_communicator,
)
from device_comms.torch_dist.torch_communicator import TorchDistributedCommunicator

register_device_communicator("torch", TorchDistributedCommunicator)
register_device_communicator("cpu", CpuCommunicator)
register_device_communicator("cuda", CudaCommunicator)  # is_available() loads NCCL lazily

__all__ = [
    "DeviceCommunicator",
    "TorchDistributedCommunicator",
    "CpuCommunicator",
    "CudaCommunicator",
    "ReduceOp",
    "reduce_local",
    "GroupCoordError",
    "CommTimeout",
    "ClosedError",
    "DeviceCommError",
    "CommunicatorUnavailable",
    "CollectiveTimeout",
    "CollectiveMismatch",
    "PeerDiedError",
    "PeerRejectedError",
    "BrokenCommunicator",
    "ConcurrentCallError",
    "CommunicatorClosed",
    "KernelCompileError",
    "NcclError",
    "register_device_communicator",
    "unregister_device_communicator",
    "get_device_communicator",
    "list_device_communicators",
    "select_device_communicator",
]

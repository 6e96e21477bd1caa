"""NCCL through :mod:`ctypes`: library discovery, dtype/op tables, bootstrap, communicator.

Importing this package loads no library and touches no GPU: ``libnccl.so.2``
is found and opened on first use (:func:`load_library`, or constructing a
:class:`PyNcclCommunicator`).
"""

from device_comms.cuda.pynccl.bootstrap import exchange_unique_id
from device_comms.cuda.pynccl.communicator import PyNcclCommunicator
from device_comms.cuda.pynccl.library import (
    SIGNATURES,
    NcclLibrary,
    find_library,
    load_library,
    unique_id,
    version,
    version_string,
)
from device_comms.cuda.pynccl.types import reduction_plan

__all__ = [
    "PyNcclCommunicator",
    "NcclLibrary",
    "SIGNATURES",
    "find_library",
    "load_library",
    "version",
    "version_string",
    "unique_id",
    "exchange_unique_id",
    "reduction_plan",
]

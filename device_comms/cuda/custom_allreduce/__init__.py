"""Custom all-reduce over CUDA IPC within one node (world sizes 2, 4, 6, 8).

Import-light: importing this package loads none of its modules; each name
below is imported from its module on first access, and no module imports
CuPy or initialises CUDA at load time.

Modules:
    communicator: ``CustomAllreduce``, the per-group all-reduce.
    virtual: ``VirtualRanks``, N ranks' kernels in one process (checks, benchmarks).
    nvrtc: compile CUDA C++ to PTX with NVRTC (no GPU needed).
    eligibility: which groups and which calls may use the custom all-reduce.
    handles: IPC handles, their exchange and their bookkeeping.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> module (relative to this package) that defines it
_EXPORTS: dict[str, str] = {
    "CustomAllreduce": "communicator",
    "VirtualRanks": "virtual",
    # nvrtc
    "CompiledPtx": "nvrtc",
    "compile_to_ptx": "nvrtc",
    "nvrtc_version": "nvrtc",
    "supported_archs": "nvrtc",
    # eligibility
    "SUPPORTED_WORLD_SIZES": "eligibility",
    "SUPPORTED_DTYPES": "eligibility",
    "DEFAULT_MAX_SIZE": "eligibility",
    "ALIGNMENT": "eligibility",
    "ENV_DISABLE": "eligibility",
    "disabled_by_env": "eligibility",
    "check_max_size": "eligibility",
    "GroupVerdict": "eligibility",
    "group_verdict": "eligibility",
    "P2PCache": "eligibility",
    "P2P_CACHE": "eligibility",
    "call_eligible": "eligibility",
    # handles
    "IpcHandle": "handles",
    "IpcBackend": "handles",
    "CudaIpcBackend": "handles",
    "HandleBook": "handles",
    "all_gather_handles": "handles",
}

# The names of _EXPORTS, spelled out so that tools see the re-exports.
__all__ = [
    "ALIGNMENT", "CompiledPtx", "CudaIpcBackend", "CustomAllreduce", "DEFAULT_MAX_SIZE",
    "ENV_DISABLE", "GroupVerdict", "HandleBook", "IpcBackend", "IpcHandle", "P2PCache",
    "P2P_CACHE", "SUPPORTED_DTYPES", "SUPPORTED_WORLD_SIZES", "VirtualRanks",
    "all_gather_handles", "call_eligible", "check_max_size", "compile_to_ptx",
    "disabled_by_env", "group_verdict", "nvrtc_version", "supported_archs",
]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from device_comms.cuda.custom_allreduce.communicator import CustomAllreduce
    from device_comms.cuda.custom_allreduce.eligibility import (
        ALIGNMENT,
        DEFAULT_MAX_SIZE,
        ENV_DISABLE,
        P2P_CACHE,
        SUPPORTED_DTYPES,
        SUPPORTED_WORLD_SIZES,
        GroupVerdict,
        P2PCache,
        call_eligible,
        check_max_size,
        disabled_by_env,
        group_verdict,
    )
    from device_comms.cuda.custom_allreduce.handles import (
        CudaIpcBackend,
        HandleBook,
        IpcBackend,
        IpcHandle,
        all_gather_handles,
    )
    from device_comms.cuda.custom_allreduce.nvrtc import (
        CompiledPtx,
        compile_to_ptx,
        nvrtc_version,
        supported_archs,
    )
    from device_comms.cuda.custom_allreduce.virtual import VirtualRanks


def __getattr__(name: str) -> Any:
    """Import ``name`` from its module on first access (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

"""``groupcoord doctor``: what a bug report about groupcoord needs to say.

Reports versions, the torch build, which backends and communicators are
available, shared-memory space and leftovers, node identity, and GPUs. Reading
the environment only: nothing is started, and CUDA is touched only through
``torch.cuda`` queries that do not create a context.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import socket
import sys
from typing import Any

__all__ = ["add_args", "run", "collect"]


def add_args(p: argparse.ArgumentParser) -> None:
    """Add ``--json``."""
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _version(mod: str) -> str:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return "not installed"


def _nccl_report() -> dict[str, Any]:
    """Which ``libnccl.so.2`` groupcoord loads, and its version (no GPU needed)."""
    from device_comms.cuda.pynccl import library
    from device_comms.errors import CommunicatorUnavailable

    try:
        path = library.find_library()
        return {"path": path, "version": library.load_library(path).version_string()}
    except (CommunicatorUnavailable, OSError) as e:
        return {"error": str(e).splitlines()[0]}


def _nvrtc_report() -> dict[str, Any]:
    """The NVRTC that compiles the custom all-reduce kernels to PTX (no GPU needed)."""
    from device_comms.cuda.custom_allreduce import nvrtc
    from device_comms.errors import CommunicatorUnavailable

    try:
        major, minor = nvrtc.nvrtc_version()
        return {"path": nvrtc.library_path(), "version": f"{major}.{minor}"}
    except (CommunicatorUnavailable, OSError) as e:
        return {"error": str(e).splitlines()[0]}


def _cupy_report() -> dict[str, Any] | str:
    """CuPy's version and CUDA runtime, imported only when installed."""
    if importlib.util.find_spec("cupy") is None:
        return "not installed (pip install 'groupcoord[cuda13]' or '[cuda]')"
    try:
        import cupy

        runtime = cupy.cuda.runtime.runtimeGetVersion()
        return {"version": cupy.__version__,
                "cuda_runtime": f"{runtime // 1000}.{runtime % 1000 // 10}"}
    except Exception as e:  # a broken CuPy install is what the report must show
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0]}


def collect() -> dict[str, Any]:
    """Gather the report as a dict."""
    import psutil
    import torch
    import torch.distributed as dist

    import device_comms
    from shm_broadcast.lifecycle.segment import list_segments, shm_free_bytes
    from shm_broadcast.ranks.topology import NODE_ID_ENV

    segs = list_segments()
    boot_id = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        pass
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {
        "groupcoord": _version("groupcoord"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "torch": torch.__version__,
        "torch_cuda_build": torch.version.cuda or "cpu-only",
        "torch_debug_build": bool(torch.version.debug),
        "packages": {p: _version(p) for p in ("pyzmq", "msgspec", "psutil", "numpy")},
        "cupy": _cupy_report(),
        "nccl": _nccl_report(),
        "nvrtc": _nvrtc_report(),
        "gloo_available": dist.is_gloo_available(),
        "nccl_available": dist.is_nccl_available(),
        "gpu_count": gpus,
        "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
        "device_communicators": device_comms.list_device_communicators(),
        "dev_shm_free_mib": round(shm_free_bytes() / 2**20, 1),
        "groupcoord_segments": len(segs),
        "orphaned_segments": [s.name for s in segs if not s.owner_alive],
        "hostname": socket.gethostname(),
        "boot_id": boot_id,
        "node_id_override": os.environ.get(NODE_ID_ENV, ""),
    }


def run(args: argparse.Namespace) -> int:
    """Print the report."""
    report = collect()
    if getattr(args, "json", False):
        print(json.dumps(report, indent=2, default=str))
        return 0
    print("groupcoord doctor")
    width = max(len(k) for k in report)
    for k, v in report.items():
        if isinstance(v, dict) and k == "device_communicators":
            print(f"  {k:<{width}} :")
            for name, info in v.items():
                print(f"      {name}: devices={info['devices']} priority={info['priority']} "
                      f"available={info['available']}")
        else:
            print(f"  {k:<{width}} : {v}")
    if report["orphaned_segments"]:
        print("\n  note: run `groupcoord cleanup --yes` to remove the orphaned segments")
    return 0

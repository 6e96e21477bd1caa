"""Importing a package loads neither the torch.compile stack nor CuPy, and starts no CUDA.

Every rank process imports the library, so what its import pulls in is paid
once per process: ``torch._dynamo`` alone is 1.3-1.5 s of CPU on the 2-vCPU
VM (docs/performance.md, "Import time"). The library only needs Dynamo while
torch.compile traces, which imports it first.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.child_env import child_env

_PROBE = textwrap.dedent(
    """
    import json, sys
    import importlib
    importlib.import_module(sys.argv[1])
    import torch
    print(json.dumps({
        "dynamo": sorted(m for m in sys.modules if m.startswith("torch._dynamo")),
        "inductor": sorted(m for m in sys.modules if m.startswith("torch._inductor")),
        "cupy": sorted(m for m in sys.modules if m == "cupy" or m.startswith("cupy.")),
        "cuda_initialized": torch.cuda.is_initialized(),
    }))
    """
)

ENTRY_POINTS = [
    "shm_broadcast",
    "device_comms",
    "coordinator",
    "coordinator.parallel_state",
    "coordinator.torch_backend",
    "coordinator.pytest_plugin",
    "coordinator.engine",
]


def _probe(module: str) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-c", _PROBE, module], capture_output=True,
                          text=True, timeout=120, check=False, env=child_env())
    assert proc.returncode == 0, proc.stderr
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_import_loads_no_compiler_no_cupy_and_no_cuda(module: str) -> None:
    out = _probe(module)
    assert out["dynamo"] == [], f"importing {module} loaded torch._dynamo"
    assert out["inductor"] == [], f"importing {module} loaded torch._inductor"
    assert out["cupy"] == [], f"importing {module} loaded CuPy"
    assert out["cuda_initialized"] is False, f"importing {module} initialised CUDA"


@pytest.mark.timeout(150)
def test_the_probe_sees_what_an_import_loads() -> None:
    assert _probe("torch._dynamo")["dynamo"] != []

"""Importing a package loads neither the torch.compile stack nor CuPy, and starts no CUDA.

Every rank process imports the library, so what its import pulls in is paid
once per process: ``torch._dynamo`` alone is 1.3-1.5 s of CPU on the 2-vCPU
VM (docs/performance.md, "Import time"). The library only needs Dynamo while
torch.compile traces, which imports it first.

One fresh interpreter imports the entry points in turn and notes what each
import added (a later entry point's own imports are then partly loaded
already: whatever loads a forbidden module, the first entry point that
imports it is named), then imports ``torch._dynamo`` itself, which shows that
the probe sees such a load.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from tests.child_env import child_env

ENTRY_POINTS = [
    "shm_broadcast",
    "device_comms",
    "coordinator",
    "coordinator.parallel_state",
    "coordinator.torch_backend",
    "coordinator.pytest_plugin",
    "coordinator.engine",
]
CONTROL = "torch._dynamo"

_PROBE = textwrap.dedent(
    """
    import importlib, json, sys
    import torch

    def forbidden():
        return {m for m in sys.modules
                if m.startswith(("torch._dynamo", "torch._inductor"))
                or m == "cupy" or m.startswith("cupy.")}

    found = {}
    for name in sys.argv[1:]:
        before = forbidden()
        importlib.import_module(name)
        found[name] = {"loaded": sorted(forbidden() - before),
                       "cuda_initialized": torch.cuda.is_initialized()}
    print(json.dumps(found))
    """
)


@pytest.fixture(scope="module")
def imports() -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", _PROBE, *ENTRY_POINTS, CONTROL],
                          capture_output=True, text=True, timeout=120, check=False,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr
    found: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return found


@pytest.mark.timeout(150)
@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_import_loads_no_compiler_no_cupy_and_no_cuda(imports: dict[str, Any],
                                                      module: str) -> None:
    got = imports[module]
    assert got["loaded"] == [], f"importing {module} loaded {got['loaded'][:5]}"
    assert got["cuda_initialized"] is False, f"importing {module} initialised CUDA"


@pytest.mark.timeout(150)
def test_the_probe_sees_what_an_import_loads(imports: dict[str, Any]) -> None:
    assert CONTROL in imports[CONTROL]["loaded"]

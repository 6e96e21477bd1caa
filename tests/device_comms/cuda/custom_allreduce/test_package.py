"""The package is import-light: no CuPy, no CUDA initialisation, lazy exports."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import device_comms.cuda.custom_allreduce as ca

_PROBE = textwrap.dedent(
    """
    import json, sys
    import device_comms.cuda.custom_allreduce as ca
    bare = sorted(m for m in sys.modules if m.startswith("device_comms.cuda.custom_allreduce."))
    for name in ca.__all__:
        getattr(ca, name)
    import torch
    print(json.dumps({
        "bare": bare,
        "cupy": sorted(m for m in sys.modules if m == "cupy" or m.startswith("cupy.")),
        "cuda_initialized": torch.cuda.is_initialized(),
    }))
    """
)


def test_import_loads_no_cupy_and_no_cuda() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["bare"] == [], "importing the package must not import its modules"
    assert out["cupy"] == []
    assert out["cuda_initialized"] is False


@pytest.mark.parametrize("name", sorted(ca.__all__))
def test_every_export_resolves(name: str) -> None:
    assert getattr(ca, name) is not None
    assert name in dir(ca)


def test_all_lists_every_lazy_export() -> None:
    assert sorted(ca.__all__) == sorted(ca._EXPORTS)


def test_unknown_attribute() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = ca.no_such_name

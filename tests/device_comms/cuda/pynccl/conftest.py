"""Fixtures of the pynccl tests.

``nccl_lib``: the discovered :class:`~device_comms.cuda.pynccl.library.NcclLibrary`;
``nccl_header``: the text of the wheel's ``nvidia/nccl/include/nccl.h``.
Without the nvidia-nccl wheel a test that needs them is skipped, or fails when
``GROUPCOORD_REQUIRE_NCCL=1`` (CI that installs the wheel sets it). Nothing
here needs a GPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from device_comms.errors import CommunicatorUnavailable

REQUIRE_ENV = "GROUPCOORD_REQUIRE_NCCL"


def skip_or_fail(reason: str) -> None:
    """Skip with ``reason``, or fail when ``GROUPCOORD_REQUIRE_NCCL=1``."""
    if os.environ.get(REQUIRE_ENV, "").strip() == "1":
        pytest.fail(f"{reason} (and {REQUIRE_ENV}=1 requires it)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def nccl_lib():
    """The NCCL library found by the package's own discovery."""
    from device_comms.cuda.pynccl.library import load_library

    try:
        return load_library()
    except CommunicatorUnavailable as e:
        skip_or_fail(f"NCCL is not available (pip install nvidia-nccl-cu13): {e}")


@pytest.fixture(scope="session")
def nccl_header() -> str:
    """``nccl.h`` of the installed nvidia-nccl wheel."""
    from device_comms.cuda.pynccl.library import _nvidia_dirs

    tried = [Path(d) / "nccl" / "include" / "nccl.h" for d in _nvidia_dirs()]
    for path in tried:
        if path.is_file():
            return path.read_text()
    skip_or_fail(f"nccl.h of the nvidia-nccl wheel not found (looked at {[str(p) for p in tried]})")
    return ""

"""Fixtures of the custom all-reduce tests.

``nvrtc``: the :mod:`device_comms.cuda.custom_allreduce.nvrtc` module, once NVRTC
has been found. Without NVRTC the test is skipped, or fails when
``GROUPCOORD_REQUIRE_NVRTC=1`` (CI that installs the wheel sets it).
"""

from __future__ import annotations

import os
from types import ModuleType

import pytest

from device_comms.errors import CommunicatorUnavailable

REQUIRE_ENV = "GROUPCOORD_REQUIRE_NVRTC"


@pytest.fixture(scope="session")
def nvrtc() -> ModuleType:
    """The nvrtc binding with its library loaded (skip or fail without one)."""
    from device_comms.cuda.custom_allreduce import nvrtc as mod

    try:
        mod.nvrtc_version()
    except CommunicatorUnavailable as e:
        reason = f"NVRTC is not available: {e}"
        if os.environ.get(REQUIRE_ENV, "").strip() == "1":
            pytest.fail(f"{reason} (and {REQUIRE_ENV}=1 requires it)")
        pytest.skip(reason)
    return mod

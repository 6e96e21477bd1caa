"""The fault rig, shared by every case of the session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.rig import FaultRig


@pytest.fixture(scope="session")
def fault_rig() -> Iterator[FaultRig]:
    """Rank processes reused across fault cases (see :mod:`tests.faults.rig`)."""
    rig = FaultRig()
    yield rig
    rig.close()

"""``groupcoord doctor`` reports what is in ``/dev/shm`` whatever the user's own files
of our naming form state."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from typing import Any

import pytest

from shm_broadcast.lifecycle.segment import SHM_DIR

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm on this platform")


@pytest.fixture
def planted_segment(request: pytest.FixtureRequest) -> Iterator[str]:
    """A file ``gc_test_<pid>_<this test's pid and random hex>`` with the pid
    part given by the test's parameter; removed afterwards."""
    name = f"gc_test_{request.param}_{os.getpid():x}{secrets.token_hex(4)}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    try:
        yield name
    finally:
        os.unlink(path)


@pytest.mark.usefixtures("cleanup_serial")  # a file cleanup keeps: another's --yes exits 2
@pytest.mark.timeout(120)
@pytest.mark.parametrize("planted_segment", ["99999999999999999999", "2147483648"],
                         ids=["20-digits", "2**31"], indirect=True)
def test_doctor_reports_a_segment_named_with_a_pid_no_process_has(
        run_cli: Any, planted_segment: str) -> None:
    code, out, err = run_cli(["doctor", "--json"])
    assert code == 0, err
    report = json.loads(out)
    assert report["groupcoord_segments"] >= 1
    assert planted_segment not in report["orphaned_segments"]  # kept: it cannot be judged

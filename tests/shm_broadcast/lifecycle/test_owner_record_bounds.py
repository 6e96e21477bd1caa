"""Files of our naming form that state numbers no process has, and owner records no
groupcoord wrote, are kept with the reason: judging them never raises, and
``groupcoord cleanup`` carries on (it used to die with ``OverflowError`` or
``RecursionError``).

Every file here is planted by the test under a fresh name (its pid and a random
token in the ``gc_<kind>_<pid>_<hex>`` token, or ``mkdtemp``'s random channel
directory name) and removed by it; ``cleanup`` runs without ``--yes`` (it only
lists), under ``cleanup_serial`` (a file it keeps would make another test's
``cleanup --yes`` exit 2).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

from shm_broadcast.lifecycle import leftovers
from shm_broadcast.lifecycle.channel_dirs import list_channel_dirs, remove_dead_channel_dir
from shm_broadcast.lifecycle.owner_identity import (
    OwnerIdentity,
    judge_owner,
    pid_exists,
    read_owner_record,
)
from shm_broadcast.lifecycle.segment import SHM_DIR, list_segments
from tests.child_env import ROOT

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm on this platform")

#: The largest number ``pid_t`` (a C ``int``) holds.
PID_MAX = 2**31 - 1


def _token() -> str:
    """A segment name's hex token of this test alone: its pid and random bits."""
    return f"{os.getpid():x}{secrets.token_hex(4)}"


def _write(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait(30)
    return child.pid


@pytest.fixture
def planted() -> Iterator[list[str]]:
    """Paths the test plants; removed afterwards (only these)."""
    paths: list[str] = []
    yield paths
    for p in paths:
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.lexists(p):
            os.unlink(p)


def _cleanup() -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shm_broadcast.cli", "cleanup", "--all"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


# ---------------------------------------------------------------------- pid in a name
@pytest.mark.parametrize("pid", [PID_MAX + 1, 2**63, 10**20])
def test_pid_exists_is_false_for_a_number_no_process_has(pid: int) -> None:
    assert pid_exists(pid) is False


@pytest.mark.parametrize("pid", [PID_MAX + 1, 2**64, 10**20])
def test_judge_owner_keeps_a_pid_no_process_has_without_asking_exists(pid: int) -> None:
    def exists(p: int) -> bool:
        raise AssertionError(f"exists({p}) asked")

    status, reason = judge_owner(pid, "no owner record", OwnerIdentity.of_self(), exists)
    assert status == "unknown" and "is not a process id" in reason, reason


@pytest.mark.usefixtures("cleanup_serial")
@pytest.mark.timeout(90)
@pytest.mark.parametrize("pid", ["99999999999999999999", "2147483648", "18446744073709551616"],
                         ids=["20-digits", "2**31", "2**64"])
def test_a_segment_named_with_a_pid_no_process_has_is_kept(pid: str,
                                                            planted: list[str]) -> None:
    name = f"gc_test_{pid}_{_token()}"
    path = os.path.join(SHM_DIR, name)
    _write(path, b"")
    planted.append(path)
    info = [s for s in list_segments() if s.name == name]
    assert [(s.status, s.owner_alive) for s in info] == [("unknown", True)], info
    res = _cleanup()
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"kept     {name}" in res.stdout and "is not a process id" in res.stdout, res.stdout
    assert os.path.exists(path)


# ---------------------------------------------------------------------- malformed records
#: Record texts no groupcoord wrote (``PID``: the segment name's pid), and the
#: reason each is refused with.
_BAD_RECORDS = {
    "pid-infinity": ('{"pid": Infinity, "pidns": 1, "start_ticks": 1, "boot_id": "x", "uid": 0}',
                     "pid is a float, not an integer"),
    "pid-nan": ('{"pid": NaN, "pidns": 1, "start_ticks": 1, "boot_id": "x", "uid": 0}',
                "pid is a float, not an integer"),
    "pid-float": ('{"pid": PID.0, "pidns": 1, "start_ticks": 1, "boot_id": "x", "uid": 0}',
                  "pid is a float, not an integer"),
    "pid-string": ('{"pid": "PID", "pidns": 1, "start_ticks": 1, "boot_id": "x", "uid": 0}',
                   "pid is a str, not an integer"),
    "pid-bool": ('{"pid": true, "pidns": 1, "start_ticks": 1, "boot_id": "x", "uid": 0}',
                 "pid is a bool, not an integer"),
    "pid-2**64": ('{"pid": 18446744073709551616, "pidns": 1, "start_ticks": 1, "boot_id": "x", '
                  '"uid": 0}', "pid 18446744073709551616 is out of range"),
    "ticks-infinity": ('{"pid": PID, "pidns": 1, "start_ticks": -Infinity, "boot_id": "x", '
                       '"uid": 0}', "start_ticks is a float, not an integer"),
    "boot-id-number": ('{"pid": PID, "pidns": 1, "start_ticks": 1, "boot_id": 7, "uid": 0}',
                       "boot_id is a int, not a string"),
    "nested-3000": ("[" * 3000, "(not JSON)"),
    "top-level-list": ("[PID]", "(a JSON list, not an object)"),
}


@pytest.mark.usefixtures("cleanup_serial")
@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", list(_BAD_RECORDS))
def test_a_segment_with_a_malformed_owner_record_is_kept(case: str,
                                                         planted: list[str]) -> None:
    pid = _dead_pid()
    name = f"gc_test_{pid}_{_token()}"
    path = os.path.join(SHM_DIR, name)
    text, why = _BAD_RECORDS[case]
    _write(path, b"")
    planted.append(path)
    _write(path + leftovers.RECORD_SUFFIX, text.replace("PID", str(pid)).encode())
    planted.append(path + leftovers.RECORD_SUFFIX)
    rec = read_owner_record(path + leftovers.RECORD_SUFFIX, os.geteuid())
    assert isinstance(rec, str) and rec.startswith("owner record malformed") and why in rec, rec
    info = [s for s in list_segments() if s.name == name]
    assert [s.status for s in info] == ["unknown"], info
    res = _cleanup()
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"kept     {name}" in res.stdout and why in res.stdout, res.stdout
    assert os.path.exists(path)


# ---------------------------------------------------------------------- channel directories
def _plant_dir(base: str, record: str) -> str:
    """A directory like a dead writer's: a ``w`` socket and the ``owner`` record."""
    path = tempfile.mkdtemp(prefix=leftovers.CHANNEL_DIR_PREFIX, dir=base)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(os.path.join(path, "w"))
    s.close()
    _write(os.path.join(path, leftovers.CHANNEL_OWNER_FILE), record.encode())
    return path


def _dir_records() -> dict[str, tuple[str, str]]:
    """Records of our own identity with one field no groupcoord writes."""
    me = OwnerIdentity.of_self().__dict__
    return {
        "pid-2**64": (json.dumps({**me, "pid": 2**64}), "pid 18446744073709551616 is out of range"),
        "pid-infinity": (json.dumps({**me, "pid": float("inf")}),
                         "pid is a float, not an integer"),
        "nested-3000": ("[" * 3000, "owner record malformed (not JSON)"),
    }


@pytest.mark.usefixtures("cleanup_serial")
@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", ["pid-2**64", "pid-infinity", "nested-3000"])
def test_a_channel_directory_with_a_record_no_groupcoord_wrote_is_kept(
        case: str, planted: list[str]) -> None:
    record, why = _dir_records()[case]
    path = _plant_dir(leftovers.channel_dir_bases()[0], record)
    planted.append(path)
    remove_dead_channel_dir(path)  # documented never to raise
    assert sorted(os.listdir(path)) == ["owner", "w"]
    info = [d for d in list_channel_dirs() if d.path == path]
    assert [d.status for d in info] == ["unknown"] and why in info[0].reason, info
    res = _cleanup()
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"kept     {path}" in res.stdout and why in res.stdout, res.stdout
    assert sorted(os.listdir(path)) == ["owner", "w"]

"""Segments record their owner's identity; cleanup removes only provably orphaned ones."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
import traceback
from typing import Any

import pytest

from shm_broadcast import SharedSegment
from shm_broadcast.lifecycle.segment import SHM_DIR, OwnerIdentity, list_segments
from tests.child_env import ROOT as REPO_ROOT
from tests.shm_broadcast.lifecycle_helpers import kill_with_reaper, unshare_prefix

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm on this platform")


def _record(name: str) -> str:
    return os.path.join(SHM_DIR, name + ".owner")


def _info(name: str) -> Any:
    found = [s for s in list_segments() if s.name == name]
    assert found, f"{name} not listed"
    return found[0]


def _cleanup(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", "shm_broadcast.cli", "cleanup", *args],
                          capture_output=True, text=True, timeout=60,
                          cwd=REPO_ROOT)


def test_owner_record_is_private_and_exact() -> None:
    with SharedSegment.create("test", 4096) as seg:
        st = os.stat(_record(seg.name))
        assert stat.S_IMODE(st.st_mode) == 0o600
        with open(_record(seg.name)) as f:
            rec = json.load(f)
        me = OwnerIdentity.of_self()
        assert rec == me.__dict__ and rec["pid"] == os.getpid() and rec["pidns"] > 0
        assert rec["start_ticks"] > 0 and len(rec["boot_id"]) == 36
        info = _info(seg.name)
        assert (info.status, info.owner_alive) == ("alive", True), info
    assert not os.path.exists(_record(seg.name))  # the owner removed both


def test_pid_reuse_and_reboot_are_recognised_as_gone() -> None:
    with SharedSegment.create("test", 4096) as seg:
        path = _record(seg.name)
        with open(path) as f:
            rec = json.load(f)
        _rewrite(path, {**rec, "start_ticks": rec["start_ticks"] - 1})  # same pid, older process
        info = _info(seg.name)
        assert info.status == "gone" and "another process" in info.reason, info
        _rewrite(path, {**rec, "boot_id": "00000000-0000-0000-0000-000000000000"})
        info = _info(seg.name)
        assert info.status == "gone" and "reboot" in info.reason, info
        _rewrite(path, {**rec, "timens": rec["timens"] + 1})  # start times not comparable
        info = _info(seg.name)
        assert info.status == "unknown" and "time namespace" in info.reason, info
        _rewrite(path, {**rec, "pidns": rec["pidns"] + 1})
        info = _info(seg.name)
        assert info.status == "unknown" and "another pid namespace" in info.reason, info
        os.chmod(path, 0o644)  # a record others could have written is not trusted
        info = _info(seg.name)
        assert info.status == "alive" and "not written privately" in info.reason, info


@pytest.mark.usefixtures("cleanup_serial")  # cleanup --yes takes any orphan
def test_cleanup_keeps_segments_it_cannot_judge_and_says_why(procs) -> None:
    owner = procs.start(segment_owner)
    _, name = procs.get()
    os.unlink(_record(name))  # no record, and then the owner dies with its reaper
    kill_with_reaper(owner.pid)
    owner.join(10)
    try:
        info = _info(name)
        assert info.status == "unknown" and "no owner record" in info.reason, info
        res = _cleanup("--yes")
        assert res.returncode == 2, res.stdout + res.stderr
        assert f"kept     {name}" in res.stdout and "no owner record" in res.stdout
        assert os.path.exists(os.path.join(SHM_DIR, name))
    finally:
        os.unlink(os.path.join(SHM_DIR, name))


@pytest.mark.usefixtures("cleanup_serial")  # cleanup --yes takes any orphan
@pytest.mark.timeout(120)
def test_cleanup_from_another_pid_namespace_refuses_to_remove_a_live_segment(procs) -> None:
    prefix = unshare_prefix()
    owner = procs.start(segment_owner)
    _, name = procs.get()
    res = _cleanup("--yes", prefix=prefix)
    assert os.path.exists(os.path.join(SHM_DIR, name)), "a live segment was removed"
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"kept     {name}" in res.stdout and "another pid namespace" in res.stdout, res.stdout
    # The owner dies (with its reaper): still undecidable from the other
    # namespace, removed from ours.
    kill_with_reaper(owner.pid)
    owner.join(10)
    res = _cleanup("--yes", prefix=prefix)
    assert os.path.exists(os.path.join(SHM_DIR, name)) and res.returncode == 2
    res = _cleanup("--yes")
    assert f"removed  {name}" in res.stdout, res.stdout + res.stderr
    assert not os.path.exists(os.path.join(SHM_DIR, name))
    assert not os.path.exists(_record(name))


@pytest.mark.usefixtures("cleanup_serial")  # cleanup --yes takes any orphan
@pytest.mark.timeout(90)
def test_cleanup_in_the_same_namespace_removes_only_the_dead_owners_segment(procs) -> None:
    live = procs.start(segment_owner)
    dead = procs.start(segment_owner)
    names = {}
    for _ in range(2):
        _, name = procs.get()
        names[int(name.split("_")[2])] = name
    kill_with_reaper(dead.pid)
    dead.join(10)
    res = _cleanup("--yes")
    assert f"removed  {names[dead.pid]}" in res.stdout, res.stdout + res.stderr
    assert not os.path.exists(os.path.join(SHM_DIR, names[dead.pid]))
    assert os.path.exists(os.path.join(SHM_DIR, names[live.pid]))
    live.terminate()  # SIGTERM: the owner unlinks its segment and record
    live.join(10)
    deadline = time.monotonic() + 10
    while os.path.exists(os.path.join(SHM_DIR, names[live.pid])) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(_record(names[live.pid]))


def _rewrite(path: str, rec: dict) -> None:
    with open(path, "w") as f:
        json.dump(rec, f)
    os.chmod(path, 0o600)


# ---------------------------------------------------------------------- child processes
def segment_owner(out: Any) -> None:
    """Create a segment, report its name, and sleep until killed."""
    try:
        seg = SharedSegment.create("test", 4096)
        out.put(("segment", seg.name))
        time.sleep(600)
    except BaseException:
        out.put(("error", 0, traceback.format_exc()))

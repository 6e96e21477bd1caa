"""``groupcoord cleanup`` collects dead writers' channel directories and orphan owner
records, and never removes anything of a live owner, another user, or a look-alike.

Writers are real processes (a MessageQueue whose reader never attached, so its
channel directory with the writer's sockets exists); "dead" means the writer
and its exit reaper were both SIGKILLed (nothing of theirs can clean up).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from shm_broadcast.lifecycle import leftovers
from shm_broadcast.lifecycle.segment import SHM_DIR, OwnerIdentity
from tests.child_env import ROOT
from tests.shm_broadcast.lifecycle_helpers import kill_with_reaper, unshare_prefix, wait_exit


def _cleanup(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", "shm_broadcast.cli", "cleanup", *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def _start_writer(prefix: tuple[str, ...] = ()) -> tuple[subprocess.Popen, dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "tests.shm_broadcast.lifecycle.test_channel_dir_cleanup",
         "writer"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        raise AssertionError(f"writer exited ({proc.returncode}) before reporting")
    return proc, json.loads(line)


def _stop(proc: subprocess.Popen) -> None:
    """Kill the writer, and first the namespace's init when ``unshare`` started it
    (killing ``unshare`` alone would leave its forked child running)."""
    try:
        for child in psutil.Process(proc.pid).children():
            child.kill()
    except psutil.NoSuchProcess:
        pass
    proc.kill()
    proc.wait(30)


def _remove_by_hand(info: dict[str, Any]) -> None:
    shutil.rmtree(info["dir"], ignore_errors=True)
    leftovers.unlink_segment(info["segment"])


@pytest.mark.usefixtures("cleanup_serial")  # cleanup --yes takes any orphan
@pytest.mark.timeout(90)
def test_a_dead_writers_directory_is_listed_then_removed() -> None:
    proc, info = _start_writer()
    try:
        assert sorted(os.listdir(info["dir"])) == ["c", "owner", "p", "w"]
        listed = _cleanup("--all")
        assert f"in use   {info['dir']}  (channel directory, owner pid {proc.pid}" in listed.stdout
        kill_with_reaper(proc.pid)
        proc.wait(30)
        time.sleep(0.2)
        assert os.path.isdir(info["dir"]), "nobody was left to remove it"
        listed = _cleanup()
        assert listed.returncode == 0, listed.stderr
        assert f"orphan   {info['dir']}  (channel directory, owner pid {proc.pid}: no process" \
            in listed.stdout, listed.stdout
        assert os.path.isdir(info["dir"]), "without --yes nothing is removed"
        removed = _cleanup("--yes")
        assert f"removed  {info['dir']}" in removed.stdout, removed.stdout + removed.stderr
        assert f"removed  {info['segment']}" in removed.stdout
        assert not os.path.lexists(info["dir"])
        assert not os.path.lexists(os.path.join(SHM_DIR, info["segment"] + ".owner"))
    finally:
        _stop(proc)
        _remove_by_hand(info)


@pytest.mark.usefixtures("cleanup_serial")  # cleanup --yes takes any orphan
@pytest.mark.timeout(120)
def test_a_live_writer_in_another_pid_namespace_is_never_removed() -> None:
    prefix = unshare_prefix()
    proc, info = _start_writer(prefix)
    try:
        res = _cleanup("--yes")
        assert res.returncode == 2, res.stdout + res.stderr
        assert f"kept     {info['dir']}" in res.stdout and "another pid namespace" in res.stdout
        assert sorted(os.listdir(info["dir"])) == ["c", "owner", "p", "w"], "a live queue was hurt"
        assert os.path.exists(os.path.join(SHM_DIR, info["segment"]))
    finally:
        _stop(proc)  # the namespace ends with its first process, the reaper with it
        _remove_by_hand(info)


@pytest.mark.usefixtures("cleanup_serial")  # cleanup --yes takes any orphan
@pytest.mark.timeout(60)
def test_an_orphan_owner_record_is_removed_and_nothing_else() -> None:
    proc, info = _start_writer()
    seg = os.path.join(SHM_DIR, info["segment"])
    foreign = None
    try:
        kill_with_reaper(proc.pid)
        proc.wait(30)
        os.unlink(seg)  # as if the owner died between unlinking the segment and its record
        assert os.path.exists(seg + ".owner")
        # Look-alikes that are not orphan records of ours: a link, another user's file.
        link = os.path.join(SHM_DIR, f"gc_test_{proc.pid}_0badc0de.owner")
        os.symlink("/etc/hostname", link)
        ids = _nobody()
        if ids is not None and os.geteuid() == 0:
            foreign = os.path.join(SHM_DIR, f"gc_test_{proc.pid}_0f0f0f0f.owner")
            with open(foreign, "w") as f:
                f.write("{}")
            os.chown(foreign, *ids)
        listed = _cleanup()
        assert f"orphan   {info['segment']}.owner  (owner record whose segment is gone)" \
            in listed.stdout, listed.stdout
        removed = _cleanup("--yes")
        assert f"removed  {info['segment']}.owner" in removed.stdout, removed.stdout
        assert not os.path.lexists(seg + ".owner")
        assert os.path.islink(link) and (foreign is None or os.path.exists(foreign))
        assert "0badc0de" not in removed.stdout and "0f0f0f0f" not in removed.stdout
    finally:
        _stop(proc)
        _remove_by_hand(info)
        for p in (os.path.join(SHM_DIR, f"gc_test_{proc.pid}_0badc0de.owner"), foreign):
            if p and os.path.lexists(p):
                os.unlink(p)


# ---------------------------------------------------------------------- look-alikes
def _nobody() -> tuple[int, int] | None:
    try:
        pw = pwd.getpwnam("nobody")
    except KeyError:
        return None
    return pw.pw_uid, pw.pw_gid


def _dead_identity() -> dict[str, Any]:
    """An owner record that would be judged gone if it were trusted: ours, with the
    pid of a process that has exited."""
    p = subprocess.Popen(["true"])
    p.wait()
    return {**OwnerIdentity.of_self().__dict__, "pid": p.pid}


def _plant(base: str, rec: dict[str, Any], extra: str | None = None, prefix: str = "gc") -> str:
    """A directory like a dead writer's: ``w`` socket, ``owner`` record, maybe more."""
    path = tempfile.mkdtemp(prefix=prefix, dir=base)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(os.path.join(path, "w"))
    s.close()
    fd = os.open(os.path.join(path, "owner"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, json.dumps(rec).encode())
    os.close(fd)
    if extra == "file":
        open(os.path.join(path, "notes.txt"), "w").close()
    elif extra == "link":
        os.symlink(_VICTIM, os.path.join(path, "p"))
    elif extra == "subdir":
        os.mkdir(os.path.join(path, "r0"))
    return path


_VICTIM = os.path.join(tempfile.gettempdir(), "gc-cleanup-victim")


@pytest.fixture
def planted() -> Iterator[list[str]]:
    """Paths the test plants; removed by hand afterwards."""
    paths: list[str] = []
    yield paths
    for p in paths:
        if os.path.islink(p) or os.path.isfile(p):
            os.unlink(p)
        else:
            shutil.rmtree(p, ignore_errors=True)


@pytest.mark.usefixtures("cleanup_serial")  # cleanup --yes takes any orphan
@pytest.mark.timeout(60)
def test_a_look_alike_planted_by_another_user_is_never_removed(planted: list[str]) -> None:
    ids = _nobody()
    if os.geteuid() != 0 or ids is None:
        pytest.skip("needs root (to plant as 'nobody' in a forked child) and a 'nobody' user")
    path = _plant_as(ids, leftovers.channel_dir_bases()[0], _dead_identity())
    planted.append(path)
    assert os.stat(path).st_uid == ids[0]
    res = _cleanup("--yes", "--all")
    assert path not in res.stdout, res.stdout  # not ours: not even listed
    assert sorted(os.listdir(path)) == ["owner", "w"]


@pytest.mark.usefixtures("cleanup_serial")  # cleanup --yes takes any orphan
@pytest.mark.timeout(60)
def test_a_segment_planted_by_another_user_is_not_judged(planted: list[str]) -> None:
    """Another user's file of our form is neither removed (root) nor reported as kept
    (which would fail every cleanup of this user for good)."""
    ids = _nobody()
    if os.geteuid() != 0 or ids is None:
        pytest.skip("needs root (to plant as 'nobody' in a forked child) and a 'nobody' user")
    path = _plant_as(ids, SHM_DIR, {**_dead_identity(), "uid": ids[0]}, _plant_segment)
    planted.extend([path, path + leftovers.RECORD_SUFFIX])
    assert os.stat(path).st_uid == ids[0]
    res = _cleanup("--yes", "--all")
    name = os.path.basename(path)
    assert name not in res.stdout, res.stdout  # not ours: not even listed
    assert res.returncode == 0, res.stdout + res.stderr
    assert os.path.exists(path) and os.path.exists(path + leftovers.RECORD_SUFFIX)


@pytest.mark.usefixtures("cleanup_serial")  # cleanup --yes takes any orphan
@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra", ["file", "link", "subdir"])
def test_our_directory_with_unexpected_contents_is_kept(extra: str, planted: list[str]) -> None:
    with open(_VICTIM, "w") as f:
        f.write("keep me")
    planted.append(_VICTIM)
    path = _plant(leftovers.channel_dir_bases()[0], _dead_identity(), extra)
    planted.append(path)
    before = sorted(os.listdir(path))
    res = _cleanup("--yes")
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"kept     {path}" in res.stdout and "which a queue does not create" in res.stdout
    assert sorted(os.listdir(path)) == before
    with open(_VICTIM) as f:
        assert f.read() == "keep me"


@pytest.mark.usefixtures("cleanup_serial")  # cleanup --yes takes any orphan
@pytest.mark.timeout(60)
def test_a_link_named_like_a_channel_directory_is_not_followed(planted: list[str]) -> None:
    base = leftovers.channel_dir_bases()[0]
    target = _plant(base, _dead_identity(), prefix="gc-link-target-")  # not our name
    planted.append(target)
    link = os.path.join(base, "gczzlinkzz")
    os.symlink(target, link)  # our name, but a link: never followed
    planted.append(link)
    res = _cleanup("--yes")
    assert link not in res.stdout and target not in res.stdout, res.stdout
    assert os.path.islink(link) and sorted(os.listdir(target)) == ["owner", "w"]


@pytest.mark.usefixtures("cleanup_serial")  # cleanup --yes takes any orphan
@pytest.mark.timeout(60)
def test_a_dead_owners_directory_without_anything_foreign_is_removed(planted: list[str]) -> None:
    """The positive control of the look-alike tests: the same planting, ours and
    clean, is removed (so the tests above fail if the checks are dropped)."""
    path = _plant(leftovers.channel_dir_bases()[0], _dead_identity())
    planted.append(path)
    res = _cleanup("--yes")
    assert f"removed  {path}" in res.stdout, res.stdout + res.stderr
    assert not os.path.lexists(path)


def _plant_segment(base: str, rec: dict[str, Any]) -> str:
    """A segment like a dead writer's, ``gc_mq_<pid>_<hex>``, with its owner record."""
    path = os.path.join(SHM_DIR, f"gc_mq_{rec['pid']}_{os.urandom(4).hex()}")
    for name, data in ((path, b"\0" * 4096), (path + leftovers.RECORD_SUFFIX,
                                                json.dumps(rec).encode())):
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, data)
        os.close(fd)
    return path


def _plant_as(ids: tuple[int, int], base: str, rec: dict[str, Any], plant: Any = None) -> str:
    """``plant`` (:func:`_plant` by default) in a forked child running as ``ids`` (uid, gid)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: syscalls only, then _exit
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(ids[1])
            os.setuid(ids[0])
            out = (plant or _plant)(base, rec).encode()
        except BaseException as e:
            out = b"!" + repr(e).encode()
        os.write(w, struct.pack("<i", len(out)) + out)
        os._exit(0)
    os.close(w)
    try:
        n = struct.unpack("<i", os.read(r, 4))[0]
        out = os.read(r, n).decode()
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert not out.startswith("!"), out
    return out


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(30)
    return child.pid


@pytest.mark.usefixtures("cleanup_serial")  # leaves an orphan for a moment
@pytest.mark.timeout(90)
@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_a_reader_removes_the_directory_of_a_writer_killed_with_its_reaper(reaped: bool) -> None:
    from shm_broadcast import MessageQueue
    from shm_broadcast.errors import GroupCoordError
    from shm_broadcast.queue.handle import Handle

    proc, info = _start_writer()
    try:
        kill_with_reaper(proc.pid)
        if reaped:
            proc.wait(30)
        else:  # its parent (this test) has not reaped it: a zombie, dead all the same
            assert wait_exit(psutil.Process(proc.pid))
        handle = Handle.from_bytes(bytes.fromhex(info["handle"]))
        with pytest.raises(GroupCoordError), \
                MessageQueue.create_from_handle(handle, handle.local_reader_ranks[0]) as mq:
            mq.wait_until_ready(timeout=5)
        assert not os.path.lexists(info["dir"]), os.listdir(info["dir"])
    finally:
        _stop(proc)
        _remove_by_hand(info)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("forged", ["dead_writer", "dead_writer_and_segment"])
def test_a_handle_naming_a_dead_writer_cannot_remove_a_live_queues_directory(forged: str) -> None:
    """A hostile (or stale) handle pairs a live queue's channel directory with a dead
    writer pid: the reader's failed attach must not remove that directory."""
    import msgspec

    from shm_broadcast import MessageQueue
    from shm_broadcast.errors import GroupCoordError
    from shm_broadcast.queue.handle import Handle

    proc, info = _start_writer()
    try:
        real = Handle.from_bytes(bytes.fromhex(info["handle"]))
        dead = _dead_pid()
        changes: dict[str, Any] = {"writer_pid": dead, "writer_create_time": 1.0}
        if forged == "dead_writer_and_segment":
            changes["segment"] = f"gc_mq_{dead}_00000000"
        evil = msgspec.structs.replace(real, **changes)
        try:
            with MessageQueue.create_from_handle(evil, real.local_reader_ranks[0]) as mq:
                mq.wait_until_ready(timeout=3)
        except GroupCoordError:
            pass
        assert sorted(os.listdir(info["dir"])) == ["c", "owner", "p", "w"]
    finally:
        _stop(proc)
        _remove_by_hand(info)


# ---------------------------------------------------------------------- child process
def _writer() -> None:
    """A writer whose one local reader never attaches: its channel directory stays."""
    from shm_broadcast import MessageQueue

    mq = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2)
    print(json.dumps({"pid": os.getpid(), "segment": mq._impl.ring.name,
                      "dir": mq._impl._channel_dir,
                      "handle": mq.export_handle().to_bytes().hex()}), flush=True)
    time.sleep(120)


if __name__ == "__main__":
    if sys.argv[1] == "writer":
        _writer()

"""PeerWatch checks a peer's pid only from the peer's own pid space (boot + pid
namespace), whatever the hostnames say. Two hosts that share a name (and, in
tests/multihost, a kernel) must not check each other's pids; a peer on this
machine reached over TCP still can be checked."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import psutil
import pytest

from shm_broadcast.waiting.peer_watch import PeerWatch, own_pid_space


def _dead_pid() -> tuple[int, float]:
    p = psutil.Popen([sys.executable, "-c", "pass"])
    ctime = p.create_time()
    p.wait()
    return p.pid, ctime


def test_own_pid_space_names_boot_and_pid_namespace() -> None:
    space = own_pid_space()
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    assert space == f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"


def test_same_pid_space_is_checked_whatever_the_hostname() -> None:
    me = psutil.Process()
    w = PeerWatch(me.pid, me.create_time(), "some-other-host", pid_space=own_pid_space())
    assert w.alive() and w.state() == "running"
    pid, ctime = _dead_pid()
    w = PeerWatch(pid, ctime, "some-other-host", pid_space=own_pid_space())
    assert not w.alive() and w.state() == "exited"


@pytest.mark.parametrize("host", ["same", "other"])
def test_another_pid_space_is_never_checked(host: str) -> None:
    """Its pid means nothing here: a dead (or reused) local pid must not make it dead."""
    pid, ctime = _dead_pid()
    name = socket.gethostname() if host == "same" else "elsewhere"
    w = PeerWatch(pid, ctime, name, pid_space="another-boot/4026531836")
    assert w.alive() and w.state() == "unknown"
    assert w.describe() == f"pid {pid} on {name}"


def test_without_a_pid_space_the_hostname_decides() -> None:
    pid, ctime = _dead_pid()
    assert not PeerWatch(pid, ctime, socket.gethostname()).alive()
    assert PeerWatch(pid, ctime, "elsewhere").alive()


def test_a_process_in_another_pid_namespace_has_another_pid_space() -> None:
    """A child that unshared its pid namespace has another pid space than its parent."""
    if os.geteuid() != 0:
        pytest.skip("needs root (unshare --pid)")
    code = "from shm_broadcast.waiting.peer_watch import own_pid_space; print(own_pid_space())"
    out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                          code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    if out.returncode != 0:
        pytest.skip(f"unshare --pid does not work here: {out.stderr.strip()[:200]}")
    theirs = out.stdout.strip()
    assert theirs and theirs != own_pid_space()
    assert theirs.split("/")[0] == own_pid_space().split("/")[0]  # one kernel, one boot

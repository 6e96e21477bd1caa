"""Test helpers around owners and their exit reapers (real processes, no mocks)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import psutil
import pytest

from shm_broadcast.lifecycle.reaper import MARKER as REAPER_MARKER

__all__ = ["reaper_of", "kill_with_reaper", "wait_exit", "wait_gone", "unshare_prefix",
           "small_shm_command"]


def reaper_of(pid: int, timeout: float = 10.0) -> psutil.Process:
    """The exit reaper of process ``pid`` (detached: found by its command line,
    ``... --groupcoord-reaper <pid> <start ticks>``)."""
    want = [REAPER_MARKER, str(pid)]
    deadline = time.monotonic() + timeout
    while True:
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if any(cmd[i : i + 2] == want for i in range(len(cmd) - 1)):
                return p
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} has no exit reaper")
        time.sleep(0.02)


def kill_with_reaper(pid: int) -> None:
    """SIGKILL process ``pid`` and its exit reaper together (as ``docker kill`` or an
    OOM kill of a whole cgroup would): nothing of the owner's is removed."""
    reaper = reaper_of(pid)
    reaper.kill()
    assert wait_exit(reaper), f"reaper {reaper.pid} survived SIGKILL"
    os.kill(pid, signal.SIGKILL)


def wait_exit(p: psutil.Process, timeout: float = 10.0) -> bool:
    """Wait until ``p`` (not necessarily our child) has exited; False at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def wait_gone(*paths: str, timeout: float = 15.0) -> list[str]:
    """Wait until none of ``paths`` exists; returns those still there at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in paths if os.path.lexists(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


def unshare_prefix() -> tuple[str, ...]:
    """The command prefix that runs a process in a new pid namespace, or skip."""
    tool = shutil.which("unshare")
    if tool is None:
        pytest.skip("unshare(1) is not installed")
    prefix = (tool, "--pid", "--fork", "--mount-proc")
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a pid namespace here (needs root or user namespaces): "
                    f"{probe.stderr.strip()[:200]}")
    return prefix


def small_shm_command(size_mib: int, argv: list[str]) -> list[str]:
    """A command running ``argv`` with a fresh ``size_mib`` MiB tmpfs on ``/dev/shm``
    (a private mount namespace: nothing outside sees it), or skip.

    Needs root (``unshare --mount`` and ``mount``); elsewhere the test skips
    with that reason.
    """
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts a small tmpfs on /dev/shm in a private mount namespace")
    tool = shutil.which("unshare")
    if tool is None or shutil.which("mount") is None:
        pytest.skip("unshare(1) or mount(8) is not installed")
    prefix = [tool, "--mount", "--propagation", "private", "sh", "-c",
              f'mount -t tmpfs -o size={size_mib}m tmpfs /dev/shm && exec "$@"', "sh"]
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a new mount namespace here: "
                    f"{probe.stderr.strip()[:200]}")
    return [*prefix, *argv]

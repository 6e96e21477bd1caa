"""A /dev/shm too small for a segment: a clear error naming its size, never SIGBUS.

Each case runs a child process in a private mount namespace whose /dev/shm is
a fresh tmpfs of a few MiB (root only; skipped elsewhere with the reason).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from tests.child_env import ROOT
from tests.shm_broadcast.lifecycle_helpers import small_shm_command


def _run_child(size_mib: int, case: str) -> dict[str, Any]:
    cmd = small_shm_command(size_mib, [sys.executable, "-m",
                                       "tests.shm_broadcast.lifecycle.test_small_shm", case])
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert res.returncode == 0, f"child failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(120)
def test_a_segment_larger_than_dev_shm_raises_shm_space_error_naming_its_size() -> None:
    out = _run_child(8, "too-small")
    for what in ("segment", "queue"):
        msg = out[what]
        assert msg.startswith("ShmSpaceError: /dev/shm is too small"), msg
        assert "8.0 MiB in all" in msg and "--shm-size" in msg, msg
    assert "a 'mq' segment needs 8.0 MiB" in out["queue"], out["queue"]  # the default ring
    assert out["left_in_dev_shm"] == [], "a failed creation left files behind"


@pytest.mark.timeout(120)
def test_a_full_dev_shm_cannot_sigbus_a_created_segment() -> None:
    out = _run_child(8, "no-sigbus")
    assert out["filler_stopped_by"] == "ENOSPC", out  # /dev/shm really was full ...
    assert out["sparse_control"] == -signal.SIGBUS, out  # ... an unreserved mapping dies ...
    assert out["segment_pages_written"] == out["segment_pages"] > 0, out  # ... ours does not


# ---------------------------------------------------------------------- child process
def _too_small() -> dict[str, Any]:
    from shm_broadcast import MessageQueue, SharedSegment, ShmSpaceError

    out: dict[str, Any] = {}
    for what, make in (("segment", lambda: SharedSegment.create("test", 16 << 20)),
                       ("queue", lambda: MessageQueue(1, 1))):
        try:
            make().close()
            out[what] = "created"
        except ShmSpaceError as e:
            out[what] = f"ShmSpaceError: {e}"
    out["left_in_dev_shm"] = sorted(os.listdir("/dev/shm"))
    return out


def _fill(path: str) -> str:
    """Write ``path`` until the file system is full; the errno name that stopped it."""
    block = b"\xff" * (64 << 10)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, block)
    except OSError as e:
        import errno

        return errno.errorcode.get(e.errno, str(e.errno))
    finally:
        os.close(fd)


def _sparse_control() -> int:
    """Exit status of a child writing to an unreserved (sparse) mapping of a full tmpfs."""
    import mmap

    pid = os.fork()
    if pid == 0:
        fd = os.open("/dev/shm/sparse", os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 1 << 20)
        mm = mmap.mmap(fd, 1 << 20)
        for off in range(0, 1 << 20, 4096):
            mm[off] = 1
        os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _no_sigbus() -> dict[str, Any]:
    from shm_broadcast import SharedSegment

    seg = SharedSegment.create("test", 4 << 20)
    out = {"filler_stopped_by": _fill("/dev/shm/filler"), "sparse_control": _sparse_control(),
           "segment_pages": seg.size // 4096}
    written = 0
    for off in range(0, seg.size, 4096):
        seg.buf[off] = 0xAB
        written += 1
    out["segment_pages_written"] = written
    seg.close()
    for name in ("filler", "sparse"):
        os.unlink(f"/dev/shm/{name}")
    return out


if __name__ == "__main__":
    result = {"too-small": _too_small, "no-sigbus": _no_sigbus}[sys.argv[1]]()
    print(json.dumps(result), flush=True)

"""The default segment sizes fit a TP=8 host into Docker's default 64 MiB /dev/shm.

A TP=8 host of the engine demo holds, at once: the TP group's broadcaster
ring (7 local readers), the demo's world broadcaster ring, 7 single-reader
result queues, and one CPU-communicator workspace for each of the world and
TP groups (8 local ranks each). The fast case allocates exactly those
segments with the library's defaults in a fresh 64 MiB tmpfs; the slow case
runs the demo itself at TP=8 there. Both need root (a private mount
namespace); elsewhere they skip with that reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.child_env import ROOT
from tests.shm_broadcast.lifecycle_helpers import small_shm_command

DOCKER_SHM_MIB = 64
#: What must stay free for everything else on the host (a quarter of it).
ROOM_MIB = 16


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.mark.timeout(120)
def test_a_tp8_hosts_default_segments_fit_docker_dev_shm_with_room() -> None:
    cmd = small_shm_command(DOCKER_SHM_MIB, [sys.executable, "-m",
                                             "tests.coordinator.group.test_shm_budget", "allocate"])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=_env())
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["error"] is None, out
    assert out["free_mib"] >= ROOM_MIB, out
    assert out["used_mib"] <= DOCKER_SHM_MIB - ROOM_MIB, out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_demo_runs_at_tp8_in_docker_dev_shm() -> None:
    cmd = small_shm_command(DOCKER_SHM_MIB, [sys.executable, "-m", "coordinator.cli", "demo",
                                             "--tp", "8", "--pp", "1", "--max-new-tokens", "2",
                                             "--no-progress"])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=ROOT, env=_env())
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "PASS" in res.stdout, res.stdout[-3000:]


# ---------------------------------------------------------------------- child process
def _allocate() -> dict[str, Any]:
    """Create every segment of a TP=8 demo host with default sizes; report the space."""
    from coordinator.group.mq_broadcasters import SINGLE_READER_CHUNK_BYTES, SINGLE_READER_CHUNKS
    from device_comms.cpu_shm.workspace import workspace_segment_bytes
    from shm_broadcast import SharedSegment, ShmRingBuffer, ShmSpaceError
    from shm_broadcast.lifecycle.segment import shm_free_bytes
    from shm_broadcast.queue.message_queue import DEFAULT_MAX_CHUNK_BYTES, DEFAULT_MAX_CHUNKS

    made: list[Any] = []
    error = None
    try:
        for _ in range(2):  # the TP group's broadcaster and the demo's world broadcaster
            made.append(ShmRingBuffer.create(7, DEFAULT_MAX_CHUNK_BYTES, DEFAULT_MAX_CHUNKS))
        for _ in range(7):  # one result queue per worker, read by the driver
            made.append(ShmRingBuffer.create(1, SINGLE_READER_CHUNK_BYTES, SINGLE_READER_CHUNKS))
        for _ in range(2):  # CPU communicator workspaces of the world and TP groups
            made.append(SharedSegment.create("cpucomm", workspace_segment_bytes(None, 8)))
    except ShmSpaceError as e:
        error = str(e)
    st = os.statvfs("/dev/shm")
    out = {"error": error, "segments": len(made),
           "used_mib": (st.f_blocks - st.f_bfree) * st.f_frsize / 2**20,
           "free_mib": shm_free_bytes() / 2**20}
    for m in made:
        m.close()
    return out


if __name__ == "__main__":
    print(json.dumps({"allocate": _allocate}[sys.argv[1]]()), flush=True)

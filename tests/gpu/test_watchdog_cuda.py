"""The watchdog of device calls on a real GPU: CUDA-event marks, a stuck call, ncclCommAbort.

Two processes share the one GPU through CUDA IPC and form a group on it
whose communicator is :class:`CudaCommunicator` without NCCL (NCCL refuses
two ranks on one GPU), so every all-reduce runs as the custom all-reduce
kernel. Its kernel waits :data:`KERNEL_WAIT_S` for a peer, longer than the
group's timeout, so a call whose peer never launches stays on the device
until the watchdog sees it:

* rank 1 skips the second all_reduce: rank 0's watchdog dumps it, names rank 1
  and aborts the communicator; rank 0's next call raises ``BrokenCommunicator``;
* with ``GROUPCOORD_WATCHDOG_ABORT=0`` rank 1 comes late, once rank 0's
  watchdog logged it: the call completes with the right sum and the group
  stays usable.

At world size 1, ``PyNcclCommunicator.abort()`` from another thread ends a
communicator whose all-reduce is queued behind a long kernel, within its
bound, and the device stays usable. The marks alone: eager marks follow their
CUDA events, and captured calls count their graph replays.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from typing import Any

import pytest
import torch

from coordinator.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

GROUP_TIMEOUT_S = 2.0
KERNEL_WAIT_S = 12.0  # the custom all-reduce kernel's own wait for a peer
NAME = "cuda-without-nccl"
N = 4096  # float32 elements: eligible for the custom all-reduce


def _register() -> None:
    from device_comms import register_device_communicator
    from device_comms.cuda.communicator import CudaCommunicator

    class NoNccl(CudaCommunicator):
        """CudaCommunicator whose all-reduce is the custom kernel only."""

        def __init__(self, cpu_group: Any, device: torch.device, device_group: Any = None,
                     unique_name: str = "", timeout: float | None = None) -> None:
            super().__init__(cpu_group, device, device_group, unique_name,
                             timeout=KERNEL_WAIT_S)

        def _make_pynccl(self) -> Any:
            return None

    register_device_communicator(NAME, NoNccl, override=True)


def _group() -> Any:
    from coordinator import GroupCoordinator

    torch.cuda.set_device(0)
    _register()
    # local rank 0 on both: the two processes share cuda:0
    g = GroupCoordinator([[0, 1]], 0, "nccl", True, group_name="wd-cuda",
                         device_communicator=NAME, timeout=GROUP_TIMEOUT_S)
    assert g.device == torch.device("cuda", 0), g.device
    return g


def _env(tmp_path: Any) -> dict[str, str]:
    """The ranks' environment: dumps go to the test's own folder."""
    return {"GROUPCOORD_TRACE_DUMP": os.path.join(str(tmp_path), "rank_")}


def _read_dump(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        data = pickle.load(f)  # our own dump, written by this test's rank
    return {"reason": data["groupcoord"]["reason"],
            "states": [(e["process_group"][0], e["collective_seq_id"], e["state"])
                       for e in data["entries"]]}


def _finish(g: Any) -> dict[str, Any]:
    from coordinator.parallel_state import get_world_group
    from coordinator.trace import watchdog as wd
    from device_comms import unregister_device_communicator

    torch.cuda.synchronize()  # a stuck kernel ends by its own wait
    get_world_group().barrier(timeout=60)
    g.destroy()
    unregister_device_communicator(NAME)
    return {"threads": [t.name for t in threading.enumerate()
                        if t.name == "groupcoord-watchdog"],
            "running": wd.watchdog().running}


def stuck(rank: int, world_size: int, dump_dir: str) -> dict[str, Any]:
    from coordinator.parallel_state import get_world_group
    from device_comms.errors import BrokenCommunicator
    from shm_broadcast.errors import CommTimeout

    g = _group()
    out: dict[str, Any] = {"name": g.unique_name, "custom": g.comm.custom_ar is not None}
    try:
        x = torch.full((N,), float(rank + 1), device="cuda")
        out["first"] = g.all_reduce(x).unique().tolist()
        if rank == 0:
            t0 = time.monotonic()
            y = g.all_reduce(x)  # enqueued; rank 1 never launches its half
            out["returned_after"] = time.monotonic() - t0
            deadline = t0 + GROUP_TIMEOUT_S + 8.0
            while g.comm.broken is None and time.monotonic() < deadline:
                time.sleep(0.02)
            out["aborted_after"] = time.monotonic() - t0
            broken = g.comm.broken
            out["broken"] = None if broken is None else {
                "type": type(broken).__name__, "text": str(broken),
                "peers": list(getattr(broken, "peers", []) or []),
                "is_timeout": isinstance(broken, CommTimeout)}
            try:
                g.all_reduce(x)
            except BrokenCommunicator as e:
                out["next"] = {"text": str(e), "peers": list(e.peers)}
            del y
            torch.cuda.synchronize()  # the kernel gave up after its own wait
            out["synced_after"] = time.monotonic() - t0
            out["dump"] = _read_dump(os.path.join(dump_dir, "rank_0"))
            out["device_ok"] = float(torch.ones(8, device="cuda").sum().item())
        else:
            get_world_group().barrier(timeout=60)  # rank 0 is done with the stuck call
            out["dump"] = _read_dump(os.path.join(dump_dir, "rank_1"))
    finally:
        if rank == 0:
            get_world_group().barrier(timeout=60)
        out.update(_finish(g))
    return out


@pytest.mark.cupy
@pytest.mark.timeout(180)
def test_a_stuck_cuda_call_is_dumped_named_and_aborted(tmp_path: Any) -> None:
    r0, r1 = run_distributed(stuck, 2, str(tmp_path), timeout=150, env=_env(tmp_path))
    assert r0["custom"] and r1["custom"], (r0, r1)
    assert r0["first"] == [3.0] and r1["first"] == [3.0], (r0, r1)
    assert r0["returned_after"] < 1.0, r0  # a device call returns once enqueued
    br = r0["broken"]
    assert br is not None and br["is_timeout"], r0
    assert GROUP_TIMEOUT_S <= r0["aborted_after"] <= GROUP_TIMEOUT_S + 1.5, r0
    assert br["peers"] == [1], br
    assert "rank(s) [1] have not reached collective #2" in br["text"], br["text"]
    assert "was aborted" in r0["next"]["text"] and r0["next"]["peers"] == [1], r0
    dump = r0["dump"]
    assert dump is not None and dump["reason"].startswith("watchdog: "), dump
    stuck_entries = [s for n, seq, s in dump["states"] if n == r0["name"] and seq == 2]
    assert stuck_entries == ["started"] or stuck_entries == ["scheduled"], dump["states"]
    assert r0["device_ok"] == 8.0
    assert r1["dump"] is None, r1  # the rank that did not call has nothing stuck
    for r in (r0, r1):
        assert r["threads"] == [] and not r["running"], r


def late(rank: int, world_size: int, dump_dir: str) -> dict[str, Any]:
    from coordinator.trace import watchdog as wd

    store = torch.distributed.distributed_c10d._get_default_store()
    logged: list[str] = []

    def seen(record: logging.LogRecord) -> None:
        logged.append(record.getMessage())
        store.set("wd-cuda/reported", b"1")

    handler = logging.Handler()
    handler.emit = seen  # type: ignore[method-assign]
    logging.getLogger(wd.__name__).addHandler(handler)
    g = _group()
    out: dict[str, Any] = {"custom": g.comm.custom_ar is not None}
    try:
        x = torch.full((N,), float(rank + 1), device="cuda")
        g.all_reduce(x)
        t0 = time.monotonic()
        if rank == 1:
            deadline = t0 + GROUP_TIMEOUT_S + 8.0
            while not store.check(["wd-cuda/reported"]) and time.monotonic() < deadline:
                time.sleep(0.02)
        y = g.all_reduce(x)
        out["second"] = y.unique().tolist()  # waits for the kernel
        out["waited"] = time.monotonic() - t0
        out["third"] = g.all_reduce(x).unique().tolist()
        out["broken"] = None if g.comm.broken is None else str(g.comm.broken)
        out["dump"] = _read_dump(os.path.join(dump_dir, f"rank_{rank}"))
    finally:
        logging.getLogger(wd.__name__).removeHandler(handler)
        out.update(_finish(g))
    out["logged"] = logged
    return out


@pytest.mark.cupy
@pytest.mark.timeout(180)
def test_without_abort_a_late_rank_is_reported_and_the_call_completes(tmp_path: Any) -> None:
    env = dict(_env(tmp_path), GROUPCOORD_WATCHDOG_ABORT="0")
    r0, r1 = run_distributed(late, 2, str(tmp_path), timeout=150, env=env)
    for r in (r0, r1):
        assert r["custom"], r
        assert r["second"] == [3.0] and r["third"] == [3.0], r
        assert r["broken"] is None and r["threads"] == [] and not r["running"], r
    assert GROUP_TIMEOUT_S <= r0["waited"] <= GROUP_TIMEOUT_S + 3.0, r0
    assert len(r0["logged"]) == 1, r0["logged"]
    assert "rank(s) [1] have not reached collective #2" in r0["logged"][0], r0["logged"]
    assert "aborted" not in r0["logged"][0], r0["logged"]
    assert r0["dump"] is not None and "rank(s) [1]" in r0["dump"]["reason"], r0["dump"]
    assert r1["logged"] == [] and r1["dump"] is None, r1


def nccl_abort(rank: int, world_size: int) -> dict[str, Any]:
    from coordinator.parallel_state import get_world_group
    from device_comms.cuda.pynccl import PyNcclCommunicator
    from device_comms.errors import CommunicatorClosed

    torch.cuda.set_device(0)
    comm = PyNcclCommunicator(get_world_group().cpu_group, torch.device("cuda", 0))
    out: dict[str, Any] = {}
    x = torch.ones(1 << 20, device="cuda")
    out["before"] = comm.all_reduce(x).unique().tolist()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))  # device work ahead of the call (1.5 s on an H200)
    comm.all_reduce(x)
    result: list[Any] = []

    def abort() -> None:
        t0 = time.monotonic()
        try:
            result.append(comm.abort(timeout=20.0))
        except Exception as e:  # reported to the test, which fails on it
            result.append(f"{type(e).__name__}: {e}")
        result.append(time.monotonic() - t0)

    t = threading.Thread(target=abort)
    t.start()
    t.join(30)
    out["abort"] = result
    out["alive"] = t.is_alive()
    try:
        comm.all_reduce(x)
    except CommunicatorClosed:
        out["after"] = "closed"
    out["again"] = comm.abort()
    torch.cuda.synchronize()
    out["device_ok"] = float(torch.ones(8, device="cuda").sum().item())
    comm.close()
    return out


def test_nccl_abort_from_another_thread_with_work_queued() -> None:
    (out,) = run_distributed(nccl_abort, 1, timeout=120)
    assert out["before"] == [1.0], out
    assert not out["alive"] and out["abort"][0] is True, out
    assert out["abort"][1] < 10.0, out  # far below the abort's own 20 s bound
    assert out["after"] == "closed" and out["again"] is False, out
    assert out["device_ok"] == 8.0, out


def test_cuda_marks_follow_events_and_count_replays() -> None:
    from coordinator.trace.cuda_marks import CudaMarker

    marker = CudaMarker(torch.device("cuda", torch.cuda.current_device()))
    x = torch.ones(1 << 20, device="cuda")
    marks = marker()
    y = x * 2
    marks.finish()
    torch.cuda.synchronize()
    assert marks.started_ns() is not None and marks.completed_ns() is not None
    assert marks.replays() is None and y.sum().item() == 2 * (1 << 20)
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
        captured = marker()
        z = x + 1
        captured.finish()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert captured.completed_ns() is not None and z.sum().item() == 2 * (1 << 20)
    assert captured.replays() == 3

"""One timeout rule everywhere: seconds >= 0, 0 polls once, None is the caller's default.

Inside a GroupCoordinator the default is the group's own timeout: its
communicator and its message queue wait no longer than that. A group given no
timeout takes ``GROUPCOORD_TIMEOUT``, else 300 s; ``GROUPCOORD_CPU_SHM_TIMEOUT``
sets the shared-memory steps of such a group. An explicit timeout beats both.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(240)


# ------------------------------------------------------------------ rank code
def _group(rank: int, world_size: int, name: str, **kw: Any) -> Any:
    from coordinator.group.group_coordinator import GroupCoordinator

    return GroupCoordinator([list(range(world_size))], rank, "gloo", True, group_name=name, **kw)


_ENVS = ("GROUPCOORD_TIMEOUT", "GROUPCOORD_CPU_SHM_TIMEOUT")


def _timeouts_reach_the_communicator(rank: int, world_size: int) -> dict[str, Any]:
    """What each source of a timeout gives: (group, communicator, queue default)."""
    out: dict[str, Any] = {}
    cases = (
        ("seconds", {"timeout": 7.5}, {}),
        ("timedelta", {"timeout": datetime.timedelta(seconds=9)}, {}),
        ("default", {}, {}),
        ("env", {}, {"GROUPCOORD_TIMEOUT": "13"}),
        ("env-shm", {}, {"GROUPCOORD_TIMEOUT": "13", "GROUPCOORD_CPU_SHM_TIMEOUT": "4"}),
        ("explicit-beats-env", {"timeout": 6.0},
         {"GROUPCOORD_TIMEOUT": "13", "GROUPCOORD_CPU_SHM_TIMEOUT": "4"}),
    )
    for tag, kw, env in cases:
        saved = {k: os.environ.pop(k, None) for k in _ENVS}
        os.environ.update(env)
        try:
            g = _group(rank, world_size, f"to-{tag}", use_message_queue_broadcaster=True, **kw)
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None)
                if v is not None:
                    os.environ[k] = v
        mq = g.mq_broadcaster
        out[tag] = (g.timeout, g.comm.timeout, type(g.comm).__name__,
                    None if mq is None else mq.default_timeout)
        g.destroy()
    return out


def _bad_group_timeouts(rank: int, world_size: int) -> list[tuple[str, str]]:
    got = []
    for bad in (0, -1.0, float("nan"), "10", True):
        try:
            _group(rank, world_size, "to-bad", timeout=bad).destroy()
            got.append((repr(bad), "no error"))
        except (TypeError, ValueError) as e:
            got.append((repr(bad), f"{type(e).__name__}: {e}"))
    return got


def _poll_once_in_a_collective(rank: int, world_size: int, late_s: float) -> tuple[str, float, str]:
    """timeout=0: rank 0 does not wait for the late ranks (the CPU shared-memory path)."""
    import torch

    from coordinator.errors import CommTimeout, PeerDiedError
    from device_comms.cpu.communicator import CpuCommunicator

    g = _group(rank, world_size, "to-poll")
    comm = CpuCommunicator(g.cpu_group, torch.device("cpu"), unique_name="to-poll0", timeout=0)
    try:
        if rank != 0:
            time.sleep(late_s)
        t0 = time.monotonic()
        try:
            comm.all_reduce(torch.ones(4))
            return ("returned", time.monotonic() - t0, "")
        except (CommTimeout, PeerDiedError) as e:  # late ranks find rank 0 gone or broken
            return (type(e).__name__, time.monotonic() - t0, str(e))
    finally:
        comm.destroy()
        g.barrier()
        g.destroy()


def _mq_waits_for_the_group_timeout(rank: int, world_size: int,
                                    timeout: float) -> tuple[str, float, str]:
    """A reader whose writer never sends gives up after the group's timeout."""
    from coordinator.errors import CommTimeout

    g = _group(rank, world_size, "to-mq", timeout=timeout, use_message_queue_broadcaster=True)
    try:
        if rank == 0:
            return ("writer", 0.0, "")
        t0 = time.monotonic()
        try:
            g.broadcast_object(None, src=0)
            return ("returned", time.monotonic() - t0, "")
        except CommTimeout as e:
            return ("CommTimeout", time.monotonic() - t0, str(e))
    finally:
        g.barrier(timeout=60)  # longer than the group's own 2 s
        g.destroy()


def _model_parallel_groups_inherit(rank: int, world_size: int, port: int) -> dict[str, Any]:
    """Re-initialise with a timeout: tp/pp/dp get the world's, and so do their communicators."""
    from coordinator import parallel_state as ps

    ps.destroy_distributed_environment()
    ps.init_distributed_environment(world_size, rank, f"tcp://127.0.0.1:{port}", rank,
                                    timeout=11.0)
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    groups = {"world": ps.get_world_group(), "tp": ps.get_tp_group(), "pp": ps.get_pp_group(),
              "dp": ps.get_dp_group()}
    out: dict[str, Any] = {k: (g.timeout, g.comm.timeout if g.world_size > 1 else None)
                           for k, g in groups.items()}
    out["tp-queue"] = ps.get_tp_group().mq_broadcaster.default_timeout
    assert ps.init_distributed_environment(timeout=11.0) is ps.get_world_group()
    try:
        ps.init_distributed_environment(timeout=12.0)
        out["other-timeout"] = "no error"
    except ValueError as e:
        out["other-timeout"] = str(e)
    return out


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_group_timeout_reaches_its_communicator_and_queue(dist_pool, world_size: int) -> None:
    for r in dist_pool(world_size).run(_timeouts_reach_the_communicator):
        assert r["seconds"] == (7.5, 7.5, "CpuCommunicator", 7.5)
        assert r["timedelta"] == (9.0, 9.0, "CpuCommunicator", 9.0)
        assert r["default"] == (300.0, 300.0, "CpuCommunicator", 300.0)
        assert r["env"] == (13.0, 13.0, "CpuCommunicator", 13.0)
        assert r["env-shm"] == (13.0, 4.0, "CpuCommunicator", 13.0)
        assert r["explicit-beats-env"] == (6.0, 6.0, "CpuCommunicator", 6.0)


def test_default_timeout_and_its_environment_variable(monkeypatch) -> None:
    from shm_broadcast.timeouts import DEFAULT_TIMEOUT_S, default_timeout

    monkeypatch.delenv("GROUPCOORD_TIMEOUT", raising=False)
    assert DEFAULT_TIMEOUT_S == 300.0 and default_timeout() == 300.0
    monkeypatch.setenv("GROUPCOORD_TIMEOUT", "42.5")
    assert default_timeout() == 42.5
    for bad in ("soon", "0", "-3", "nan", "inf"):
        monkeypatch.setenv("GROUPCOORD_TIMEOUT", bad)
        with pytest.raises(ValueError, match="GROUPCOORD_TIMEOUT"):
            default_timeout()


def test_a_queue_default_timeout_is_checked_and_used() -> None:
    from shm_broadcast import MessageQueue, QueueTimeout

    with MessageQueue(1, 1, [1], max_chunk_bytes=1024, max_chunks=1, name="dflt") as w, \
            MessageQueue.create_from_handle(w.export_handle(), 1) as r:
        w.wait_until_ready(10)
        r.wait_until_ready(10)
        assert w.default_timeout is None and r.default_timeout is None
        for bad, exc in (("1", TypeError), (-1.0, ValueError), (float("nan"), ValueError)):
            with pytest.raises(exc, match="default_timeout"):
                r.default_timeout = bad
        r.default_timeout = 0.3
        t0 = time.monotonic()
        with pytest.raises(QueueTimeout):
            r.dequeue()  # no timeout given: the default applies
        assert 0.25 <= time.monotonic() - t0 < 3
        w.default_timeout = 0.3
        w.enqueue(1)  # the ring holds one message: the next must wait for the reader
        t0 = time.monotonic()
        with pytest.raises(QueueTimeout, match=r"reader rank\(s\) \[1\]"):
            w.enqueue(2)
        assert 0.25 <= time.monotonic() - t0 < 3
        assert r.dequeue() == 1


def test_a_group_timeout_must_be_positive(dist_pool) -> None:
    for got in dist_pool(2).run(_bad_group_timeouts):
        kinds = dict(got)
        for bad in ("0", "-1.0", "nan"):
            assert kinds[bad].startswith("ValueError") and "timeout" in kinds[bad], kinds
        for bad in ("'10'", "True"):
            assert kinds[bad].startswith("TypeError") and "timeout" in kinds[bad], kinds


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_timeout_zero_polls_once(dist_pool, world_size: int) -> None:
    res = dist_pool(world_size).run(_poll_once_in_a_collective, 3.0, timeout=120)
    kind, elapsed, msg = res[0]
    assert kind == "CommTimeout", res[0]
    assert elapsed < 2.0, f"timeout=0 waited {elapsed:.2f}s"
    assert "rank(s) [" in msg and "1" in msg.split("rank(s) [")[1].split("]")[0], msg


def test_queue_waits_are_bounded_by_the_group_timeout(dist_pool) -> None:
    res = dist_pool(2).run(_mq_waits_for_the_group_timeout, 2.0, timeout=120)
    kind, elapsed, msg = res[1]
    assert kind == "CommTimeout", res[1]
    assert 1.5 <= elapsed < 15, elapsed
    assert "to-mq" in msg or "queue" in msg, msg


def test_model_parallel_groups_inherit_the_world_timeout() -> None:
    from coordinator.testing import free_port, run_distributed

    res = run_distributed(_model_parallel_groups_inherit, 4, free_port(), timeout=180)
    for r in res:
        assert r["world"] == (11.0, 11.0) and r["tp"] == (11.0, 11.0), r
        assert r["pp"][0] == 11.0 and r["dp"][0] == 11.0, r
        assert r["tp-queue"] == 11.0, r
        # asking an existing world group for another timeout is an error, not ignored
        assert "timeout" in r["other-timeout"] and "12" in r["other-timeout"], r

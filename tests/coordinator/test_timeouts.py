"""One timeout rule everywhere: seconds >= 0, 0 polls once, None is the caller's default.

Inside a GroupCoordinator the default is the group's own timeout: its
communicator and its message queue wait no longer than that.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(240)


# ------------------------------------------------------------------ rank code
def _group(rank: int, world_size: int, name: str, **kw: Any) -> Any:
    from coordinator.group_coordinator import GroupCoordinator

    return GroupCoordinator([list(range(world_size))], rank, "gloo", True, group_name=name, **kw)


def _timeouts_reach_the_communicator(rank: int, world_size: int) -> dict[str, Any]:
    from device_comms.cpu_communicator import DEFAULT_TIMEOUT

    out: dict[str, Any] = {}
    for tag, kw in (("seconds", {"timeout": 7.5}),
                    ("timedelta", {"timeout": datetime.timedelta(seconds=9)}),
                    ("default", {})):
        g = _group(rank, world_size, f"to-{tag}", **kw)
        out[tag] = (g.timeout, g.comm.timeout, type(g.comm).__name__)
        g.destroy()
    out["cpu_default"] = DEFAULT_TIMEOUT
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
    from device_comms.cpu_communicator import CpuCommunicator

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
    return {k: (g.timeout, g.comm.timeout if g.world_size > 1 else None)
            for k, g in groups.items()}


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_group_timeout_reaches_its_communicator(dist_pool, world_size: int) -> None:
    for r in dist_pool(world_size).run(_timeouts_reach_the_communicator):
        assert r["seconds"] == (7.5, 7.5, "CpuCommunicator")
        assert r["timedelta"] == (9.0, 9.0, "CpuCommunicator")
        # no group timeout given: torch's default for the group, the communicator's own
        assert r["default"] == (1800.0, r["cpu_default"], "CpuCommunicator")


def test_a_group_timeout_must_be_positive(dist_pool) -> None:
    for got in dist_pool(2).run(_bad_group_timeouts):
        kinds = dict(got)
        for bad in ("0", "-1.0", "nan"):
            assert kinds[bad].startswith("ValueError") and "timeout" in kinds[bad], kinds
        for bad in ("'10'", "True"):
            assert kinds[bad].startswith("TypeError") and "timeout" in kinds[bad], kinds


@pytest.mark.parametrize("world_size", [2, 3])
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

"""Failures and harness behaviour, run on pool ranks (or hand-spawned ones)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from tests.coordinator._dist_checks import expect_equal, expect_raises


# ---------------------------------------------------------------------- failures
class RankBoom(ValueError):
    """A custom exception raised on one rank (re-raised in the parent with its type)."""


class Unpicklable(Exception):
    """An exception that cannot be pickled (holds a lambda)."""

    def __init__(self) -> None:
        super().__init__("cannot travel")
        self.fn = lambda: None


def raise_on(rank: int, world_size: int, bad_rank: int, kind: str) -> int:
    """Raise on ``bad_rank`` (the others return their rank)."""
    if rank == bad_rank:
        if kind == "custom":
            raise RankBoom(f"boom on rank {rank}")
        if kind == "keyerror":
            raise KeyError("missing")
        if kind == "unpicklable":
            raise Unpicklable()
    return rank


def exit_on(rank: int, world_size: int, bad_rank: int, how: str) -> int:
    """Die without a result on ``bad_rank``: ``os._exit(3)`` or SIGKILL."""
    import signal

    if rank == bad_rank:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def return_unpicklable(rank: int, world_size: int) -> Any:
    """Return something the pipe cannot carry."""
    return lambda: rank


def echo(rank: int, world_size: int, *args: Any) -> tuple[Any, ...]:
    """Return what the rank was called with, plus its pid and parent pid."""
    return (rank, world_size, args, os.getpid())


def read_env(rank: int, world_size: int, name: str) -> dict[str, Any]:
    """The rank's view of env var ``name`` and of its node placement."""
    from coordinator import parallel_state as ps

    return {"env": os.environ.get(name), "same_node": ps.in_the_same_node_as(ps.get_world_group())}


def init_mp_then_check(rank: int, world_size: int, step: int) -> bool:
    """Step 0 leaves model parallelism initialised; step 1 sees it torn down."""
    from coordinator import parallel_state as ps

    if step == 0:
        ps.initialize_model_parallel(world_size, 1)
        return ps.model_parallel_is_initialized()
    was = ps.model_parallel_is_initialized()
    ps.initialize_model_parallel(1, world_size)
    return was


def mismatched_all_reduce_on_gloo(rank: int, world_size: int) -> None:
    """On a group forced onto plain gloo (the "torch" communicator), all ranks
    all-reduce but the last rank passes a tensor twice as long."""
    from coordinator import GroupCoordinator

    g = GroupCoordinator([list(range(world_size))], rank, "gloo", True,
                         group_name="gloo-only", device_communicator="torch")
    assert type(g.comm).__name__ == "TorchDistributedCommunicator"
    n = 1000 * (2 if rank == world_size - 1 else 1)
    g.all_reduce(torch.ones(n))


def killed_mid_collective(rank: int, world_size: int, victim: int, delay: float) -> int:
    """All ranks loop over all_reduce; ``victim`` SIGKILLs itself ``delay`` s in."""
    import signal
    import threading

    from coordinator.parallel_state import get_world_group

    g = get_world_group()
    g.barrier()
    if rank == victim:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    x = torch.ones(1 << 18)
    for _ in range(100_000):
        g.all_reduce(x)
    return rank


def barrier_timeout(rank: int, world_size: int) -> str:
    """barrier(timeout) with rank 1 missing raises CollectiveTimeout on rank 0 (world size 2)."""
    from coordinator import GroupCoordinator
    from coordinator.parallel_state import get_world_group
    from device_comms import CollectiveTimeout

    tmp = GroupCoordinator([list(range(world_size))], rank, "gloo", True, group_name="bartmp")
    msg = ""
    t0 = time.monotonic()
    if rank == 0:
        msg = expect_raises("barrier-timeout", CollectiveTimeout, lambda: tmp.barrier(timeout=1.0),
                            "bartmp", "barrier")
        assert time.monotonic() - t0 < 20, "barrier(timeout=1) took far too long"
    get_world_group().barrier()  # rank 1 waits here until rank 0 has failed
    tmp.destroy()
    return msg


def mismatch_then_recover(rank: int, world_size: int) -> dict[str, Any]:
    """Mismatched collectives on the default communicator: every rank must get an
    error (not hang), and the group must work afterwards."""
    from coordinator.parallel_state import get_world_group

    g = get_world_group()
    last = rank == world_size - 1
    out: dict[str, Any] = {"comm": type(g.comm).__name__}
    calls = {
        "numel": lambda: g.all_reduce(torch.ones(2000 if last else 1000)),
        "dtype": lambda: g.all_reduce(torch.ones(4, dtype=torch.int32 if last else torch.float32)),
        "op": lambda: g.all_reduce(torch.ones(4), "max" if last else "sum"),
        "all_gather": lambda: g.all_gather(torch.ones(3 if last else 2), 0),
        "kind": lambda: g.all_gather(torch.ones(4), 0) if last else g.all_reduce(torch.ones(4)),
    }
    for name, call in calls.items():
        t0 = time.monotonic()
        try:
            call()
            out[name] = ("no error", None)
        except Exception as e:  # noqa: BLE001 - the type is the result
            out[name] = (type(e).__name__, round(time.monotonic() - t0, 2))
        expect_equal(f"recovered after {name}", g.all_reduce(torch.ones(3)),
                     torch.full((3,), float(world_size)))
    return out


def survivor_main(rank: int, world_size: int, port: int, conn: Any) -> None:
    """Entry point of a hand-spawned rank (no harness watching): rank 1 SIGKILLs
    itself in the middle of a stream of all-reduces; every survivor reports what
    it raised and how long after the death (sent through ``conn``)."""
    import signal

    from coordinator import GroupCoordinator
    from coordinator import parallel_state as ps

    try:
        ps.init_distributed_environment(world_size, rank, f"tcp://127.0.0.1:{port}", rank)
        default = ps.get_world_group()
        gloo = GroupCoordinator([list(range(world_size))], rank, "gloo", True,
                                group_name="gloo-only", device_communicator="torch")
        default.barrier()
        x = torch.ones(1 << 16)
        report: dict[str, Any] = {"comm": type(default.comm).__name__}
        for i in range(10_000):
            if rank == 1 and i == 20:
                conn.send(("dying", time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            g = default if i % 2 == 0 else gloo
            try:
                g.all_reduce(x)
            except Exception as e:  # noqa: BLE001 - reported to the test
                report["first"] = (g.unique_name, type(e).__name__, time.time(), str(e)[:300])
                break
        # The other group must fail as well (not hang) now that the peer is gone.
        other = gloo if report.get("first", ("world",))[0].startswith("world") else default
        try:
            other.all_reduce(x)
            report["second"] = (other.unique_name, "no error", time.time(), "")
        except Exception as e:  # noqa: BLE001
            report["second"] = (other.unique_name, type(e).__name__, time.time(), str(e)[:300])
        conn.send(("report", report))
    except BaseException as e:  # noqa: BLE001
        conn.send(("crash", repr(e)))
    finally:
        conn.close()
        os._exit(0)  # skip teardown that would talk to the dead peer


def sleep_then(rank: int, world_size: int, seconds: float, value: Any) -> Any:
    """Sleep, then return ``value`` (harness tests)."""
    time.sleep(seconds)
    return value


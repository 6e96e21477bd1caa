"""Works of the groupcoord backend: async collectives, futures, waits from other
threads, and gloo's point-to-point calls (tags, bounded waits, any source)."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.coordinator.torch_backend import cases


@pytest.fixture(scope="module")
def pool(dist_pool: Callable[[int], Any]) -> Iterator[Any]:
    yield dist_pool(2)
    dist_pool(2).run(cases.drop_groups, timeout=60)


def _async_collective(rank: int, world: int) -> dict[str, Any]:
    pg = cases.group()
    t = torch.full((4,), float(rank + 1))
    w = dist.all_reduce(t, async_op=True, group=pg)
    out: dict[str, Any] = {"completed": w.is_completed(), "success": w.is_success()}
    out["wait"] = w.wait(datetime.timedelta(seconds=5))
    fut = w.get_future()
    out["future"] = fut.wait()[0].tolist()
    seen: list[bool] = []
    th = threading.Thread(target=lambda: seen.append(w.wait()))
    th.start()
    th.join(10)
    out["thread_wait"] = seen
    out["value"] = t.tolist()
    return out


def test_async_collective_work(pool: Any) -> None:
    for res in pool.run(_async_collective, timeout=60):
        assert res["completed"] and res["success"] and res["wait"] is True
        assert res["future"] == res["value"] == [3.0] * 4
        assert res["thread_wait"] == [True]


def _p2p(rank: int, world: int) -> dict[str, Any]:
    pg = cases.group()
    out: dict[str, Any] = {}
    if rank == 0:
        a, b = torch.arange(3.0), torch.arange(4.0).reshape(2, 2).t()  # b non-contiguous
        works = [dist.isend(a, 1, group=pg, tag=1), dist.isend(b, 1, group=pg, tag=2)]
        for w in works:
            w.wait()
        dist.send(torch.tensor([5.0]), 1, group=pg, tag=0)
        dist.barrier(group=pg)  # rank 1 asked for a future before this send
        dist.send(torch.tensor([3.0]), 1, group=pg, tag=3)
    else:
        got_b = torch.zeros(2, 2).t()  # filled through a contiguous buffer
        got_a = torch.zeros(3)
        wb = dist.irecv(got_b, 0, group=pg, tag=2)  # tags match out of order
        wa = dist.irecv(got_a, 0, group=pg, tag=1)
        wa.wait()
        wb.wait()
        out["a"], out["b"] = got_a.tolist(), got_b.tolist()
        out["future_done"] = wa.get_future().done()
        anyone = torch.zeros(1)
        out["source"] = dist.recv(anyone, group=pg)
        out["any"] = anyone.tolist()
        fut = dist.irecv(torch.zeros(1), 0, group=pg, tag=3).get_future()  # before the send
        dist.barrier(group=pg)
        out["future"] = fut.wait()[0].tolist()
    return out


def test_point_to_point(pool: Any) -> None:
    res = pool.run(_p2p, timeout=60)[1]
    assert res["a"] == [0.0, 1.0, 2.0]
    assert res["b"] == [[0.0, 2.0], [1.0, 3.0]]
    assert res["future_done"] is True
    assert res["source"] == 0 and res["any"] == [5.0]
    assert res["future"] == [3.0]


def _recv_times_out(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 waits 0.2 s for a message rank 0 never sends (on a group of its own:
    gloo closes the two ranks' connection when a wait times out)."""
    import time

    import coordinator  # noqa: F401 - registers the backend
    from coordinator.errors import CommTimeout

    pg = dist.new_group(backend="groupcoord")
    out: dict[str, Any] = {}
    if rank == 1:
        w = dist.irecv(torch.zeros(1), 0, group=pg, tag=7)
        t0 = time.monotonic()
        for key in ("first", "again"):
            try:
                w.wait(datetime.timedelta(milliseconds=200))
                out[key] = None
            except CommTimeout as e:
                out[key] = type(e).__name__
        out["took"] = time.monotonic() - t0
        out["completed"] = w.is_completed()
        try:
            w.get_future().wait()
        except CommTimeout as e:
            out["future_error"] = type(e).__name__
            out["names_peer"] = "recv from rank 0" in str(e)
        for key, call in (("recv_after", dist.irecv), ("send_after", dist.isend)):
            try:  # gloo closed the pair: the next call on it fails at its start
                call(torch.zeros(1), 0, group=pg, tag=8).wait()
                out[key] = None
            except Exception as e:
                out[key] = type(e).__name__
    dist.barrier()
    dist.destroy_process_group(pg)
    return out


def test_recv_wait_is_bounded(pool: Any) -> None:
    res = pool.run(_recv_times_out, timeout=60)[1]
    assert res["first"] == res["again"] == "CommTimeout"
    assert res["took"] < 5.0
    assert res["completed"] is True and res["future_error"] == "CommTimeout"
    assert res["names_peer"] is True
    # not gloo's bare RuntimeError: the family's, naming the group, the op and the peer
    assert res["recv_after"] == res["send_after"] == "CommTimeout"


def _batch_and_monitored(rank: int, world: int) -> dict[str, Any]:
    pg = cases.group()
    send = torch.full((2,), float(rank))
    recv = torch.zeros(2)
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % world, pg),
           dist.P2POp(dist.irecv, recv, (rank - 1) % world, pg)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    pg.monitored_barrier(datetime.timedelta(seconds=10))
    return {"recv": recv.tolist()}


def test_batch_isend_irecv_and_monitored_barrier(pool: Any) -> None:
    for rank, res in enumerate(pool.run(_batch_and_monitored, timeout=60)):
        assert res["recv"] == [float((rank - 1) % 2)] * 2


def _destroy_frees(rank: int, world: int) -> dict[str, Any]:
    import gc
    import os

    from torch.distributed import distributed_c10d as c10d

    import coordinator  # noqa: F401 - registers the backend

    def ours() -> list[str]:  # our shared memory mapped in this process
        with open("/proc/self/maps") as f:
            return [line for line in f if "/gc_" in line]

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def books() -> tuple[int, int]:  # torch's private maps the gloo group beneath enters
        return len(c10d._world.pg_map), len(c10d._world.pg_group_ranks)

    gc.collect()  # an earlier test's garbage would otherwise unmap its memory mid-test
    before, fds_before, books_before = set(ours()), fds(), books()
    threads_before = {t.ident for t in threading.enumerate()}
    pg = dist.new_group(backend="groupcoord")
    dist.all_reduce(torch.ones(2), group=pg)
    mapped = [line for line in ours() if line not in before]
    # unlinked once mapped: a process that exits without destroying leaves no name
    unlinked = bool(mapped) and all(line.rstrip().endswith("(deleted)") for line in mapped)
    comm = pg.communicator
    served = comm.shm_calls["all_reduce"]
    dist.destroy_process_group(pg)
    closed = comm.closed
    del pg, comm
    gc.collect()  # the group's sockets close with the last reference to it
    return {"mapped": len(mapped), "unlinked": unlinked,
            "left": len([line for line in ours() if line in mapped]),
            "closed": closed, "served": served, "fds": fds() - fds_before,
            "books": books() == books_before,
            "threads": [t.name for t in threading.enumerate() if t.ident not in threads_before]}


def test_destroy_frees_shared_memory(pool: Any) -> None:
    for r in pool.run(_destroy_frees, timeout=60):
        assert r["mapped"] > 0 and r["unlinked"] and r["left"] == 0
        assert r["closed"] and r["served"] == 1
        assert r["fds"] <= 0 and r["books"] and r["threads"] == []


def _ddp_step(rank: int, world: int) -> dict[str, Any]:
    """One DDP step on groupcoord and on gloo: the same gradients (DDP's reducer
    all-reduces through C++ and reads the works' futures)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for hook in (None, default_hooks.allreduce_hook, default_hooks.fp16_compress_hook):
        grads = {}
        for name, pg in (("gloo", dist.group.WORLD), ("groupcoord", cases.group())):
            torch.manual_seed(0)
            model = DDP(torch.nn.Linear(4, 3), process_group=pg)
            if hook is not None:  # hooks read the works' futures
                model.register_comm_hook(pg, hook)
            x = cases.inp((5, 4), torch.float32, rank)
            model(x).square().sum().backward()
            grads[name] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        out[getattr(hook, "__name__", "builtin")] = (
            len(grads["groupcoord"]) == 2
            and all(torch.equal(a, b) for a, b in
                    zip(grads["gloo"], grads["groupcoord"], strict=True)))
    return out


def test_ddp_step_equals_gloo(pool: Any) -> None:
    for res in pool.run(_ddp_step, timeout=60):
        assert res == {"builtin": True, "allreduce_hook": True, "fp16_compress_hook": True}


def _threads(rank: int, world: int) -> dict[str, Any]:
    """Rank 0: a second thread's collective while one is in a barrier (its peer comes
    0.5 s late) raises ConcurrentCallError and touches nothing; two threads wait on
    one receive (into a non-contiguous tensor) at once."""
    import time

    pg = cases.group()
    dist.barrier(group=pg)  # the communicator is built (its set-up is a collective too)
    out: dict[str, Any] = {}
    if rank == 0:
        th = threading.Thread(target=dist.barrier, kwargs={"group": pg})
        th.start()
        time.sleep(0.1)
        try:
            dist.all_reduce(torch.ones(3), group=pg)
            out["second"] = None
        except Exception as e:
            out["second"] = type(e).__name__
        th.join(10)
        time.sleep(0.3)  # both of rank 1's threads are waiting when the data comes
        dist.send(torch.arange(4.0), 1, group=pg, tag=11)
    else:
        time.sleep(0.5)
        dist.barrier(group=pg)
        got = torch.zeros(2, 2).t()
        w = dist.irecv(got, 0, group=pg, tag=11)
        seen: list[Any] = []
        waiters = [threading.Thread(target=lambda: seen.append(w.wait())) for _ in range(2)]
        for t in waiters:
            t.start()
        for t in waiters:
            t.join(5)
        out["waits"], out["got"] = seen, got.tolist()
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, group=pg)
    out["after"] = t.tolist()
    return out


def test_threads_on_one_group(pool: Any) -> None:
    res = pool.run(_threads, timeout=60)
    assert res[0]["second"] == "ConcurrentCallError"
    assert res[1]["waits"] == [True, True] and res[1]["got"] == [[0.0, 1.0], [2.0, 3.0]]
    assert res[0]["after"] == res[1]["after"] == [1.0] * 3


def _abort(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 aborts its group while a thread of it waits in an all_reduce that
    rank 1 never makes (on a group of its own, with a 10 s timeout)."""
    import time

    import coordinator  # noqa: F401 - registers the backend

    pg = dist.new_group(backend="groupcoord", timeout=datetime.timedelta(seconds=10))
    dist.barrier(group=pg)
    out: dict[str, Any] = {}
    if rank == 0:
        def waiter() -> None:
            t0 = time.monotonic()
            try:
                dist.all_reduce(torch.ones(4), group=pg)
                out["thread"] = None
            except Exception as e:
                out["thread"], out["took"] = type(e).__name__, time.monotonic() - t0

        th = threading.Thread(target=waiter)
        th.start()
        time.sleep(0.2)
        pg.abort()
        th.join(15)
        try:
            dist.all_reduce(torch.ones(4), group=pg)
            out["after"] = None
        except Exception as e:
            out["after"] = type(e).__name__
    dist.barrier()
    dist.destroy_process_group(pg)  # after abort too
    return out


def test_abort_breaks_a_call_in_flight(pool: Any) -> None:
    res = pool.run(_abort, timeout=60)[0]
    assert res["thread"] == "ClosedError" and res["took"] < 5.0, res
    assert res["after"] == "ClosedError"

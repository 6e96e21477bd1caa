"""Bad input, failures and harness behaviour, run on pool ranks (or hand-spawned ones)."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch

from device_comms import PeerRejectedError, ReduceOp
from tests.coordinator._dist_checks import (
    expect_equal,
    expect_raises,
    make,
)


# ---------------------------------------------------------------------- bad input
def run_bad_inputs(rank: int, world_size: int) -> list[str]:
    """Every bad argument raises TypeError/ValueError on the caller, naming the argument.

    Arguments the ranks all agree on are passed on every rank (each raises).
    Checks only one rank can make (its own size entry, the source's tensor)
    run with every rank in the call: that rank raises its own error and the
    others PeerRejectedError naming it, within two seconds; the group then
    still works.
    """
    from coordinator import GroupCoordinator
    from coordinator.parallel_state import get_world_group

    g = get_world_group()
    n, me = g.world_size, g.rank_in_group
    other = (me + 1) % n
    x = make(me, (2, 4), torch.float32, "bad")
    xi = make(me, (2, 4), torch.int64, "bad")
    meta = torch.empty(2, 4, device="meta")
    T, V = TypeError, ValueError
    cases: list[tuple[str, type, Callable[[], Any], tuple[str, ...]]] = [
        ("all_reduce/band-float", T, lambda: g.all_reduce(x, ReduceOp.BAND), ("op", "BAND", "float32")),
        ("all_reduce/bxor-bf16", T, lambda: g.all_reduce(x.bfloat16(), ReduceOp.BXOR), ("op", "bfloat16")),
        ("all_reduce/avg-int", T, lambda: g.all_reduce(xi, ReduceOp.AVG), ("op", "AVG", "int64")),
        ("all_reduce/bad-op", T, lambda: g.all_reduce(x, "median"), ("op",)),
        ("all_reduce/uint16", T, lambda: g.all_reduce(x.to(torch.uint16)), ("op", "uint16")),
        ("reduce/float8", T, lambda: g.reduce(x.to(torch.float8_e4m3fn), 0, ReduceOp.MAX),
         ("op", "float8")),
        ("reduce_scatter/uint32", T, lambda: g.reduce_scatter(torch.zeros(n, dtype=torch.uint32), 0),
         ("uint32",)),
        ("all_reduce/not-tensor", T, lambda: g.all_reduce([1.0, 2.0]), ("input_", "list")),
        ("all_reduce/meta-device", V, lambda: g.all_reduce(meta), ("input_", "cpu")),
        ("all_gather/dim-range", V, lambda: g.all_gather(x, 2), ("dim", "[-2, 2)")),
        ("all_gather/dim-neg", V, lambda: g.all_gather(x, -3), ("dim",)),
        ("all_gather/dim-type", T, lambda: g.all_gather(x, 1.0), ("dim",)),
        ("all_gather/0-dim", V, lambda: g.all_gather(torch.tensor(1.0), 0), ("dim", "0-dim")),
        ("all_gather/not-tensor", T, lambda: g.all_gather(None), ("input_",)),
        ("all_gatherv/sizes-len", V, lambda: g.all_gatherv(x, 0, [2] * (n + 1)), ("sizes", str(n))),
        ("all_gatherv/sizes-neg", V, lambda: g.all_gatherv(x, 0, [2] * (n - 1) + [-1]), ("sizes[",)),
        ("all_gatherv/sizes-type", T, lambda: g.all_gatherv(x, 0, "22"), ("sizes",)),
        ("all_gatherv/dim", V, lambda: g.all_gatherv(x, 5, [2] * n), ("dim",)),
        ("reduce_scatter/indivisible", V, lambda: g.reduce_scatter(torch.ones(2, n + 1)), ("divisible", "input_.shape")),
        ("reduce_scatter/dim", V, lambda: g.reduce_scatter(x, 3), ("dim",)),
        ("reduce_scatter/band-float", T, lambda: g.reduce_scatter(torch.ones(n), 0, ReduceOp.BAND), ("op",)),
        ("reduce_scatterv/sum", V, lambda: g.reduce_scatterv(torch.ones(n + 2), 0, [1] * n), ("sizes", "sum")),
        ("reduce_scatterv/len", V, lambda: g.reduce_scatterv(torch.ones(4), 0, [4] + [0] * n), ("sizes",)),
        ("reduce_scatterv/avg-int", T, lambda: g.reduce_scatterv(xi, 0, [2] + [0] * (n - 1), ReduceOp.AVG), ("op",)),
        ("gather/dst-range", V, lambda: g.gather(x, n), ("dst", f"[0, {n})")),
        ("gather/dst-neg", V, lambda: g.gather(x, -1), ("dst",)),
        ("gather/dst-type", T, lambda: g.gather(x, "0"), ("dst",)),
        ("gather/dim", V, lambda: g.gather(x, 0, 2), ("dim",)),
        ("reduce/dst", V, lambda: g.reduce(x, n + 3), ("dst",)),
        ("reduce/op", T, lambda: g.reduce(x, 0, ReduceOp.BOR), ("op",)),
        ("scatter/src", V, lambda: g.scatter(x, n), ("src",)),
        ("scatter/dim-type", T, lambda: g.scatter(x, 0, "0"), ("dim",)),
        ("all_to_all/scatter_dim", V, lambda: g.all_to_all(x, 2, 0), ("scatter_dim",)),
        ("all_to_all/gather_dim", V, lambda: g.all_to_all(torch.ones(n, 2), 0, -3), ("gather_dim",)),
        ("broadcast/src", V, lambda: g.broadcast(x, n), ("src",)),
        ("broadcast/src-bool", T, lambda: g.broadcast(x, True), ("src",)),
        ("broadcast/not-tensor", T, lambda: g.broadcast(3.0, 0), ("input_",)),
        ("broadcast_object/src", V, lambda: g.broadcast_object(1, n), ("src",)),
        ("broadcast_object_list/src", V, lambda: g.broadcast_object_list([1], -1), ("src",)),
        ("broadcast_object_list/type", T, lambda: g.broadcast_object_list((1, 2), 0), ("obj_list", "tuple")),
        ("broadcast_tensor_dict/src", V, lambda: g.broadcast_tensor_dict({"a": x}, n), ("src",)),
        ("send/self", V, lambda: g.send(x, me), ("dst", "this rank")),
        ("send/range", V, lambda: g.send(x, n), ("dst",)),
        ("send/not-tensor", T, lambda: g.send("x", other), ("tensor",)),
        ("recv/self", V, lambda: g.recv((2,), torch.float32, me), ("src", "this rank")),
        ("recv/dtype", T, lambda: g.recv((2,), "float32", other), ("dtype",)),
        ("recv/range", V, lambda: g.recv((2,), torch.float32, -1), ("src",)),
        ("recv/size-type", T, lambda: g.recv("ab", torch.float32, other), ("size",)),
        ("recv/size-neg", V, lambda: g.recv((2, -1), torch.float32, other), ("size",)),
        ("send_object/self", V, lambda: g.send_object({}, me), ("dst",)),
        ("send_object/range", V, lambda: g.send_object({}, n), ("dst",)),
        ("recv_object/self", V, lambda: g.recv_object(me), ("src",)),
        ("recv_object/type", T, lambda: g.recv_object(None), ("src",)),
        ("send_tensor_dict/self", V, lambda: g.send_tensor_dict({"a": x}, me), ("dst",)),
        ("send_tensor_dict/range", V, lambda: g.send_tensor_dict({"a": x}, n), ("dst",)),
        ("send_tensor_dict/not-a-dict", T, lambda: g.send_tensor_dict([x], other), ("tensor_dict",)),
        ("recv_tensor_dict/range", V, lambda: g.recv_tensor_dict(n), ("src",)),
        ("group_ranks/dup", V, lambda: GroupCoordinator([[0, 0]], 0, "gloo", True), ("group_ranks",)),
        ("group_ranks/range", V, lambda: GroupCoordinator([list(range(n + 1))], 0, "gloo", True), ("group_ranks",)),
        ("group_ranks/type", T, lambda: GroupCoordinator("01", 0, "gloo", True), ("group_ranks",)),
    ]
    if n == 1:  # everything divides by 1; a send_tensor_dict to oneself is a no-op
        cases = [c for c in cases if "indivisible" not in c[0] and c[0] != "send_tensor_dict/self"]
    names = []
    for name, exc, fn, words in cases:
        expect_raises(name, exc, fn, *words)
        names.append(name)
    # Arguments only one rank can get wrong (its own size entry, the source's
    # tensor): every rank makes the call; the offender raises its own error,
    # the others a prompt PeerRejectedError naming it, and the group still works.
    if n > 1:
        sizes = [2] * n
        for bad in sorted({0, n // 2, n - 1}):  # first, a middle and the last rank
            own = make(me, (3 if me == bad else 2, 4), torch.float32, "ok")
            one_rank = [
                ("all_gatherv/own-size", lambda: g.all_gatherv(own, 0, sizes),
                 (f"sizes[{bad}]", "input_.shape[0]")),
                ("all_gatherv/own-size-list",
                 lambda: g.all_gatherv([make(me, (2, 4), torch.float32, "ok"), own], 0, sizes),
                 (f"sizes[{bad}]", "input_[1]")),
                ("broadcast/non-contiguous",
                 lambda: g.broadcast(x.t() if me == bad else torch.empty(4, 2), bad),
                 ("contiguous",)),
            ]
            for name, fn, words in one_rank:
                t0 = time.monotonic()
                if me == bad:
                    try:
                        fn()
                        raise AssertionError(f"{name}: rank {me} passed a bad argument, no error")
                    except PeerRejectedError as e:
                        raise AssertionError(f"{name}: the offender got its peers' error: {e}")
                    except ValueError as e:
                        assert all(w in str(e) for w in words), f"{name}: {e}"
                else:
                    msg = expect_raises(name + "/peer", PeerRejectedError, fn, f"rank {bad}", *words)
                    took = time.monotonic() - t0
                    assert took < 2.0, f"{name}/peer: {took:.2f}s to learn of rank {bad}'s rejection"
                    assert "rejected" in msg, msg
                expect_equal(f"{name}/then-works", g.all_reduce(torch.ones(3)),
                             torch.full((3,), float(n)))
                names.append(f"{name}@{bad if bad in (0, n - 1) else 'mid'}")
    # Arguments only the source can get wrong, with every rank in the call: the
    # source raises its own error and tells the receivers, who raise too.
    src_cases = [
        ("scatter/src-dim", ValueError, lambda: g.scatter(x, 0, 2), "dim"),
        ("scatter/src-not-tensor", TypeError, lambda: g.scatter([1.0], 0, 0), "input_"),
        ("broadcast_tensor_dict/not-a-dict", TypeError,
         lambda: g.broadcast_tensor_dict([("a", x)], 0), "tensor_dict"),
    ]
    if n > 1:
        src_cases.append(("scatter/src-indivisible", ValueError,
                          lambda: g.scatter(torch.ones(n + 1, 2), 0, 0), "divisible"))
    receivers = {
        "scatter": lambda: g.scatter(None, 0, 0),
        "broadcast_tensor_dict": lambda: g.broadcast_tensor_dict(None, 0),
    }
    for name, exc, fn, word in src_cases:
        if me == 0:
            expect_raises(name, exc, fn, word)
        else:
            expect_raises(name + "/receiver", ValueError, receivers[name.split("/")[0]],
                          "source rank 0")
    # The group still works after all of that.
    expect_equal("still-works", g.all_reduce(torch.ones(3)), torch.full((3,), float(n)))
    return names


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


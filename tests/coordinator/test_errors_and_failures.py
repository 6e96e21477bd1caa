"""Bad input, mismatched collectives, timeouts and dying ranks.

* Bad arguments raise TypeError/ValueError on the caller, naming the argument.
  When only one rank's arguments are bad (its own size entry, the broadcast
  source's tensor) its peers, in the same call, raise PeerRejectedError naming
  that rank within two seconds; either way the group keeps working.
* A collective whose ranks disagree on the tensor size, or a rank killed in the
  middle of a collective, is reported by the harness within seconds; nothing
  hangs. The failing runs use their own short-lived ranks so the shared pools
  stay warm.
* The validation helpers are property-tested in process (hypothesis).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.errors import DistributedTimeout, RankDiedError
from coordinator.testing import run_distributed
from device_comms import (
    CollectiveMismatch,
    CollectiveTimeout,
    PeerDiedError,
    PeerRejectedError,
    ReduceOp,
    validation,
)
from device_comms.reduce_op import check_reduce_op
from tests.coordinator.rank_checks import expect_equal, expect_raises, make

# ---------------------------------------------------------------------- bad arguments
# One test id per bad argument and world size, each run on the shared pool
# ranks; every run ends by checking that the group still works.
BadArgument = tuple[str, type, Callable[[], Any], tuple[str, ...]]  # name, exception, call, words


def _bad_arguments(g: Any, n: int, me: int) -> list[BadArgument]:
    """``(name, exception, call, words its message must name)`` for every bad argument
    the ranks all agree on (each rank raises). Built on the ranks with their group;
    the test process builds it with ``g=None`` for the names only (nothing is called)."""
    from coordinator import GroupCoordinator

    # The point-to-point partner makes the matching call with a bad argument of its
    # own (pairs 0-1, 2-3: the lower rank sends, the higher receives): a rejected
    # send/recv still meets its peer, as a valid one does. Two sends (or two
    # receives) between a pair never meet: each direction is a stream of its own
    # (device_comms/signatures/p2p_envelopes.py), and gloo's send is a rendezvous.
    other = me ^ 1 if me ^ 1 < n else (me + 1) % n
    sends = me <= other
    bad_send = (lambda: g.send("x", other), ("tensor",))
    bad_recv = (lambda: g.recv((2,), "float32", other), ("dtype",))
    x = make(me, (2, 4), torch.float32, "bad")
    xi = make(me, (2, 4), torch.int64, "bad")
    meta = torch.empty(2, 4, device="meta")
    u4 = (torch.arange(8, dtype=torch.uint8) % 16).reshape(2, 4).view(torch.uint4)
    u4n = torch.zeros(n, 2, dtype=torch.uint8).view(torch.uint4)
    T, V = TypeError, ValueError
    cases: list[BadArgument] = [
        ("all_reduce/band-float", T, lambda: g.all_reduce(x, ReduceOp.BAND),
         ("op", "BAND", "float32")),
        ("all_reduce/bxor-bf16", T, lambda: g.all_reduce(x.bfloat16(), ReduceOp.BXOR),
         ("op", "bfloat16")),
        ("all_reduce/avg-int", T, lambda: g.all_reduce(xi, ReduceOp.AVG), ("op", "AVG", "int64")),
        ("all_reduce/bad-op", T, lambda: g.all_reduce(x, "median"), ("op",)),
        ("all_reduce/uint16", T, lambda: g.all_reduce(x.to(torch.uint16)), ("op", "uint16")),
        ("reduce/float8", T, lambda: g.reduce(x.to(torch.float8_e4m3fn), 0, ReduceOp.MAX),
         ("op", "float8")),
        ("reduce_scatter/uint32", T,
         lambda: g.reduce_scatter(torch.zeros(n, dtype=torch.uint32), 0), ("uint32",)),
        # torch keeps uint4 a byte an element but cannot copy it: refused, not failed mid-step
        ("all_reduce/uint4", T, lambda: g.all_reduce(u4), ("op", "uint4")),
        ("all_gather/uint4", T, lambda: g.all_gather(u4, 0), ("input_", "uint4", "copy")),
        ("gather/uint4", T, lambda: g.gather(u4, 0, 0), ("input_", "uint4")),
        ("broadcast/uint4", T, lambda: g.broadcast(u4, 0), ("input_", "uint4")),
        ("all_to_all/uint4", T, lambda: g.all_to_all(u4n, 0, 0), ("input_", "uint4")),
        # the source's tensor is refused there and, arriving as a buffer, on the receivers
        ("broadcast_tensor_dict/uint4", T,
         lambda: g.broadcast_tensor_dict({"a": u4} if me == 0 else None, 0), ("uint4", "copy")),
        ("all_reduce/not-tensor", T, lambda: g.all_reduce([1.0, 2.0]), ("input_", "list")),
        ("all_reduce/meta-device", V, lambda: g.all_reduce(meta), ("input_", "cpu")),
        ("all_gather/dim-range", V, lambda: g.all_gather(x, 2), ("dim", "[-2, 2)")),
        ("all_gather/dim-neg", V, lambda: g.all_gather(x, -3), ("dim",)),
        ("all_gather/dim-type", T, lambda: g.all_gather(x, 1.0), ("dim",)),
        ("all_gather/0-dim", V, lambda: g.all_gather(torch.tensor(1.0), 0), ("dim", "0-dim")),
        ("all_gather/not-tensor", T, lambda: g.all_gather(None), ("input_",)),
        ("all_gatherv/sizes-len", V, lambda: g.all_gatherv(x, 0, [2] * (n + 1)), ("sizes", str(n))),
        ("all_gatherv/sizes-neg", V, lambda: g.all_gatherv(x, 0, [2] * (n - 1) + [-1]),
         ("sizes[",)),
        ("all_gatherv/sizes-type", T, lambda: g.all_gatherv(x, 0, "22"), ("sizes",)),
        ("all_gatherv/dim", V, lambda: g.all_gatherv(x, 5, [2] * n), ("dim",)),
        ("reduce_scatter/indivisible", V, lambda: g.reduce_scatter(torch.ones(2, n + 1)),
         ("divisible", "input_.shape")),
        ("reduce_scatter/dim", V, lambda: g.reduce_scatter(x, 3), ("dim",)),
        ("reduce_scatter/band-float", T, lambda: g.reduce_scatter(torch.ones(n), 0, ReduceOp.BAND),
         ("op",)),
        ("reduce_scatterv/sum", V, lambda: g.reduce_scatterv(torch.ones(n + 2), 0, [1] * n),
         ("sizes", "sum")),
        ("reduce_scatterv/len", V, lambda: g.reduce_scatterv(torch.ones(4), 0, [4] + [0] * n),
         ("sizes",)),
        ("reduce_scatterv/avg-int", T,
         lambda: g.reduce_scatterv(xi, 0, [2] + [0] * (n - 1), ReduceOp.AVG), ("op",)),
        ("gather/dst-range", V, lambda: g.gather(x, n), ("dst", f"[0, {n})")),
        ("gather/dst-neg", V, lambda: g.gather(x, -1), ("dst",)),
        ("gather/dst-type", T, lambda: g.gather(x, "0"), ("dst",)),
        ("gather/dim", V, lambda: g.gather(x, 0, 2), ("dim",)),
        ("reduce/dst", V, lambda: g.reduce(x, n + 3), ("dst",)),
        ("reduce/op", T, lambda: g.reduce(x, 0, ReduceOp.BOR), ("op",)),
        ("scatter/src", V, lambda: g.scatter(x, n), ("src",)),
        ("scatter/dim-type", T, lambda: g.scatter(x, 0, "0"), ("dim",)),
        ("all_to_all/scatter_dim", V, lambda: g.all_to_all(x, 2, 0), ("scatter_dim",)),
        ("all_to_all/gather_dim", V, lambda: g.all_to_all(torch.ones(n, 2), 0, -3),
         ("gather_dim",)),
        ("broadcast/src", V, lambda: g.broadcast(x, n), ("src",)),
        ("broadcast/src-bool", T, lambda: g.broadcast(x, True), ("src",)),
        ("broadcast/not-tensor", T, lambda: g.broadcast(3.0, 0), ("input_",)),
        ("broadcast_object/src", V, lambda: g.broadcast_object(1, n), ("src",)),
        ("broadcast_object_list/src", V, lambda: g.broadcast_object_list([1], -1), ("src",)),
        ("broadcast_object_list/type", T, lambda: g.broadcast_object_list((1, 2), 0),
         ("obj_list", "tuple")),
        ("broadcast_tensor_dict/src", V, lambda: g.broadcast_tensor_dict({"a": x}, n), ("src",)),
        ("send/self", V, lambda: g.send(x, me), ("dst", "this rank")),
        ("send/range", V, lambda: g.send(x, n), ("dst",)),
        ("send/not-tensor", T, *bad_send) if sends else ("send/not-tensor", T, *bad_recv),
        ("recv/self", V, lambda: g.recv((2,), torch.float32, me), ("src", "this rank")),
        ("recv/dtype", T, *bad_send) if sends else ("recv/dtype", T, *bad_recv),
        ("recv/range", V, lambda: g.recv((2,), torch.float32, -1), ("src",)),
        ("recv/size-type", T, *bad_send) if sends
        else ("recv/size-type", T, lambda: g.recv("ab", torch.float32, other), ("size",)),
        ("recv/size-neg", T, *bad_send) if sends
        else ("recv/size-neg", V, lambda: g.recv((2, -1), torch.float32, other), ("size",)),
        # results no host can hold: refused before anything is allocated
        ("recv/size-huge", T, *bad_send) if sends
        else ("recv/size-huge", V, lambda: g.recv((1 << 40,), torch.float32, other),
              ("size", "memory")),
        ("all_gather/result-overflows", V, lambda: g.all_gather(torch.empty(0, 1 << 62), 1),
         ("input_", "int64")),
        ("gather/result-overflows", V, lambda: g.gather(torch.empty(0, 1 << 62), 0, 1),
         ("input_", "int64")),
        ("all_gatherv/sizes-huge", V, lambda: g.all_gatherv(x, 0, [2] * (n - 1) + [1 << 40]),
         ("sizes", "memory")),
        ("send_object/self", V, lambda: g.send_object({}, me), ("dst",)),
        ("send_object/range", V, lambda: g.send_object({}, n), ("dst",)),
        ("recv_object/self", V, lambda: g.recv_object(me), ("src",)),
        ("recv_object/type", T, lambda: g.recv_object(None), ("src",)),
        ("send_tensor_dict/self", V, lambda: g.send_tensor_dict({"a": x}, me), ("dst",)),
        ("send_tensor_dict/range", V, lambda: g.send_tensor_dict({"a": x}, n), ("dst",)),
        # the receiver is told of the sender's bad dict (PeerRejectedError quotes it)
        ("send_tensor_dict/not-a-dict", T, lambda: g.send_tensor_dict([x], other), ("tensor_dict",))
        if sends or n == 1 else
        ("send_tensor_dict/not-a-dict", V, lambda: g.recv_tensor_dict(other),
         ("rejected", "tensor_dict must be a dict")),
        ("send_tensor_dict/all_gather_group", T,
         lambda: g.send_tensor_dict({"a": x}, other, all_gather_group="tp"), ("all_gather_group",))
        if sends or n == 1 else
        ("send_tensor_dict/all_gather_group", V, lambda: g.recv_tensor_dict(other),
         ("rejected", "all_gather_group must be a GroupCoordinator")),
        ("recv_tensor_dict/range", V, lambda: g.recv_tensor_dict(n), ("src",)),
        ("group_ranks/dup", V, lambda: GroupCoordinator([[0, 0]], 0, "gloo", True),
         ("group_ranks",)),
        ("group_ranks/range", V, lambda: GroupCoordinator([list(range(n + 1))], 0, "gloo", True),
         ("group_ranks",)),
        ("group_ranks/type", T, lambda: GroupCoordinator("01", 0, "gloo", True), ("group_ranks",)),
        ("group_ranks/float", T, lambda: GroupCoordinator([[0.0]], 0, "gloo", True),
         ("group_ranks", "float")),
    ]
    if n == 1:  # everything divides by 1, one copy overflows nothing; a send_tensor_dict
        # to oneself is a no-op, and one rank's broadcast_tensor_dict copies nothing
        cases = [c for c in cases if "indivisible" not in c[0] and "overflows" not in c[0]
                 and c[0] not in ("send_tensor_dict/self", "broadcast_tensor_dict/uint4")]
    return cases


def _one_rank_bad_arguments(
    g: Any, n: int, me: int, bad: int
) -> list[tuple[str, Callable[[], Any], tuple[str, ...]]]:
    """``(name, call, words)`` for arguments only one rank can get wrong (its own
    size entry, the source's tensor), got wrong by rank ``bad``."""
    x = make(me, (2, 4), torch.float32, "bad")
    sizes = [2] * n
    own = make(me, (3 if me == bad else 2, 4), torch.float32, "ok")
    return [
        ("all_gatherv/own-size", lambda: g.all_gatherv(own, 0, sizes),
         (f"sizes[{bad}]", "input_.shape[0]")),
        ("all_gatherv/own-size-list",
         lambda: g.all_gatherv([make(me, (2, 4), torch.float32, "ok"), own], 0, sizes),
         (f"sizes[{bad}]", "input_[1]")),
        ("broadcast/non-contiguous",
         lambda: g.broadcast(x.t() if me == bad else torch.empty(4, 2), bad),
         ("contiguous",)),
    ]


def _offenders(n: int) -> list[int]:
    """The first, a middle and the last rank."""
    return sorted({0, n // 2, n - 1}) if n > 1 else []


def _source_bad_arguments(g: Any, n: int) -> list[tuple[str, type, Callable[[], Any], str]]:
    """``(name, exception, call on the source, word)`` for arguments only the source can get
    wrong."""
    x = make(0, (2, 4), torch.float32, "bad")
    cases = [
        ("scatter/src-dim", ValueError, lambda: g.scatter(x, 0, 2), "dim"),
        ("scatter/src-not-tensor", TypeError, lambda: g.scatter([1.0], 0, 0), "input_"),
        ("broadcast_tensor_dict/not-a-dict", TypeError,
         lambda: g.broadcast_tensor_dict([("a", x)], 0), "tensor_dict"),
    ]
    if n > 1:
        cases.append(("scatter/src-indivisible", ValueError,
                      lambda: g.scatter(torch.ones(n + 1, 2), 0, 0), "divisible"))
    return cases


def _still_works(g: Any) -> None:
    expect_equal("still-works", g.all_reduce(torch.ones(3)), torch.full((3,), float(g.world_size)))


def _bad_argument(rank: int, world_size: int, name: str) -> str:
    """On the ranks: bad argument ``name`` raises its TypeError/ValueError on every rank."""
    from coordinator.parallel_state import get_world_group

    g = get_world_group()
    (case,) = [c for c in _bad_arguments(g, g.world_size, g.rank_in_group) if c[0] == name]
    _, exc, fn, words = case
    expect_raises(name, exc, fn, *words)
    _still_works(g)
    return name


def _one_rank_bad_argument(rank: int, world_size: int, name: str, bad: int) -> str:
    """On the ranks: every rank makes the call; the offender ``bad`` raises its own
    error, the others a prompt PeerRejectedError naming it, and the group still works."""
    from coordinator.parallel_state import get_world_group

    g = get_world_group()
    n, me = g.world_size, g.rank_in_group
    (case,) = [c for c in _one_rank_bad_arguments(g, n, me, bad) if c[0] == name]
    _, fn, words = case
    t0 = time.monotonic()
    if me == bad:
        try:
            fn()
            raise AssertionError(f"{name}: rank {me} passed a bad argument, no error")
        except PeerRejectedError as e:
            raise AssertionError(f"{name}: the offender got its peers' error: {e}") from e
        except ValueError as e:
            assert all(w in str(e) for w in words), f"{name}: {e}"
    else:
        msg = expect_raises(name + "/peer", PeerRejectedError, fn, f"rank {bad}", *words)
        took = time.monotonic() - t0
        assert took < 2.0, f"{name}/peer: {took:.2f}s to learn of rank {bad}'s rejection"
        assert "rejected" in msg, msg
    expect_equal(f"{name}/then-works", g.all_reduce(torch.ones(3)), torch.full((3,), float(n)))
    return f"{name}@{bad}"


def _source_bad_argument(rank: int, world_size: int, name: str) -> str:
    """On the ranks: the source (rank 0) raises its own error and tells the
    receivers, who raise too; the group still works."""
    from coordinator.parallel_state import get_world_group

    g = get_world_group()
    (case,) = [c for c in _source_bad_arguments(g, g.world_size) if c[0] == name]
    _, exc, fn, word = case
    receivers = {
        "scatter": lambda: g.scatter(None, 0, 0),
        "broadcast_tensor_dict": lambda: g.broadcast_tensor_dict(None, 0),
    }
    if g.rank_in_group == 0:
        expect_raises(name, exc, fn, word)
    else:  # scatter: a rejected call (PeerRejectedError); tensor dicts: a source failure
        expect_raises(name + "/receiver", ValueError, receivers[name.split("/")[0]],
                      "rank 0 rejected" if name.startswith("scatter") else "source rank 0")
    _still_works(g)
    return name


BAD_WORLD_SIZES = [1, 2, 4]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,name", [
    pytest.param(ws, c[0], id=f"ws{ws}-{c[0]}")
    for ws in BAD_WORLD_SIZES for c in _bad_arguments(None, ws, 0)
])
def test_bad_argument_raises_on_the_caller(dist_pool, world_size, name):
    assert dist_pool(world_size).run(_bad_argument, name, timeout=60) == [name] * world_size


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,name,bad", [
    pytest.param(ws, c[0], bad, id=f"ws{ws}-{c[0]}@rank{bad}")
    for ws in BAD_WORLD_SIZES for bad in _offenders(ws)
    for c in _one_rank_bad_arguments(None, ws, 0, bad)
])
def test_argument_only_one_rank_gets_wrong_fails_its_peers_promptly(dist_pool, world_size,
    name, bad):
    got = dist_pool(world_size).run(_one_rank_bad_argument, name, bad, timeout=60)
    assert got == [f"{name}@{bad}"] * world_size


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,name", [
    pytest.param(ws, c[0], id=f"ws{ws}-{c[0]}")
    for ws in BAD_WORLD_SIZES for c in _source_bad_arguments(None, ws)
])
def test_argument_only_the_source_gets_wrong_raises_on_every_rank(dist_pool, world_size, name):
    assert dist_pool(world_size).run(_source_bad_argument, name, timeout=60) == [name] * world_size


def test_bad_argument_tables():
    for ws in BAD_WORLD_SIZES:
        names = [c[0] for c in _bad_arguments(None, ws, 0)]
        assert len(names) > 50 and len(set(names)) == len(names)
        offenders = _offenders(ws)
        assert offenders == ([] if ws == 1 else sorted({0, ws // 2, ws - 1}))
        assert len(_one_rank_bad_arguments(None, ws, 0, 0)) == 3


@pytest.mark.timeout(120)
def test_barrier_with_timeout_names_the_group_and_the_missing_rank(dist_pool):
    msgs = dist_pool(2).run(barrier_timeout, timeout=90)
    assert "bartmp" in msgs[0] and "barrier" in msgs[0]
    assert "Ranks 1 failed" in msgs[0] or "Rank 1 failed" in msgs[0], msgs[0]


@pytest.mark.timeout(120)
def test_a_call_after_a_timeout_says_the_group_is_closed(dist_pool):
    """gloo closes all of a group's connections when one of its waits times out:
    the next call fails at once, and says so instead of reporting a new timeout."""
    msgs = dist_pool(2).run(call_after_timeout, timeout=90)
    assert "timed out" in msgs[1]["first"], msgs[1]
    later, seconds = msgs[1]["later"]
    assert "earlier timeout closed this group's connections" in later, later
    assert seconds < 2, msgs[1]


def call_after_timeout(rank: int, world_size: int) -> dict[str, Any]:
    from coordinator import GroupCoordinator
    from coordinator.errors import CommTimeout
    from coordinator.parallel_state import get_world_group

    tmp = GroupCoordinator([list(range(world_size))], rank, "gloo", True, group_name="closing",
                           timeout=1.5)
    out: dict[str, Any] = {}
    try:
        if rank == 1:  # rank 0 never sends
            with pytest.raises(CommTimeout) as first:
                tmp.recv((2,), torch.float32, 0)
            out["first"] = str(first.value)
            t0 = time.monotonic()
            with pytest.raises(CommTimeout) as later:
                tmp.barrier()
            out["later"] = (str(later.value), time.monotonic() - t0)
        get_world_group().barrier()
    finally:
        tmp.destroy()
    return out


# Errors a rank may legitimately report for a broken collective; a hang
# (DistributedTimeout) is the one outcome that is not acceptable.
_REPORTED = (RankDiedError, PeerDiedError, CollectiveMismatch, CollectiveTimeout)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_mismatched_collectives_raise_on_every_rank_and_the_group_recovers(dist_pool, world_size):
    """The default CPU communicator compares what every rank called: a mismatch
    (size, dtype, op, or a different collective) is a CollectiveMismatch on
    every rank, at once, and the next collective works."""
    results = dist_pool(world_size).run(mismatch_then_recover, timeout=90)
    for r in results:
        comm = r.pop("comm")
        for name, (exc, seconds) in r.items():
            assert exc == "CollectiveMismatch", f"{comm}: {name} -> {exc}"
            assert seconds < 10, f"{comm}: {name} took {seconds}s to be detected"
    assert issubclass(CollectiveMismatch, ValueError)


@pytest.mark.timeout(90)
def test_mismatched_sizes_on_plain_gloo_fail_fast_instead_of_hanging():
    """Plain gloo (the "torch" communicator) does not hang either: the rank that
    receives more bytes than it expects aborts (SIGABRT from a C++ enforce,
    which Python cannot catch) and the harness reports the death in seconds."""
    t0 = time.monotonic()
    with pytest.raises(_REPORTED) as info:
        run_distributed(mismatched_all_reduce_on_gloo, 2, timeout=45)
    elapsed = time.monotonic() - t0
    assert not isinstance(info.value, DistributedTimeout)
    assert elapsed < 45, f"took {elapsed:.1f}s"


@pytest.mark.timeout(90)
def test_rank_killed_mid_collective_is_reported_within_timeout():
    t0 = time.monotonic()
    with pytest.raises(_REPORTED) as info:
        run_distributed(killed_mid_collective, 2, 1, 0.5, timeout=60)
    elapsed = time.monotonic() - t0
    # Measured here: a few seconds, almost all of it process start-up.
    assert elapsed < 30, f"a dead rank took {elapsed:.1f}s to be reported"
    if isinstance(info.value, RankDiedError):
        assert info.value.rank == 1 and "SIGKILL" in str(info.value)
    else:  # the survivor noticed first
        assert getattr(info.value, "groupcoord_rank", None) == 0


@pytest.mark.timeout(120)
def test_survivors_of_a_killed_rank_raise_peer_died_error_without_the_harness():
    """Production has no harness: the ranks themselves must notice a dead peer.
    Three hand-spawned ranks alternate all-reduces on the default (shared-memory)
    communicator and on plain gloo; rank 1 is SIGKILLed; both survivors must raise
    PeerDiedError promptly, on the group they were in and on the other one.
    (The ranks start as the launcher starts a process, not through a pool: forks
    of the fork server, which imported torch once; each spawned rank imported it
    again, ~2.5 s of CPU.)"""
    import multiprocessing as mp

    from coordinator.testing import free_port
    from shm_broadcast.ranks.launcher import start_process

    ctx = mp.get_context("spawn")
    port = free_port()
    pipes, procs = [], []
    for rank in range(3):
        parent, child = ctx.Pipe(duplex=False)
        p = start_process(survivor_main, (rank, 3, port, child), name=f"gc-survivor-{rank}")
        child.close()
        pipes.append(parent)
        procs.append(p)
    try:
        msgs = {}
        for rank, c in enumerate(pipes):
            assert c.poll(90), f"rank {rank} reported nothing within 90 s (hang?)"
            msgs[rank] = c.recv()
        assert msgs[1][0] == "dying", msgs[1]
        died = msgs[1][1]
        for rank in (0, 2):
            kind, report = msgs[rank]
            assert kind == "report", report
            for which in ("first", "second"):
                group, exc, when, text = report[which]
                assert exc == "PeerDiedError", f"rank {rank} {which} on {group}: {exc}: {text}"
                assert when - died < 30, f"rank {rank} noticed after {when - died:.1f}s"
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in pipes:
            c.close()


# ---------------------------------------------------------------------- in process
@settings(max_examples=200, deadline=None)
@given(st.integers(-10, 10), st.integers(0, 6))
def test_norm_dim_property(dim, ndim):
    if ndim == 0 or not -ndim <= dim < ndim:
        with pytest.raises(ValueError, match="dim"):
            validation.norm_dim(dim, ndim)
    else:
        assert validation.norm_dim(dim, ndim) == dim % ndim


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-2, 5), max_size=6), st.integers(1, 5), st.integers(0, 20))
def test_check_sizes_property(sizes, world_size, total):
    ok_len = len(sizes) == world_size
    ok_vals = all(s >= 0 for s in sizes)
    ok_sum = sum(sizes) == total
    if ok_len and ok_vals and ok_sum:
        assert validation.check_sizes(sizes, world_size, total=total) == sizes
    else:
        with pytest.raises(ValueError, match="sizes"):
            validation.check_sizes(sizes, world_size, total=total)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(list(ReduceOp)),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64,
                        torch.int64, torch.int32, torch.uint8, torch.bool,
                        torch.uint16, torch.uint64, torch.float8_e5m2]))
def test_check_reduce_op_property(op, dtype):
    bitwise = op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
    no_arith = dtype in (torch.uint16, torch.uint64, torch.float8_e5m2)
    refused = no_arith or (bitwise and dtype.is_floating_point) or (
        op is ReduceOp.AVG and not dtype.is_floating_point)
    if refused:
        with pytest.raises(TypeError, match=f"op=ReduceOp.{op.name}"):
            check_reduce_op(op, dtype)
    else:
        assert check_reduce_op(op, dtype) is op
        assert check_reduce_op(op.name.lower(), dtype) is op  # names are accepted too


def _torch_dtypes() -> list[torch.dtype]:
    """Every dtype this torch names, quantised ones aside (no tensor passes the checks
    with those)."""
    found = {getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
    return sorted((d for d in found if not str(d).startswith(("torch.qint", "torch.quint"))),
                  key=str)


def _has_arithmetic(dtype: torch.dtype) -> bool:
    """Whether torch adds two CPU tensors of ``dtype`` (made from bytes: any dtype)."""
    carrier = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64,
               16: torch.complex128}[dtype.itemsize]
    a = torch.zeros(2, dtype=carrier).view(dtype)
    try:
        torch.add(a, a)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


@pytest.mark.parametrize("dtype", [d for d in _torch_dtypes() if not _has_arithmetic(d)],
                         ids=str)
def test_every_dtype_torch_cannot_add_is_refused_for_every_op(dtype):
    """A reduction of a dtype without arithmetic (bits8, float4_e2m1fn_x2, uint4...)
    is refused before any step; accepted, it failed mid-collective on one rank."""
    for op in ReduceOp:
        with pytest.raises(TypeError, match=f"op=ReduceOp.{op.name}"):
            check_reduce_op(op, dtype)


def test_check_helpers_reject_wrong_types():
    with pytest.raises(TypeError, match="sizes"):
        validation.check_sizes((i for i in range(2)), 2)
    with pytest.raises(TypeError, match=r"sizes\[1\]"):
        validation.check_sizes([1, True], 2)
    with pytest.raises(ValueError, match=r"sizes\[1\]"):
        validation.check_sizes([1, -1], 2)
    with pytest.raises(TypeError, match="src"):
        validation.check_rank(True, 2, "src")
    with pytest.raises(TypeError, match="input_"):
        validation.check_tensor([1], "input_")
    with pytest.raises(TypeError, match="op"):
        check_reduce_op(3, torch.float32)


# ---------------------------------------------------------------------- on the ranks
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
        except Exception as e:
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
            except Exception as e:
                report["first"] = (g.unique_name, type(e).__name__, time.time(), str(e)[:300])
                break
        # The other group must fail as well (not hang) now that the peer is gone.
        other = gloo if report.get("first", ("world",))[0].startswith("world") else default
        try:
            other.all_reduce(x)
            report["second"] = (other.unique_name, "no error", time.time(), "")
        except Exception as e:
            report["second"] = (other.unique_name, type(e).__name__, time.time(), str(e)[:300])
        conn.send(("report", report))
    except BaseException as e:
        conn.send(("crash", repr(e)))
    finally:
        conn.close()
        os._exit(0)  # skip teardown that would talk to the dead peer


# ---------------------------------------------------------------- destroyed under a call
_RUNNING_OPS: dict[str, Callable[[Any], Any]] = {
    "all_reduce": lambda g: g.all_reduce(torch.ones(2)),
    "broadcast_object": lambda g: g.broadcast_object(None, src=0),
    "recv_object": lambda g: g.recv_object(0),
    "recv_tensor_dict": lambda g: g.recv_tensor_dict(0),  # waits for its link's offer
}


def _destroyed_under_a_call(rank: int, world_size: int, op: str) -> dict[str, Any]:
    """Rank 1 is in ``op`` on one thread (rank 0 never joins it) when another thread
    destroys the group: the call raises ClosedError naming the group and op, not
    whatever torch or a released buffer raised (a blocking gloo receive is not
    interrupted: it ends at the group's timeout, 3 s)."""
    import threading

    from coordinator import GroupCoordinator
    from coordinator.errors import ClosedError

    g = GroupCoordinator([[0, 1]], rank, "gloo", True, group_name=f"gone-{op}", timeout=3)
    g.barrier()
    if rank == 0:
        time.sleep(1.0)
        g.destroy()
        return {}
    out: dict[str, Any] = {}

    def call() -> None:
        t0 = time.monotonic()
        try:
            _RUNNING_OPS[op](g)
            out["error"] = "none"
        except ClosedError as e:
            out["error"], out["text"] = "ClosedError", str(e)
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
        out["s"] = time.monotonic() - t0

    th = threading.Thread(target=call)
    th.start()
    time.sleep(0.3)
    g.destroy()
    th.join(30)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", sorted(_RUNNING_OPS))
def test_a_call_running_when_its_group_is_destroyed_raises_closed_error(dist_pool, op):
    res = dist_pool(2).run(_destroyed_under_a_call, op, timeout=50)[1]
    assert res.get("error") == "ClosedError", res
    assert f"op {op}" in res["text"] and "destroyed" in res["text"], res
    assert res["s"] < 3 + 2.0, res

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

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.errors import DistributedTimeout, RankDiedError
from coordinator.testing import run_distributed
from device_comms import CollectiveMismatch, CollectiveTimeout, PeerDiedError, ReduceOp
from device_comms import validation
from device_comms.reduce_op import check_reduce_op
from tests.coordinator import _dist_failures as F


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_bad_arguments_raise_on_the_caller(dist_pool, world_size):
    results = dist_pool(world_size).run(F.run_bad_inputs, timeout=150)
    assert all(r == results[0] for r in results)
    assert len(results[0]) > 50
    one_rank = [c for c in results[0] if "@" in c]  # offender first, middle, last rank
    want = 0 if world_size == 1 else 3 * len({0, world_size // 2, world_size - 1})
    assert len(one_rank) == want, one_rank


@pytest.mark.timeout(120)
def test_barrier_with_timeout_names_the_group_and_the_missing_rank(dist_pool):
    msgs = dist_pool(2).run(F.barrier_timeout, timeout=90)
    assert "bartmp" in msgs[0] and "barrier" in msgs[0]
    assert "Ranks 1 failed" in msgs[0] or "Rank 1 failed" in msgs[0], msgs[0]


# Errors a rank may legitimately report for a broken collective; a hang
# (DistributedTimeout) is the one outcome that is not acceptable.
_REPORTED = (RankDiedError, PeerDiedError, CollectiveMismatch, CollectiveTimeout)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_mismatched_collectives_raise_on_every_rank_and_the_group_recovers(dist_pool, world_size):
    """The default CPU communicator compares what every rank called: a mismatch
    (size, dtype, op, or a different collective) is a CollectiveMismatch on
    every rank, at once, and the next collective works."""
    results = dist_pool(world_size).run(F.mismatch_then_recover, timeout=90)
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
        run_distributed(F.mismatched_all_reduce_on_gloo, 2, timeout=45)
    elapsed = time.monotonic() - t0
    assert not isinstance(info.value, DistributedTimeout)
    assert elapsed < 45, f"took {elapsed:.1f}s"


@pytest.mark.timeout(90)
def test_rank_killed_mid_collective_is_reported_within_timeout():
    t0 = time.monotonic()
    with pytest.raises(_REPORTED) as info:
        run_distributed(F.killed_mid_collective, 2, 1, 0.5, timeout=60)
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
    PeerDiedError promptly, on the group they were in and on the other one."""
    import multiprocessing as mp

    from coordinator.testing import free_port

    ctx = mp.get_context("spawn")
    port = free_port()
    pipes, procs = [], []
    for rank in range(3):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=F.survivor_main, args=(rank, 3, port, child), daemon=True)
        p.start()
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

"""``isend_tensor_dict`` / ``irecv_tensor_dict`` with an ``all_gather_group``.

A pipeline stage of TP ranks that all hold the same tensors sends each one as
this rank's ``1/tp`` slice; the receiving stage's TP ranks get their slices
asynchronously and rebuild the tensors in the background, trading slices
point to point over their TP group (vLLM 0.33's
``irecv_tensor_dict(all_gather_group=...)`` leaves that to a ``postprocess``
step; here ``wait()`` only waits).

The senders' "replicated" tensors deliberately differ between TP ranks, so a
rebuilt tensor shows which rank's slice landed where. Layouts: TP x PP of
2 x 2 and 3 x 2, over the shared-memory links and over the CPU group.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.coordinator.p2p.test_tensor_dict import expect_same_dict, mixed_dict
from tests.coordinator.rank_checks import env_set, expect_raises, make

pytestmark = pytest.mark.timeout(240)

OFF = {"off": False}


def _sender_dict(sender: int) -> dict[Any, Any]:
    d = mixed_dict(sender, "slices")
    d["rep"] = make(sender, (6, 4), torch.float32, "rep")
    d["rep_nc"] = make(sender, (4, 6), torch.int64, "repnc").t()  # non-contiguous
    d["odd"] = make(sender, (7,), torch.float32, "odd")  # no tp divides 7
    d["off"] = make(sender, (12,), torch.float32, "off")  # divisible, switched off
    return d


def _expected(senders: list[int], me: int) -> dict[Any, Any]:
    """What TP rank ``me`` of the receiving stage holds after the rebuild, from the
    sending stage's TP ranks ``senders`` (global ranks)."""
    n = len(senders)
    want = _sender_dict(senders[me])
    for key, whole in list(want.items()):
        if (not isinstance(whole, torch.Tensor) or key in OFF or not whole.numel()
                or whole.numel() % n):
            continue
        parts = [_sender_dict(s)[key].reshape(n, -1)[i] for i, s in enumerate(senders)]
        want[key] = torch.cat(parts).reshape(whole.shape)
    return want


def run_async_slices(rank: int, world_size: int, tp: int, transport: str) -> list[str]:
    from coordinator import parallel_state as ps

    with env_set("GROUPCOORD_P2P_SHM", "1" if transport == "link" else "0"):
        ps.initialize_model_parallel(tp, world_size // tp)
        try:
            return _slices_suite(rank, tp)
        finally:
            ps.destroy_model_parallel()


def _slices_suite(rank: int, tp_size: int) -> list[str]:
    from coordinator import parallel_state as ps

    tp, pp = ps.get_tp_group(), ps.get_pp_group()
    stage, me = pp.rank_in_group, tp.rank_in_group
    last = pp.world_size - 1
    done = []
    # 1) every stage sends to the next (the last back to the first), three dicts
    # outstanding at once; a TP all_reduce runs between the receive and its wait.
    prev_tp = [(stage - 1) % pp.world_size * tp_size + i for i in range(tp_size)]
    sends = [pp.isend_tensor_dict({**_sender_dict(rank), "i": i}, all_gather_group=tp,
                                  all_gather_tensors=OFF) for i in range(3)]
    recvs = [pp.irecv_tensor_dict(all_gather_group=tp) for _ in range(3)]
    total = tp.all_reduce(torch.ones(3))
    assert total.tolist() == [float(tp_size)] * 3, total
    for i, h in enumerate(recvs):
        got = h.wait()
        expect_same_dict(f"slices/{i}", got, {**_expected(prev_tp, me), "i": i})
        assert h.wait() is got, "a second wait returns the same dict"
        assert h.is_completed()
    for h in sends:
        assert h.wait() is None
    done.append("ring")
    # 2) without an all_gather_group: every tensor whole, as the blocking call.
    if stage == 0:
        pp.isend_tensor_dict(_sender_dict(rank), dst=last).wait()
    elif stage == last:
        got = pp.irecv_tensor_dict(0).wait()
        expect_same_dict("whole", got, _sender_dict(rank - stage * tp_size))
    done.append("whole")
    # 3) a receiver without the sender's group gets ValueError at wait, after the
    # dict was drained: the next dict arrives in step.
    if stage == 0:
        for _ in range(2):
            pp.isend_tensor_dict(_sender_dict(rank), 1, tp, OFF).wait()
    elif stage == 1:
        h = pp.irecv_tensor_dict(0)
        expect_raises("missing-group", ValueError, h.wait, "no all_gather_group", "irecv")
        expect_raises("missing-group/again", ValueError, h.wait, "no all_gather_group")
        got = pp.irecv_tensor_dict(0, tp).wait()
        expect_same_dict("after-missing", got, _expected(list(range(tp_size)), me))
    done.append("missing-group")
    # 4) argument errors raise at the call: a receiver's group that is no group
    # (nothing is received: the next receive takes the dict); a sender's forced
    # slice of a tensor no size divides (the receiver is told).
    if stage == 0:
        pp.isend_tensor_dict({"x": torch.arange(4.0)}, 1, tp).wait()
        expect_raises("force-odd", ValueError,
                      lambda: pp.isend_tensor_dict({"odd": torch.ones(7)}, 1, tp,
                                                   {"odd": True}), "odd", "7")
        expect_raises("send-not-a-group", TypeError,
                      lambda: pp.isend_tensor_dict({"x": 1}, 1, tp.cpu_group),
                      "all_gather_group")
    elif stage == 1:
        expect_raises("recv-not-a-group", TypeError,
                      lambda: pp.irecv_tensor_dict(0, tp.cpu_group), "all_gather_group",
                      "ProcessGroup")
        got = pp.irecv_tensor_dict(0, tp).wait()
        assert torch.equal(got["x"], torch.arange(4.0)), got
        expect_raises("told-odd", ValueError, pp.irecv_tensor_dict(0, tp).wait,
                      "rank 0", "'odd'", "7 elements")
        expect_raises("told-group", ValueError, pp.irecv_tensor_dict(0, tp).wait,
                      "rank 0", "all_gather_group")
    done.append("errors")
    # 5) in step afterwards
    if stage == 0:
        pp.isend_tensor_dict(_sender_dict(rank), 1, tp, OFF).wait()
    elif stage == 1:
        got = pp.irecv_tensor_dict(0, tp).wait()
        expect_same_dict("in-step", got, _expected(list(range(tp_size)), me))
    done.append("in-step")
    return done


@pytest.mark.parametrize("transport", ["link", "cpu-group"])
@pytest.mark.parametrize("tp,pp", [(2, 2), (3, 2)], ids=["tp2-pp2", "tp3-pp2"])
def test_async_dicts_rebuild_slices_at_wait(dist_pool, tp, pp, transport) -> None:
    results = dist_pool(tp * pp).run(run_async_slices, tp, transport, timeout=200)
    assert results == [["ring", "whole", "missing-group", "errors", "in-step"]] * (tp * pp)


def run_polls(rank: int, world_size: int, transport: str) -> list[Any]:
    """TP=2 x PP=2. The second sender starts 1.5 s after the first. Receivers poll
    with wait(0) and, between polls, make all_gathers of their TP group of the
    shape a rebuild would make: the rebuild must not pair with them (it used to
    run at the first poll that found the transfer done, a moment that differs
    between the ranks). Then rank 2 waits with a 1 s timeout for a dict whose
    TP peer (rank 3) waits only 4 s later: the wait ends when the dict is there."""
    import time

    from coordinator import parallel_state as ps
    from coordinator.errors import CommTimeout

    with env_set("GROUPCOORD_P2P_SHM", "1" if transport == "link" else "0"):
        ps.initialize_model_parallel(2, 2)
        try:
            tp, pp = ps.get_tp_group(), ps.get_pp_group()
            out: list[Any] = []
            if pp.rank_in_group == 0:
                time.sleep(1.5 * rank)
                pp.isend_tensor_dict({"x": torch.full((8,), 7.0)}, 1, tp).wait()
                pp.isend_tensor_dict({"y": torch.arange(6.0)}, 1, tp).wait()
                return out
            h = pp.irecv_tensor_dict(0, tp)
            gathers = 0
            while True:
                try:
                    got = h.wait(0)
                    break
                except CommTimeout:
                    pass
                tp.all_gather(torch.full((4,), float(rank)), dim=0)  # the rank's own TP work
                gathers += 1
                time.sleep(0.1)
            out.append(got["x"].tolist())
            tp.barrier()
            h = pp.irecv_tensor_dict(0, tp)
            if rank == 3:
                time.sleep(4.0)
            t0 = time.monotonic()
            got = h.wait(timeout=10.0 if rank == 3 else 1.0)
            out.append((got["y"].tolist(), rank == 3 or time.monotonic() - t0 < 1.5))
            return out
        finally:
            ps.destroy_model_parallel()


@pytest.mark.parametrize("transport", ["link", "cpu-group"])
def test_polling_receivers_interleaved_with_tp_work_get_their_dicts(dist_pool,
                                                                    transport) -> None:
    got = dist_pool(4).run(run_polls, transport, timeout=200)
    want = [[7.0] * 8, ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], True)]
    assert got == [[], [], want, want], got


def run_group_of_one(rank: int, world_size: int) -> list[Any]:
    from coordinator import parallel_state as ps

    ps.initialize_model_parallel(1, 1)
    try:
        pp, tp = ps.get_pp_group(), ps.get_tp_group()
        sent = pp.isend_tensor_dict({"a": torch.ones(2)}, all_gather_group=tp).wait()
        got = pp.irecv_tensor_dict(all_gather_group=tp).wait()
        expect_raises("one/not-a-group", TypeError,
                      lambda: pp.irecv_tensor_dict(all_gather_group=object()),
                      "all_gather_group")
        return [sent, got]
    finally:
        ps.destroy_model_parallel()


def test_a_group_of_one_takes_the_group_and_returns_none(dist_pool) -> None:
    assert dist_pool(1).run(run_group_of_one, timeout=60) == [[None, None]]

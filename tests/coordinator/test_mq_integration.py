"""GroupCoordinator + shm_broadcast: broadcasters, single-reader queues, external writers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from coordinator import GroupCoordinator
from coordinator import parallel_state as ps
from shm_broadcast import WaitPolicy


@pytest.mark.parametrize("world_size,tp", [(2, 2), (4, 4), (4, 2)])
def test_tp_group_broadcasts_through_queue(dist_pool, world_size: int, tp: int) -> None:
    for r in dist_pool(world_size).run(tp_broadcasts, tp, timeout=120):
        assert r["has_mq"]
        assert "bad_obj" not in r, r.get("bad_obj")
        assert r["dict_ok"]
        assert r["writer_last_ok"]
        assert r.get("bad_option") is True
        assert r.get("bad_blocking") == "blocking must be a bool, got str ('no')", r
        # The group's broadcaster readers wait predictively; an explicit policy wins.
        assert r["predictive"] == (r["rank_in_group"] != 0)
        assert r["explicit_plain"] is True
        for arg in ("group", "metadata_group"):
            assert r[f"bad-{arg}"] == (f"{arg} must be a torch.distributed.ProcessGroup or None, "
                                       f"got str")
        for path in ("queue", "world", "metadata-group"):
            assert r[f"grads/{path}"] in (("src", True), [
                ("g", "Tensor", False, True), ("plain", "Tensor", False, True),
                ("w", "Tensor", False, True)]), (path, r[f"grads/{path}"])


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("blocking", [True, False])
def test_single_reader_queues(dist_pool, world_size: int, blocking: bool) -> None:
    res = dist_pool(world_size).run(single_reader, blocking, timeout=120)
    assert res[-1]["ok"]
    assert res[-1]["count"] == 20 * (world_size - 1)


@pytest.mark.parametrize("who", ["every-rank", "writer-rank-only"])
@pytest.mark.parametrize("blocking", [True, False])
def test_external_writer_handle(dist_pool, who: str, blocking: bool) -> None:
    """As in vLLM: the writer rank's handle counts and every rank of the group (the
    writer rank too) reads the external queue, whether or not the others pass it."""
    res = dist_pool(3).run(external_writer, who, blocking, timeout=120)
    assert res[1]["got"] == [0, 1, 2, 3, 4]
    assert res[2]["got"] == [0, 1, 2, 3, 4]
    assert res[1]["transport"] == res[2]["transport"] == "shm"


@pytest.mark.parametrize("who", ["every-rank", "writer-rank-only"])
def test_an_external_handles_secret_does_not_travel_over_the_group(dist_pool, who: str) -> None:
    """The external queue's reader of group rank 1 is remote (TCP): the handle the
    writer rank broadcasts holds no client secret, so rank 1 reads only when it
    passed the handle (with its secret) itself."""
    res = dist_pool(3).run(external_remote_reader, who, timeout=120)
    if who == "every-rank":
        assert res[2]["got"] == [0, 1, 2, 3, 4] and res[2]["transport"] == "tcp", res[2]
    else:
        assert res[2]["error"][0] == "ValueError" and "CURVE" in res[2]["error"][1], res[2]
    assert res[1]["transport"] == "shm", res[1]
    assert res[1]["got"] == ([0, 1, 2, 3, 4] if who == "every-rank" else []), res[1]


def test_a_bad_external_writer_handle_raises_on_every_rank(dist_pool) -> None:
    res = dist_pool(2).run(bad_external_handle, timeout=120)
    assert res[0]["error"][0] == "ValueError" and "Handle" in res[0]["error"][1], res[0]
    assert res[1]["error"][0] == "PeerRejectedError" and "rank 0" in res[1]["error"][1], res[1]
    assert res[0]["type"][0] == "TypeError" and "external_writer_handle" in res[0]["type"][1]
    assert res[1]["type"][0] == "PeerRejectedError", res[1]
    assert res[0]["after"] == res[1]["after"] == "ok"  # the group goes on


@pytest.mark.parametrize("world_size", [2, 4])
def test_src_only_argument_errors_raise_everywhere(dist_pool, world_size: int) -> None:
    res = dist_pool(world_size).run(src_only_errors_reach_everyone, timeout=120)
    for rank, r in enumerate(res):
        for name in ("world", "tp_mq"):
            kind, elapsed, msg = r[f"{name}_btd"]
            # The source raises the plain argument error; the others learn of it
            # as CollectiveMismatch (a ValueError) naming the source.
            assert kind == ("TypeError" if rank == 0 else "CollectiveMismatch"), (rank, name, msg)
            assert elapsed < 10 and ("source rank 0" in msg or rank == 0), msg
            kind, elapsed, msg = r[f"{name}_scatter"]
            # A rejected scatter is a rejected call like any other: PeerRejectedError
            # (a CollectiveMismatch) naming the source on the receivers.
            assert kind == ("ValueError" if rank == 0 else "PeerRejectedError"), (rank, name, msg)
            assert rank == 0 or "rank 0" in msg, msg
            assert elapsed < 10, (rank, name, msg)
            assert "divisible" in msg, msg
            assert r[f"{name}_after"]


# ---------------------------------------------------------------------- on the ranks
def tp_broadcasts(rank: int, world_size: int, tp: int) -> dict:
    ps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                 pipeline_model_parallel_size=world_size // tp)
    g = ps.get_tp_group()
    out: dict = {"has_mq": g.mq_broadcaster is not None, "rank_in_group": g.rank_in_group,
                 "predictive": "planned" in g.mq_broadcaster.park_stats()}
    for step in range(50):
        src_obj = {"step": step, "ids": list(range(step % 7)), "tag": f"s{step}"}
        got = g.broadcast_object(src_obj if g.rank_in_group == 0 else None)
        if got != src_obj:
            out["bad_obj"] = (step, got)
    meta = {
        "input_ids": torch.arange(10, dtype=torch.int64),
        "positions": torch.arange(10, dtype=torch.int32)[::2],   # non-contiguous
        "scale": torch.tensor(0.5, dtype=torch.bfloat16),        # 0-dim bf16
        "empty": torch.empty(0, 3),
        "none": None,
        "reqs": ["a", "b"],
    }
    d = g.broadcast_tensor_dict(meta if g.rank_in_group == 0 else None)
    out["dict_ok"] = all(
        torch.equal(d[k], meta[k]) and d[k].dtype == meta[k].dtype
        for k in ("input_ids", "positions", "scale", "empty")
    ) and d["none"] is None and d["reqs"] == ["a", "b"]
    # A group argument that is no process group: TypeError naming it, on every rank
    for arg in ("group", "metadata_group"):
        try:
            g.broadcast_tensor_dict(meta if g.rank_in_group == 0 else None, **{arg: "tp"})
            out[f"bad-{arg}"] = "returned"
        except TypeError as e:
            out[f"bad-{arg}"] = str(e)
    # Receivers get plain tensors outside autograd over the queue, as over the
    # group's other paths (the world group's, and an explicit metadata group)
    grads = {"w": torch.nn.Parameter(torch.arange(4.0)),
             "g": torch.ones(3, requires_grad=True) * 2,  # a non-leaf
             "plain": torch.ones(2, dtype=torch.int32)}
    for path, group, kw in (("queue", g, {}), ("world", ps.get_world_group(), {}),
                            ("metadata-group", g, {"metadata_group": g.cpu_group})):
        src = group.rank_in_group == 0
        got = group.broadcast_tensor_dict(grads if src else None, **kw)
        out[f"grads/{path}"] = ("src", all(got[k] is grads[k] for k in grads)) if src else sorted(
            (k, type(v).__name__, v.requires_grad, torch.equal(v.detach(), grads[k].detach()))
            for k, v in got.items())
    # A second broadcaster with a non-zero writer and its own queue options:
    # a 4 KiB ring of 2 chunks, so the 20 KB message takes the overflow path.
    try:
        g.create_mq_broadcaster(max_chunk=1)
    except TypeError as e:
        out["bad_option"] = "max_chunk" in str(e)
    try:
        g.create_mq_broadcaster(blocking="no")
    except TypeError as e:
        out["bad_blocking"] = str(e)
    mq = g.create_mq_broadcaster(writer_rank=g.world_size - 1, max_chunk_bytes=1 << 12,
                                 max_chunks=2, wait_policy=WaitPolicy(yield_s=0.005),
                                 warn_interval=30.0)
    last = g.rank_in_group == g.world_size - 1
    out["explicit_plain"] = "planned" not in mq.park_stats()
    got = mq.broadcast_object({"from": "last"} if last else None)
    big = {"blob": "x" * 20_000, "t": torch.arange(1000)}
    got_big = mq.broadcast_object(big if last else None)
    out["writer_last_ok"] = got == {"from": "last"} and got_big["blob"] == big["blob"] and \
        torch.equal(got_big["t"], big["t"])
    mq.close()
    return out


def single_reader(rank: int, world_size: int, blocking: bool) -> dict:
    g = ps.get_world_group()
    reader = world_size - 1
    writer, readers = g.create_single_reader_mq_broadcasters(reader_rank_in_group=reader,
                                                             blocking=blocking)
    if not blocking:
        for q in [writer, *readers]:
            if q is not None:
                q.wait_until_ready()
    out: dict = {}
    try:
        if g.rank_in_group == reader:
            assert writer is None and readers[reader] is None
            got = {}
            for _step in range(20):
                for r, q in enumerate(readers):
                    if q is not None:
                        msg = q.dequeue(timeout=30)
                        got.setdefault(r, []).append(msg)
            out["ok"] = all(
                m["rank"] == r and m["step"] == i
                and torch.equal(m["t"], torch.full((3,), float(r * 100 + i)))
                for r, msgs in got.items()
                for i, m in enumerate(msgs)
            )
            out["count"] = sum(len(m) for m in got.values())
        else:
            assert readers == []
            for step in range(20):
                writer.enqueue({"rank": g.rank_in_group, "step": step,
                                "t": torch.full((3,), float(g.rank_in_group * 100 + step))})
        g.barrier()
    finally:
        for q in [writer, *readers]:
            if q is not None:
                q.close()
    return out


def external_writer(rank: int, world_size: int, who: str, blocking: bool) -> dict:
    from shm_broadcast.queue.message_queue import MessageQueue

    # Rank 0 is outside the group [1, 2] and writes to it.
    gc = GroupCoordinator([[0], [1, 2]], rank, "gloo", use_device_communicator=False,
                          group_name="ext")
    mq = None
    box = [None]
    if rank == 0:
        mq = MessageQueue(n_reader=2, n_local_reader=2, local_reader_ranks=[0, 1])
        box = [mq.export_handle().to_bytes()]
    dist.broadcast_object_list(box, src=0)
    out: dict = {}
    try:
        if rank == 0:
            mq.wait_until_ready()
            for i in range(5):
                mq.enqueue({"i": i})
        else:
            passes = who == "every-rank" or gc.rank_in_group == 0
            mq = gc.create_mq_broadcaster(external_writer_handle=box[0] if passes else None,
                                          blocking=blocking)
            if not blocking:
                mq.wait_until_ready(30)
            out["got"] = [mq.dequeue(timeout=30)["i"] for _ in range(5)]
            out["transport"] = mq.transport
        dist.barrier()
    finally:
        if mq is not None:
            mq.close()
        gc.destroy()
    return out


def external_remote_reader(rank: int, world_size: int, who: str) -> dict:
    from shm_broadcast.queue.message_queue import MessageQueue

    # Rank 0 is outside the group [1, 2]; group rank 1 (global 2) reads over TCP.
    gc = GroupCoordinator([[0], [1, 2]], rank, "gloo", use_device_communicator=False,
                          group_name="ext-remote")
    mq = None
    box = [None]
    if rank == 0:
        mq = MessageQueue(n_reader=2, n_local_reader=1, local_reader_ranks=[0],
                          connect_ip="127.0.0.1")
        box = [mq.export_handle().to_bytes()]
        assert mq.export_handle().curve_client_secret is not None
    dist.broadcast_object_list(box, src=0)  # the test's own trusted channel
    out: dict = {}
    try:
        every = who == "every-rank"  # else the remote reader never connects: no messages
        if rank == 0:
            if every:
                mq.wait_until_ready(30)
            dist.barrier()
            for i in range(5 if every else 0):
                mq.enqueue({"i": i}, timeout=30)
        else:
            passes = who == "every-rank" or gc.rank_in_group == 0
            try:
                mq = gc.create_mq_broadcaster(external_writer_handle=box[0] if passes else None,
                                              blocking=False)
            except ValueError as e:
                out["error"] = (type(e).__name__, str(e))
            dist.barrier()
            if mq is not None:
                out["got"] = [mq.dequeue(timeout=30)["i"] for _ in range(5 if every else 0)]
                out["transport"] = mq.transport
        dist.barrier()
    finally:
        if mq is not None:
            mq.close()
        gc.destroy()
    return out


def bad_external_handle(rank: int, world_size: int) -> dict:
    gc = GroupCoordinator([[0, 1]], rank, "gloo", use_device_communicator=False,
                          group_name="bad-ext", timeout=30)
    out: dict = {}
    try:
        for key, handle in (("error", b"not a handle"), ("type", 42)):
            try:
                gc.create_mq_broadcaster(external_writer_handle=handle if rank == 0 else None)
                out[key] = ("none", "")
            except Exception as e:
                out[key] = (type(e).__name__, str(e))
        # Only the writer rank's handle decides: another rank's own is not used.
        from shm_broadcast.queue.message_queue import MessageQueue

        spare = MessageQueue(1, 1) if rank == 1 else None
        mq = gc.create_mq_broadcaster(  # the group is in step
            external_writer_handle=None if spare is None else spare.export_handle())
        if rank == 0:
            mq.enqueue("ok")
        out["after"] = "ok" if rank == 0 else mq.dequeue(timeout=30)
        mq.close()
        if spare is not None:
            spare.close()
    finally:
        gc.destroy()
    return out


def src_only_errors_reach_everyone(rank: int, world_size: int) -> dict:
    """A bad argument only src can see must make every rank raise, not hang."""
    import time as _t

    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    out: dict = {}
    for name, group in (("world", ps.get_world_group()), ("tp_mq", ps.get_tp_group())):
        t0 = _t.monotonic()
        try:
            group.broadcast_tensor_dict([1, 2] if group.rank_in_group == 0 else None)  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:
            out[f"{name}_btd"] = (type(e).__name__, _t.monotonic() - t0, str(e))
        t0 = _t.monotonic()
        try:
            group.scatter(torch.ones(3, 2) if group.rank_in_group == 0 else None, src=0, dim=0)
        except (TypeError, ValueError) as e:
            out[f"{name}_scatter"] = (type(e).__name__, _t.monotonic() - t0, str(e))
        group.barrier()
        ok = group.broadcast_tensor_dict({"x": torch.ones(2)} if group.rank_in_group == 0 else None)
        out[f"{name}_after"] = bool(torch.equal(ok["x"], torch.ones(2)))
    return out

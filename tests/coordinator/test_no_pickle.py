"""Ordinary workloads never unpickle what a peer sent (issue 12).

In every rank, ``pickle.loads`` and ``pickle.Unpickler`` are replaced by
stand-ins that raise, and so are torch.distributed's own reference to the
Unpickler (its ``*_object`` collectives use it) and the queue codec's opt-in
Unpickler. The Unpickler stand-in is a class that raises when constructed, so
modules imported meanwhile can still subclass it. Then real processes run
queue round trips (shared memory and TCP on loopback, ring-sized and overflow
messages), object collectives, tensor dicts (message queue, CPU group,
explicit groups, point to point), result queues and the demo engine. Every
call passes and no stand-in is reached.

The block also covers *setup*: model-parallel groups (communicator
workspaces), message queues and result queues exchange their handles through
``shm_broadcast/ranks/group_adapter.py``, which moves msgpack bytes, not pickles.

The pool's parent<->rank pipe (``multiprocessing``, the test harness's own
channel to its children) is not a peer channel and keeps its pickle.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch


class PickleUsed(AssertionError):
    """Raised by the replaced pickle entry points."""


#: The call log of the active block (None: no block active).
_SEEN: list[list[str]] = []


def _refusing_loads(*args: Any, **kwargs: Any) -> Any:
    _SEEN[-1].append("pickle.loads")
    raise PickleUsed("pickle.loads was called on received bytes")


class _RefusingUnpickler(pickle.Unpickler):
    """Stands in for ``pickle.Unpickler``: constructing one raises while a block is
    active. It is a class (a subclass of the real one) so that modules imported
    meanwhile can still define subclasses, which keep working after the block."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if _SEEN:
            _SEEN[-1].append(f"{type(self).__name__}()")
            raise PickleUsed(f"{type(self).__name__} was constructed on received bytes")
        super().__init__(*args, **kwargs)


@contextlib.contextmanager
def pickle_blocked() -> Iterator[list[str]]:
    """Replace the unpickling entry points with raisers; yields the calls seen."""
    import torch._dynamo  # noqa: F401 -- imported lazily by custom ops; import it unblocked
    import torch.distributed.distributed_c10d as c10d

    from shm_broadcast.codec import pickle_opt_in as codec_pickle

    patches = [(pickle, "loads", _refusing_loads), (pickle, "Unpickler", _RefusingUnpickler),
               (c10d, "_unpickler", _RefusingUnpickler),
               (codec_pickle, "OobUnpickler", _RefusingUnpickler)]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    for mod, name, fn in patches:
        setattr(mod, name, fn)
    _SEEN.append([])
    try:
        yield _SEEN[-1]
    finally:
        _SEEN.pop()
        for mod, name, old in saved:
            setattr(mod, name, old)


# ---------------------------------------------------------------------- workloads
def _payloads(i: int) -> list[Any]:
    return [
        {"step": i, "ids": torch.arange(8) + i, "pos": (i, i + 1), "flags": {1, 2}},
        [np.arange(5, dtype=np.float32) * i, {("k", i): torch.ones(2, dtype=torch.bfloat16)}],
        {"big": torch.full((300_000,), float(i))},  # > a 256 KiB chunk: the overflow path
        (None, b"\x00" * 10, 2**70, np.int64(i), torch.Size([i, 2]), torch.float16),
    ]


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=False))
    return a == b


def queue_round_trips(world: Any) -> int:
    """Writer rank 0; rank 1 reads through shared memory, rank 2 over TCP on loopback."""
    from shm_broadcast import MessageQueue

    me, n = world.rank_in_group, world.world_size
    mq = None
    if me == 0:
        mq = MessageQueue(n - 1, 1, [1], max_chunk_bytes=256 << 10, max_chunks=4,
                          connect_ip="127.0.0.1", name="no-pickle")
    handle = world.broadcast_object(mq.export_handle().to_bytes() if mq else None, 0)
    if mq is None:
        mq = MessageQueue.create_from_handle(handle, me)
    try:
        mq.wait_until_ready(60)
        assert mq.transport == ("writer", "shm", "tcp")[min(me, 2)]
        for i in range(20):
            for obj in _payloads(i):
                if me == 0:
                    mq.enqueue(obj, timeout=60)
                else:
                    got = mq.dequeue(timeout=60)
                    assert _same(got, obj), (i, got, obj)
        world.barrier()
    finally:
        mq.close()
    return 20 * len(_payloads(0))


def object_collectives(g: Any) -> int:
    me, n, count = g.rank_in_group, g.world_size, 0
    for src in range(n):
        for obj in _payloads(src):
            assert _same(g.broadcast_object(obj if me == src else None, src), obj)
            count += 1
        lst = _payloads(src) if me == src else [None] * len(_payloads(src))
        g.broadcast_object_list(lst, src)
        assert _same(lst, _payloads(src))
    for a in range(n):
        b = (a + 1) % n
        for obj in _payloads(a):
            if me == a:
                g.send_object(obj, b)
            elif me == b:
                assert _same(g.recv_object(a), obj)
            count += 1
    return count


def tensor_dicts(g: Any) -> int:
    me, n = g.rank_in_group, g.world_size
    td = {"x": torch.arange(12.0).reshape(3, 4), "ids": torch.tensor([1, 2]), "t": (1, 2),
          ("k", 1): "tuple key", "none": None, "np": np.ones(3, np.int32),
          "e": torch.empty(0, 2), "p": torch.nn.Parameter(torch.ones(2))}
    want = {k: (v.detach() if isinstance(v, torch.nn.Parameter) else v) for k, v in td.items()}

    def same_dict(got: dict) -> None:
        assert list(got) == list(td)
        for k in td:
            v = got[k].detach() if isinstance(got[k], torch.Tensor) else got[k]
            v = torch.Tensor(v) if isinstance(v, torch.nn.Parameter) else v
            assert _same(v, want[k]) or (isinstance(v, torch.Tensor) and torch.equal(v, want[k])), k

    for src in range(n):
        same_dict(g.broadcast_tensor_dict(td if me == src else None, src))
        same_dict(g.broadcast_tensor_dict(td if me == src else None, src, g.device_group,
                                          g.cpu_group))
    for a in range(n):
        b = (a + 1) % n
        if me == a:
            g.send_tensor_dict(td, b)
        elif me == b:
            same_dict(g.recv_tensor_dict(a))
    return 3 * n


def workloads(rank: int, world_size: int) -> dict[str, Any]:
    """Setup, then every workload, all under the block."""
    from coordinator import parallel_state as ps

    counts: dict[str, Any] = {}
    with pickle_blocked() as seen:
        ps.initialize_model_parallel(world_size, 1)
        world, tp = ps.get_world_group(), ps.get_tp_group()
        assert tp.mq_broadcaster is not None and not tp.allow_pickle and not world.allow_pickle
        writer, readers = world.create_single_reader_mq_broadcasters(0, blocking=True)
        try:
            counts["queue"] = queue_round_trips(world)
            counts["objects-world"] = object_collectives(world)  # the CPU group path
            counts["objects-tp"] = object_collectives(tp)  # the TP message queue from rank 0
            counts["tensor_dicts-world"] = tensor_dicts(world)
            counts["tensor_dicts-tp"] = tensor_dicts(tp)
            counts["results"] = _results(rank, writer, readers)
            counts["gloo"] = gloo_communicator(world)
        finally:
            for q in [writer, *readers]:
                if q is not None:
                    q.close()
    counts["pickle_calls"] = list(seen)
    return counts


def gloo_communicator(world: Any) -> int:
    """The torch (gloo) communicator's own metadata: scatter's announcement, a source
    that rejects its scatter, and a rank that rejects its broadcast."""
    from device_comms import TorchDistributedCommunicator
    from device_comms.errors import CollectiveMismatch, PeerRejectedError

    me, n = world.rank_in_group, world.world_size
    comm = TorchDistributedCommunicator(world.cpu_group, torch.device("cpu"), unique_name="np")
    try:
        full = torch.arange(n * 2, dtype=torch.float32).reshape(n, 2) if me == 0 else None
        assert torch.equal(comm.scatter(full, src=0, dim=0).flatten(), torch.arange(2.0) + 2 * me)
        bad = torch.ones(n + 1, 2) if me == 0 else None  # not divisible: rank 0 rejects
        with contextlib.suppress(ValueError):  # the source's own error
            comm.scatter(bad, src=0, dim=0)
            raise AssertionError("the scatter of an indivisible tensor returned")
        rejected = "no" if me == 1 else torch.ones(3)  # rank 1 passes a str
        try:
            comm.broadcast(rejected, src=0)  # type: ignore[arg-type]
            raise AssertionError("a broadcast with a rejected peer returned")
        except (TypeError, PeerRejectedError, CollectiveMismatch):
            pass
    finally:
        comm.destroy()
    return 3


def _results(rank: int, writer: Any, readers: list[Any]) -> int:
    """Workers send results back through their single-reader queues."""
    if writer is not None:
        for i in range(10):
            writer.enqueue({"rank": rank, "tokens": torch.arange(i), "i": (i,)}, timeout=60)
        return 10
    got = 0
    for r, q in enumerate(readers):
        for i in range(10 if q is not None else 0):
            msg = q.dequeue(timeout=60)
            assert msg["rank"] == r and msg["i"] == (i,)
            assert torch.equal(msg["tokens"], torch.arange(i))
            got += 1
    return got


def setup_and_demo(rank: int, world_size: int, tp: int, pp: int) -> dict[str, Any]:
    """The demo engine (groups, queues, TP/PP model, greedy generation) under the block."""
    from coordinator.engine.demo.engine import EngineConfig, engine_rank

    cfg = EngineConfig(tp=tp, pp=pp, model_dir=None, seed=0, progress=False,
                       requests=(((5, 17, 42), 4, 0), ((88, 3), 3, 1)))
    with pickle_blocked() as seen:
        out = engine_rank(rank, world_size, cfg)
    return {"generated": out.get("generated"), "pickle_calls": list(seen)}


# ---------------------------------------------------------------------- tests
@pytest.mark.timeout(240)
def test_workloads_never_unpickle(dist_pool):
    results = dist_pool(3).run(workloads, timeout=200)
    for rank, counts in enumerate(results):
        assert counts.pop("pickle_calls") == [], f"rank {rank} reached pickle"
        assert all(v > 0 for k, v in counts.items() if k != "results" or rank == 0), counts


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_demo_never_unpickles(dist_pool, tp, pp):
    results = dist_pool(2).run(setup_and_demo, tp, pp, timeout=240)
    assert [r["pickle_calls"] for r in results] == [[], []]
    generated = results[0]["generated"]
    assert [len(g) for g in generated] == [4, 3], generated

"""Asynchronous point-to-point calls (isend / irecv / tensor dicts) on real gloo groups.

Every case runs on pooled ranks with a group of its own (the default
shared-memory CPU communicator, whose send/recv go over gloo), destroyed at
the end of the rank function, which also checks that the group's worker
threads are gone. A dead peer is tested on hand-spawned ranks, since the
harness would kill the survivors.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shm_broadcast.ranks.launcher import spawn_group

# ---------------------------------------------------------------------- helpers (rank side)


def _group(rank: int, n: int, timeout: float = 30.0) -> Any:
    from coordinator import GroupCoordinator

    return GroupCoordinator([list(range(n))], rank, "gloo", True, group_name="async",
                            timeout=timeout)


def _p2p_threads(g: Any) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(f"gc-p2p {g.unique_name} ")]


def _with_group(rank: int, n: int, body: Callable[[Any], Any], timeout: float = 30.0) -> Any:
    """Run ``body(group)``; destroy the group; check that its threads ended."""
    g = _group(rank, n, timeout)
    try:
        out = body(g)
    finally:
        g.destroy()
    left = _p2p_threads(g)
    assert not left, f"rank {rank}: threads left after destroy: {left}"
    return out


def _payload(src: int, dst: int, i: int) -> torch.Tensor:
    """Message ``i`` from ``src`` to ``dst``: sizes alternate between inline (small)
    and large (over the 64 KiB envelope), dtypes vary."""
    n = 17 + i if i % 3 else 20_000 + 7 * i
    dtype = (torch.float32, torch.int64, torch.bfloat16)[i % 3]
    base = torch.arange(n, dtype=torch.float64) + 1000 * src + 100_000 * dst + 10 * i
    return base.to(dtype).reshape(-1, 1) if i % 2 else base.to(dtype)


def _peers(rank: int, n: int, pattern: str) -> tuple[list[int], list[int]]:
    """``(send to, receive from)`` of ``rank`` in ``pattern``."""
    if pattern == "ring":
        return [(rank + 1) % n], [(rank - 1) % n]
    buddy = rank ^ 1  # pairs (0, 1), (2, 3): each sends to and receives from its buddy
    return [buddy], [buddy]


# ---------------------------------------------------------------------- rank functions
def many_outstanding(rank: int, n: int, pattern: str, k: int) -> int:
    """``k`` isends per destination and ``k`` irecvs per source, all outstanding, waited
    in reverse order: every receive must hold the message issued in the same place."""

    def body(g: Any) -> int:
        to, frm = _peers(rank, n, pattern)
        sends = [(d, i, g.isend(_payload(rank, d, i), d)) for d in to for i in range(k)]
        recvs = []
        for s in frm:
            for i in range(k):
                want = _payload(s, rank, i)
                target = torch.empty_like(want) if i % 2 else (want.shape, want.dtype)
                recvs.append((s, i, want, target, g.irecv(target, s)))
        for s, i, want, target, h in reversed(recvs):
            got = h.wait()
            assert h.is_completed() and h.op == "irecv" and h.peer == s
            assert got.dtype == want.dtype and torch.equal(got, want), (s, i)
            if isinstance(target, torch.Tensor):
                assert got is target  # filled in place
        calls = [h.call for _, _, h in sends]
        assert calls == sorted(calls) and len(set(calls)) == len(calls)
        for _d, _i, h in reversed(sends):
            assert h.wait() is None and h.is_completed()
        return len(recvs)

    return _with_group(rank, n, body)


def mixed_with_blocking(rank: int, n: int) -> list[Any]:
    """Asynchronous and blocking calls interleaved in one direction around a ring, each
    received by a call of the other kind, with a collective while handles are outstanding.

    Each rank sends to the next: isend, send, isend_tensor_dict, send_tensor_dict,
    send_object, isend; and receives from the previous: irecv, irecv,
    recv_tensor_dict, irecv_tensor_dict, recv_object, irecv."""

    def body(g: Any) -> list[Any]:
        nxt, prv = (rank + 1) % n, (rank - 1) % n
        sends = [g.isend(torch.full((4,), 1.0 + rank), nxt)]
        h_x1 = g.irecv(((4,), torch.float32), prv)
        h_x2 = g.irecv(((70_000,), torch.float32), prv)  # posted before the blocking sends
        total = g.all_reduce(torch.ones(2))
        g.send(torch.full((70_000,), 2.0 + rank), nxt)  # after the isend above completed
        sends.append(g.isend_tensor_dict({"k": 3, "t": torch.arange(5) + rank}, nxt))
        d3 = g.recv_tensor_dict(prv)  # after h_x1 and h_x2 completed
        h_d4 = g.irecv_tensor_dict(prv)
        g.send_tensor_dict({"k": 4, "t": torch.ones(70_000) * rank}, nxt)
        if rank % 2 == 0:  # blocking objects around a ring: by parity
            g.send_object({"obj": 5, "from": rank}, nxt)
            o5 = g.recv_object(prv)
        else:
            o5 = g.recv_object(prv)
            g.send_object({"obj": 5, "from": rank}, nxt)
        sends.append(g.isend(torch.tensor([6 + rank]), nxt))
        x6 = g.irecv(((1,), torch.int64), prv).wait()
        x1, x2, d4 = h_x1.wait(), h_x2.wait(), h_d4.wait()
        for h in sends:
            assert h.wait() is None
        assert torch.equal(total, torch.full((2,), float(n)))
        assert torch.equal(x1, torch.full((4,), 1.0 + prv))
        assert torch.equal(x2, torch.full((70_000,), 2.0 + prv))
        assert d3["k"] == 3 and torch.equal(d3["t"], torch.arange(5) + prv)
        assert d4["k"] == 4 and torch.equal(d4["t"], torch.ones(70_000) * prv)
        assert o5 == {"obj": 5, "from": prv} and x6.item() == 6 + prv
        g.barrier()
        return [d3["k"], d4["k"], o5["obj"], x6.item() - prv]

    return _with_group(rank, n, body)


def into_buffers(rank: int, n: int) -> list[str]:
    """irecv into caller-owned buffers of every writable kind: each is filled in
    place and returned, small (inline) and large alike."""
    kinds: dict[str, Callable[[int], torch.Tensor]] = {
        "contiguous": lambda m: torch.zeros(m, 4),
        "transposed": lambda m: torch.zeros(4, m).t(),
        "sliced": lambda m: torch.zeros(m, 8)[:, ::2],
        "leaf-requires-grad": lambda m: torch.zeros(m, 4, requires_grad=True),
        "non-leaf-requires-grad": lambda m: torch.zeros(m, 4, requires_grad=True) * 1,
    }

    def body(g: Any) -> list[str]:
        nxt, prv = (rank + 1) % n, (rank - 1) % n
        done = []
        for name, make_buf in kinds.items():
            for m in (3, 20_000):
                want = torch.arange(m * 4.0).reshape(m, 4) + prv
                h = g.isend(torch.arange(m * 4.0).reshape(m, 4) + rank, nxt)
                buf = make_buf(m)
                got = g.irecv(buf, prv).wait()
                h.wait()
                assert got is buf, name
                assert torch.equal(buf.detach(), want), name
            done.append(name)
        return done

    return _with_group(rank, n, body)


def _dict_for(src: int, i: int) -> dict[Any, Any]:
    g = torch.Generator().manual_seed(src * 31 + i)
    return {
        "hidden": torch.randn(3 + i, 8, generator=g),
        "ids": torch.randint(0, 1000, (50_000 if i == 1 else 5,), generator=g),
        "half": torch.randn(4, generator=g).to(torch.bfloat16),
        "mask": torch.rand(6, generator=g) > 0.5,
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(float(src + i)),
        "strided": torch.arange(12.0).reshape(3, 4).t() + src,  # not contiguous
        "name": f"dict {i} from {src}",
        "step": i,
        "lens": [1, 2, src],
        "nested": {"a": None, "b": [src, "x"]},
        7: None,
    }


def _same_dict(got: dict[Any, Any], want: dict[Any, Any]) -> None:
    assert list(got) == list(want), (list(got), list(want))
    for key, w in want.items():
        v = got[key]
        if isinstance(w, torch.Tensor):
            assert v.dtype == w.dtype and v.shape == w.shape and torch.equal(v, w), key
        else:
            assert v == w, (key, v, w)


def tensor_dicts(rank: int, n: int, k: int) -> int:
    """``k`` dicts each way around a ring, all outstanding at once."""

    def body(g: Any) -> int:
        nxt, prv = (rank + 1) % n, (rank - 1) % n
        sent = [_dict_for(rank, i) for i in range(k)]
        hs = [g.isend_tensor_dict(d, nxt) for d in sent]
        sent[0]["name"] = "changed after isend"  # the call sent a snapshot of the dict
        rs = [g.irecv_tensor_dict(prv) for _ in range(k)]
        for i, h in enumerate(rs):
            _same_dict(h.wait(), _dict_for(prv, i))
        for h in hs:
            assert h.wait() is None
        return k

    return _with_group(rank, n, body)


def wait_timeouts(rank: int, n: int, group_timeout: float) -> dict[str, Any]:
    """Rank 1 waits for rank 0, which never sends: an explicit timeout, a poll, then the
    group's timeout; each must raise CommTimeout naming the peer within timeout + 1 s."""
    from coordinator.errors import CommTimeout

    def body(g: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if rank == 1:
            h = g.irecv(((3,), torch.float32), 0)
            for label, timeout in (("explicit", 0.5), ("poll", 0), ("default", None)):
                t0 = time.monotonic()
                try:
                    h.wait(timeout)
                except CommTimeout as e:
                    out[label] = (time.monotonic() - t0, str(e), list(e.peers), e.call)
            out["completed"] = h.is_completed()
        return out  # rank 0 makes no call on the group

    # Both ranks meet again on the world group before destroying theirs.
    def run(g: Any) -> dict[str, Any]:
        out = body(g)
        from coordinator.parallel_state import get_world_group

        get_world_group().barrier()
        return out

    return _with_group(rank, n, run, timeout=group_timeout)


def send_timeout(rank: int, n: int) -> dict[str, Any]:
    """Every rank isends to the next, nobody receives: the sends cannot complete."""
    from coordinator.errors import CommTimeout
    from coordinator.parallel_state import get_world_group

    def body(g: Any) -> dict[str, Any]:
        h = g.isend(torch.ones(3), (rank + 1) % n)
        t0 = time.monotonic()
        try:
            h.wait(0.5)
            res: dict[str, Any] = {"raised": None}
        except CommTimeout as e:
            res = {"raised": "CommTimeout", "s": time.monotonic() - t0, "text": str(e),
                   "peers": list(e.peers)}
        res["completed"] = h.is_completed()
        get_world_group().barrier()
        # Now the peers receive: the send completes, the wait succeeds.
        got = g.irecv(((3,), torch.float32), (rank - 1) % n).wait()
        assert torch.equal(got, torch.ones(3))
        assert h.wait() is None
        return res

    return _with_group(rank, n, body)


def destroy_with_outstanding(rank: int, n: int) -> dict[str, Any]:
    """Handles outstanding at destroy() (one running, one queued, one dropped) end
    with ClosedError; nobody deadlocks; the threads are joined."""
    from coordinator.errors import ClosedError
    from coordinator.p2p.point_to_point import CLOSE_GRACE_S
    from coordinator.parallel_state import get_world_group

    g = _group(rank, n)
    peer = (rank + 1) % n
    running = g.irecv(((5,), torch.float32), peer)  # nobody ever sends
    queued = g.irecv(((5,), torch.float32), peer)
    dropped = g.irecv(((5,), torch.float32), peer)
    del dropped
    assert not running.is_completed() and not queued.is_completed()
    get_world_group().barrier()
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g.destroy()
    took = time.monotonic() - t0
    out: dict[str, Any] = {"destroy_s": took, "grace": CLOSE_GRACE_S,
                           "threads": _p2p_threads(g),
                           "warned": [str(w.message)[:200] for w in caught]}
    for label, h in (("running", running), ("queued", queued)):
        assert h.is_completed()
        try:
            h.wait(0)
            out[label] = "no error"
        except ClosedError as e:
            out[label] = ("ClosedError", str(e))
    try:
        g.isend(torch.ones(1), peer)
        out["after"] = "no error"
    except Exception as e:
        out["after"] = type(e).__name__
    get_world_group().barrier()
    return out


def dropped_failure_warns(rank: int, n: int) -> list[str]:
    """A handle dropped without wait() whose call fails is reported as a warning.

    The sender keeps its direction on the CPU group (``GROUPCOORD_P2P_SHM=0``),
    where a receiver's refusal reaches the sender (on a link only the receiver
    raises)."""
    from coordinator.errors import CollectiveMismatch

    def body(g: Any) -> list[str]:
        peer = rank ^ 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if rank % 2 == 0:
                # The handle is dropped at once; the receiver expects another
                # shape, so this send fails.
                g.isend(torch.ones(4), peer)
                # A later call in the same direction still runs, after the failed one.
                g.send(torch.ones(2), peer)
            else:
                with pytest.raises(CollectiveMismatch):
                    g.recv((5,), torch.float32, peer)
                assert torch.equal(g.recv((2,), torch.float32, peer), torch.ones(2))
            g.barrier()
        return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]

    if rank % 2 == 0:
        os.environ["GROUPCOORD_P2P_SHM"] = "0"
    try:
        return _with_group(rank, n, body)
    finally:
        os.environ.pop("GROUPCOORD_P2P_SHM", None)  # pool workers run later tests


def completion_progress(rank: int, n: int) -> dict[str, Any]:
    """is_completed() is False until the peer takes part, then True for good."""
    from coordinator.parallel_state import get_world_group

    def body(g: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if rank == 0:
            h = g.isend(torch.arange(100_000, dtype=torch.float32), 1)
            out["before_peer"] = h.is_completed()
            get_world_group().barrier()  # rank 1 posts its receive only after this
            deadline = time.monotonic() + 20
            while not h.is_completed() and time.monotonic() < deadline:
                time.sleep(0.01)
            out["after_peer"] = h.is_completed()
            out["result"] = h.wait()
            out["still"] = h.is_completed()
        elif rank == 1:
            time.sleep(0.3)
            get_world_group().barrier()
            h = g.irecv(((100_000,), torch.float32), 0)
            got = h.wait()
            out["ok"] = torch.equal(got, torch.arange(100_000, dtype=torch.float32))
            out["done"] = h.is_completed()
        else:
            get_world_group().barrier()
        g.barrier()
        return out

    return _with_group(rank, n, body)


BAD_CALLS: dict[str, tuple[type[Exception], str]] = {
    "isend-not-a-tensor": (TypeError, "tensor"),
    "isend-dst-self": (ValueError, "dst"),
    "isend-dst-out-of-range": (ValueError, "dst"),
    "isend-dst-bool": (TypeError, "dst"),
    "isend-meta-tensor": (ValueError, "tensor"),
    "irecv-spec-not-a-pair": (TypeError, "tensor_or_spec"),
    "irecv-spec-bad-dtype": (TypeError, "tensor_or_spec[1]"),
    "irecv-spec-negative": (ValueError, "tensor_or_spec[0]"),
    "irecv-src-self": (ValueError, "src"),
    "irecv-expanded-buffer": (ValueError, "tensor_or_spec"),
    "irecv-inference-buffer": (ValueError, "tensor_or_spec"),
    "irecv-spec-too-big": (ValueError, "tensor_or_spec"),
    "isend_tensor_dict-not-a-dict": (TypeError, "tensor_dict"),
    "isend_tensor_dict-sparse": (TypeError, "tensor_dict['s']"),
    "irecv_tensor_dict-src-float": (TypeError, "src"),
    "wait-negative-timeout": (ValueError, "timeout"),
    "wait-string-timeout": (TypeError, "timeout"),
}


def _inference_zeros(n: int) -> torch.Tensor:
    """A tensor made under ``torch.inference_mode()``: torch refuses writes into it
    outside that mode."""
    with torch.inference_mode():
        return torch.zeros(n)


def _bad_call(g: Any, rank: int, case: str) -> Any:
    peer = rank ^ 1
    calls: dict[str, Callable[[], Any]] = {
        "isend-not-a-tensor": lambda: g.isend([1.0, 2.0], peer),
        "isend-dst-self": lambda: g.isend(torch.ones(2), rank),
        "isend-dst-out-of-range": lambda: g.isend(torch.ones(2), g.world_size),
        "isend-dst-bool": lambda: g.isend(torch.ones(2), True),
        "isend-meta-tensor": lambda: g.isend(torch.empty(2, device="meta"), peer),
        "irecv-spec-not-a-pair": lambda: g.irecv("float32", peer),
        "irecv-spec-bad-dtype": lambda: g.irecv(((2,), "float32"), peer),
        "irecv-spec-negative": lambda: g.irecv(((2, -1), torch.float32), peer),
        "irecv-src-self": lambda: g.irecv(((2,), torch.float32), rank),
        "irecv-expanded-buffer": lambda: g.irecv(torch.zeros(1).expand(2), peer),
        "irecv-inference-buffer": lambda: g.irecv(_inference_zeros(2), peer),
        "irecv-spec-too-big": lambda: g.irecv(((1 << 40, 1 << 30), torch.float32), peer),
        "isend_tensor_dict-not-a-dict": lambda: g.isend_tensor_dict([torch.ones(1)], peer),
        "isend_tensor_dict-sparse": lambda: g.isend_tensor_dict(
            {"s": torch.eye(2).to_sparse()}, peer),
        "irecv_tensor_dict-src-float": lambda: g.irecv_tensor_dict(1.0),
        "wait-negative-timeout": lambda: g.isend(torch.ones(2), peer).wait(-1),
        "wait-string-timeout": lambda: g.isend(torch.ones(2), peer).wait("1s"),
    }
    return calls[case]()


def bad_arguments(rank: int, n: int, case: str, transport: str) -> dict[str, Any]:
    """Even ranks make the bad call; odd ranks make the matching good one when the bad
    call had a valid peer: the peer is told (PeerRejectedError), not left
    waiting, whether the direction is unsettled (the bad call settles it), on
    a link (settled by a first dict) or on the CPU group (``GROUPCOORD_P2P_SHM=0``)."""
    from coordinator.errors import CollectiveMismatch, PeerRejectedError

    exc_type, arg = BAD_CALLS[case]
    rejected_peer = case in ("isend-not-a-tensor", "isend-meta-tensor", "irecv-spec-not-a-pair",
                             "irecv-spec-bad-dtype", "irecv-spec-negative",
                             "irecv-expanded-buffer", "irecv-inference-buffer",
                             "irecv-spec-too-big")

    def body(g: Any) -> dict[str, Any]:
        peer = rank ^ 1
        out: dict[str, Any] = {}
        if transport != "unsettled":  # a first dict each way settles both directions
            h = g.isend_tensor_dict({"x": torch.zeros(1)}, peer)
            g.recv_tensor_dict(peer)
            h.wait()
        if rank % 2 == 0:
            with pytest.raises(exc_type) as info:
                _bad_call(g, rank, case)
            out["text"] = str(info.value)
            assert arg in out["text"], (case, out["text"])
        if rejected_peer:
            out.update(_rejected_peer(g, rank, peer, case, transport, PeerRejectedError))
        if case.startswith("isend_tensor_dict") and rank % 2:  # told in place of the dict
            with pytest.raises(CollectiveMismatch) as told:
                g.irecv_tensor_dict(peer).wait(10)
            out["peer_told"] = str(told.value)
        if case.startswith("wait-") and rank % 2:  # the sends were valid: receive them
            g.irecv(((2,), torch.float32), peer).wait()
        # The pair still works afterwards, in both directions.
        h = g.isend(torch.full((3,), float(rank)), peer)
        got = g.irecv(((3,), torch.float32), peer).wait()
        h.wait()
        assert torch.equal(got, torch.full((3,), float(peer)))
        return out

    if transport == "cpu-group":
        os.environ["GROUPCOORD_P2P_SHM"] = "0"
    try:
        return _with_group(rank, n, body)
    finally:
        os.environ.pop("GROUPCOORD_P2P_SHM", None)  # pool workers run later tests


def bad_call_behind_a_settling_dict(rank: int, n: int, direction: str) -> dict[str, Any]:
    """Rank 0's first call toward rank 1 is an un-waited dict (it settles the direction
    on a link), then a call with a bad argument: its rejection takes the direction's
    order, on the link rank 1 reads (not the CPU group), and rank 1's matching call
    raises PeerRejectedError at once; the calls after it pair as issued."""
    from coordinator.errors import PeerRejectedError

    def body(g: Any) -> dict[str, Any]:
        good = torch.arange(4.0)
        t0 = time.monotonic()
        peer = 1 - rank
        if direction == "send":  # rank 0 sends on the settling direction
            if rank == 0:
                h = g.isend_tensor_dict({"x": good}, peer)
                with pytest.raises(TypeError):
                    g.isend("not a tensor", peer)
                h2 = g.isend(good, peer)
                h.wait(20)
                h2.wait(20)
            else:
                assert torch.equal(g.recv_tensor_dict(peer)["x"], good)
                with pytest.raises(PeerRejectedError, match="rank 0"):
                    g.recv((4,), torch.float32, peer)
                assert torch.equal(g.recv((4,), torch.float32, peer), good)
        else:  # rank 0 receives on the settling direction
            if rank == 0:
                h = g.irecv_tensor_dict(peer)
                with pytest.raises(TypeError):
                    g.irecv("float32", peer)
                got = g.irecv(((4,), torch.float32), peer).wait(20)
                assert torch.equal(h.wait(20)["x"], good) and torch.equal(got, good)
            else:
                g.send_tensor_dict({"x": good}, peer)
                with pytest.raises(PeerRejectedError, match="rank 0"):
                    g.send(good, peer)
                g.send(good, peer)
        g.barrier()
        return {"seconds": time.monotonic() - t0}

    return _with_group(rank, n, body)


def _rejected_peer(g: Any, rank: int, peer: int, case: str, transport: str,
                   rejected: type[Exception]) -> dict[str, Any]:
    """The odd rank's good call matching the even rank's bad one: it is told, on
    whichever transport the direction took."""
    sending = "isend" in case  # the even rank's bad call sends
    if rank % 2:
        h = (g.irecv(((2,), torch.float32), peer) if sending
             else g.isend(torch.ones(2), peer))
        with pytest.raises(rejected) as rej:
            h.wait(10)
        return {"peer_told": str(rej.value)}
    return {}


def killed_peer(rank: int, n: int) -> dict[str, Any]:
    """Rank 0 SIGKILLs itself while large isends to rank 1 are in flight; rank 1's
    irecvs were posted before and must raise PeerDiedError at wait(), promptly."""
    from coordinator import GroupCoordinator
    from coordinator.errors import PeerDiedError

    g = GroupCoordinator([list(range(n))], rank, "gloo", True, group_name="killed", timeout=60)
    k, numel = 4, 4 << 20  # 16 MiB each: a transfer takes a while on a loaded machine
    g.barrier()
    if rank == 0:
        hs = [g.isend(torch.full((numel,), float(i)), 1) for i in range(k)]
        hs[0].wait()
        os.kill(os.getpid(), signal.SIGKILL)  # the next transfer is under way
        time.sleep(60)
        return {}
    hs = [g.irecv(((numel,), torch.float32), 0) for _ in range(k)]
    issued = time.monotonic()
    out: dict[str, Any] = {"results": []}
    for h in hs:
        try:
            got = h.wait()
            out["results"].append(("ok", bool(torch.equal(got[:3], got[-3:]))))
        except PeerDiedError as e:
            out["results"].append(("PeerDiedError", list(e.peers), str(e)[:300]))
        except Exception as e:
            out["results"].append((type(e).__name__, str(e)[:300]))
    out["s"] = time.monotonic() - issued
    return out


def _pin_process(cpu: int) -> None:
    """Bind every thread of this process, and the threads it starts later, to ``cpu``."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that just ended
            os.sched_setaffinity(int(tid), {cpu})


def sender_dies_after_its_send(rank: int, n: int) -> dict[str, Any]:
    """Rank 0's isend of a tensor in parts completes (its last parts wait in the link's
    ring), then rank 0 stops rank 1 and dies; rank 2 continues rank 1 once rank 0 is
    gone and a liveness tick has passed, so rank 1's ``wait()`` finds its peer dead
    while its channel's thread still has parts to read. Ranks 0 and 1 share one CPU:
    while rank 0 runs, rank 1's thread does not, so it is stopped with parts unread."""
    from coordinator import GroupCoordinator
    from coordinator.errors import PeerDiedError
    from coordinator.p2p.channels import LIVENESS_S
    from tests.processes import running, stop_process

    cpus = sorted(os.sched_getaffinity(0))
    _pin_process(cpus[-1] if rank == 2 else cpus[0])
    pids: list[Any] = [None] * n
    torch.distributed.all_gather_object(pids, os.getpid())
    g = GroupCoordinator([list(range(n))], rank, "gloo", True, group_name="dies-after",
                         timeout=60)
    numel = 6 << 20  # 24 MiB: a header and 13 parts through a ring of two chunks
    if rank == 0:
        g.send(torch.zeros(2), 1)  # settles the direction on a link
        g.isend(torch.arange(numel, dtype=torch.float32), 1).wait()
        stop_process(pids[1])
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        return {}
    if rank == 2:
        end = time.monotonic() + 60
        while running(pids[0]) and time.monotonic() < end:
            time.sleep(0.005)
        time.sleep(3 * LIVENESS_S)  # rank 1's wait is due for a liveness check
        os.kill(pids[1], signal.SIGCONT)
        return {}
    g.recv(torch.Size([2]), torch.float32, 0)
    h = g.irecv(((numel,), torch.float32), 0)
    try:
        got = h.wait()
    except PeerDiedError as e:
        return {"error": str(e)[:300]}
    return {"equal": bool(torch.equal(got, torch.arange(numel, dtype=torch.float32)))}


def alone(rank: int, n: int) -> dict[str, Any]:
    """A group of one: dicts behave as the blocking calls (nothing to send, None
    received); a tensor has no peer to go to."""

    def body(g: Any) -> dict[str, Any]:
        h = g.isend_tensor_dict({"a": torch.ones(2)})
        r = g.irecv_tensor_dict()
        out = {"sent": (h.is_completed(), h.wait()), "received": (r.is_completed(), r.wait())}
        try:
            g.isend(torch.ones(2))
        except ValueError as e:
            out["isend"] = str(e)
        return out

    return _with_group(rank, n, body)


# ---------------------------------------------------------------------- tests
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,pattern", [(2, "ring"),
                                                pytest.param(4, "ring", marks=pytest.mark.slow),
                                                (4, "pairs")])
def test_many_outstanding_handles_arrive_in_issue_order(dist_pool, world_size, pattern) -> None:
    k = 12
    got = dist_pool(world_size).run(many_outstanding, pattern, k, timeout=100)
    assert got == [k] * world_size


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_blocking_calls_keep_their_place_among_async_ones(dist_pool, world_size) -> None:
    got = dist_pool(world_size).run(mixed_with_blocking, timeout=100)
    assert got == [[3, 4, 5, 6]] * world_size


@pytest.mark.timeout(120)
def test_irecv_fills_every_writable_buffer_in_place(dist_pool) -> None:
    got = dist_pool(2).run(into_buffers, timeout=100)
    assert got == [["contiguous", "transposed", "sliced", "leaf-requires-grad",
                    "non-leaf-requires-grad"]] * 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_dicts_with_several_tensors_and_values(dist_pool, world_size) -> None:
    assert dist_pool(world_size).run(tensor_dicts, 3, timeout=100) == [3] * world_size


@pytest.mark.timeout(120)
def test_wait_timeout_names_the_group_op_call_and_peer(dist_pool) -> None:
    group_timeout = 3.0
    out = dist_pool(2).run(wait_timeouts, group_timeout, timeout=100)[1]
    for label, limit in (("explicit", 0.5), ("poll", 0.0), ("default", group_timeout)):
        assert label in out, f"wait({label}) did not raise CommTimeout: {out}"
        took, text, peers, call = out[label]
        assert took < limit + 1.0, f"wait({label}) took {took:.2f}s"
        assert peers == [0], text
        assert "'async" in text and "irecv" in text and f"call #{call}" in text, text
        assert "rank(s) [0]" in text, text
    assert out["completed"] in (False, True)  # gloo itself may have given up by now


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_send_nobody_receives_times_out_then_completes(dist_pool, world_size) -> None:
    for rank, res in enumerate(dist_pool(world_size).run(send_timeout, timeout=100)):
        assert res["raised"] == "CommTimeout", res
        assert res["s"] < 1.5 and res["peers"] == [(rank + 1) % world_size], res
        assert "isend" in res["text"] and not res["completed"], res


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_destroy_ends_outstanding_handles_and_joins_threads(dist_pool, world_size) -> None:
    for res in dist_pool(world_size).run(destroy_with_outstanding, timeout=100):
        assert res["destroy_s"] < res["grace"] + 3.0, res
        assert res["threads"] == [], res
        assert res["running"][0] == "ClosedError" and "destroyed" in res["running"][1], res
        assert res["queued"][0] == "ClosedError" and "before" in res["queued"][1], res
        assert res["after"] == "NotInitializedError", res
        # the dropped handle failed too, and said so
        assert any("dropped without wait()" in w for w in res["warned"]), res


@pytest.mark.timeout(120)
def test_a_dropped_handle_that_fails_is_reported_not_silent(dist_pool) -> None:
    warned = dist_pool(2).run(dropped_failure_warns, timeout=100)
    assert any("isend to rank 1" in w and "CollectiveMismatch" in w for w in warned[0]), warned
    assert warned[1] == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_is_completed_progresses_with_the_peer(dist_pool, world_size) -> None:
    out = dist_pool(world_size).run(completion_progress, timeout=100)
    assert out[0] == {"before_peer": False, "after_peer": True, "result": None, "still": True}
    assert out[1] == {"ok": True, "done": True}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_arguments_raise_naming_the_argument(dist_pool, case) -> None:
    out = dist_pool(2).run(bad_arguments, case, "unsettled", timeout=100)
    assert BAD_CALLS[case][1] in out[0]["text"]
    if "peer_told" in out[1]:
        assert "rank 0" in out[1]["peer_told"], out[1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("direction", ["send", "recv"])
def test_a_bad_call_queued_behind_a_settling_dict_is_told_on_the_link(dist_pool,
                                                                     direction) -> None:
    out = dist_pool(2).run(bad_call_behind_a_settling_dict, direction, timeout=100)
    assert all(o["seconds"] < 15 for o in out), out  # no wait for the group's timeout


_TOLD_CASES = ["isend-not-a-tensor", "isend-meta-tensor", "irecv-spec-not-a-pair",
               "irecv-spec-negative", "irecv-inference-buffer"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["link", "cpu-group"])
@pytest.mark.parametrize("case", _TOLD_CASES)
def test_bad_arguments_on_a_settled_direction(dist_pool, case, transport) -> None:
    """Told to the peer on either transport: over the CPU group, or on the link."""
    out = dist_pool(2).run(bad_arguments, case, transport, timeout=100)
    assert BAD_CALLS[case][1] in out[0]["text"]
    assert "rank 0" in out[1]["peer_told"], out[1]


@pytest.mark.timeout(120)
def test_peer_killed_mid_transfer_raises_at_wait() -> None:
    outcomes = spawn_group(killed_peer, 2, timeout=90)
    assert outcomes[0].exitcode == -signal.SIGKILL, outcomes[0]
    res = outcomes[1]
    assert res.ok, res.error
    results = res.result["results"]
    failed = [r for r in results if r[0] != "ok"]
    assert failed, f"every transfer completed before the kill: {results}"
    assert all(r[0] == "PeerDiedError" and r[1] == [0] for r in failed), results
    assert results[0] == ("ok", True), results  # rank 0 saw it complete before dying
    assert results[-1][0] == "PeerDiedError", results  # the last one cannot have arrived
    assert res.result["s"] < 30, res.result


@pytest.mark.timeout(120)
def test_a_send_that_completed_arrives_after_its_sender_died() -> None:
    outcomes = spawn_group(sender_dies_after_its_send, 3, timeout=90)
    assert outcomes[0].exitcode == -signal.SIGKILL, outcomes[0]
    assert outcomes[2].ok, outcomes[2].error
    assert outcomes[1].ok, outcomes[1].error
    assert outcomes[1].result == {"equal": True}, outcomes[1].result


def test_cuda_half_imports_lazily_and_without_touching_cuda() -> None:
    """The CUDA module is imported only by a CUDA group's first call, and importing
    it initialises nothing on a machine without a GPU."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "import coordinator\n"
        "assert 'coordinator.p2p.point_to_point' in sys.modules\n"
        "assert 'coordinator.p2p.cuda_p2p' not in sys.modules\n"
        "import coordinator.p2p.cuda_p2p as m\n"
        "assert not torch.cuda.is_initialized()\n"
        "assert hasattr(m, 'CudaP2P') and hasattr(m, 'EventWork')\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.timeout(60)
def test_a_group_of_one(dist_pool) -> None:
    (out,) = dist_pool(1).run(alone, timeout=50)
    assert out["sent"] == (True, None) and out["received"] == (True, None)
    assert "dst=0 is this rank" in out["isend"]

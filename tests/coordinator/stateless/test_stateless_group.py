"""StatelessProcessGroup over real TCPStores in real processes."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from coordinator import StatelessProcessGroup
from coordinator.errors import CommTimeout
from coordinator.parallel_state import in_the_same_node_as
from coordinator.testing import free_port


@pytest.mark.parametrize("world_size", [2, 3])
def test_stateless_group_collectives(dist_pool, world_size: int) -> None:
    res = dist_pool(world_size).run(exercise, free_port(), free_port(), timeout=90)
    for rank, r in enumerate(res):
        prev = (rank - 1) % world_size
        assert r["refused"] == ["TypeError", "ValueError"], r["refused"]
        assert r["ring0"] == {"from": prev, "i": 0}
        assert r["ring1"] == {"from": prev, "i": 1}
        assert r["bcast"] == [f"x{s}" for s in range(world_size)]
        assert r["gather"] == [10 * i for i in range(world_size)]
        assert r["same_node"] == [True] * world_size
        assert r["world_unchanged"]
        if rank < 2:
            assert r["b_gather"] == [("b", 0), ("b", 1)]
            assert r["b_self"].startswith("CollectiveMismatch") and "src" in r["b_self"], \
                r["b_self"]
            assert r["b_next"] == "fresh", \
                "a broadcast after one with disagreeing sources read a stale value"
        # The last rank names itself the source, the others rank 0: every rank raises.
        assert r["a_src_mismatch"].startswith("CollectiveMismatch"), r["a_src_mismatch"]
        assert "broadcast_obj" in r["a_src_mismatch"], r["a_src_mismatch"]
        assert r["a_next"] == "after", r
    # Everything read was deleted; only barrier bookkeeping of the last barrier may remain.
    assert res[0]["keys_left"] <= world_size + 2


def test_stateless_barrier_timeout_names_missing_rank(dist_pool) -> None:
    res = dist_pool(3).run(barrier_timeout, free_port(), timeout=90)
    for r in res[:2]:
        assert r["elapsed"] is not None and r["elapsed"] < 6.0
        assert r["is_timeout"]
        missing = re.search(r"rank\(s\) \[([0-9, ]*)\]", r["msg"])
        assert missing is not None, r["msg"]
        assert 2 in [int(x) for x in missing.group(1).split(",")], r["msg"]  # late ones may join it
        assert "barrier" in r["msg"] and "'t'" in r["msg"]


@pytest.mark.timeout(120)
def test_vllm_style_group_of_tensors(dist_pool) -> None:
    """vLLM's tests/distributed/test_utils.py cpu_worker: tensors broadcast from
    every rank; create() with vLLM's keywords (store_timeout,
    data_expiration_seconds, and rank 0's own listening socket)."""
    res = dist_pool(2).run(vllm_tensors, free_port(), timeout=90)
    for r in res:
        assert r["bcast"] == [0, 1] and r["gather"] == [[0.0, 0.0], [1.0, 1.0]], r
        assert r["p2p"] == [1, 2, 3], r


def test_stateless_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world_size"):
        StatelessProcessGroup.create("127.0.0.1", free_port(), 0, 0)
    with pytest.raises(ValueError, match="rank"):
        StatelessProcessGroup.create("127.0.0.1", free_port(), 3, 2)
    with pytest.raises(ValueError, match="port"):
        StatelessProcessGroup.create("127.0.0.1", 70000, 0, 1)
    g = StatelessProcessGroup.create("127.0.0.1", free_port(), 0, 2, timeout=5)
    with pytest.raises(ValueError, match="dst"):
        g.send_obj(1, dst=0)
    with pytest.raises(ValueError, match="src"):
        g.broadcast_obj(1, src=5)
    with pytest.raises(TypeError, match="dst"):
        g.send_obj(1, dst="1")  # type: ignore[arg-type]
    g.close()


@pytest.mark.timeout(60)
def test_a_first_call_that_fails_to_agree_takes_no_sequence_number() -> None:
    """Rank 2 of three is not constructed yet: rank 0's first send_obj, and a first
    broadcast, fail with CommTimeout naming it. Once rank 2 joins, the repeated calls
    pair with rank 1's (and rank 2's) first calls. The failed calls used to take their
    sequence numbers: the repeated value went under the next one, and rank 1 waited
    for the first in vain."""
    import datetime
    import threading

    port, secret = free_port(), StatelessProcessGroup.generate_secret()

    def client() -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=10))

    g0 = StatelessProcessGroup.create("127.0.0.1", port, 0, 3, timeout=0.5, name="sq",
                                      secret=secret)
    g1 = StatelessProcessGroup(1, 3, client(), name="sq", timeout=5, secret=secret)
    g2 = None
    try:
        with pytest.raises(CommTimeout) as err:
            g0.send_obj("hello", 1)
        assert list(err.value.peers) == [2], err.value
        with pytest.raises(CommTimeout):
            g0.broadcast_obj("to all", src=0)
        g2 = StatelessProcessGroup(2, 3, client(), name="sq", timeout=5, secret=secret)
        g0.send_obj("hello again", 1)
        assert g1.recv_obj(0) == "hello again"
        # A broadcast returns once every rank called it (each states its source).
        got: list = []
        rest = [threading.Thread(target=lambda g=g: got.append(
            g.broadcast_obj(None, src=0, timeout=10))) for g in (g1, g2)]
        for t in rest:
            t.start()
        assert g0.broadcast_obj("to all again", src=0, timeout=10) == "to all again"
        for t in rest:
            t.join(30)
        assert got == ["to all again"] * 2
    finally:
        for g in (g2, g1, g0):
            if g is not None:
                g.close()


@pytest.mark.timeout(60)
def test_a_value_as_large_as_the_store_carries_round_trips() -> None:
    """torch's (libuv) TCPStore carries values up to 8 MiB; the largest object whose
    sealed value fills that exactly goes from rank 0 to rank 1 intact."""
    from coordinator.stateless.store_sealing import MIN_SEALED_BYTES
    from shm_broadcast.ranks.group_adapter import encode_object

    store_cap = 8 << 20
    framing = len(encode_object(bytes(1 << 20))) - (1 << 20)  # of a bytes object this large
    payload = os.urandom(store_cap - MIN_SEALED_BYTES - framing)
    assert MIN_SEALED_BYTES + len(encode_object(payload)) == store_cap
    port, secret = free_port(), StatelessProcessGroup.generate_secret()
    g0 = StatelessProcessGroup.create("127.0.0.1", port, 0, 2, timeout=30, name="big",
                                      secret=secret)
    g1 = StatelessProcessGroup.create("127.0.0.1", port, 1, 2, timeout=30, name="big",
                                      secret=secret)
    try:
        g0.send_obj(payload, dst=1)
        assert len(g0.store.get("big/p2p/0->1/0")) == store_cap
        assert g1.recv_obj(src=0) == payload
        g1.send_obj(b"", dst=0)  # and the smallest
        assert g0.recv_obj(src=1) == b""
    finally:
        g1.close()
        g0.close()


# ---------------------------------------------------------------------- on the ranks
def exercise(rank: int, world_size: int, port_a: int, port_b: int) -> dict:
    world_before = dist.get_world_size()
    a = StatelessProcessGroup.create("127.0.0.1", port_a, rank, world_size, timeout=30, name="a")
    # A second, independent group in the same process: only ranks 0 and 1.
    b = None
    if rank < 2:
        b = StatelessProcessGroup.create("127.0.0.1", port_b, rank, 2, timeout=30, name="b")
    out: dict = {}
    # A bad timeout is refused before the call takes a sequence number: the
    # messages that follow still pair up in order (source and receivers alike).
    out["refused"] = []
    for call in (lambda: a.recv_obj(src=(rank - 1) % world_size, timeout="soon"),
                 lambda: a.broadcast_obj("early" if rank == 0 else None, 0, timeout=-1)):
        try:
            call()
        except (TypeError, ValueError) as e:
            out["refused"].append(type(e).__name__)
    # p2p ring, twice, so sequence numbers advance.
    for i in range(2):
        a.send_obj({"from": rank, "i": i}, dst=(rank + 1) % world_size)
        out[f"ring{i}"] = a.recv_obj(src=(rank - 1) % world_size)
    out["bcast"] = [a.broadcast_obj(f"x{src}" if rank == src else None, src=src)
                    for src in range(world_size)]
    out["gather"] = a.all_gather_obj(rank * 10)
    last = world_size - 1
    out["a_src_mismatch"] = _outcome(
        lambda: a.broadcast_obj(("claim", rank), src=last if rank == last else 0))
    out["a_next"] = a.broadcast_obj("after" if rank == 0 else None, src=0)
    a.barrier()
    if b is not None:
        out["b_gather"] = b.all_gather_obj(("b", rank))
        # The ranks disagree on the source: each is its own source. The next
        # broadcast must still pair with the same call on both ranks.
        out["b_self"] = _outcome(lambda: b.broadcast_obj(("self", rank), src=rank))
        out["b_next"] = b.broadcast_obj("fresh" if rank == 0 else None, src=0)
        b.barrier()
    out["same_node"] = in_the_same_node_as(a, source_rank=0)
    a.barrier()
    if rank == 0:
        time.sleep(0.2)  # let the last readers finish their cleanup
        out["keys_left"] = a.store.num_keys()
    a.barrier()
    out["world_unchanged"] = dist.get_world_size() == world_before
    return out


def _outcome(call: Callable[[], Any]) -> Any:
    """``call()``'s result, or ``"<error type>: <message>"`` when it raised one of the
    library's errors."""
    from coordinator.errors import GroupCoordError

    try:
        return call()
    except GroupCoordError as e:
        return f"{type(e).__name__}: {e}"


def vllm_tensors(rank: int, world_size: int, port: int) -> dict:
    import socket

    import torch

    sock = None
    if rank == 0:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()
    g = StatelessProcessGroup.create("127.0.0.1", port, rank, world_size, store_timeout=30,
                                     data_expiration_seconds=3600, listen_socket=sock,
                                     name="vllm")
    out = {"bcast": [int(g.broadcast_obj(torch.tensor([rank]) if rank == src else None,
                                         src).item()) for src in range(world_size)],
           "gather": [t.tolist() for t in g.all_gather_obj(torch.full((2,), float(rank)))]}
    peer = 1 - rank
    g.send_obj(torch.tensor([1, 2, 3]), peer)
    out["p2p"] = g.recv_obj(peer).tolist()
    g.barrier()
    g.close()
    if sock is not None:
        sock.close()
    return out


def barrier_timeout(rank: int, world_size: int, port: int) -> dict:
    g = StatelessProcessGroup.create("127.0.0.1", port, rank, world_size, timeout=30, name="t")
    g.barrier()
    if rank == world_size - 1:
        time.sleep(3.5)  # skip the second barrier until the others gave up (at 2 s)
        return {"skipped": True}
    t0 = time.monotonic()
    out: dict = {"elapsed": None}
    try:
        g.barrier(timeout=2.0)
    except CommTimeout as e:
        out = {"elapsed": time.monotonic() - t0, "msg": str(e),
               "is_timeout": isinstance(e, TimeoutError)}
    if rank == 0:  # rank 0 hosts the store: outlive the other ranks' timed-out waits
        time.sleep(1.5)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("late_rank", [1, 0])
def test_waiting_for_a_late_rank_logs_nothing(capfd: pytest.CaptureFixture[str],
                                              late_rank: int) -> None:
    """One rank of two joins 1.5 s late. Rank 0 waits for the answers in slices (it
    checks its own record between them); a joining rank waits for rank 0's record in
    slices. A slice spent in the store's timed wait made torch's client log two
    warnings each time it ran out ("[c10d] waitForInput: ... likely a timeout"), a
    dozen lines for one late rank."""
    import threading

    port, secret = free_port(), StatelessProcessGroup.generate_secret()
    groups: list[StatelessProcessGroup] = []
    errors: list[BaseException] = []

    def rank(r: int, after: float) -> None:
        try:
            time.sleep(after)
            g = StatelessProcessGroup.create("127.0.0.1", port, r, 2, timeout=20,
                                             name="late", secret=secret)
            groups.append(g)
            t0 = time.monotonic()
            g.barrier()
            if after == 0.0:
                waited.append(time.monotonic() - t0)
        except BaseException as e:
            errors.append(e)

    waited: list[float] = []
    threads = [threading.Thread(target=rank, args=(r, 1.5 if r == late_rank else 0.0))
               for r in (0, 1)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join(40)
    finally:
        for g in groups:
            g.close()
    assert not errors, errors
    assert len(waited) == 1 and waited[0] < 10.0, waited
    err = capfd.readouterr().err
    assert "waitForInput" not in err, err[-2000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_vllm_tensor_calls(dist_pool, world_size: int) -> None:
    """vLLM 0.33's tensor calls of its stateless group (``broadcast``, ``send``,
    ``recv``, ``all_reduce``): same results on every rank, mismatches raise."""
    res = dist_pool(world_size).run(tensor_calls, free_port(), timeout=90)
    n = world_size
    for rank, r in enumerate(res):
        assert r["bcast"] == [[float(src), 1.0] for src in range(n)], r
        assert r["bcast_is_own"] == [True], r
        assert r["recv"] == [float((rank - 1) % n)] * 3 and r["recv_is_given"], r
        assert r["sum"] == [[float(sum(range(n))), float(n)]], r
        assert r["max"] == [float(n - 1)] * 2 and r["min"] == [0.0, 0.0], r
        assert r["avg"] == [sum(range(n)) / n], r
        assert r["product_int"] == [0 if n > 1 else 1], r
        assert r["dtypes"] == ["torch.float32", "torch.int64"], r
        assert r["refused"] == ["TypeError"] * 4, r
        assert r["bxor"] == [0 if n % 2 == 0 else 1], r  # the ranks' 1s, xored
        assert r["bcast_mismatch"] == (None if rank == 0 else "CollectiveMismatch"), r
        assert r["mismatch"] == "CollectiveMismatch", r
        # Rank 0 sums, the others take the maximum: every rank raises, naming both.
        assert r["op_mismatch"].startswith("CollectiveMismatch"), r["op_mismatch"]
        assert "SUM" in r["op_mismatch"] and "MAX" in r["op_mismatch"], r["op_mismatch"]
        assert r["after_op_mismatch"] == [float(n)], r
        # The last rank's op is no reduce op: it raises TypeError, the others hear why.
        want = "TypeError" if rank == n - 1 else "PeerRejectedError"
        assert r["one_rejects"].startswith(want), r["one_rejects"]
        assert f"rank {n - 1}" in r["one_rejects"] or rank == n - 1, r["one_rejects"]
        assert r["after_one_rejects"] == [float(n)], r
        assert r["recv_mismatch"] == ("CollectiveMismatch" if rank < 2 else None), r
        assert r["recv_untouched"], r


def tensor_calls(rank: int, world_size: int, port: int) -> dict:
    import torch

    from coordinator.errors import CollectiveMismatch
    from device_comms import ReduceOp

    g = StatelessProcessGroup.create("127.0.0.1", port, rank, world_size, timeout=30,
                                     name="tensors")
    out: dict = {"bcast": [], "bcast_is_own": [], "refused": []}
    for src in range(world_size):
        mine = torch.tensor([float(src), 1.0]) if rank == src else None
        got = g.broadcast(mine, src)
        out["bcast"].append(got.tolist())
        if rank == src:
            out["bcast_is_own"].append(got is mine)
    nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
    g.send(torch.full((3,), float(rank)), nxt)
    given = torch.zeros(3)
    got = g.recv(given, prev)
    out["recv"], out["recv_is_given"] = got.tolist(), got is given
    x = torch.tensor([[float(rank), 1.0]])
    out["sum"] = g.all_reduce(x).tolist()
    out["max"] = g.all_reduce(torch.full((2,), float(rank)), dist.ReduceOp.MAX).tolist()
    out["min"] = g.all_reduce(torch.full((2,), float(rank)), ReduceOp.MIN).tolist()
    out["avg"] = g.all_reduce(torch.tensor([float(rank)]), dist.ReduceOp.AVG).tolist()
    product = g.all_reduce(torch.tensor([rank], dtype=torch.int64), dist.ReduceOp.PRODUCT)
    out["product_int"] = product.tolist()
    out["dtypes"] = [str(x.dtype), str(product.dtype)]
    out["bxor"] = g.all_reduce(torch.tensor([1]), ReduceOp.BXOR).tolist()
    for bad in (lambda: g.send([1.0], nxt), lambda: g.all_reduce(x, op=1.5),
                lambda: g.all_reduce(x, op=ReduceOp.BAND),  # bitwise on floats
                lambda: g.all_reduce(torch.tensor([rank]), dist.ReduceOp.AVG)):  # on ints
        try:
            bad()
        except (TypeError, ValueError) as e:
            out["refused"].append(type(e).__name__)
    # A receiver that expects another shape raises; the source goes on.
    try:
        g.broadcast(torch.ones(2) if rank == 0 else torch.zeros(5, dtype=torch.int64), 0)
        out["bcast_mismatch"] = None
    except CollectiveMismatch:
        out["bcast_mismatch"] = "CollectiveMismatch"
    # The last rank's tensor has another shape: every rank raises.
    try:
        g.all_reduce(torch.ones(3 if rank == world_size - 1 else 2))
        out["mismatch"] = None
    except CollectiveMismatch:
        out["mismatch"] = "CollectiveMismatch"
    out["op_mismatch"] = _outcome(lambda: g.all_reduce(
        torch.tensor([float(rank)]), op="sum" if rank == 0 else dist.ReduceOp.MAX))
    out["after_op_mismatch"] = g.all_reduce(torch.ones(1)).tolist()
    try:
        out["one_rejects"] = g.all_reduce(
            torch.ones(1), op=1.5 if rank == world_size - 1 else ReduceOp.SUM)
    except (TypeError, CollectiveMismatch) as e:
        out["one_rejects"] = f"{type(e).__name__}: {e}"
    out["after_one_rejects"] = g.all_reduce(torch.ones(1)).tolist()
    # Rank 1 sends rank 0 a tensor of another dtype, rank 0 one of another shape.
    out["recv_mismatch"], out["recv_untouched"] = None, True
    if rank < 2:
        g.send(torch.ones(3, dtype=torch.int64) if rank == 1 else torch.ones(4), 1 - rank)
        into = torch.zeros(3)
        try:
            g.recv(into, 1 - rank)
        except CollectiveMismatch:
            out["recv_mismatch"] = "CollectiveMismatch"
        out["recv_untouched"] = into.tolist() == [0.0, 0.0, 0.0]
    g.barrier()
    g.close()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank0", ["absent", "silent"])
def test_create_without_rank_0_is_a_comm_timeout_naming_the_group(rank0: str) -> None:
    """Rank 1 creates its group while rank 0's store is absent (nothing listens:
    torch raised its DistNetworkError, outside the library's family) or silent (the
    kernel accepts, nobody answers). Either way: CommTimeout naming the group, the op
    and rank 0, with the group's name and rank 0 in its fields."""
    import socket

    server = socket.create_server(("127.0.0.1", 0)) if rank0 == "silent" else None
    port = server.getsockname()[1] if server is not None else free_port()
    try:
        t0 = time.monotonic()
        with pytest.raises(CommTimeout) as err:
            StatelessProcessGroup.create("127.0.0.1", port, 1, 2, timeout=1.0, name="lonely",
                                         secret=StatelessProcessGroup.generate_secret())
        assert time.monotonic() - t0 < 20.0
    finally:
        if server is not None:
            server.close()
    e = err.value
    assert e.queue == "lonely" and list(e.peers) == [0], (e.queue, e.peers)
    assert "'lonely'" in str(e) and "op create" in str(e) and "rank 0" in str(e), str(e)
    assert "rank 1/2" in str(e), str(e)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", ["leaf_requiring_grad", "view_of_such_a_leaf", "expanded_view",
                                 "inference"])
def test_recv_into_an_unwritable_tensor_takes_no_message(bad: str) -> None:
    """A tensor ``recv`` cannot write in place is refused before a message is taken:
    the message stays for the next recv. It used to be taken from the store, then
    ``copy_`` failed (a raw RuntimeError) and the message was lost."""
    import torch

    port, secret = free_port(), StatelessProcessGroup.generate_secret()
    g0 = StatelessProcessGroup.create("127.0.0.1", port, 0, 2, timeout=10, name="rb",
                                      secret=secret)
    g1 = StatelessProcessGroup.create("127.0.0.1", port, 1, 2, timeout=10, name="rb",
                                      secret=secret)
    try:
        g0.send(torch.tensor([1.0, 2.0]), 1)
        g0.send(torch.tensor([3.0, 4.0]), 1)
        if bad == "leaf_requiring_grad":
            into = torch.zeros(2, requires_grad=True)
        elif bad == "view_of_such_a_leaf":
            into = torch.zeros(3, requires_grad=True)[:2]
        elif bad == "expanded_view":
            into = torch.zeros(1).expand(2)
        else:
            with torch.inference_mode():
                into = torch.zeros(2)
        with pytest.raises(ValueError, match="tensor"):
            g1.recv(into, 0)
        assert g1.recv(torch.zeros(2), 0).tolist() == [1.0, 2.0]
        assert g1.recv(torch.zeros(2), 0).tolist() == [3.0, 4.0]
    finally:
        g1.close()
        g0.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["broadcast", "broadcast_obj"])
def test_a_source_that_cannot_send_tells_the_receiver_and_leaves_no_keys(call: str) -> None:
    """The source's ``tensor`` is none (``broadcast``), or its object does not encode
    (``broadcast_obj``): the receiver raises at once (for ``broadcast`` it waited
    until the timeout), none of the call's keys stays in the store (they stayed:
    the source never counted itself), and the next broadcast pairs."""
    import threading

    import torch

    port, secret = free_port(), StatelessProcessGroup.generate_secret()
    g0 = StatelessProcessGroup.create("127.0.0.1", port, 0, 2, timeout=20, name="bk",
                                      secret=secret)
    g1 = StatelessProcessGroup.create("127.0.0.1", port, 1, 2, timeout=20, name="bk",
                                      secret=secret)
    got: dict[str, Any] = {}

    def receive() -> None:
        start = time.monotonic()
        try:
            getattr(g1, call)(None, 0)
            got["receiver"] = "returned"
        except Exception as e:  # the test checks which error, and how soon
            got["receiver"], got["took"] = type(e).__name__, time.monotonic() - start

    try:
        receiver = threading.Thread(target=receive)
        receiver.start()
        with pytest.raises(TypeError):
            getattr(g0, call)([1.0] if call == "broadcast" else object(), 0)
        receiver.join(30)
        want = "PeerRejectedError" if call == "broadcast" else "CollectiveMismatch"
        assert got.get("receiver") == want and got["took"] < 10, got
        nxt = threading.Thread(target=lambda: got.update(next=g1.broadcast(None, 0)))
        nxt.start()
        g0.broadcast(torch.ones(1), 0)
        nxt.join(30)
        assert got["next"].tolist() == [1.0]
        time.sleep(0.3)  # the last reader's deletes
        assert sorted(k for k in g0.store.list_keys() if "/bcast/" in k) == []
    finally:
        g1.close()
        g0.close()


@pytest.mark.timeout(60)
def test_a_group_on_a_bracketed_ipv6_loopback_address() -> None:
    """``[::1]`` is ``::1``: a loopback group (its secret from the private key file)
    whose ranks connect. Rank 1 used to time out connecting to ``[::1]``."""
    import socket
    import threading

    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    port = free_port()
    g0 = StatelessProcessGroup.create("[::1]", port, 0, 2, timeout=10, name="v6")
    g1 = StatelessProcessGroup.create("[::1]", port, 1, 2, timeout=10, name="v6")
    got: list = []
    try:
        t = threading.Thread(target=lambda: got.append(g0.broadcast_obj("x", 0)))
        t.start()
        got.append(g1.broadcast_obj(None, 0))
        t.join(30)
        assert got == ["x", "x"]
    finally:
        g1.close()
        g0.close()


@pytest.mark.parametrize("store", ["not a store", None, 12345, object()])
def test_a_store_that_is_not_a_store_is_a_type_error(store: Any) -> None:
    """It used to be an AttributeError from deep inside, or a ClosedError (None)."""
    with pytest.raises(TypeError, match="store") as err:
        StatelessProcessGroup(0, 2, store, secret=b"k" * 32, timeout=2)
    assert type(store).__name__ in str(err.value), err.value


@pytest.mark.timeout(60)
@pytest.mark.parametrize("secured", [True, False])
def test_a_dropped_group_stops_its_store_without_the_cyclic_gc(secured: bool) -> None:
    """Rank 0's group dropped without close(): its store stops listening and its
    worker thread ends once the last reference goes. The session agreement held the
    group's bound method, a cycle that kept both until the cyclic GC ran."""
    import gc
    import threading

    import psutil

    def listening(port: int) -> bool:
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in psutil.Process().net_connections(kind="tcp"))

    name = f"dropped{int(secured)}"
    port = free_port()
    gc.disable()
    try:
        g = StatelessProcessGroup.create("127.0.0.1", port, 0, 1, timeout=5, name=name,
                                         **({"secret": b"k" * 32} if secured else
                                            {"insecure": True}))
        g.barrier()
        del g
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and (listening(port) or any(
                name in t.name for t in threading.enumerate())):
            time.sleep(0.05)
        assert not listening(port)
        assert not [t.name for t in threading.enumerate() if name in t.name]
    finally:
        gc.enable()

"""Plain ``send``/``recv`` (and ``isend``/``irecv``) on a direction settled on a
shared-memory link (coordinator.p2p.link_tensors), on real ranks.

Each rank code builds its own group; a first call of either kind (a tensor
dict or a tensor) settles each direction. Then single tensors of every kind
travel on the link (the link's message count proves it), mixed in order with
dicts and asynchronous calls. A tensor's send meets its receiver: mismatched
calls raise on both ranks, bad arguments are told to the peer, and the link
stays in order.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from coordinator.errors import CollectiveMismatch


def _group(rank: int, n: int, name: str) -> Any:
    from coordinator import GroupCoordinator

    return GroupCoordinator([list(range(n))], rank, "gloo", True, group_name=name, timeout=30)


def _tensors(src: int) -> list[torch.Tensor]:
    """Every dtype family, 0-d, empty, views, and one larger than a link chunk."""
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6) + 10 * src
    return [base.float(), base.to(torch.bfloat16), base.long(), base.to(torch.int8),
            base.long() % 3 == 0, torch.complex(base.float(), -base.float()),
            torch.tensor(2.5 + src), torch.empty(0, 3), base.float()[:, ::2], base.t(),
            torch.arange(3 << 20 >> 2, dtype=torch.float32) + src]  # 3 MiB: streamed


def _messages(g: Any, peer: int) -> int:
    """Messages the link to ``peer`` has carried (its writer's sequence number)."""
    from coordinator.p2p.channels import SEND

    link = g._p2p.links.settled(SEND, peer)
    return -1 if link is None else link._impl._seq


def pairs(rank: int, world_size: int, first: str) -> list[str]:
    """A ring: each rank sends to the next and receives from the previous; the
    first call of each direction (``first``: a dict or a tensor) settles it."""
    g = _group(rank, world_size, "lt")
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    bad: list[str] = []
    mine, theirs = _tensors(rank), _tensors(prv)
    try:
        for step in ("settle", "tensors", "mixed"):
            if step == "settle" and first == "dict":  # the offer waits for its receiver
                h = g.isend_tensor_dict({"x": torch.ones(2) * rank}, nxt)
                got = g.recv_tensor_dict(prv)
                h.wait(20)
                bad += [] if torch.equal(got["x"], torch.ones(2) * prv) else ["settling dict"]
                continue
            if step == "settle":
                h = g.isend(torch.ones(2) * rank, nxt)
                got = g.irecv(((2,), torch.float32), prv).wait(20)
                h.wait(20)
                bad += [] if torch.equal(got, torch.ones(2) * prv) else ["settling tensor"]
                bad += [] if _messages(g, nxt) == 1 else ["the first tensor is not on the link"]
                continue
            if step == "tensors":
                before = _messages(g, nxt)
                for i, (t, want) in enumerate(zip(mine, theirs, strict=False)):
                    if rank % 2 == 0:
                        g.send(t, nxt)
                        got = g.recv(want.shape, want.dtype, prv)
                    else:
                        got = g.recv(want.shape, want.dtype, prv)
                        g.send(t, nxt)
                    if got.dtype != want.dtype or not torch.equal(got, want.contiguous()):
                        bad.append(f"tensor {i} ({want.dtype} {tuple(want.shape)})")
                if _messages(g, nxt) < before + len(mine):
                    bad.append(f"not on the link: {before} -> {_messages(g, nxt)} messages")
                continue
            h = [g.isend(mine[0], nxt), g.isend_tensor_dict({"k": mine[2]}, nxt),
                 g.isend(mine[5], nxt)]
            r1 = g.recv(theirs[0].shape, theirs[0].dtype, prv)
            r2 = g.recv_tensor_dict(prv)
            r3 = g.irecv((theirs[5].shape, theirs[5].dtype), prv).wait(20)
            for x in h:
                x.wait(20)
            if not (torch.equal(r1, theirs[0]) and torch.equal(r2["k"], theirs[2])
                    and torch.equal(r3, theirs[5])):
                bad.append("mixed order")
    finally:
        g.destroy()
    return bad


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size, first", [(2, "dict"), (3, "tensor"),
                                               pytest.param(3, "dict", marks=pytest.mark.slow),
                                               pytest.param(2, "tensor", marks=pytest.mark.slow)])
def test_single_tensors_travel_on_the_link_in_order(dist_pool, world_size, first):
    assert dist_pool(world_size).run(pairs, first, timeout=140) == [[]] * world_size


def _outcome(fn: Any) -> str:
    try:
        out = fn()
    except Exception as e:
        return type(e).__name__
    return "ok" if not isinstance(out, torch.Tensor) else f"ok {tuple(out.shape)} {out.dtype}"


def mismatches(rank: int, world_size: int) -> list[str]:
    """Rank 0 sends, rank 1 receives; each mismatch is followed by a good exchange.
    Every sender learns the receiver's verdict."""
    g = _group(rank, 2, "lm")
    good = torch.arange(6.0)
    got: list[str] = []

    def exchange() -> None:
        if rank == 0:
            g.send(good, 1)
        else:
            got.append(_outcome(lambda: g.recv((6,), torch.float32, 0)))

    try:
        if rank == 0:
            g.send_tensor_dict({"x": good}, 1)
        else:
            g.recv_tensor_dict(0)
        big = 3 << 20  # streamed: a confirmed header, then parts
        cases = [
            (lambda: g.send(torch.ones(4), 1), lambda: g.recv((5,), torch.float32, 0)),
            (lambda: g.send(torch.ones(4), 1), lambda: g.recv((4,), torch.int64, 0)),
            (lambda: g.send(torch.ones(big), 1), lambda: g.recv((big + 1,), torch.float32, 0)),
            (lambda: g.send_tensor_dict({"a": torch.ones(big)}, 1),
             lambda: g.recv((big,), torch.float32, 0)),
            (lambda: g.send(torch.ones(2), 1), lambda: g.recv_tensor_dict(0)),
            (lambda: g.send(torch.ones(big), 1), lambda: g.recv_tensor_dict(0)),
            # bad arguments raise on their caller; the peer is told
            (lambda: g.send("not a tensor", 1), lambda: g.recv((2,), torch.float32, 0)),
            (lambda: g.send(torch.ones(2), 1), lambda: g.recv((-1,), torch.float32, 0)),
            (lambda: g.send(torch.ones(big), 1), lambda: g.recv((-1,), torch.float32, 0)),
            (lambda: g.send_tensor_dict({"a": torch.ones(big)}, 1),
             lambda: g.recv((2, -1), torch.float32, 0)),
        ]
        for send, recv in cases:
            got.append(_outcome(send if rank == 0 else recv))
            exchange()
    finally:
        g.destroy()
    return got


@pytest.mark.timeout(120)
def test_mismatched_calls_raise_on_both_ranks_and_keep_the_link_in_order(dist_pool):
    sender, receiver = dist_pool(2).run(mismatches, timeout=110)
    ok = "ok (6,) torch.float32"
    mm = "CollectiveMismatch"
    assert sender == [mm] * 6 + ["TypeError"] + ["PeerRejectedError"] * 3, sender
    assert receiver == [mm, ok, mm, ok, mm, ok, mm, ok, mm, ok, mm, ok,
                        "PeerRejectedError", ok] + ["ValueError", ok] * 3, receiver


def cpu_group_direction(rank: int, world_size: int, first: str) -> list[bool]:
    """With GROUPCOORD_P2P_SHM=0 on the sender the direction settles on the CPU
    group at its first dict (or stays unsettled without one): send/recv keep
    working through the communicator, and nothing is on a link."""
    if rank == 0:
        os.environ["GROUPCOORD_P2P_SHM"] = "0"
    g = _group(rank, 2, "lc")
    try:
        if rank == 0:
            if first == "dict":
                g.send_tensor_dict({"x": torch.ones(2)}, 1)
            g.send(torch.arange(5), 1)
            g.send(torch.ones(3), 1)
            return [_messages(g, 1) == -1]
        if first == "dict":
            g.recv_tensor_dict(0)
        return [torch.equal(g.recv((5,), torch.int64, 0), torch.arange(5)),
                torch.equal(g.recv((3,), torch.float32, 0), torch.ones(3))]
    finally:
        os.environ.pop("GROUPCOORD_P2P_SHM", None)  # pool workers run later tests
        g.destroy()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("first", ["dict", "tensor"])
def test_a_direction_on_the_cpu_group_keeps_the_communicator(dist_pool, first):
    assert dist_pool(2).run(cpu_group_direction, first, timeout=50) == [[True], [True, True]]


def plain_only(rank: int, world_size: int) -> list[str]:
    """Directions that only ever carry single tensors settle on links at their
    first one: every tensor travels there."""
    from coordinator.p2p.channels import RECV, SEND

    g = _group(rank, world_size, "lp")
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    bad: list[str] = []
    try:
        for i, (t, want) in enumerate(zip(_tensors(rank)[:4], _tensors(prv)[:4], strict=False)):
            h = g.isend(t, nxt)
            got = g.recv(want.shape, want.dtype, prv)
            h.wait(20)
            if got.dtype != want.dtype or not torch.equal(got, want):
                bad.append(f"tensor {i}")
        if g._p2p.links.settled(SEND, nxt) is None or g._p2p.links.settled(RECV, prv) is None:
            bad.append("single tensors did not settle their directions on links")
        elif _messages(g, nxt) != 4:
            bad.append(f"{_messages(g, nxt)} messages on the link, not 4")
    finally:
        g.destroy()
    return bad


@pytest.mark.timeout(120)
def test_single_tensors_alone_settle_a_link(dist_pool):
    assert dist_pool(3).run(plain_only, timeout=100) == [[]] * 3


def other_kinds(rank: int, world_size: int, case: str) -> str:
    """Rank 0 sends, rank 1 makes a receive of another kind: the receiver raises
    CollectiveMismatch naming both calls (it never returns a link offer or a
    dict's metadata as an object); a sender that waits for its receiver raises
    too: it times out, or sees the receiver's connections close when the
    receiver destroys its group first."""
    from coordinator import GroupCoordinator
    from coordinator.errors import ClosedError, CommTimeout

    if case == "send_tensor_dict/cpu-group" and rank == 0:
        os.environ["GROUPCOORD_P2P_SHM"] = "0"
    g = GroupCoordinator([[0, 1]], rank, "gloo", True, group_name="kinds", timeout=3)
    try:
        if case == "send_tensor_dict/cpu-group":  # settle the direction first
            g.send_tensor_dict({"x": torch.ones(1)}, 1) if rank == 0 else g.recv_tensor_dict(0)
        sends = {"send": lambda: g.send(torch.ones(2), 1),
                 "send_object": lambda: g.send_object([1, 2], 1),
                 "send_tensor_dict/cpu-group": lambda: g.send_tensor_dict({"x": torch.ones(2)},
                                                                           1)}
        receives = {"send": lambda: g.recv_object(0),
                    "send_object": lambda: g.recv((2,), torch.float32, 0),
                    "send_tensor_dict/cpu-group": lambda: g.recv_object(0)}
        try:
            got = sends[case]() if rank == 0 else receives[case]()
        except (CommTimeout, ClosedError):
            return "raised"
        except CollectiveMismatch as e:
            return f"CollectiveMismatch: {e}"
        return f"returned {got!r:.60}"
    finally:
        os.environ.pop("GROUPCOORD_P2P_SHM", None)  # pool workers run later tests
        g.destroy()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case, sender, waited", [
    ("send", "raised", "recv_object"),
    ("send_object", "returned None", "recv or recv_tensor_dict"),
    ("send_tensor_dict/cpu-group", "raised", "recv_object"),
])
def test_a_call_of_another_kind_raises_instead_of_taking_what_was_sent(dist_pool, case, sender,
                                                                       waited):
    out = dist_pool(2).run(other_kinds, case, timeout=50)
    assert out[0] == sender, out
    assert out[1].startswith("CollectiveMismatch"), out
    assert f"where this rank called {waited}" in out[1], out


def late_receiver(rank: int, world_size: int) -> list[str]:
    """Rank 1 comes to its recv after rank 0's send timed out: the direction closes
    on both sides (a late message must not pair with a later call); the one
    message already in the ring is still delivered, in its place."""
    from coordinator import GroupCoordinator

    g = GroupCoordinator([[0, 1]], rank, "gloo", True, group_name="late", timeout=2)
    out: list[str] = []
    try:
        if rank == 0:
            g.send(torch.zeros(3), 1)  # settles the link
            out.append(_outcome(lambda: g.send(torch.ones(3), 1)))
            out.append(_outcome(lambda: g.send(torch.ones(3), 1)))
        else:
            g.recv((3,), torch.float32, 0)
            time.sleep(3.5)
            out.append(_outcome(lambda: g.recv((3,), torch.float32, 0)))
            out.append(_outcome(lambda: g.recv((3,), torch.float32, 0)))
        g.barrier()
    finally:
        g.destroy()
    return out


@pytest.mark.timeout(60)
def test_a_send_that_times_out_closes_its_direction(dist_pool):
    sender, receiver = dist_pool(2).run(late_receiver, timeout=50)
    assert sender == ["CommTimeout", "ClosedError"], sender
    assert receiver == ["ok (3,) torch.float32", "ClosedError"], receiver


def subgroup_peers(rank: int, world_size: int) -> list[Any]:
    """In the group of global ranks [1, 2], errors name group ranks (as the CPU
    group's signed calls do): the receiver is group rank 1, the sender 0."""
    from coordinator import GroupCoordinator
    from coordinator.errors import PeerRejectedError

    g = GroupCoordinator([[0], [1, 2]], rank, "gloo", True, group_name="sub", timeout=30)
    out: list[Any] = []
    try:
        if rank == 1:
            for _ in range(2):
                try:
                    g.send(torch.ones(4), 1)
                except PeerRejectedError as e:
                    out.append(("PeerRejectedError", e.rank, list(e.peers)))
                except CollectiveMismatch as e:
                    out.append(("CollectiveMismatch", list(e.peers)))
            with pytest.raises(TypeError):
                g.send("not a tensor", 1)  # type: ignore[arg-type]
            with pytest.raises(CollectiveMismatch):
                g.send_tensor_dict({"a": torch.ones(2)}, 1)
        elif rank == 2:
            try:
                g.recv((5,), torch.float32, 0)
            except CollectiveMismatch as e:
                out.append(("CollectiveMismatch", list(e.peers)))
            with pytest.raises(ValueError):
                g.recv((-1,), torch.float32, 0)
            with pytest.raises(PeerRejectedError) as rejected:
                g.recv((4,), torch.float32, 0)
            out.append(("PeerRejectedError", rejected.value.rank, list(rejected.value.peers)))
            with pytest.raises(CollectiveMismatch) as wrong_kind:
                g.recv((2,), torch.float32, 0)
            said = str(wrong_kind.value)
            out.append(("CollectiveMismatch", list(wrong_kind.value.peers),
                        "rank 0" in said and g.unique_name in said))
    finally:
        g.destroy()
    return out


@pytest.mark.timeout(60)
def test_link_errors_in_a_subgroup_name_group_ranks(dist_pool):
    out = dist_pool(3).run(subgroup_peers, timeout=50)
    assert out[1] == [("CollectiveMismatch", [1]), ("PeerRejectedError", 1, [1])], out
    assert out[2] == [("CollectiveMismatch", [0]), ("PeerRejectedError", 0, [0]),
                      ("CollectiveMismatch", [0], True)], out

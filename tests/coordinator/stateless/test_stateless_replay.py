"""Replays of an earlier incarnation of a stateless group, and values planted to be fetched
again and again, attacked with real processes and stores.

The attacker holds no secret, only a plain store client (loopback): it recorded what
incarnation 1 of a group left in the store (session records and sealed values) and plants
it into incarnation 2 (the same secret, name, size and port), whose ranks are separate
processes. No rank
of incarnation 2 may ever return an incarnation-1 value: the ranks either carry on with
their own values, or raise AuthenticationError naming the replayed record.

A reader that refused a value fetches it again only once it changed, and looks no more
often than an exponential back-off: a planted 8 MiB value is fetched once, where a reader
used to fetch (and authenticate) it every 5 ms.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch.distributed as dist

from coordinator.errors import GroupCoordError
from coordinator.stateless.stateless_group import StatelessProcessGroup
from coordinator.testing import free_port

HOST = "127.0.0.1"
NAME = "replay"

def _store_client(port: int) -> Any:
    import datetime

    return dist.TCPStore(HOST, port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))


def _plant(store: Any, key: str, value: bytes) -> None:
    """``store.set`` and a round trip after it: the value is in the store on return
    (a ``set`` alone is not answered)."""
    store.set(key, value)
    store.check([key])


def _attack(port: int, plant: dict[str, bytes], rank0_key: str, failed: list) -> None:
    """The attacker (a thread here; it holds no secret, only a plain store client): waits
    until rank 0 of the new incarnation has joined, plants its recording, then tells the
    other ranks (through the test's own key ``attack/done``) that they may start."""
    try:
        store = _store_client(port)
        store.wait([rank0_key])
        for key, value in plant.items():
            _plant(store, key, value)
        _plant(store, "attack/done", b"1")
    except BaseException as e:  # reported by the test
        failed.append(e)


def _value(incarnation: int, dst: int) -> dict:
    return {"incarnation": incarnation, "cmd": f"weights from incarnation {incarnation}",
            "for": dst}


def _record_incarnation_1(port: int, secret: bytes, world_size: int) -> dict[str, bytes]:
    """Run incarnation 1 (every rank in this process) while recording, with a plain
    store client, every key and value it can read: the session records once every
    rank has joined, then the sealed values rank 0 sends."""
    groups = [StatelessProcessGroup.create(HOST, port, r, world_size, timeout=10, name=NAME,
                                           secret=secret) for r in range(world_size)]
    spy = _store_client(port)
    try:
        recorded = {k: spy.get(k) for k in spy.list_keys()}
        for dst in range(1, world_size):
            groups[0].send_obj(_value(1, dst), dst)
        recorded.update({k: spy.get(k) for k in spy.list_keys() if k not in recorded})
        for dst in range(1, world_size):
            assert groups[dst].recv_obj(0) == _value(1, dst)
    finally:
        for g in reversed(groups):
            g.close()
    return recorded


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("replayed", ["others", "rank0"])
def test_a_replayed_incarnation_is_refused(dist_pool, world_size: int, replayed: str) -> None:
    """``others``: the attacker plants incarnation 1's records of ranks 1.., its
    confirmation and its sealed values before those ranks join; the last rank joins a
    second late. The records lie under incarnation 1's keys (its rank-0 nonce), which
    no rank of incarnation 2 reads. ``rank0``: the attacker also writes incarnation
    1's record of rank 0 over rank 0's before the other ranks join (they verify it:
    it is authentic), and rank 0 sends half a second later, so the receivers meet the
    planted values first (the attack of issue 37: they returned incarnation 1's).
    Every rank then raises AuthenticationError: rank 0 finds the replayed record over
    its own, and the others find rank 0's refusal (or incarnation 1's confirmation,
    which lists other nonces) where they wait for rank 0's confirmation."""
    port, secret = free_port(), StatelessProcessGroup.generate_secret()
    recorded = _record_incarnation_1(port, secret, world_size)
    rank0_key = f"{NAME}/session"
    plant = {k: v for k, v in recorded.items()
             if not k.endswith(("/writes", "/done")) and (replayed == "rank0" or k != rank0_key)}
    assert any("/p2p/" in k for k in plant), plant.keys()  # sealed values are planted too
    failed: list[BaseException] = []
    attacker = threading.Thread(target=_attack, args=(port, plant, rank0_key, failed),
                                daemon=True)
    attacker.start()
    late, pause, timeout = (world_size - 1, 0.0, 10.0) if replayed == "others" else (-1, 0.5, 2.0)
    try:
        res = dist_pool(world_size).run(_rank_incarnation_2, port, secret, timeout, late, pause,
                                        timeout=60)
    finally:
        attacker.join(30)
    assert not failed, failed
    got = [r["got"] for r in res]
    assert not any("incarnation 1" in g for g in got), got  # never an old value
    if replayed == "others":  # the planted records lie under keys nobody reads
        assert got == ["sent"] + [repr(_value(2, d)) for d in range(1, world_size)], got
        return
    # Rank 0 finds the replayed record over its own and the answers to it, and names
    # the ranks that gave them; those ranks are told so (no CommTimeout).
    assert got[0].startswith("AuthenticationError"), got[0]
    others = list(range(1, world_size))
    assert f"rank(s) {others} had verified the replayed record" in got[0], got[0]
    assert "earlier incarnation" in got[0] and "replay" in got[0], got[0]
    assert f"own record '{NAME}/session' was replaced" in got[0], got[0]
    for g in got[1:]:
        assert g.startswith("AuthenticationError") and "earlier incarnation" in g, g


def _rank_incarnation_2(rank: int, world_size: int, port: int, secret: bytes, timeout: float,
                        late: int, pause: float) -> dict:
    raw = _store_client(port) if rank > 0 else None
    if raw is not None:
        raw.wait(["attack/done"])  # the attacker has planted its recording
        if rank == late:
            time.sleep(0.5)  # joins late: its planted record is read first
    g = StatelessProcessGroup.create(HOST, port, rank, world_size, timeout=timeout, name=NAME,
                                     secret=secret)
    out: dict[str, Any] = {}
    try:
        if rank == 0:
            raw = _store_client(port)
            raw.wait(["attack/done"])
            time.sleep(pause)
            for dst in range(1, world_size):
                g.send_obj(_value(2, dst), dst)
            out["got"] = "sent"
        else:
            out["got"] = repr(g.recv_obj(0))
    except GroupCoordError as e:
        out["got"] = f"{type(e).__name__}: {e}"
    out["rejected"] = g.rejected_values
    # Rank 0 hosts the store: it stays until every other rank is done with it.
    assert raw is not None
    if rank > 0:
        raw.set(f"finished/{rank}", b"")
    else:
        raw.wait([f"finished/{r}" for r in range(1, world_size)])
    del raw
    g.close()
    return out


# ---------------------------------------------------------------------- planted large values
class _CountingStore(dist.TCPStore):
    """A store client that counts what its ``get`` and ``compare_set`` bring back: the
    rank's own calls, on a real store."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fetched: list[tuple[str, str, int]] = []

    def get(self, key: str) -> bytes:  # type: ignore[override]
        value = super().get(key)
        self.fetched.append(("get", key, len(value)))
        return value

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:  # type: ignore[override]
        value = super().compare_set(key, expected, desired)
        self.fetched.append(("compare_set", key, len(value)))
        return value


def _counting_client(port: int) -> _CountingStore:
    import datetime

    return _CountingStore(HOST, port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))


BIG = 8 << 20  # the most a (libuv) TCPStore carries


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["value", "session-record"])
def test_a_planted_large_value_is_fetched_once(where: str) -> None:
    """An outsider plants 8 MiB of garbage under the key rank 1 reads (``value``: the
    next message from rank 0; ``session-record``: rank 0's session record, over rank
    0's, before rank 1 joins). Rank 1 refuses it and raises AuthenticationError at its
    timeout, having fetched it once (twice for the record: it looks again right after
    it took the counter's snapshot). It used to fetch it every 5 ms."""
    port, secret = free_port(), StatelessProcessGroup.generate_secret()
    g0 = StatelessProcessGroup.create(HOST, port, 0, 2, timeout=10, name="big", secret=secret)
    key = "big/p2p/0->1/1" if where == "value" else "big/session"
    store = _counting_client(port)
    g1 = None
    try:
        if where == "value":  # a first message: the ranks agree on the session
            g1 = StatelessProcessGroup(1, 2, store, name="big", timeout=10, secret=secret)
            g0.send_obj("first", 1)
            assert g1.recv_obj(0) == "first"
        _plant(_store_client(port), key, os.urandom(BIG))
        t0 = time.monotonic()
        with pytest.raises(GroupCoordError) as err:
            if g1 is not None:
                g1.recv_obj(0, timeout=2.0)
            else:
                StatelessProcessGroup(1, 2, store, name="big", timeout=2.0, secret=secret)
        elapsed = time.monotonic() - t0
        assert type(err.value).__name__ == "AuthenticationError", err.value
        large = [f for f in store.fetched if f[1] == key and f[2] >= BIG]
        looks = [f for f in store.fetched if f[1] == key]
        assert len(large) <= (1 if where == "value" else 2), (len(large), elapsed)
        # The marker (or the session counter) is looked at with back-off: a handful of times.
        assert len(looks) <= 14, (len(looks), elapsed)
    finally:
        if g1 is not None:
            g1.close()
        g0.close()


@pytest.mark.timeout(60)
def test_a_value_replaced_again_and_again_is_fetched_with_back_off() -> None:
    """The outsider writes a new 1 MiB of garbage under the key every 20 ms for 2 s: the
    reader fetches each version it looks at, but looks no more often than the back-off
    (5 ms doubling to 0.5 s: 10 looks in 2 s), where it used to fetch every 5 ms."""
    port, secret = free_port(), StatelessProcessGroup.generate_secret()
    g0 = StatelessProcessGroup.create(HOST, port, 0, 2, timeout=10, name="again", secret=secret)
    store = _counting_client(port)
    g1 = StatelessProcessGroup(1, 2, store, name="again", timeout=10, secret=secret)
    g0.send_obj("first", 1)  # the ranks agree on the session
    assert g1.recv_obj(0) == "first"
    key = "again/p2p/0->1/1"
    stop = threading.Event()

    def replant() -> None:
        outsider = _store_client(port)
        while not stop.is_set():
            outsider.set(key, os.urandom(1 << 20))
            stop.wait(0.02)

    outsider = threading.Thread(target=replant, daemon=True)
    try:
        _plant(_store_client(port), key, os.urandom(1 << 20))
        outsider.start()
        with pytest.raises(GroupCoordError) as err:
            g1.recv_obj(0, timeout=2.0)
        assert type(err.value).__name__ == "AuthenticationError", err.value
        large = [f for f in store.fetched if f[1] == key and f[2] >= 1 << 20]
        assert len(large) <= 2 * 11, len(large)  # at most a get and a compare_set per look
        assert g1.rejected_values >= 2  # it did see new versions
    finally:
        stop.set()
        outsider.join(10)
        g1.close()
        g0.close()

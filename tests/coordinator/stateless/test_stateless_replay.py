"""Replays of an earlier incarnation of a stateless group, and values planted to be fetched
again and again, attacked with real processes and stores.

The attacker holds no secret, only a plain store client (loopback): it recorded what
incarnation 1 of a group left in the store (session records and sealed values) and plants
it into incarnation 2 (the same secret, name, size and port), whose ranks are separate
processes. No rank
of incarnation 2 may ever return an incarnation-1 value: the ranks either carry on with
their own values, or raise AuthenticationError naming the replayed record.

Every rank of incarnation 2 is told about a replayed record of rank 0, also when every
rank but 0 verified it (they wait for rank 0's confirmation), and what an unfinished
incarnation left in a shared store does not disturb the next one (each counts under keys
of its own rank-0 nonce).

A reader that refused a value fetches it again only once it changed, and looks no more
often than an exponential back-off, also while an outsider floods the key with new values:
a planted 8 MiB value is fetched once, where a reader used to fetch (and authenticate) it
every 5 ms.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch.distributed as dist

from coordinator.errors import AuthenticationError, CommTimeout, GroupCoordError
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
@pytest.mark.parametrize("world_size, replayed", [
    (2, "rank0"), (3, "others"),
    pytest.param(2, "others", marks=pytest.mark.slow),
    pytest.param(3, "rank0", marks=pytest.mark.slow),
])
def test_a_replayed_incarnation_is_refused(dist_pool, world_size: int, replayed: str) -> None:
    """``others``: the attacker plants incarnation 1's records of ranks 1.., its
    confirmation and its sealed values before those ranks join; the last rank joins a
    second late. The records lie under incarnation 1's keys (its rank-0 nonce), which
    no rank of incarnation 2 reads. ``rank0``: the attacker also writes incarnation
    1's record of rank 0 over rank 0's before the other ranks join (they verify it:
    it is authentic), and rank 0 sends half a second later, so the receivers meet the
    planted values first (without every rank's nonce they returned incarnation 1's).
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


@pytest.mark.timeout(60)
def test_a_reader_flooded_with_new_values_keeps_its_timeout_and_back_off() -> None:
    """An outsider writes a new small garbage value under the key rank 1 reads next as
    fast as it can, so nearly every ``compare_set`` of the reader finds a newer value
    than the one it refused. The reader still looks no more often than the back-off (its
    first fetch, 7 looks in the first second and one at the deadline: at most one get
    and one compare_set each) and raises at its timeout. It used to go straight back to
    compare_set after each newer value, without back-off or deadline check: thousands of
    compare_set calls in one call, which returned only once the outsider lost a race."""
    port, secret = free_port(), StatelessProcessGroup.generate_secret()
    g0 = StatelessProcessGroup.create(HOST, port, 0, 2, timeout=10, name="flood", secret=secret)
    store = _counting_client(port)
    g1 = StatelessProcessGroup(1, 2, store, name="flood", timeout=10, secret=secret)
    g0.send_obj("first", 1)  # the ranks agree on the session
    assert g1.recv_obj(0) == "first"
    key = "flood/p2p/0->1/1"
    stop = threading.Event()

    def flood() -> None:  # stops by itself, for the old code that ignored its deadline
        outsider = _store_client(port)
        i, end = 0, time.monotonic() + 6.0
        while not stop.is_set() and time.monotonic() < end:
            outsider.set(key, os.urandom(64) + i.to_bytes(8, "little"))  # no answer awaited
            i += 1
        outsider.check([key])

    _plant(_store_client(port), key, os.urandom(72))
    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    del store.fetched[:]
    t0 = time.monotonic()
    try:
        with pytest.raises(AuthenticationError):
            g1.recv_obj(0, timeout=1.0)
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        flooder.join(30)
        g1.close()
        g0.close()
    swaps = [f for f in store.fetched if f[0] == "compare_set"]
    gets = [f for f in store.fetched if f[0] == "get" and f[1] == key]
    assert len(swaps) <= 9 and len(gets) <= 9, (len(swaps), len(gets), elapsed)
    assert elapsed < 3.0, elapsed


@pytest.mark.timeout(60)
def test_a_key_found_empty_is_reported_as_such() -> None:
    """The key rank 1 reads next holds the empty marker (what a reader that refused a
    value leaves; a key deleted between the reader's wait and its get reads the same).
    The reader used to say that 0 values failed authentication because another reader
    refused one."""
    port, secret = free_port(), StatelessProcessGroup.generate_secret()
    g0 = StatelessProcessGroup.create(HOST, port, 0, 2, timeout=10, name="empty", secret=secret)
    g1 = StatelessProcessGroup.create(HOST, port, 1, 2, timeout=10, name="empty", secret=secret)
    try:
        g0.send_obj("first", 1)  # the ranks agree on the session
        assert g1.recv_obj(0) == "first"
        _plant(_store_client(port), "empty/p2p/0->1/1", b"")
        with pytest.raises(AuthenticationError) as err:
            g1.recv_obj(0, timeout=0.3)
        msg = str(err.value)
        assert "0 value(s)" not in msg, msg
        assert "every fetch found it empty" in msg and "deleted between" in msg, msg
        assert err.value.rejected == 0
    finally:
        g1.close()
        g0.close()


def _external_group(port: int, rank: int, world_size: int, secret: bytes, name: str,
                    timeout: float) -> StatelessProcessGroup:
    return StatelessProcessGroup(rank, world_size, _store_client(port), name=name,
                                 timeout=timeout, secret=secret)


def _external_store(port: int) -> Any:
    import datetime

    return dist.TCPStore(HOST, port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_a_replay_verified_by_every_other_rank_is_reported_on_every_rank(
        world_size: int) -> None:
    """Incarnation 1 ran to the end (its session keys are gone); the attacker recorded its
    record of rank 0 and writes it over incarnation 2's before the other ranks join, so
    every rank but 0 verifies it. Those ranks used to agree among themselves and exchange
    values, and only rank 0 reported the replay (with two ranks, rank 1 only ever got a
    plain CommTimeout). Now they wait for rank 0's confirmation: without it they send
    nothing (CommTimeout naming rank 0, which says the record may have been replayed);
    rank 0 finds the replayed record over its own and the answers to it, and raises
    AuthenticationError naming them; then they raise AuthenticationError at once."""
    port, secret = free_port(), StatelessProcessGroup.generate_secret()
    master = _external_store(port)  # a shared store: a group does not own it
    old = [_external_group(port, r, world_size, secret, "ra", 5.0) for r in range(world_size)]
    recorded = master.get("ra/session")
    got: list[Any] = [None] * world_size

    def bcast(r: int) -> None:  # a broadcast returns once every rank called it
        got[r] = old[r].broadcast_obj("incarnation 1" if r == 0 else None, src=0)

    callers = [threading.Thread(target=bcast, args=(r,)) for r in range(world_size)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(30)
    assert got == ["incarnation 1"] * world_size
    for g in old:
        g.close()
    assert not [k for k in master.list_keys() if k.startswith("ra/session")]  # cleaned up
    new0 = _external_group(port, 0, world_size, secret, "ra", 2.0)
    master.set("ra/session", recorded)  # the replay
    others = [_external_group(port, r, world_size, secret, "ra", 2.0)
              for r in range(1, world_size)]
    try:
        # The ranks that verified the replay cannot talk among themselves (a broadcast
        # from rank 1 used to go out to rank 2): rank 0 has not confirmed anything yet.
        with pytest.raises(CommTimeout) as timeout:
            others[0].broadcast_obj("from rank 1", src=1, timeout=0.5)
        assert list(timeout.value.peers) == [0], timeout.value
        assert "replayed" in str(timeout.value), timeout.value
        t0 = time.monotonic()
        with pytest.raises(AuthenticationError) as err:
            new0.send_obj("incarnation 2", 1)
        assert list(err.value.peers) == list(range(1, world_size)), err.value
        assert "own record 'ra/session' was replaced" in str(err.value), err.value
        assert time.monotonic() - t0 < 1.5  # found in its first wait slice, not at 2 s
        for g in others:
            t0 = time.monotonic()
            with pytest.raises(AuthenticationError, match="earlier incarnation") as err:
                g.recv_obj(0)
            assert list(err.value.peers) == [0], err.value
            assert time.monotonic() - t0 < 1.5  # rank 0 told them: no wait for 2 s
    finally:
        for g in [*others, new0]:
            g.close()


@pytest.mark.timeout(60)
def test_a_leftover_of_an_unfinished_incarnation_does_not_disturb_the_next() -> None:
    """On a shared store, incarnation 1 of a group of three stops before rank 2 made a
    call, so its session keys stay. Incarnation 2 (the same secret, name and size) used
    to count on from incarnation 1's ``session/done``: its first rank to agree deleted
    every session record, and the others failed with CommTimeout naming ranks that had
    joined. Now each incarnation counts under keys of its own rank-0 nonce, and the last
    rank of incarnation 2 to agree deletes incarnation 2's keys only."""
    port, secret = free_port(), StatelessProcessGroup.generate_secret()
    master = _external_store(port)
    a = [_external_group(port, r, 3, secret, "sd", 2.0) for r in range(3)]
    first = master.get("sd/session")[:16].hex()
    a[0].send_obj("x", 1)
    assert a[1].recv_obj(0) == "x"  # rank 2 never calls
    for g in a:
        g.close()
    b = [_external_group(port, r, 3, secret, "sd", 2.0) for r in range(3)]
    try:
        b[0].send_obj("y", 1)
        assert b[1].recv_obj(0) == "y"
        b[2].send_obj("z", 0)
        assert b[0].recv_obj(2) == "z"
        left = [k for k in master.list_keys() if k.startswith("sd/session")]
        assert left and all(k.startswith(f"sd/session/{first}/") for k in left), left
    finally:
        for g in b:
            g.close()

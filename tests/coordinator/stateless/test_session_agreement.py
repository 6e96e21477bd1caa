"""SessionAgreement and RetryDelay on their own, over a real TCPStore.

Each rank's agreement gets its own store client and plain store calls (what the
group's bounded calls do when the store answers); the group-level attacks run in
test_stateless_replay.py and test_stateless_security.py. Where a rank other than 0
agrees, rank 0 agrees first (or in a thread): a rank other than 0 waits for rank 0's
confirmation.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import struct
import threading
import time
from typing import Any

import pytest
import torch.distributed as dist

from coordinator.errors import AuthenticationError, CommTimeout
from coordinator.stateless.retry_delay import RetryDelay
from coordinator.stateless.session_agreement import SessionAgreement, session_of
from coordinator.stateless.store_sealing import Sealer, session_tag

HOST = "127.0.0.1"
NAME = "g"
SECRET = bytes(range(32))


def _client(port: int) -> Any:
    return dist.TCPStore(HOST, port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


@pytest.fixture
def server() -> Any:
    store = dist.TCPStore(HOST, 0, None, True, datetime.timedelta(seconds=10),
                          wait_for_workers=False)
    yield store
    del store


def _agreement(port: int, rank: int, world_size: int) -> SessionAgreement:
    """Rank ``rank``'s agreement over a store client of its own."""
    store = _client(port)

    def call(method: str, *args: Any, op: str, deadline: tuple[float, float] | None = None) -> Any:
        return getattr(store, method)(*args)

    return SessionAgreement(NAME, rank, world_size, port, label=f"rank {rank}", call=call)


def _deadline(seconds: float) -> tuple[float, float]:
    return time.monotonic() + seconds, seconds


def _answer(port: int, key: str, world_size: int, nonce: bytes, rank0_nonce: bytes) -> bytes:
    """A record under ``key`` answering ``rank0_nonce``, as a secret holder writes it."""
    payload = nonce + rank0_nonce
    return payload + session_tag(SECRET, NAME, key, payload, port, world_size)


def test_the_session_is_the_documented_hash_of_every_nonce() -> None:
    nonces = [os.urandom(16) for _ in range(3)]
    expected = hashlib.sha256(b"groupcoord stateless-group session v2" + struct.pack("<I", 3)
                              + b"".join(nonces)).digest()
    assert session_of(nonces) == expected
    for i in range(3):  # every rank's nonce counts
        changed = list(nonces)
        changed[i] = os.urandom(16)
        assert session_of(changed) != expected
    assert session_of(nonces[:2]) != session_of(nonces[:2] + [b""])


def test_every_rank_contributes_and_the_ranks_agree(server: Any) -> None:
    """Three ranks join one after another (rank 0 first: the others wait for its
    record), then agree (rank 0 first: the others wait for its confirmation): their
    sealers are the one of the session of the three nonces in the records, and the
    last to agree deleted every session key."""
    port = server.port
    ranks = [_agreement(port, r, 3) for r in range(3)]
    for a in ranks:
        a.join(lambda: SECRET, 5.0)
    records = [server.get(a.record_key(r)) for r, a in enumerate(ranks)]
    sealers = [a.agree(_deadline(5.0), "test") for a in ranks]
    nonces = [rec[:16] for rec in records]
    assert all(rec[16:32] == nonces[0] for rec in records[1:])  # each answers rank 0's nonce
    reference = Sealer(NAME, SECRET, session_of(nonces), port=port, world_size=3)
    sealed = sealers[1].seal("g/k", b"hello")
    assert [s.open("g/k", sealed) for s in (sealers[0], sealers[2], reference)] == [b"hello"] * 3
    stale = Sealer(NAME, SECRET, session_of([nonces[0], os.urandom(16), nonces[2]]), port=port,
                   world_size=3)
    with pytest.raises(AuthenticationError):
        stale.open("g/k", sealed)  # one nonce other: another session
    assert all(a.rejected == 0 for a in ranks)
    assert server.num_keys() == 0


def test_world_size_one_writes_nothing(server: Any) -> None:
    calls: list[str] = []

    def call(method: str, *args: Any, op: str, deadline: tuple[float, float] | None = None) -> Any:
        calls.append(method)
        return getattr(server, method)(*args)

    a = SessionAgreement(NAME, 0, 1, server.port, label="rank 0", call=call)
    a.join(lambda: SECRET, 5.0)
    sealer = a.agree(_deadline(1.0), "test")
    assert sealer.open("g/k", sealer.seal("g/k", b"x")) == b"x"
    assert calls == [] and server.num_keys() == 0  # no store access at all


def test_a_planted_answer_is_refused_until_the_ranks_own_replaces_it(server: Any) -> None:
    """A record of rank 1 answering another rank-0 nonce (an earlier incarnation's) is
    in the store before rank 1 joins: rank 0 refuses it, and accepts rank 1's own
    record once rank 1 joins."""
    port = server.port
    r0, r1 = _agreement(port, 0, 2), _agreement(port, 1, 2)
    r0.join(lambda: SECRET, 5.0)
    server.set(r0.record_key(1), _answer(port, r0.record_key(1), 2, os.urandom(16),
                                         os.urandom(16)))
    got: dict[str, Any] = {}
    agree = threading.Thread(target=lambda: got.update(s=r0.agree(_deadline(10.0), "test")))
    agree.start()
    time.sleep(0.3)
    r1.join(lambda: SECRET, 5.0)
    agree.join(15)
    sealer1 = r1.agree(_deadline(5.0), "test")
    assert got["s"].open("g/k", sealer1.seal("g/k", b"ok")) == b"ok"
    assert r0.rejected >= 1


@pytest.mark.parametrize("planted", ["stale", "forged"])
def test_a_refused_answer_is_named_at_the_deadline(server: Any, planted: str) -> None:
    port = server.port
    r0 = _agreement(port, 0, 2)
    r0.join(lambda: SECRET, 5.0)
    key = r0.record_key(1)
    record = (_answer(port, key, 2, os.urandom(16), os.urandom(16)) if planted == "stale"
              else os.urandom(64))
    server.set(key, record)
    t0 = time.monotonic()
    with pytest.raises(AuthenticationError) as err:
        r0.agree(_deadline(0.5), "send_obj")
    assert time.monotonic() - t0 < 5.0
    msg = str(err.value)
    assert f"'{key}' (the answer of rank(s) [1])" in msg, msg
    assert ("answer(s) a nonce of rank 0 that is not this rank's" if planted == "stale"
            else "failed authentication") in msg, msg
    assert list(err.value.peers) == [1] and err.value.rejected >= 1


def test_a_rank_that_never_joined_is_a_comm_timeout(server: Any) -> None:
    r0 = _agreement(server.port, 0, 3)
    r0.join(lambda: SECRET, 5.0)
    _agreement(server.port, 1, 3).join(lambda: SECRET, 5.0)
    with pytest.raises(CommTimeout) as err:
        r0.agree(_deadline(0.3), "test")
    assert list(err.value.peers) == [2], err.value


def test_a_wrong_secret_fails_when_joining(server: Any) -> None:
    _agreement(server.port, 0, 2).join(lambda: SECRET, 5.0)
    with pytest.raises(AuthenticationError, match="failed authentication"):
        _agreement(server.port, 1, 2).join(lambda: bytes(32), 0.3)


def _in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``fn()`` in a thread; the dict gets its result (``"ok"``) or error (``"err"``)
    and when it ended (``"t"``)."""
    got: dict[str, Any] = {}

    def run() -> None:
        try:
            got["ok"] = fn()
        except Exception as e:  # handed to the test
            got["err"] = e
        got["t"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, got


def test_a_rank_other_than_0_waits_for_rank_0s_confirmation(server: Any) -> None:
    """Rank 1 agrees only once rank 0 confirmed the session: before rank 0's first call
    it raises CommTimeout naming rank 0; a call in progress returns once rank 0 agreed.
    The confirmation lists every nonce, under this incarnation's keys."""
    port = server.port
    r0, r1 = _agreement(port, 0, 2), _agreement(port, 1, 2)
    r0.join(lambda: SECRET, 5.0)
    r1.join(lambda: SECRET, 5.0)
    with pytest.raises(CommTimeout, match="rank 0 did not confirm") as err:
        r1.agree(_deadline(0.3), "recv_obj")
    assert list(err.value.peers) == [0]
    waiting, got = _in_thread(lambda: r1.agree(_deadline(10.0), "recv_obj"))
    time.sleep(0.2)
    assert "ok" not in got and "err" not in got  # still waiting for rank 0
    assert r0.confirm_key() == f"g/session/{server.get('g/session')[:16].hex()}/confirm"
    sealer0 = r0.agree(_deadline(5.0), "send_obj")
    waiting.join(10)
    assert got["ok"].open("g/k", sealer0.seal("g/k", b"hi")) == b"hi"
    assert server.num_keys() == 0  # the last to agree deleted every session key


def _recorded_rank0_record(port: int, world_size: int) -> bytes:
    """The record of rank 0 of an earlier incarnation that ran to the end (its keys gone)."""
    old = _agreement(port, 0, world_size)
    old.join(lambda: SECRET, 5.0)
    store = _client(port)
    record = bytes(store.get("g/session"))
    store.delete_key("g/session")
    store.delete_key("g/session/writes")
    return record


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_replayed_rank0_record_is_reported_on_every_rank(server: Any, world_size: int) -> None:
    """Every rank but 0 verified a replayed record of rank 0, and waits for rank 0's
    confirmation: rank 0 finds the replayed record over its own and tells them (a
    refusal where they wait), and everyone raises AuthenticationError at once, also in
    every later call."""
    port = server.port
    recorded = _recorded_rank0_record(port, world_size)
    r0 = _agreement(port, 0, world_size)
    r0.join(lambda: SECRET, 5.0)
    server.set("g/session", recorded)
    others = [_agreement(port, r, world_size) for r in range(1, world_size)]
    for a in others:
        a.join(lambda: SECRET, 5.0)
    waiting = [_in_thread(lambda a=a: a.agree(_deadline(10.0), "recv_obj")) for a in others]
    time.sleep(0.1)
    t0 = time.monotonic()
    with pytest.raises(AuthenticationError, match="own record 'g/session' was replaced") as err:
        r0.agree(_deadline(10.0), "send_obj")
    assert list(err.value.peers) == list(range(1, world_size))
    assert server.get("g/session") != recorded  # rank 0 wrote its own back
    for thread, got in waiting:
        thread.join(10)
        assert isinstance(got.get("err"), AuthenticationError), got
        assert "found it over its own record and refused it" in str(got["err"])
        assert got["t"] - t0 < 3.0  # told at once, not at their deadline
    with pytest.raises(AuthenticationError, match="own record"):  # the next call: at once
        r0.agree(_deadline(10.0), "send_obj")
    with pytest.raises(AuthenticationError, match="earlier incarnation"):
        others[0].agree(_deadline(10.0), "recv_obj")


def test_a_leftover_rank0_record_read_before_rank_0_wrote_its_own(server: Any) -> None:
    """A shared store holds the record of rank 0 of an incarnation that never finished
    its set-up; rank 1 is constructed before rank 0 and verifies it. Rank 0 finds it when
    it joins and leaves a refusal where rank 1 waits: rank 1's first call raises
    AuthenticationError at once, and rank 0's names rank 1."""
    port = server.port
    _agreement(port, 0, 2).join(lambda: SECRET, 5.0)  # the unfinished incarnation's rank 0
    r1 = _agreement(port, 1, 2)
    r1.join(lambda: SECRET, 5.0)
    r0 = _agreement(port, 0, 2)
    r0.join(lambda: SECRET, 5.0)
    t0 = time.monotonic()
    with pytest.raises(AuthenticationError, match="left in a shared store") as err:
        r1.agree(_deadline(5.0), "recv_obj")
    assert time.monotonic() - t0 < 2.0 and list(err.value.peers) == [0]
    with pytest.raises(AuthenticationError) as err:
        r0.agree(_deadline(5.0), "send_obj")
    assert list(err.value.peers) == [1], err.value


def test_a_replayed_confirmation_lists_other_nonces(server: Any) -> None:
    """Rank 1 verified a replayed record of rank 0, and the attacker also planted that
    incarnation's confirmation where rank 1 waits: it lists another nonce of rank 1, so
    rank 1 raises AuthenticationError at once instead of agreeing on it."""
    port = server.port
    o0, o1 = _agreement(port, 0, 2), _agreement(port, 1, 2)
    o0.join(lambda: SECRET, 5.0)
    o1.join(lambda: SECRET, 5.0)
    recorded = server.get("g/session")
    o0.agree(_deadline(5.0), "send_obj")
    confirmation = server.get(o0.confirm_key())
    for key in (o0.confirm_key(), o0.record_key(1), o0.writes_key, o0.done_key, "g/session",
                "g/session/writes"):
        server.delete_key(key)
    r0 = _agreement(port, 0, 2)
    r0.join(lambda: SECRET, 5.0)
    server.set("g/session", recorded)
    r1 = _agreement(port, 1, 2)
    r1.join(lambda: SECRET, 5.0)
    server.set(r1.confirm_key(), confirmation)
    t0 = time.monotonic()
    with pytest.raises(AuthenticationError, match="lists another nonce of this rank"):
        r1.agree(_deadline(5.0), "recv_obj")
    assert time.monotonic() - t0 < 2.0


def test_a_forged_confirmation_is_refused_until_rank_0s_own_arrives(server: Any) -> None:
    """Garbage planted where rank 1 waits for the confirmation is refused (not fatal):
    rank 1 reads it again once rank 0 counted itself done, and agrees."""
    port = server.port
    r0, r1 = _agreement(port, 0, 2), _agreement(port, 1, 2)
    r0.join(lambda: SECRET, 5.0)
    r1.join(lambda: SECRET, 5.0)
    server.set(r1.confirm_key(), os.urandom(65))
    waiting, got = _in_thread(lambda: r1.agree(_deadline(10.0), "recv_obj"))
    time.sleep(0.2)
    sealer0 = r0.agree(_deadline(5.0), "send_obj")
    waiting.join(10)
    assert got["ok"].open("g/k", sealer0.seal("g/k", b"hi")) == b"hi"
    assert r1.rejected >= 1


def test_retry_delay_doubles_to_its_cap_and_stops_at_the_deadline() -> None:
    t0 = time.monotonic()
    delay = RetryDelay(t0 + 0.4, first=0.01, most=0.08)
    sleeps = 0
    while delay.sleep():
        sleeps += 1
    elapsed = time.monotonic() - t0
    # 10, 20, 40, 80, 80, 80, 80 ms (390 ms), then the last 10 ms: 8 sleeps at most
    # (fewer on a busy machine, where sleeps overrun)
    assert 1 <= sleeps <= 8, sleeps
    assert elapsed >= 0.4
    assert not delay.sleep()  # past the deadline: no sleep at all


def test_retry_delay_next_gives_the_delays_without_sleeping() -> None:
    t0 = time.monotonic()
    delay = RetryDelay(t0 + 10.0, first=0.05, most=0.5)
    steps = [delay.next() for _ in range(6)]
    assert time.monotonic() - t0 < 1.0  # no sleep
    assert steps == [0.05, 0.1, 0.2, 0.4, 0.5, 0.5]
    assert RetryDelay(t0 - 1.0).next() is None  # past the deadline

"""PeerBudgets alone (shm_broadcast.queue.inbound_limits), and the ZAP handler's
connections per key (shm_broadcast.queue.transport.ReaderAuthenticator)."""

from __future__ import annotations

import zmq

from shm_broadcast.queue.inbound_limits import BAD_FRAMES_PER_PEER, PeerBudgets
from shm_broadcast.queue.transport import ZAP_DOMAIN, ZAP_DOMAIN_DATA, ReaderAuthenticator


def test_a_key_beyond_its_subscriptions_is_cut_off_and_the_rest_dropped() -> None:
    b = PeerBudgets(3)
    assert [b.take_subscription("R1") for _ in range(3)] == [True] * 3
    assert b.take_subscription("R2")  # each key its own budget
    assert not b.cut_off and b.subscriptions_dropped == 0
    assert not b.take_subscription("R1")
    assert not b.take_subscription("R1")
    assert b.cut_off == {"R1": "sent more than 3 subscriptions"}
    assert b.subscriptions_dropped == 2
    b.drop_subscription()  # not the queue's topic: counted, no cut-off
    assert b.subscriptions_dropped == 3 and list(b.cut_off) == ["R1"]


def test_a_connection_beyond_its_invalid_frames_is_muted() -> None:
    b = PeerBudgets(8)
    for _ in range(BAD_FRAMES_PER_PEER):
        assert not b.muted(b"X")
        b.refuse(b"X")
    assert b.muted(b"X") and b.muted(b"X")
    assert not b.muted(b"R1")  # another connection is unaffected
    assert b.bad_control == BAD_FRAMES_PER_PEER and b.control_dropped == 2


def test_zap_admits_a_key_a_bounded_number_of_times_per_domain() -> None:
    ctx = zmq.Context()
    auth = ReaderAuthenticator(ctx, {b"k" * 40: "R1"}, connections=2)
    try:
        assert auth.callback(ZAP_DOMAIN, b"k" * 40) and auth.callback(ZAP_DOMAIN, b"k" * 40)
        assert not auth.callback(ZAP_DOMAIN, b"k" * 40)
        assert auth.callback(ZAP_DOMAIN_DATA, b"k" * 40)  # counted per socket
        assert not auth.callback(ZAP_DOMAIN, b"u" * 40)
        auth.admit(b"u" * 40, "R2")
        assert auth.callback(ZAP_DOMAIN, b"u" * 40)
        assert (auth.denied, auth.over_limit) == (1, 1)
    finally:
        auth.stop()
        ctx.term()


def test_a_key_can_be_cut_off_for_another_reason_and_the_first_reason_stays() -> None:
    b = PeerBudgets(2)
    b.cut("R3", "sent a message of more parts than a reader's")
    assert b.take_subscription("R4")  # another key is untouched
    b.take_subscription("R3")
    b.take_subscription("R3")
    b.take_subscription("R3")  # beyond the budget too: the first reason stays
    assert b.cut_off == {"R3": "sent a message of more parts than a reader's"}

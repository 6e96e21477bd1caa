"""WriterControl alone: a real ring, real ipc sockets, a local reader's frames
(shm_broadcast.queue.writer_control)."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import psutil
import pytest
import zmq

from shm_broadcast.queue.ring_buffer import ShmRingBuffer
from shm_broadcast.queue.transport import (
    ACK,
    CTL_ACK,
    CTL_CLOSED,
    CTL_HELLO,
    TOPIC_OVERFLOW,
    bind,
    close_all,
    new_socket,
)
from shm_broadcast.queue.writer_control import WriterControl
from shm_broadcast.waiting.peer_watch import own_pid_space


@pytest.fixture
def channel() -> Iterator[dict[str, Any]]:
    """A one-slot ring with this process registered in slot 0, the writer's XPUB
    and ROUTER on ipc, and a reader's SUB and DEALER (routing id ``L0``)."""
    ctime = psutil.Process(os.getpid()).create_time()
    ring = ShmRingBuffer.create(1, 4096, 2)
    ring.register_reader(0, os.getpid(), ctime)
    ctx = zmq.Context(io_threads=1)
    socks: list[zmq.Socket] = []
    with tempfile.TemporaryDirectory(prefix="wctl") as d:
        try:
            pub = new_socket(ctx, zmq.XPUB)
            pub.setsockopt(zmq.XPUB_VERBOSER, 1)
            ctl = new_socket(ctx, zmq.ROUTER)
            sub = new_socket(ctx, zmq.SUB)
            dealer = new_socket(ctx, zmq.DEALER)
            socks += [pub, ctl, sub, dealer]
            sub.connect(bind(pub, f"ipc://{d}/p"))
            dealer.setsockopt(zmq.ROUTING_ID, b"L0")
            dealer.connect(bind(ctl, f"ipc://{d}/c"))
            control = WriterControl(local_ranks=(3,), n_remote=0, per_reader_keys=True, ring=ring,
                                    pub=pub, ctl=ctl, mon=None, monitors=None, auth=None)
            yield {"control": control, "sub": sub, "dealer": dealer, "ctime": ctime}
        finally:
            close_all(*socks)
            ctx.term()
            ring.close()


def _hello(rank: int, pid: int, ctime: float) -> bytes:
    return CTL_HELLO + msgspec.msgpack.encode(
        [rank, pid, ctime, socket.gethostname(), own_pid_space()])


def _settle(control: WriterControl, sent: int, until: Any) -> None:
    """Drain until ``until()`` holds (frames cross the ipc sockets asynchronously)."""
    end = time.monotonic() + 10
    while True:
        control.drain_subscriptions()
        control.drain(sent)
        if until() or time.monotonic() > end:
            return
        time.sleep(0.01)


def test_a_local_reader_is_missing_until_its_hello_and_subscription(channel: dict) -> None:
    control: WriterControl = channel["control"]
    assert control.missing_readers() == ["local reader rank 3"]
    channel["dealer"].send(_hello(3, os.getpid(), channel["ctime"]))
    _settle(control, 0, lambda: "local reader rank 3" not in control.missing_readers())
    assert control.missing_readers() == ["subscriptions still in flight"]
    channel["sub"].subscribe(TOPIC_OVERFLOW)
    _settle(control, 0, lambda: not control.missing_readers())
    assert control.missing_readers() == []
    assert control.security_stats(True, 0)["bad_control"] == 0


def test_forged_and_out_of_place_frames_are_counted_not_applied(channel: dict) -> None:
    control: WriterControl = channel["control"]
    dealer = channel["dealer"]
    dealer.send(_hello(3, os.getpid() + 1, channel["ctime"]))  # not the registered process
    dealer.send(_hello(4, os.getpid(), channel["ctime"]))  # not the slot's rank
    dealer.send(b"h\xff\x00")  # not a hello at all
    dealer.send(CTL_ACK + ACK.pack(1))  # acks are for remote readers
    dealer.send(b"?")  # no such kind
    _settle(control, 0, lambda: control.security_stats(False, 0)["bad_control"] >= 5)
    assert control.security_stats(False, 0)["bad_control"] == 5
    assert control.missing_readers() == ["local reader rank 3"]
    # The real hello still counts, once; its goodbye is recorded.
    dealer.send(_hello(3, os.getpid(), channel["ctime"]))
    dealer.send(_hello(3, os.getpid(), channel["ctime"]))  # a second hello: refused
    dealer.send(CTL_CLOSED)
    _settle(control, 0, lambda: 3 in control.said_goodbye)
    assert control.said_goodbye == {3}
    assert control.security_stats(False, 0)["bad_control"] == 6


def test_a_message_of_more_parts_is_dropped_part_by_part_within_the_budget(
        channel: dict) -> None:
    """A local peer's control message of many parts counts as one invalid frame;
    its parts are dropped at most DRAIN_FRAMES per drain, never built into one
    list, and the frames after it are read as usual."""
    from shm_broadcast.queue.inbound_limits import DRAIN_FRAMES

    control: WriterControl = channel["control"]
    dealer = channel["dealer"]
    parts = 3 * DRAIN_FRAMES
    dealer.send_multipart([b"x"] * parts)
    dealer.send(_hello(3, os.getpid(), channel["ctime"]))
    end = time.monotonic() + 10
    while control.security_stats(False, 0)["bad_control"] == 0:
        assert time.monotonic() < end, "the long message never came in"
        control.drain(0)
        time.sleep(0.01)
    assert "local reader rank 3" in control.missing_readers()  # parts still being dropped
    drains = 1
    while "local reader rank 3" in control.missing_readers():
        assert drains <= parts // DRAIN_FRAMES + 2, drains
        control.drain(0)
        drains += 1
    assert drains >= parts // DRAIN_FRAMES  # bounded work per drain
    assert control.security_stats(False, 0)["bad_control"] == 1

"""Frames whose sizes disagree with their header: readers raise DecodeError, never
``struct.error``/``IndexError``, and read on.

The writer's own sockets and ring play a writer that is buggy or hostile (it
holds the queue's keys, so nothing else can reach a reader): a remote reader's
data arrives on the CURVE-sealed TCP PUB socket, an overflow payload of a
shared-memory reader on the writer's owner-only IPC socket, announced by a
chunk in the ring.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from shm_broadcast import MessageQueue
from shm_broadcast.errors import DecodeError
from shm_broadcast.queue.transport import (
    KIND_DATA,
    KIND_OVERFLOW,
    TOPIC_OVERFLOW,
    TOPIC_REMOTE,
    WIRE,
)

pytestmark = pytest.mark.timeout(60)


def _connected(local: bool) -> tuple[MessageQueue, MessageQueue]:
    if local:
        w = MessageQueue(1, 1, [1], name="malformed-local", max_chunk_bytes=4096, max_chunks=2)
    else:
        w = MessageQueue(1, 0, [], connect_ip="127.0.0.1", name="malformed-remote")
    r = MessageQueue.create_from_handle(w.export_handle(1), 1)
    t = threading.Thread(target=w.wait_until_ready, args=(30,))
    t.start()
    r.wait_until_ready(30)
    t.join()
    return w, r


#: Remote frames by case: ``seq`` is the next message's number.
_REMOTE: dict[str, Callable[[int], list[bytes]]] = {
    "topic-only": lambda seq: [TOPIC_REMOTE],
    "short-header": lambda seq: [TOPIC_REMOTE + b"\x01" * (WIRE.size - 3)],
    "msgpack-longer-than-frame": lambda seq: [
        TOPIC_REMOTE + WIRE.pack(seq, KIND_DATA, 10**9, 0) + b"\x90"],
    "arrays-longer-than-frame": lambda seq: [
        TOPIC_REMOTE + WIRE.pack(seq, KIND_DATA, 1, 10**12) + b"\x90"],
    "trailing-bytes": lambda seq: [TOPIC_REMOTE + WIRE.pack(seq, KIND_DATA, 1, 0) + b"\x90xx"],
    "second-frame-of-wrong-size": lambda seq: [
        TOPIC_REMOTE + WIRE.pack(seq, KIND_DATA, 1, 64) + b"\x90", b"\x00" * 8],
    "three-frames": lambda seq: [
        TOPIC_REMOTE + WIRE.pack(seq, KIND_DATA, 1, 0) + b"\x90", b"", b""],
}

#: Overflow payloads by case, announced by a chunk saying 1 msgpack byte, 0 array bytes.
_OVERFLOW: dict[str, Callable[[int], list[bytes]]] = {
    "one-frame": lambda seq: [TOPIC_OVERFLOW + WIRE.pack(seq, KIND_DATA, 1, 0) + b"\x90"],
    "short-header": lambda seq: [TOPIC_OVERFLOW + b"\x00" * 4, b""],
    "msgpack-of-other-size": lambda seq: [
        TOPIC_OVERFLOW + WIRE.pack(seq, KIND_DATA, 1, 0) + b"\x90\x90", b""],
    "arrays-of-other-size": lambda seq: [
        TOPIC_OVERFLOW + WIRE.pack(seq, KIND_DATA, 1, 0) + b"\x90", b"\x00" * 64],
}


def _send_remote(w: MessageQueue, frames: list[bytes]) -> None:
    w._writer._remote.pub.send_multipart(frames)  # the writer plays the attacker


def _send_overflow(w: MessageQueue, frames: list[bytes]) -> None:
    """Publish an overflow chunk (1 msgpack byte, no arrays) whose payload is ``frames``."""
    wr: Any = w._writer  # the writer plays the attacker
    ring, seq = wr.ring, wr._seq
    chunk = seq % wr.max_chunks
    wr._sockets().pub.send_multipart(frames)
    ring.begin_write(chunk)
    WIRE.pack_into(ring.buf, ring.data_offset(chunk), seq, KIND_OVERFLOW, 1, 0)
    ring.publish(chunk)
    ring.full_fence()
    wr._seq = seq + 1


@pytest.mark.parametrize("case", sorted(_REMOTE))
def test_a_remote_reader_refuses_frames_that_disagree_with_their_header(case: str) -> None:
    w, r = _connected(local=False)
    try:
        w.enqueue({"honest": 1})
        assert r.dequeue(timeout=10) == {"honest": 1}
        _send_remote(w, _REMOTE[case](1))
        with pytest.raises(DecodeError, match="malformed message from the writer") as e:
            r.dequeue(timeout=10)
        assert len(e.value.peers) == 1  # the writer, named
    finally:
        r.close()
        w.close()


@pytest.mark.parametrize("case", sorted(_OVERFLOW))
def test_a_local_reader_refuses_an_overflow_payload_that_disagrees_with_its_chunk(
        case: str) -> None:
    w, r = _connected(local=True)
    try:
        _send_overflow(w, _OVERFLOW[case](0))
        with pytest.raises(DecodeError, match="malformed payload for overflow message #0"):
            r.dequeue(timeout=10)
        w.enqueue({"honest": 2})  # the refused chunk was released: the queue goes on
        assert r.dequeue(timeout=10) == {"honest": 2}
    finally:
        r.close()
        w.close()

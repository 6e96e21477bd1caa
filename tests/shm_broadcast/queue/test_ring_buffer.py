"""ShmRingBuffer: the flag protocol, walked through state by state."""

from __future__ import annotations

import os
import stat

import pytest

from shm_broadcast import SegmentError, SharedSegment, ShmRingBuffer
from shm_broadcast.lifecycle.segment import SHM_DIR
from shm_broadcast.queue.ring_buffer import (
    CHUNK_HEADER,
    READER_ATTACHED,
    READER_CLOSED,
    READER_EMPTY,
)


@pytest.mark.timeout(30)
def test_chunk_state_machine_two_readers():
    with_ring = ShmRingBuffer.create(2, 256, 2)
    try:
        reader = ShmRingBuffer.attach(with_ring.name)
        try:
            w, r = with_ring, reader
            # Initially every chunk is FREE (never written) and nothing is readable.
            assert w.is_free(0) and w.is_free(1)
            assert not r.is_readable(0, 0) and not r.is_readable(0, 1)
            # WRITING: W cleared; still unreadable.
            w.begin_write(0)
            w.buf[w.data_offset(0)] = 42
            assert not r.is_readable(0, 0)
            # PUBLISHED: readable by both, no longer free, both lagging.
            w.publish(0)
            assert r.is_readable(0, 0) and r.is_readable(0, 1)
            assert not w.is_free(0)
            assert w.lagging_readers(0) == [0, 1]
            assert r.buf[r.data_offset(0)] == 42
            # PARTIALLY READ: reader 0 done, reader 1 still lagging.
            r.mark_read(0, 0)
            assert not r.is_readable(0, 0) and r.is_readable(0, 1)
            assert not w.is_free(0) and w.lagging_readers(0) == [1]
            # Every reader done: FREE again for the next round.
            r.mark_read(0, 1)
            assert w.is_free(0) and w.lagging_readers(0) == []
            # Next round on the same chunk: W := 0 hides it from readers again.
            w.begin_write(0)
            assert not r.is_readable(0, 0) and not r.is_readable(0, 1)
            w.publish(0)
            assert r.is_readable(0, 0)
            # Chunks are independent.
            assert w.is_free(1) and not r.is_readable(1, 0)
        finally:
            reader.close()
    finally:
        with_ring.close()


@pytest.mark.timeout(30)
def test_header_fields_and_reader_table():
    ring = ShmRingBuffer.create(3, 1024, 4)
    try:
        assert (ring.n_reader, ring.max_chunks, ring.max_chunk_bytes) == (3, 4, 1024)
        other = ShmRingBuffer.attach(ring.name)
        try:
            assert (other.n_reader, other.max_chunks, other.max_chunk_bytes) == (3, 4, 1024)
            ring.set_writer(1234, 5.5)
            assert other.writer_identity() == (1234, 5.5)
            assert not other.is_ready() and not other.is_shutdown()
            ring.set_ready()
            ring.set_shutdown()
            assert other.is_ready() and other.is_shutdown()
            assert other.reader_state(1) == READER_EMPTY
            other.register_reader(1, os.getpid(), 7.25)
            assert ring.reader_state(1) == READER_ATTACHED
            assert ring.reader_identity(1) == (os.getpid(), 7.25)
            with pytest.raises(SegmentError, match="already taken"):
                other.register_reader(1, 1, 1.0)
            with pytest.raises(ValueError, match="reader index"):
                other.register_reader(3, 1, 1.0)
            other.set_reader_state(1, READER_CLOSED)
            assert ring.reader_state(1) == READER_CLOSED
            assert ring.take_parked_readers() == []
            other.set_reader_parked(2, True)
            ring.full_fence()
            lo, hi = ring.parked_span()
            assert ring.buf[lo:hi] == b"\x00\x00\x01"
            assert ring.take_parked_readers() == [2]  # taken: cleared for the next ring
            assert ring.take_parked_readers() == [] and ring.buf[lo:hi] == bytes(3)
            assert not ring.take_writer_parked()
            other.set_writer_parked(True)
            assert ring.take_writer_parked() and not ring.take_writer_parked()
            # Chunk data regions are disjoint, aligned and large enough.
            offs = [ring.data_offset(c) for c in range(4)]
            assert all(o % 64 == 0 for o in offs)
            assert all(b - a >= 1024 for a, b in zip(offs, offs[1:], strict=False))
        finally:
            other.close()
    finally:
        ring.close()


@pytest.mark.timeout(30)
def test_segment_is_private_named_and_owned():
    ring = ShmRingBuffer.create(1, 4096, 2)
    path = os.path.join(SHM_DIR, ring.name)
    try:
        assert ring.name.startswith(f"gc_mq_{os.getpid()}_")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        reader = ShmRingBuffer.attach(ring.name)
        reader.close()
        assert os.path.exists(path), "a reader must never unlink"
    finally:
        ring.close()
    assert not os.path.exists(path), "the owner unlinks on close"


@pytest.mark.timeout(30)
def test_bad_arguments_and_foreign_segments():
    with pytest.raises(ValueError, match="n_reader"):
        ShmRingBuffer.create(0, 4096, 2)
    with pytest.raises(ValueError, match="max_chunk_bytes"):
        ShmRingBuffer.create(1, CHUNK_HEADER, 2)
    with pytest.raises(ValueError, match="max_chunks"):
        ShmRingBuffer.create(1, 4096, 0)
    with pytest.raises(SegmentError, match="does not exist"):
        ShmRingBuffer.attach("gc_mq_1_deadbeef")
    with SharedSegment.create("test", 4096) as seg, \
            pytest.raises(SegmentError, match="bad magic"):
        ShmRingBuffer.attach(seg.name)

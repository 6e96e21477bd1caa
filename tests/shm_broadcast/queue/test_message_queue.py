"""MessageQueue behaviour that one process can exercise (writer and readers as objects).

Readers created in the test process are real readers: same ring, same sockets,
same protocol as in another process; only the scheduling is simpler.
"""

from __future__ import annotations

import pickle
import threading
import time

import msgspec
import pytest
import torch

from shm_broadcast import (
    Handle,
    MessageQueue,
    QueueClosedError,
    QueueRoleError,
    QueueTimeout,
    SegmentError,
    WaitPolicy,
)
from tests.child_env import ROOT as REPO_ROOT


def make_queue(n_local: int, n_remote: int = 0, **kw):
    """Writer plus readers (local ranks 1..n_local, remote after), all connected."""
    local = list(range(1, n_local + 1))
    remote = list(range(n_local + 1, n_local + n_remote + 1))
    w = MessageQueue(n_local + n_remote, n_local, local,
                     connect_ip="127.0.0.1" if n_remote else None, **kw)
    readers = []
    try:
        readers = [MessageQueue.create_from_handle(w.export_handle(r), r) for r in local + remote]
        w.wait_until_ready(30)
        for r in readers:
            r.wait_until_ready(30)
    except BaseException:
        for q in [w, *readers]:
            q.close()
        raise
    return w, readers


@pytest.fixture
def queues(request):
    made = []

    def make(*args, **kw):
        w, readers = make_queue(*args, **kw)
        made.extend([w, *readers])
        return w, readers

    yield make
    for q in reversed(made):
        q.close()


@pytest.mark.timeout(60)
def test_local_and_remote_readers_get_everything_in_order(queues):
    w, readers = queues(2, 1, max_chunk_bytes=4096, max_chunks=3, name="order")
    msgs = [{"i": i, "pad": "x" * (i * 97 % 9000)} for i in range(40)]  # some overflow
    for m in msgs:
        w.enqueue(m, timeout=10)
        for r in readers:  # readers keep up, so the 3-chunk ring never blocks
            assert r.dequeue(timeout=10) == m
    assert readers[2].rank == 3 and not readers[2].is_writer


@pytest.mark.timeout(60)
def test_poll_and_non_blocking_dequeue(queues):
    w, (r,) = queues(1, name="poll")
    assert not r.poll()
    t0 = time.monotonic()
    with pytest.raises(QueueTimeout) as info:
        r.dequeue(timeout=0)
    assert time.monotonic() - t0 < 0.1
    assert "'poll'" in str(info.value) and "reader rank 1" in str(info.value)
    assert info.value.queue == "poll" and info.value.side == "reader rank 1"
    w.enqueue("a")
    assert r.poll()
    assert r.dequeue(timeout=0) == "a"
    assert not r.poll()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n_remote", [0, 1], ids=["local", "remote"])
def test_dequeue_timeout_is_bounded(queues, n_remote):
    w, readers = queues(1 - n_remote, n_remote, name="slow")
    r = readers[0]
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:  # QueueTimeout is a TimeoutError
        r.dequeue(timeout=0.3)
    elapsed = time.monotonic() - t0
    assert isinstance(info.value, QueueTimeout)
    assert 0.3 <= elapsed < 0.8, elapsed
    assert "'slow'" in str(info.value) and "message #0" in str(info.value)


@pytest.mark.timeout(60)
def test_enqueue_timeout_names_the_lagging_reader(queues):
    w, (r1, r2) = queues(2, max_chunks=2, name="lag")
    for i in range(2):
        w.enqueue(i)
        assert r1.dequeue(timeout=5) == i  # rank 1 keeps up, rank 2 reads nothing
    t0 = time.monotonic()
    with pytest.raises(QueueTimeout) as info:
        w.enqueue(2, timeout=0.3)
    assert 0.3 <= time.monotonic() - t0 < 0.8
    assert info.value.peers == (2,) and info.value.side == "writer"
    assert "reader rank(s) [2]" in str(info.value) and "'lag'" in str(info.value)
    # Nothing was lost: once rank 2 catches up, the writer proceeds.
    assert [r2.dequeue(timeout=5) for _ in range(2)] == [0, 1]
    w.enqueue(2, timeout=5)
    assert r1.dequeue(timeout=5) == 2 and r2.dequeue(timeout=5) == 2


@pytest.mark.timeout(60)
def test_remote_reader_flow_control_blocks_writer(queues):
    w, (remote,) = queues(0, 1, max_chunks=2, name="credit")
    window = w.export_handle().remote_window
    for i in range(window):
        w.enqueue(i, timeout=5)
    with pytest.raises(QueueTimeout) as info:
        w.enqueue("one too many", timeout=0.3)
    assert info.value.peers == (1,)
    assert [remote.dequeue(timeout=5) for _ in range(window)] == list(range(window))
    w.enqueue("now fits", timeout=5)
    assert remote.dequeue(timeout=5) == "now fits"


def _blocked(fn, out):
    t0 = time.monotonic()
    try:
        out.append(("returned", fn(), time.monotonic() - t0))
    except Exception as e:
        out.append(("raised", e, time.monotonic() - t0))


@pytest.mark.timeout(60)
def test_shutdown_wakes_blocked_callers(queues):
    # A reader blocked in another thread, woken by its own shutdown().
    w, (r1, r2) = queues(2, name="stop")
    out: list = []
    t = threading.Thread(target=_blocked, args=(r1.dequeue, out))
    t.start()
    time.sleep(0.3)  # long enough to park
    r1.shutdown()
    t.join(5)
    assert out and out[0][0] == "raised" and isinstance(out[0][1], QueueClosedError)
    assert out[0][2] < 0.3 + 1.0
    # The writer now fails fast instead of waiting for the departed reader.
    with pytest.raises(QueueClosedError, match="reader rank 1 closed"):
        for i in range(100):
            w.enqueue(i, timeout=5)
    # Writer shutdown: rank 2 drains what was sent, then gets QueueClosedError.
    sent = w.export_handle().max_chunks
    w.shutdown()
    assert [r2.dequeue(timeout=5) for _ in range(sent)] == list(range(sent))
    with pytest.raises(QueueClosedError, match="shut the queue down"):
        r2.dequeue(timeout=5)
    with pytest.raises(QueueClosedError):
        w.enqueue("late")


@pytest.mark.timeout(60)
def test_writer_shutdown_from_another_thread_wakes_blocked_enqueue(queues):
    w, (r,) = queues(1, max_chunks=1, name="full")
    w.enqueue(0)
    out: list = []
    t = threading.Thread(target=_blocked, args=(lambda: w.enqueue(1), out))
    t.start()
    time.sleep(0.3)
    w.shutdown()
    t.join(5)
    assert out and isinstance(out[0][1], QueueClosedError) and out[0][2] < 1.5


@pytest.mark.timeout(60)
def test_close_from_another_thread_while_blocked():
    w, (r,) = make_queue(1, name="close")
    out: list = []
    t = threading.Thread(target=_blocked, args=(r.dequeue, out))
    t.start()
    time.sleep(0.3)
    r.close()  # shuts down, waits for the blocked call to leave, then closes
    t.join(5)
    w.close()
    assert out and isinstance(out[0][1], QueueClosedError)
    assert r.closed and w.closed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("side", ["writer", "reader"])
def test_a_second_thread_in_a_call_is_refused(queues, side):
    """A queue side serves one call at a time: a second thread's enqueue/dequeue
    raises ConcurrentCallError naming the call and leaves the first one and
    the ring as they were."""
    from shm_broadcast import ConcurrentCallError

    w, (r,) = queues(1, max_chunks=1, name=f"two-threads-{side}")
    if side == "writer":
        w.enqueue(0)  # the ring is full: the next enqueue waits for the reader
        first, second = (lambda: w.enqueue(1)), (lambda: w.enqueue(2))
    else:  # nothing to read: the dequeue waits for the writer
        first, second = r.dequeue, r.dequeue
    out: list = []
    t = threading.Thread(target=lambda: out.append(first()))
    t.start()
    time.sleep(0.3)
    op = "enqueue" if side == "writer" else "dequeue"
    with pytest.raises(ConcurrentCallError, match=rf"{op}\(\) was called while another "
                                                  rf"thread is in a call"):
        second()
    if side == "writer":
        assert r.dequeue(timeout=10) == 0  # room: the first enqueue goes on
        t.join(10)
        assert r.dequeue(timeout=10) == 1 and not r.poll()
    else:
        w.enqueue("next")
        t.join(10)
        assert out == ["next"]
    assert not t.is_alive()
    if side == "writer":
        w.enqueue(3)  # the side serves calls again
        assert r.dequeue(timeout=10) == 3
    else:
        w.enqueue(4)
        assert r.dequeue(timeout=10) == 4


@pytest.mark.timeout(60)
def test_lifecycle_handles_and_roles():
    w, (r,) = make_queue(1, name="life")
    with w, r:
        h = w.export_handle()
        assert Handle.from_bytes(h.to_bytes()) == h
        assert pickle.loads(pickle.dumps(h)) == h
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(h), type=Handle) == h
        with pytest.raises(QueueRoleError):
            r.enqueue(1)
        with pytest.raises(QueueRoleError):
            w.dequeue()
        with pytest.raises(QueueRoleError):
            r.export_handle()
        with pytest.raises(TypeError, match="export_handle"):
            pickle.dumps(w)
        assert w.broadcast_object({"a": 1}) == {"a": 1}
        assert r.broadcast_object() == {"a": 1}
        assert "writer" in repr(w) and "reader rank 1" in repr(r)
    assert w.closed and r.closed
    w.close()
    r.close()  # idempotent
    with pytest.raises(QueueClosedError):
        w.enqueue(1)
    with pytest.raises(QueueClosedError):
        r.dequeue(timeout=0)


# Queues, a local and a remote reader among them, dropped without close() inside
# reference cycles (vLLM's callers drop queues): collecting them must not hang.
_DROPPED = r"""
import faulthandler, gc, sys
faulthandler.dump_traceback_later(40, exit=True)
from tests.shm_broadcast.queue.test_message_queue import make_queue
def drop(n_local, n_remote):
    w, readers = make_queue(n_local, n_remote)
    w.enqueue({"step": 1})
    assert [r.dequeue(timeout=10) for r in readers] == [{"step": 1}] * len(readers)
    for q in [w, *readers]:
        q.cycle = [w, *readers]  # only the garbage collector can free them
drop(1, 0)
gc.collect()
drop(1, 1)
gc.collect()
print("collected")
"""


@pytest.mark.timeout(90)
def test_queues_dropped_without_close_do_not_hang_the_garbage_collector():
    import subprocess
    import sys

    root = REPO_ROOT
    proc = subprocess.run([sys.executable, "-c", _DROPPED], capture_output=True, text=True,
                          timeout=80, cwd=root)
    assert proc.returncode == 0 and "collected" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.timeout(60)
def test_zero_reader_queue_and_bytes_handle():
    with MessageQueue(0, 0, name="empty") as w:
        w.wait_until_ready(1)
        w.enqueue({"nobody": "listens"})
    w, (r,) = make_queue(1, name="bytes")
    # A handle may travel as bytes; a second process claiming the same slot fails.
    with w, r, pytest.raises(Exception, match="already taken"):
        MessageQueue.create_from_handle(w.export_handle().to_bytes(), 1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_reader=-1, n_local_reader=0), "n_reader"),
        (dict(n_reader=1, n_local_reader=2), "n_local_reader"),
        (dict(n_reader=2, n_local_reader=2, local_reader_ranks=[1, 1]), "local_reader_ranks"),
        (dict(n_reader=2, n_local_reader=2, local_reader_ranks=[1]), "local_reader_ranks"),
        (dict(n_reader=1, n_local_reader=1, max_chunk_bytes=10), "max_chunk_bytes"),
        (dict(n_reader=1, n_local_reader=1, max_chunks=0), "max_chunks"),
        (dict(n_reader=1, n_local_reader=0, connect_ip=""), "connect_ip"),
        (dict(n_reader=1, n_local_reader=0, connect_ip="notanip"), "connect_ip"),
        (dict(n_reader=1, n_local_reader=0, connect_ip="127.0.0.1:80"), "connect_ip"),
        (dict(n_reader=1, n_local_reader=0, connect_ip="*"), "connect_ip"),
        (dict(n_reader=1, n_local_reader=0, connect_ip="0.0.0.0"), "connect_ip"),
        (dict(n_reader=1, n_local_reader=0, connect_ip="::"), "connect_ip"),
    ],
    ids=["n_reader", "n_local_reader", "ranks-repeated", "ranks-short", "chunk-bytes",
         "chunks", "ip-empty", "ip-name", "ip-with-port", "ip-star", "ip-any4", "ip-any6"],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MessageQueue(**kwargs)


_WRONG_TYPES = {  # name: (keyword arguments for MessageQueue(2, 2, ...), argument named)
    "local_reader_ranks-int": (dict(local_reader_ranks=5), "local_reader_ranks"),
    "local_reader_ranks-str": (dict(local_reader_ranks="01"), "local_reader_ranks"),
    "local_reader_ranks-floats": (dict(local_reader_ranks=[0.0, 1.0]), r"local_reader_ranks\[0\]"),
    "allow_pickle-str": (dict(allow_pickle="yes"), "allow_pickle"),
    "exact_types-int": (dict(exact_types=1), "exact_types"),
    "writer_rank-str": (dict(writer_rank="0"), "writer_rank"),
    "remote_reader_keys-list": (dict(remote_reader_keys=[b"k"]), "remote_reader_keys"),
    "remote_reader_keys-str-rank": (dict(remote_reader_keys={"a": b"k"}), "remote_reader_keys"),
    "remote_reader_keys-str-key": (dict(remote_reader_keys={0: "k"}), "remote_reader_keys"),
    "connect_ip-int": (dict(connect_ip=5), "connect_ip"),
    "name-int": (dict(name=3), "name"),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(_WRONG_TYPES))
def test_arguments_of_the_wrong_type_raise_type_error(case):
    kwargs, match = _WRONG_TYPES[case]
    with pytest.raises(TypeError, match=match):
        MessageQueue(2, 2, **kwargs)


@pytest.mark.timeout(30)
def test_a_negative_writer_rank_is_a_value_error():
    with pytest.raises(ValueError, match="writer_rank"):
        MessageQueue(1, 1, writer_rank=-1)


@pytest.mark.timeout(30)
def test_bad_call_arguments(queues):
    w, (r,) = queues(1, name="args")
    with pytest.raises(ValueError, match="timeout"):
        r.dequeue(timeout=-1)
    with pytest.raises(TypeError, match="timeout"):
        w.enqueue(1, timeout="soon")
    with pytest.raises(TypeError, match="Handle"):
        MessageQueue.create_from_handle({"not": "a handle"}, 0)
    with pytest.raises(ValueError, match="rank"):
        MessageQueue.create_from_handle(w.export_handle(), -3)
    with pytest.raises(ValueError, match="no remote endpoint"):
        MessageQueue.create_from_handle(w.export_handle(), 7)  # not local, no TCP side
    with pytest.raises(TypeError, match="WaitPolicy"):
        MessageQueue(1, 1, wait_policy={"spin_s": 0})
    with pytest.raises(ValueError, match="spin_s"):
        WaitPolicy(spin_s=-1)


@pytest.mark.timeout(60)
def test_wait_until_ready_times_out_naming_missing_readers():
    with MessageQueue(2, 1, [4], connect_ip="127.0.0.1", name="lonely") as w:
        t0 = time.monotonic()
        with pytest.raises(QueueTimeout) as info:
            w.wait_until_ready(timeout=0.3)
        assert time.monotonic() - t0 < 1.0
        assert "local reader rank 4" in str(info.value) and "1 remote reader" in str(info.value)
        assert info.value.peers == (4,)  # ranks only: the remote one's is not known here


@pytest.mark.timeout(60)
def test_wait_until_ready_names_the_missing_remote_ranks_it_made_keys_for():
    with MessageQueue(3, 1, [4], connect_ip="127.0.0.1", name="lonely-keys") as w:
        w.export_handle(1)
        w.export_handle(2)
        with pytest.raises(QueueTimeout) as info:
            w.wait_until_ready(timeout=0.3)
        assert "local reader rank 4" in str(info.value), info.value
        assert "remote reader rank(s) [1, 2]" in str(info.value), info.value
        assert info.value.peers == (4, 1, 2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("field,factor", [("max_chunks", 2), ("max_chunk_bytes", 4),
                                          ("max_chunk_bytes", 0.5)],
                         ids=["more-chunks", "larger-chunks", "smaller-chunks"])
def test_a_handle_that_disagrees_with_its_ring_is_refused(field, factor):
    """A reader maps the ring by its own header: a handle claiming another
    geometry (forged, or of another queue) is refused before the reader takes
    its slot, and the honest reader still attaches afterwards."""
    with MessageQueue(1, 1, [1], max_chunk_bytes=1 << 16, max_chunks=4, name="geom") as w:
        h = w.export_handle()
        lie = msgspec.structs.replace(h, **{field: int(getattr(h, field) * factor)})
        with pytest.raises(SegmentError, match="its handle says"):
            MessageQueue.create_from_handle(lie, 1)
        with MessageQueue.create_from_handle(h, 1) as r:
            w.wait_until_ready(10)
            w.enqueue({"ok": 1})
            assert r.dequeue(timeout=10) == {"ok": 1}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("corruption", ["blob-beyond-chunk", "metadata-beyond-chunk",
                                        "unknown-kind", "wrong-sequence"])
def test_a_corrupt_chunk_header_is_refused_not_read(queues, corruption):
    """A same-user process rewrites a published chunk's header: the reader must
    raise, never decode bytes outside the chunk (another chunk the writer may be
    filling, or the rest of the segment)."""
    import numpy as np

    from shm_broadcast import DecodeError
    from shm_broadcast.queue.transport import WIRE

    w, (r,) = queues(1, max_chunk_bytes=4096, max_chunks=4, name="corrupt")
    w.enqueue([np.arange(8, dtype=np.uint8)], timeout=10)
    ring = w._impl.ring
    d = ring.data_offset(0)
    seq, kind, mlen, blen = WIRE.unpack_from(ring.buf, d)
    forged = {"blob-beyond-chunk": (seq, kind, mlen, 1 << 40),
              "metadata-beyond-chunk": (seq, kind, 4096, 0),
              "unknown-kind": (seq, 99, mlen, blen),
              "wrong-sequence": (seq + 7, kind, mlen, blen)}[corruption]
    WIRE.pack_into(ring.buf, d, *forged)
    with pytest.raises(DecodeError, match="the ring is corrupt"):
        r.dequeue(timeout=5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("big", [False, True], ids=["in-ring", "overflow"])
def test_a_hash_flooding_message_is_refused_naming_the_writer(queues, big):
    """A writer (a peer a reader does not have to trust) sends a set whose items
    all share one hash: every reader, local and remote, refuses it with a
    ``DecodeError`` that names the queue and the writer, and reads on."""
    from shm_broadcast import DecodeError
    from tests.shm_broadcast.codec.flooding import colliding_pairs

    w, readers = queues(1, 1, max_chunk_bytes=4096, max_chunks=4, name="flood")
    flood = set(colliding_pairs(64))
    w.enqueue({"pad": "x" * (8000 if big else 0), "flood": flood}, timeout=10)
    w.enqueue("after", timeout=10)
    for r in readers:
        with pytest.raises(DecodeError, match=r"queue 'flood': .*reader.* refused message #0 "
                                              r"from the writer.*share") as got:
            r.dequeue(timeout=10)
        assert got.value.peers and got.value.queue == "flood"
        assert r.dequeue(timeout=10) == "after"


@pytest.mark.timeout(60)
def test_overflow_tensors_are_private_to_each_reader(queues, monkeypatch):
    """A message too large for a chunk arrives as a zmq frame per reader, local
    and remote; its large tensor is then a view of that frame, not a copy. Each
    reader's tensors must still be its own: writable, equal to what was sent,
    and untouched by what another reader, the writer or a later message does."""
    from shm_broadcast.codec.message_codec import Codec

    lent = []  # arrays the decoders returned without copying
    plain_copy = Codec._plain_copy

    def spy(self, *args, **kwargs):
        out = plain_copy(self, *args, **kwargs)
        if out.base is not None:
            lent.append(out)
        return out

    monkeypatch.setattr(Codec, "_plain_copy", spy)
    w, readers = queues(2, 1, max_chunk_bytes=4096, max_chunks=4, name="ovf")
    big = torch.arange(64 << 10, dtype=torch.float32)  # 256 KiB: the overflow path
    small = torch.arange(7, dtype=torch.int64)
    w.enqueue({"big": big, "small": small, "n": 1}, timeout=10)
    big.fill_(-1.0)  # the writer reuses its tensor: the message sent stays as it was
    w.enqueue({"big": big, "small": small, "n": 2}, timeout=10)
    firsts = [r.dequeue(timeout=10) for r in readers]
    seconds = [r.dequeue(timeout=10) for r in readers]
    want = torch.arange(64 << 10, dtype=torch.float32)
    for i, got in enumerate(firsts):
        assert got["n"] == 1 and torch.equal(got["small"], small)
        assert torch.equal(got["big"], want), i
        got["big"].mul_(2)  # writable, and only this reader's
    for i, got in enumerate(firsts):
        assert torch.equal(got["big"], want * 2), i
    for got in seconds:
        assert got["n"] == 2 and torch.equal(got["big"], torch.full_like(want, -1.0))
    ptrs = {t["big"].data_ptr() for t in firsts + seconds}
    assert len(ptrs) == len(firsts + seconds)  # no two messages or readers share memory
    assert len(lent) == len(firsts + seconds)  # each big tensor was its frame's memory


@pytest.mark.timeout(60)
def test_an_overflow_complex128_tensor_is_aligned(queues):
    """zmq frames start 8 bytes off 16, where torch's complex128 kernels fault:
    such a tensor must arrive on 16 bytes (a copy) and work in strided kernels."""
    w, readers = queues(1, 1, max_chunk_bytes=4096, max_chunks=4, name="c128")
    sent = torch.arange(16 << 10, dtype=torch.float64).to(torch.complex128) * (1 + 2j)
    w.enqueue({"c": sent}, timeout=10)
    for r in readers:
        got = r.dequeue(timeout=10)["c"]
        assert got.data_ptr() % 16 == 0
        assert torch.equal(got[::3].sum(), sent[::3].sum())

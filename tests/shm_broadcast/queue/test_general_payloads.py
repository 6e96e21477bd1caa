"""MessageQueue on general payloads and configurations, with real reader processes.

Every received object must equal the sent one with its type (a tuple stays a
tuple), tensors bit-exact with dtype and shape, and never alias the ring or
the sender's memory.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import math
import os
import threading
import time
import traceback
from typing import Any

import msgspec
import numpy as np
import psutil
import pytest
import torch

from shm_broadcast import (
    MessageQueue,
    QueueClosedError,
    QueueRoleError,
    QueueTimeout,
    list_segments,
)
from shm_broadcast.codec.message_codec import Codec
from shm_broadcast.queue.ring_buffer import CHUNK_HEADER


def _send_payloads(mq: MessageQueue, mcb: int) -> None:
    for _name, obj in payloads(mcb):
        mq.enqueue(obj, timeout=60)
    t = torch.zeros(4)
    mq.enqueue(t, timeout=60)
    t.fill_(1.0)  # the first copy is already on its way; it must not change
    mq.enqueue(t, timeout=60)


@pytest.mark.timeout(60)
def test_every_payload_kind_round_trips_exactly(procs):
    # Queue A: 2 local readers + 1 remote (TCP), writer rank 7, 4 KiB chunks, 2 of them:
    # many payloads overflow through zmq, interleaved with ring messages.
    # Queue B: the same 3 readers all local, 128-byte chunks and max_chunks=1.
    # The payloads include kinds only pickle carries exactly (enums, dataclasses,
    # Structs, namedtuples, object arrays), so both sides opt in explicitly;
    # test_payloads_without_pickle covers the default.
    qa = MessageQueue(3, 2, [1, 2], max_chunk_bytes=4096, max_chunks=2,
                      connect_ip="127.0.0.1", name="payloads-a", writer_rank=7, allow_pickle=True)
    qb = MessageQueue(3, 3, [3, 1, 2], max_chunk_bytes=128, max_chunks=1, name="payloads-b",
                      allow_pickle=True)
    try:
        for r in (1, 2, 3):
            procs.start(payload_reader, [qa.export_handle(r), qb.export_handle(r)], r,
                        [4096, 128])
        qa.wait_until_ready(50)
        _send_payloads(qa, 4096)
        qa.close()
        qb.wait_until_ready(50)
        _send_payloads(qb, 128)
        qb.close()
        reports = sorted(procs.get(timeout=50) for _ in range(3))
    finally:
        qa.close()
        qb.close()
    assert [(k, r) for k, r, _ in reports] == [("ok", 1), ("ok", 2), ("ok", 3)]
    for _, rank, errors in reports:
        assert errors == [], f"reader rank {rank}: {errors}"


#: Payloads that hold a kind msgspec cannot carry exactly (only with allow_pickle).
PICKLE_ONLY = {"enums", "dataclass", "struct", "namedtuple", "ordered_dict", "arrays",
               "tensor_tuple"}


@pytest.mark.timeout(60)
def test_payloads_without_pickle():
    """Default codec: every payload but the pickle-only kinds round-trips exactly;
    those are refused on the sender with a TypeError naming the opt-in."""
    codec = Codec()
    errors = []
    for name, obj in payloads(4096):
        try:
            enc = codec.encode(obj)
        except TypeError as e:
            if name not in PICKLE_ONLY or "allow_pickle=True" not in str(e):
                errors.append(f"{name}: {e}")
            continue
        if name in PICKLE_ONLY:
            errors.append(f"{name}: was encoded without pickle")
            continue
        got = codec.decode(enc.msg, enc.blob_bytes(), 0, enc.blob_len)
        problem = mismatch(got, obj, name)
        if problem:
            errors.append(problem)
    assert errors == []


def test_chunk_boundary_is_exact():
    # The sizes the sweep uses really sit on both sides of the ring/overflow boundary.
    for mcb in (128, 4096):
        exact, over = boundary_sizes(mcb)
        c = Codec()
        assert 32 + len(c.encode(b"\x07" * exact).msg) == mcb
        assert 32 + len(c.encode(b"\x07" * over).msg) == mcb + 1


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_six_local_readers_with_scattered_ranks(procs):
    ranks = [9, 2, 5, 7, 1, 4]
    n = 150
    mq = MessageQueue(6, 6, ranks, max_chunk_bytes=1024, max_chunks=3, name="six",
                      writer_rank=3)
    try:
        for r in ranks:
            procs.start(numpy_reader, mq.export_handle(), r, n)
        mq.wait_until_ready(50)
        for i in range(n):
            assert mq.broadcast_object(numpy_message(i), timeout=30) is not None
    finally:
        mq.close()
    reports = sorted(procs.get(timeout=40) for _ in ranks)
    assert reports == [("ok", r, [], True) for r in sorted(ranks)]


def _queue_with_readers(n_local: int, n_remote: int, **kw) -> tuple[MessageQueue, list]:
    local = list(range(1, n_local + 1))
    remote = list(range(n_local + 1, n_local + n_remote + 1))
    w = MessageQueue(n_local + n_remote, n_local, local,
                     connect_ip="127.0.0.1" if n_remote else None, **kw)
    readers = [MessageQueue.create_from_handle(w.export_handle(r), r) for r in local + remote]
    w.wait_until_ready(20)
    for r in readers:
        r.wait_until_ready(20)
    return w, readers


def _our_segments() -> set[str]:
    return {s.name for s in list_segments() if f"_{os.getpid()}_" in s.name}


@pytest.mark.timeout(60)
def test_open_close_cycles_leak_nothing():
    proc = psutil.Process()
    # One warm-up cycle: first use loads libraries and creates lazily made objects.
    w, rs = _queue_with_readers(2, 1, max_chunk_bytes=1024, max_chunks=2)
    for q in [w, *rs]:
        q.close()
    fds, threads, segs = proc.num_fds(), proc.num_threads(), _our_segments()
    for i in range(15):
        w, rs = _queue_with_readers(2, 1, max_chunk_bytes=1024, max_chunks=2, name=f"cycle{i}")
        w.enqueue({"i": i, "big": b"x" * 3000})  # overflow path too
        assert [r.dequeue(timeout=10) for r in rs] == [{"i": i, "big": b"x" * 3000}] * 3
        for q in [*rs, w] if i % 2 else [w, *rs]:
            q.close()
    # zmq closes sockets and joins its I/O threads asynchronously: a leak is what
    # is still there after a settling bound, not what a loaded machine lags behind on.
    # Counts are read together and the last pair kept: the leak fixture's watcher
    # thread holds a /proc file open for an instant now and then, so a lone later
    # read could count its descriptor.
    deadline = time.monotonic() + 3.0
    now = (proc.num_fds(), proc.num_threads())
    while (now[0] > fds or now[1] > threads) and time.monotonic() < deadline:
        time.sleep(0.05)
        now = (proc.num_fds(), proc.num_threads())
    assert _our_segments() == segs
    assert now[0] <= fds, f"file descriptors leaked: {now[0]} open, {fds} before"
    assert now[1] <= threads, f"threads (zmq contexts) leaked: {now[1]} running, {threads} before"


@pytest.mark.timeout(60)
def test_closed_queue_and_wrong_role_raise_clear_errors():
    w, (r, rr) = _queue_with_readers(1, 1, max_chunk_bytes=1024, max_chunks=1, name="roles")
    try:
        with pytest.raises(QueueRoleError, match="enqueue.*reader rank 1"):
            r.enqueue("x")
        with pytest.raises(QueueRoleError, match="enqueue.*reader rank 2"):
            rr.enqueue("x")
        with pytest.raises(QueueRoleError, match="dequeue"):
            w.dequeue()
        with pytest.raises(QueueRoleError):
            r.export_handle()
        # timeout=0: a non-blocking dequeue, and an enqueue into a full one-chunk ring.
        with pytest.raises(QueueTimeout):
            r.dequeue(timeout=0)
        w.enqueue(("first",), timeout=0)
        t0 = time.monotonic()
        with pytest.raises(QueueTimeout, match="reader rank"):
            w.enqueue("second", timeout=0)
        assert time.monotonic() - t0 < 0.5
        assert r.dequeue(timeout=0) == ("first",)
        assert rr.dequeue(timeout=5) == ("first",)
        w.enqueue("second", timeout=0)
        assert r.broadcast_object(timeout=5) == "second" == rr.broadcast_object(timeout=5)
        with pytest.raises((TypeError, ValueError), match="timeout"):
            w.enqueue("x", timeout=-1)
        with pytest.raises((TypeError, ValueError), match="timeout"):
            r.dequeue(timeout="soon")
    finally:
        for q in (r, rr, w):
            q.close()
    for _q, op in ((w, lambda: w.enqueue(1)), (r, lambda: r.dequeue(timeout=0)),
                   (rr, lambda: rr.dequeue(timeout=0)), (r, lambda: r.wait_until_ready(1))):
        with pytest.raises(QueueClosedError, match="roles"):
            op()
    assert w.closed and r.closed and not r.poll()


@pytest.mark.timeout(30)
def test_nesting_too_deep_raises_value_error_and_queue_stays_usable():
    w, (r,) = _queue_with_readers(1, 0, max_chunk_bytes=1 << 16, max_chunks=2, name="deep")
    try:
        deep: object = 0
        for _ in range(5000):
            deep = [deep]
        with pytest.raises(ValueError, match="nested too deeply"):
            w.enqueue(deep, timeout=5)
        w.enqueue("after", timeout=5)
        assert r.dequeue(timeout=5) == "after"
    finally:
        r.close()
        w.close()


@pytest.mark.timeout(30)
def test_memoryview_and_received_arrays_are_private():
    w, (r,) = _queue_with_readers(1, 0, max_chunk_bytes=1 << 16, max_chunks=2, name="private")
    try:
        a = np.arange(8, dtype=np.int64)
        w.enqueue({"a": a, "mv": memoryview(a), "rw": memoryview(bytearray(b"rw"))})
        a[:] = -1
        got = r.dequeue(timeout=5)
        assert got["a"].tolist() == list(range(8)) and got["a"].flags.writeable
        assert type(got["mv"]) is memoryview and got["mv"].tolist() == list(range(8))
        assert got["rw"].readonly is False and bytes(got["rw"]) == b"rw"
        got["a"][:] = 5
        w.enqueue("next")
        assert r.dequeue(timeout=5) == "next" and got["a"].tolist() == [5] * 8
    finally:
        r.close()
        w.close()


def _shutdown_soon(mq: MessageQueue) -> None:
    time.sleep(0.2)
    mq.shutdown()


@pytest.mark.timeout(30)
def test_dequeue_order_with_overflow_interleaved_and_slow_start():
    # The reader starts reading only after the writer filled the ring with a mix of
    # overflow and ring messages: order must still be the send order.
    w, (r, rr) = _queue_with_readers(1, 1, max_chunk_bytes=256, max_chunks=4, name="mix")
    try:
        msgs = [("big", i, b"y" * 400) if i % 2 else ("small", i) for i in range(4)]
        for m in msgs:
            w.enqueue(m, timeout=5)
        assert [r.dequeue(timeout=5) for _ in msgs] == msgs
        assert [rr.dequeue(timeout=5) for _ in msgs] == msgs
        threading.Thread(target=_shutdown_soon, args=(r,), daemon=True).start()
        with pytest.raises(QueueClosedError):
            r.dequeue()
    finally:
        for q in (r, rr, w):
            q.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("rank", [None, 1], ids=["any-reader", "rank-1"])
def test_a_closed_writer_exports_no_handle(rank: int | None) -> None:
    """A handle of a closed queue would name a segment that is gone."""
    w = MessageQueue(1, 1, [1], name="closed-handle")
    w.export_handle(rank)
    w.close()
    with pytest.raises(QueueClosedError, match="export_handle"):
        w.export_handle(rank)


# ------------------------------------------------------------ payloads and reader processes
# Both the test (writer) and the reader processes build the same payloads with
# payloads(), so a reader can check each message without it being sent twice.
# Module-level classes keep pickled values importable in the children.
class Color(enum.Enum):
    RED = 1
    BLUE = "b"


class Level(enum.IntEnum):
    LOW = 1


@dataclasses.dataclass
class Point:
    x: int
    tags: tuple
    data: Any = None


class Meta(msgspec.Struct):
    name: str
    shape: tuple
    extra: dict = {}


Pair = collections.namedtuple("Pair", "left right")


def _deep(depth: int, wrap: Any) -> Any:
    x: Any = "leaf"
    for _ in range(depth):
        x = wrap(x)
    return x


def boundary_sizes(max_chunk_bytes: int) -> tuple[int, int]:
    """Lengths ``L`` of a ``bytes`` payload that exactly fills a chunk, and ``L + 1``.

    A message without arrays fits when ``CHUNK_HEADER + len(msgpack) <= max_chunk_bytes``.
    """
    codec = Codec()
    best = 0
    for n in range(max(0, max_chunk_bytes - 64), max_chunk_bytes):
        mlen = len(codec.encode(b"\x07" * n).msg)
        if mlen == max_chunk_bytes - CHUNK_HEADER:
            best = n
    if not best:
        raise AssertionError(f"no exact-boundary bytes length for {max_chunk_bytes}")
    return best, best + 1


def payloads(max_chunk_bytes: int, with_torch: bool = True) -> list[tuple[str, Any]]:
    """Deterministic ``(name, object)`` pairs covering the supported value kinds."""
    rng = np.random.default_rng(1234)
    exact, over = boundary_sizes(max_chunk_bytes)
    out: list[tuple[str, Any]] = [
        ("none", None),
        ("none_list", [None, None, (None,)]),
        ("nested", {"a": [1, (2, 3), {4, 5}, frozenset({6, (7, 8)})], "b": ({"c": (9,)}, [])}),
        ("int_keys", {1: "a", -2: "b", 2**63 - 1: "c"}),
        ("odd_keys", {(1, 2): "t", None: 3, 1.5: 2, True: "bool", "s": 1, frozenset({1}): 0}),
        ("bool_vs_int_key", {True: 1, 2: 2}),
        ("bytes", b"\x00\xff" * 3),
        ("bytearray", bytearray(b"abc\x00")),
        ("memoryview", memoryview(b"view")),
        ("memoryview_2d", memoryview(np.arange(6.0).reshape(2, 3))),
        ("unicode", "h\u00e9llo \U0001f600 \u4e2d\u6587"),
        ("surrogate", "a\ud800b"),
        ("surrogate_in_dict", {"k": ["x", "\udcff"], "t": (1,)}),
        ("big_ints", [2**64 - 1, -(2**63), 2**64, -(2**70), 10**40]),
        ("floats", [float("nan"), float("inf"), -float("inf"), -0.0, 5e-324]),
        ("np_scalars", [np.int64(3), np.float32(1.5), np.bool_(True), np.uint8(255),
                        np.complex64(1 + 2j), np.float16(-0.0)]),
        ("enums", [Color.RED, Color.BLUE, Level.LOW]),
        ("dataclass", Point(1, (2, "x"), {"a": np.arange(3)})),
        ("struct", Meta("m", (1, 2), {"k": [1.5]})),
        ("namedtuple", Pair(1, Pair((2,), None))),
        ("ordered_dict", collections.OrderedDict([("b", 1), ("a", 2)])),
        ("deep_list", _deep(400, lambda x: [x])),
        ("deep_dict", _deep(300, lambda x: {"k": x})),
        ("deep_tuple", _deep(150, lambda x: (x,))),
        ("exact_chunk", b"\x07" * exact),
        ("small_after_exact", (1, 2)),
        ("over_by_one", b"\x07" * over),
        ("small_after_over", {"i": 1}),
    ]
    arrays: dict[str, np.ndarray] = {}
    for dt in ("i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16",
               "?", ">i4", ">f8", "M8[s]", "m8[ms]", "U3", "S2"):
        a = rng.integers(0, 100, size=(3, 4)).astype(dt)
        arrays[dt] = a
    arrays["structured"] = np.array([(1, 2.5, b"ab"), (3, -1.0, b"c")],
                                    dtype=[("a", "<i4"), ("b", "<f8"), ("c", "S2")])
    arrays["aligned_struct"] = np.zeros(2, dtype=np.dtype([("a", "i1"), ("b", "i8")], align=True))
    arrays["fortran"] = np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4))
    arrays["strided"] = np.arange(40, dtype=np.float64)[::3]
    arrays["reversed"] = np.arange(5)[::-1]
    arrays["zero_d"] = np.array(7, dtype=np.int16)
    arrays["empty"] = np.zeros((0, 5), dtype=np.float32)
    arrays["object"] = np.array([1, "a", None, (2,)], dtype=object)
    arrays["many_dims"] = np.arange(2, dtype=np.int8).reshape([1] * 39 + [2])
    out.append(("arrays", arrays))
    out.append(("array_in_tuple", (np.arange(3), [np.ones(2, np.float32)])))
    if with_torch:
        import torch

        tensors: dict[str, Any] = {}
        for name in ("float32", "float64", "float16", "bfloat16", "int8", "int16", "int32",
                     "int64", "uint8", "bool", "complex64", "complex128", "uint16", "uint32",
                     "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                     "float8_e5m2fnuz"):
            dt = getattr(torch, name, None)
            if dt is None:
                continue
            raw = torch.from_numpy(rng.integers(0, 256, size=(3, 16), dtype=np.uint8).copy())
            if dt is torch.bool:
                raw = raw % 2  # a bool byte other than 0/1 is not a valid value
            tensors[name] = raw.view(dt)  # random bit patterns (NaNs included), 16 bytes a row
        base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
        tensors["zero_dim"] = torch.tensor(3.25)
        tensors["numel0"] = torch.zeros(0, 7, dtype=torch.int64)
        tensors["transposed"] = base.transpose(0, 2)
        tensors["offset_view"] = base.reshape(-1)[7:19]
        tensors["expanded"] = torch.tensor([1.0, 2.0]).expand(4, 2)
        tensors["channels_last"] = torch.arange(24.0).reshape(1, 2, 3, 4).to(
            memory_format=torch.channels_last)
        tensors["requires_grad"] = torch.ones(3, requires_grad=True)
        tensors["conj"] = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj()
        out.append(("tensors", tensors))
        out.append(("parameter", torch.nn.Parameter(torch.arange(4.0))))
        out.append(("torch_meta", [torch.Size([2, 3]), torch.float16, torch.bfloat16,
                                   torch.device("cpu"), (torch.int8,)]))
        out.append(("tensor_tuple", (torch.ones(2, dtype=torch.bfloat16),
                                     Point(0, (torch.zeros(1),)))))
        big = max_chunk_bytes // 4 + 64
        out.append(("tensor_overflow", {"t": torch.arange(big, dtype=torch.int32), "i": 1}))
        out.append(("after_tensor_overflow", torch.full((2,), 7, dtype=torch.int8)))
    return out


def mismatch(a: Any, b: Any, path: str = "$") -> str | None:
    """Return where ``b`` differs from ``a`` (type included), or ``None`` when equal."""
    if type(a) is not type(b):
        return f"{path}: type {type(b).__qualname__}, expected {type(a).__qualname__}"
    if isinstance(a, np.ndarray):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: array {b.dtype}{b.shape}, expected {a.dtype}{a.shape}"
        if a.dtype.hasobject:
            return None if a.tolist() == b.tolist() else f"{path}: object array differs"
        return None if np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes() \
            else f"{path}: array bytes differ"
    if type(a).__module__.startswith("torch"):
        return _torch_mismatch(a, b, path)
    if isinstance(a, float):
        same = (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b))
        return None if same else f"{path}: {b!r} != {a!r}"
    if isinstance(a, np.generic):
        same = a.tobytes() == b.tobytes() and a.dtype == b.dtype
        return None if same else f"{path}: {b!r} != {a!r}"
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: length {len(b)} != {len(a)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            m = mismatch(x, y, f"{path}[{i}]")
            if m:
                return m
        return None
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{path}: keys {list(b)!r} != {list(a)!r}"
        for k in a:
            m = mismatch(a[k], b[k], f"{path}[{k!r}]")
            if m:
                return m
        return None
    if dataclasses.is_dataclass(a):
        return mismatch(dataclasses.astuple(a), dataclasses.astuple(b), path)
    if isinstance(a, msgspec.Struct):
        return mismatch(msgspec.structs.astuple(a), msgspec.structs.astuple(b), path)
    if isinstance(a, memoryview):
        ok = ((a.tobytes(), a.format, a.shape, a.readonly)
              == (b.tobytes(), b.format, b.shape, b.readonly))
        return None if ok else f"{path}: memoryview differs"
    return None if a == b else f"{path}: {b!r} != {a!r}"


def _torch_mismatch(a: Any, b: Any, path: str) -> str | None:
    import torch

    if isinstance(a, torch.Tensor):
        if (a.dtype, a.shape, a.requires_grad) != (b.dtype, b.shape, b.requires_grad):
            return (f"{path}: tensor {b.dtype}{tuple(b.shape)} grad={b.requires_grad}, expected "
                    f"{a.dtype}{tuple(a.shape)} grad={a.requires_grad}")
        if a.numel() and not torch.equal(_bits(a), _bits(b)):
            return f"{path}: tensor bits differ"
        return None
    return None if a == b else f"{path}: {b!r} != {a!r}"


def _bits(t: Any) -> Any:
    import torch

    t = t.detach().resolve_conj().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype.itemsize else t


def payload_reader(handles: list, rank: int, chunk_sizes: list[int], out: Any) -> None:
    """Read every payload from each queue in ``handles``, check them, report mismatches.

    Also checks received tensors never alias the ring: a tensor received first
    is mutated, more messages are read, and the others received so far must be
    unchanged (and the mutated one keeps its new value).
    """
    try:
        import torch

        errors: list[str] = []
        for handle, mcb in zip(handles, chunk_sizes, strict=True):
            expected = payloads(mcb)
            with MessageQueue.create_from_handle(handle, rank, allow_pickle=True) as mq:
                mq.wait_until_ready(60)
                kept: list[tuple[Any, Any]] = []
                for name, exp in expected:
                    got = mq.dequeue(timeout=60)
                    m = mismatch(exp, got)
                    if m:
                        errors.append(f"q{mcb} {name}: {m}")
                    if isinstance(got, dict) and name == "tensors":
                        got["float32"].fill_(-1.0)  # mutate right away
                        kept.append((got["float32"], torch.full_like(got["float32"], -1.0)))
                        kept.extend((t, t.clone()) for k, t in got.items() if k != "float32")
                # The writer mutates its tensor after sending; the second copy must show it.
                first, second = mq.dequeue(timeout=60), mq.dequeue(timeout=60)
                if not (torch.equal(first, torch.zeros(4)) and torch.equal(second, torch.ones(4))):
                    errors.append(f"q{mcb} sender aliasing: {first} {second}")
                for t, snap in kept:
                    if not torch.equal(_bits(t), _bits(snap)):
                        errors.append(f"q{mcb}: a received tensor changed after more messages")
                try:
                    mq.dequeue(timeout=60)
                    errors.append(f"q{mcb}: message after the last one")
                except QueueClosedError:
                    pass
        out.put(("ok", rank, errors))
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


def numpy_reader(handle: Any, rank: int, n: int, out: Any) -> None:
    """Read ``n`` numpy-only messages (no torch import, fast to spawn) and check them."""
    try:
        errors = []
        with MessageQueue.create_from_handle(handle, rank) as mq:
            mq.wait_until_ready(60)
            for i in range(n):
                got = mq.dequeue(timeout=60)
                m = mismatch(numpy_message(i), got)
                if m:
                    errors.append(f"#{i}: {m}")
            t0 = time.monotonic()
            with contextlib.suppress(QueueClosedError):
                mq.dequeue(timeout=60)
            closed_after = time.monotonic() - t0
        out.put(("ok", rank, errors, closed_after < 30))
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


def numpy_message(i: int) -> Any:
    """The ``i``-th message of the many-readers test; every 5th overflows a 1 KiB chunk."""
    size = 600 if i % 5 == 3 else i % 13
    return (i, {"a": np.arange(size, dtype=np.float64) * i, (i, "k"): {i % 3}}, b"x" * (i % 7))


#: Array bytes around the one-frame / two-frame boundary of remote messages (64 KiB).
_REMOTE_BLOB_SIZES = [0, 1, 4096, (1 << 16) - 1, 1 << 16, (1 << 16) + 8, 1 << 20]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n_local", [0, 1], ids=["remote-only", "with-ring"])
def test_remote_messages_of_every_frame_layout_arrive_exact(n_local):
    # Small messages travel to remote readers as one frame (arrays appended),
    # larger ones as two; with a ring the arrays are copied out of the chunk,
    # and a message larger than a chunk reuses the overflow frames.
    w, readers = _queue_with_readers(n_local, 1, max_chunk_bytes=1 << 17, max_chunks=2,
                                     name=f"frames{n_local}")
    try:
        for size in _REMOTE_BLOB_SIZES:
            arr = np.arange(size, dtype=np.uint8) * 7
            msg = {"size": size, "arr": arr, "tail": [size, "x" * (size % 97)]}
            w.enqueue(msg, timeout=10)
            for r in readers:
                got = r.dequeue(timeout=10)
                assert got["size"] == size and got["tail"] == msg["tail"]
                assert got["arr"].dtype == np.uint8 and np.array_equal(got["arr"], arr)
        w.enqueue("no arrays", timeout=10)
        assert [r.dequeue(timeout=10) for r in readers] == ["no arrays"] * len(readers)
    finally:
        for q in [*readers, w]:
            q.close()

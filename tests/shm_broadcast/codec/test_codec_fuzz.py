"""The codec's decoder against malformed and hostile input.

Whatever bytes arrive, ``Codec.decode`` returns a value or raises
:class:`DecodeError`: never ``IndexError``, ``struct.error``, ``MemoryError``,
``UnicodeDecodeError``, msgspec's errors or a crash, and it allocates nothing
for a size it has not checked against the bytes present.

* ``test_mutated_messages_*``: valid messages of every kind the codec carries
  (the corpus), mutated byte-wise (flips, interesting values, insertions,
  deletions, truncation, splices, lying blob lengths) plus hypothesis-driven
  mutations and raw random bytes: about 2,000 inputs in CI, over 100,000 under
  the ``slow`` marker (``pytest -m slow``).
* ``test_attack_*``: the attacks of issue 12: a ~30-byte message claiming 1 GiB,
  shape ``(-4,)``, unknown dtypes, object dtypes, lying blob lengths.

The helpers (:func:`corpus`, :func:`mutate`, :func:`check_decode`) are reused
by ``tests/coordinator/p2p/test_tensor_dict_fuzz.py`` for the tensor-dict
metadata decoder.
"""

from __future__ import annotations

import random
import resource
import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shm_broadcast.codec import pickle_opt_in as codec_pickle
from shm_broadcast.codec import wire_format
from shm_broadcast.codec.message_codec import Codec, SourceFailure
from shm_broadcast.errors import DecodeError, GroupCoordError

#: Bytes worth writing over a length, count or dtype field.
INTERESTING = [b"\x00", b"\xff", b"\x7f", b"\x80", b"\xff\xff\xff\xff", b"\x00\x00\x00\x40",
               b"\xff\xff\xff\xff\xff\xff\xff\x7f", b"\x00\x00\x00\x00\x00\x00\x00\x80",
               b"\xfc\xff\xff\xff\xff\xff\xff\xff", b"\xdd", b"\xdf", b"\xc9", b"\xc7", b"\xd4",
               b"\xc6", b"\xdb"]


def corpus() -> list[tuple[bytes, bytes]]:
    """``(msg, blob)`` of valid messages covering every ext and array kind."""
    values: list[Any] = [
        None, 1, -(2**63), 2**64 - 1, 2**80, 1.5, "é", "a\udc80", b"\x00", bytearray(b"ba"),
        [1, [2, [3]]], {"a": 1, 2: "b"}, (1, (2,)), {1, 2}, frozenset({"x"}),
        {(1, 2): "tuple key", None: 3}, memoryview(b"mv"),
        memoryview(np.arange(6.0).reshape(2, 3)), np.float32(1.5), np.int64(-3),
        np.datetime64("2024-01-01", "D"), torch.Size([2, 3]), torch.bfloat16,
        torch.device("cpu"), SourceFailure("why"),
        torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor(2.5),
        torch.zeros(0, 3), torch.ones(3, dtype=torch.bfloat16, requires_grad=True),
        torch.nn.Parameter(torch.arange(4.0)), torch.tensor([1 + 2j]),
        np.arange(12, dtype=np.int16).reshape(3, 4), np.array(["ab"], dtype="S2"),
        np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8", (2,))]), np.zeros((0, 5)),
        {"step": 3, "ids": torch.arange(8), "meta": [(1, 2), {"k": np.ones(2)}]},
    ]
    out = []
    c = Codec()
    for v in values:
        enc = c.encode(v)
        out.append((bytes(enc.msg), bytes(enc.blob_bytes())))
    return out


def mutate(rng: random.Random, data: bytes, n: int | None = None) -> bytes:
    """``data`` with 1..4 random byte-level mutations."""
    buf = bytearray(data)
    for _ in range(n if n is not None else rng.randint(1, 4)):
        op = rng.randrange(7)
        pos = rng.randrange(len(buf) + 1)
        if op == 0 and buf:  # flip bits
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1:  # overwrite with an interesting value
            v = rng.choice(INTERESTING)
            buf[pos:pos + len(v)] = v
        elif op == 2:  # random byte
            if buf:
                buf[rng.randrange(len(buf))] = rng.randrange(256)
        elif op == 3:  # insert
            buf[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
        elif op == 4:  # delete
            del buf[pos:pos + rng.randint(1, 9)]
        elif op == 5:  # truncate
            del buf[pos:]
        else:  # duplicate a slice elsewhere (splice)
            a = rng.randrange(len(buf) + 1)
            buf[pos:pos] = buf[a:a + rng.randint(1, 16)]
    return bytes(buf)


def check_decode(fn: Callable[[], Any], what: str) -> None:
    """Run one decode: any result or DecodeError passes; anything else fails."""
    try:
        fn()
    except DecodeError:
        pass
    except Exception as e:
        raise AssertionError(f"{what}: {type(e).__name__}: {e}") from e


def _decode_one(c: Codec, msg: bytes, blob: bytes, blob_len: int, what: str) -> None:
    check_decode(lambda: c.decode(msg, blob, 0, blob_len), what)


def run_mutations(n: int, seed: int) -> int:
    """Decode ``n`` mutated messages (msg, blob or the declared blob length)."""
    rng = random.Random(seed)
    seeds = corpus()
    c = Codec()
    for i in range(n):
        msg, blob = rng.choice(seeds)
        where = rng.randrange(4)
        if where <= 1:
            msg = mutate(rng, msg)
        elif where == 2:
            blob = mutate(rng, blob)
        blob_len = len(blob)
        if where == 3 or rng.random() < 0.1:
            blob_len = rng.choice([0, len(blob) + 1, 1 << 30, rng.randrange(len(blob) + 64)])
            if where == 3:
                msg = mutate(rng, msg, 1)
        _decode_one(c, msg, blob, blob_len, f"case {i} (seed {seed})")
    return n


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.timeout(120)
def test_mutated_messages_raise_only_decode_error():
    before = _max_rss_mb()
    assert run_mutations(1500, seed=12) == 1500
    assert _max_rss_mb() - before < 256, "decoding mutated messages grew the process by >256 MB"


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed_index=st.integers(0, 10_000), ops=st.lists(
    st.tuples(st.integers(0, 6), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=9)),
    min_size=1, max_size=6))
def test_mutated_messages_hypothesis(seed_index, ops):
    msg, blob = _CORPUS[seed_index % len(_CORPUS)]
    buf = bytearray(msg)
    for op, pos, data in ops:
        pos %= len(buf) + 1
        if op <= 2:
            buf[pos:pos + len(data)] = data
        elif op == 3:
            buf[pos:pos] = data
        elif op == 4:
            del buf[pos:pos + len(data)]
        elif op == 5:
            del buf[pos:]
        else:
            buf[pos:pos] = buf[:len(data)]
    _decode_one(Codec(), bytes(buf), blob, len(blob), f"ops {ops}")


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.binary(max_size=64))
def test_random_bytes_raise_only_decode_error(msg, blob):
    _decode_one(Codec(), msg, blob, len(blob), repr(msg))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_mutated_messages_slow_100k():
    """The long run: over 100,000 mutated messages, several seeds."""
    before = _max_rss_mb()
    total = sum(run_mutations(25_500, seed=s) for s in (1, 2, 3, 4))
    assert total >= 100_000
    assert _max_rss_mb() - before < 256


_CORPUS = corpus()


# ---------------------------------------------------------------------- attacks
def _ext(code: int, data: bytes) -> bytes:
    return msgspec.msgpack.encode(msgspec.msgpack.Ext(code, data))


def _tensor_msg(nbytes: int, shape: tuple[int, ...], code: int = 0, off: int = 0) -> bytes:
    head = wire_format.TENSOR_HEAD.pack(off, nbytes, code, 0, len(shape))
    return _ext(wire_format.EXT_TENSOR, head + struct.pack(f"<{len(shape)}q", *shape))


def _array_msg(nbytes: int, shape: tuple[int, ...], descr: bytes) -> bytes:
    head = wire_format.ARRAY_HEAD.pack(0, nbytes, len(shape), len(descr))
    return _ext(wire_format.EXT_NDARRAY, head + struct.pack(f"<{len(shape)}q", *shape) + descr)


def _refused_without_allocating(msg: bytes, blob: bytes, blob_len: int, match: str) -> None:
    c = Codec()
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError, match=match):
            c.decode(msg, blob, 0, blob_len)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < (1 << 20), f"decoding a refused message allocated {peak} bytes"


@pytest.mark.timeout(30)
def test_attack_30_bytes_claiming_1gib_is_refused_without_allocating():
    torch.empty(0)  # the codec's torch tables exist before tracemalloc starts
    wire_format.TORCH.load()
    gib = 1 << 30
    claims = [
        # nbytes 0 but a shape of 1 GiB: numpy would allocate it
        (_tensor_msg(0, (gib // 4,)), b"", 0, "needs"),
        # nbytes 1 GiB, declared blob 1 GiB, but only 64 bytes present
        (_tensor_msg(gib, (gib // 4,)), bytes(64), gib, "beyond"),
        (_array_msg(0, (gib,), b"|u1"), b"", 0, "needs"),
        (_array_msg(gib, (1024,), b"|V1048576"), bytes(64), gib, "beyond"),
        # zero-size string dtypes: 0 data bytes fit any shape, but numpy makes
        # S0/U0 arrays S1/U1 and would allocate 1 or 4 bytes per element
        (_array_msg(0, (gib,), b"<U0"), b"", 0, "no item size"),
        (_array_msg(0, (gib,), b"|S0"), b"", 0, "no item size"),
        (_array_msg(0, (gib,), b"|S"), b"", 0, "no item size"),
        (_array_msg(0, (gib,), b"\x00" + msgspec.msgpack.encode("<U0")), b"", 0, "no item size"),
        # other 0-byte items: an array of them holds any number of elements in 0 bytes
        (_array_msg(0, (gib,), b"|V0"), b"", 0, "no item size"),
        (_array_msg(0, (gib,), b"\x00" + msgspec.msgpack.encode([])), b"", 0, "no item size"),
        (_array_msg(0, (gib,), b"\x00" + msgspec.msgpack.encode([["a", "<U0"]])), b"", 0,
         "no item size"),
        (_array_msg(0, (gib,), b"\x00" + msgspec.msgpack.encode([["a", "<f8", [0]]])), b"", 0,
         "no item size"),
    ]
    for msg, blob, blob_len, match in claims:
        assert len(msg) <= 48, len(msg)  # about 30-40 bytes
        _refused_without_allocating(msg, blob, blob_len, match)


@pytest.mark.timeout(30)
def test_attack_negative_shapes_are_refused():
    blob = bytes(64)
    _refused_without_allocating(_tensor_msg(16, (-4,)), blob, 64, "negative|needs")
    _refused_without_allocating(_tensor_msg(16, (-4, -1)), blob, 64, "negative")
    _refused_without_allocating(_array_msg(16, (-2, -2), b"<f4"), blob, 64, "negative")
    _refused_without_allocating(
        _tensor_msg(0, (0, 1 << 62, 1 << 62)), b"", 0, "corrupt")


@pytest.mark.timeout(30)
def test_attack_unknown_and_object_dtypes_are_refused():
    blob = bytes(64)
    _refused_without_allocating(_tensor_msg(8, (2,), code=250), blob, 64, "unknown tensor dtype")
    for descr in (b"|O", b"<O8", b"\x00" + msgspec.msgpack.encode([["a", "|O"]]),
                  b"not a dtype", b"\xff\xfe", b"(1, 2)", b"\x00\xc1"):
        with pytest.raises(DecodeError):
            Codec().decode(_array_msg(8, (1,), descr), blob, 0, 64)
    with pytest.raises(DecodeError, match="unknown ext code"):
        Codec().decode(_ext(99, b"x"), b"", 0, 0)
    with pytest.raises(DecodeError, match="unknown torch dtype"):
        Codec().decode(_ext(wire_format.EXT_TORCH_DTYPE, b"__class__"), b"", 0, 0)


@pytest.mark.timeout(30)
def test_attack_pickled_value_is_refused_without_unpickling(monkeypatch):
    """A pickle from a peer that opted in (or an attacker) is never loaded."""
    import pickle

    def boom(*a, **k):
        raise AssertionError("the decoder called into pickle")

    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(codec_pickle, "OobUnpickler", boom)
    msg = _ext(wire_format.EXT_PICKLE, pickle.dumps(print))
    with pytest.raises(DecodeError, match="allow_pickle"):
        Codec().decode(msg, b"", 0, 0)


@pytest.mark.timeout(30)
def test_decode_error_is_in_the_family():
    assert issubclass(DecodeError, GroupCoordError) and issubclass(DecodeError, ValueError)
    import coordinator
    import device_comms
    import shm_broadcast

    for pkg in (shm_broadcast, device_comms.errors, coordinator.errors):
        assert "DecodeError" in pkg.__all__ and pkg.DecodeError is DecodeError
    with pytest.raises(DecodeError, match="nested too deeply"):
        deep = b"\x91" * 100_000 + b"\xc0"  # 100,000 nested one-element arrays
        Codec().decode(_ext(wire_format.EXT_TUPLE, deep), b"", 0, 0)


@pytest.mark.timeout(30)
def test_valid_corpus_still_round_trips():
    c = Codec()
    for msg, blob in _CORPUS:
        c.decode(msg, blob, 0, len(blob))
    got = c.decode(*_CORPUS[-1], 0, len(_CORPUS[-1][1]))
    assert got["step"] == 3 and torch.equal(got["ids"], torch.arange(8))
    assert type(got["meta"][0]) is tuple and np.array_equal(got["meta"][1]["k"], np.ones(2))


@pytest.mark.parametrize("dtype", ["V0", "empty-struct"])
def test_arrays_of_zero_byte_items_need_pickle(dtype):
    """The decoder refuses 0-byte items, so the encoder does not send them out of
    band: without pickle they are a TypeError naming the dtype; with it they go
    in-band and round-trip."""
    a = np.zeros(5, dtype=np.dtype("V0") if dtype == "V0" else np.dtype([]))
    with pytest.raises(TypeError, match="0 bytes"):
        Codec().encode({"a": a})
    c = Codec(allow_pickle=True)
    enc = c.encode({"a": a})
    blob = enc.blob_bytes()
    got = c.decode(enc.msg, blob, 0, enc.blob_len)["a"]
    assert got.dtype == a.dtype and got.shape == a.shape


def _freed_tensor(n: int, keep_bytes: int = 0) -> torch.Tensor:
    t = torch.full((n,), 7.0)
    t.untyped_storage().resize_(keep_bytes)
    return t


@pytest.mark.parametrize("case", ["freed", "shrunk", "freed-view", "freed-in-pickle"])
def test_a_tensor_without_its_bytes_is_refused_before_any_copy(case):
    """Encoding copies tensors by address: a freed storage would crash the process
    and a shrunk one would send whatever the allocator put after it."""
    from shm_broadcast import EncodeError

    if case == "freed-view":
        base = torch.ones(64)
        t = base[8:].view(8, 7)
        base.untyped_storage().resize_(0)
    else:
        t = _freed_tensor(4096, 64 if case == "shrunk" else 0)
    codec = Codec(allow_pickle=case == "freed-in-pickle")
    value = {"a": [t]} if case != "freed-in-pickle" else {"a": [t, _Opaque()]}
    with pytest.raises(EncodeError, match="storage was freed or shrunk") as info:
        codec.encode(value)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


class _Opaque:
    """A value only pickle carries (its tensors then go out of band)."""


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_nested_tensors_are_refused_by_type(layout):
    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)
    with pytest.raises(TypeError, match="(?i)nested"):  # jagged ones are a subclass
        Codec().encode({"a": [nt]})

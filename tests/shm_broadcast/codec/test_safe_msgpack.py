"""The flood-safe msgpack decoder on its own: its routes, its quick walk, and its
Python reader, which must read every frame exactly as msgspec does."""

from __future__ import annotations

import datetime
import random
import struct
from typing import Any

import msgspec
import pytest

from shm_broadcast.codec import safe_msgpack
from shm_broadcast.codec.hash_flooding import HASH_RANDOMISED, MAX_SHARED_HASH
from shm_broadcast.codec.safe_msgpack import SMALL_FRAME, SafeDecoder
from shm_broadcast.errors import DecodeError
from tests.shm_broadcast.codec.flooding import array_key, colliding_pairs, native_map_frame

enc = msgspec.msgpack.encode
Ext = msgspec.msgpack.Ext


def _hook(code: int, data: memoryview) -> Any:
    return ("ext", code, bytes(data))


def _values() -> list[Any]:
    """Frames of every msgpack type, as msgspec (and exact=False writers) make them."""
    return [
        None, True, False, 0, 127, -1, -32, -33, 255, 256, 65535, 65536, 2**32, 2**64 - 1,
        -(2**63), -129, -32769, 1.5, float("inf"), "", "é" * 40, "x" * 300, "y" * 70000,
        b"", b"\x00" * 40, b"\xde" * 300, b"z" * 70000, [], [[]], {}, {"a": {"b": [1]}},
        list(range(100)), {str(i): i for i in range(40)}, {i: str(i) for i in range(40)},
        {(1, 2): 3, (4, (5, 6)): 7}, {1.5: "f", None: "n", True: "t", b"k": "b"},
        {frozenset({1}): 1}, [Ext(3, b"abc"), Ext(-5, b""), Ext(7, b"q" * 300)],
        datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc),
        [[[[[[[[[1, "deep"]]]]]]]]],
        {"big": [{"k": i, "v": b"b", "t": (i, i)} for i in range(300)]},
        # larger than SMALL_FRAME, one per route: the no-ext typed pass (its result is
        # returned), the typed passes with exts or bytes, the full walk, the reader
        list(range(5000)), [i / 3 for i in range(2000)],
        {f"k{i}": [i, "v", None, True, -i, 2**40] for i in range(800)},
        [list(range(10))] * 1000 + [Ext(3, b"x")], [b"x" * 10] * 1000,
        [["s", b"b"]] * 2000, [[[[[[[[[i]]]]]]]] for i in range(1000)],
        {(i, i): i for i in range(1000)}, {i + 0.5: i for i in range(1000)},
    ]


@pytest.mark.parametrize("value", _values(), ids=lambda v: repr(v)[:30])
def test_the_python_reader_reads_what_msgspec_reads(value):
    data = enc(value)
    want = msgspec.msgpack.Decoder(ext_hook=_hook).decode(data)
    assert safe_msgpack._Reader(data, _hook).read() == want
    assert SafeDecoder(_hook).decode(data) == want
    assert SafeDecoder(_hook).decode(memoryview(data)) == want
    assert SafeDecoder(_hook).decode(data, exts_likely=True) == want  # a hint, never a verdict


def test_float32_and_every_integer_width_read_alike():
    frames = [b"\xca" + struct.pack(">f", 1.25), b"\xcc\xff", b"\xcd\xff\xff", b"\xd0\x80",
              b"\xd1\x80\x00", b"\xd2\x80\x00\x00\x00", b"\xce\xff\xff\xff\xff",
              b"\xd9\x03abc", b"\xda\x00\x01q", b"\xdb\x00\x00\x00\x01r", b"\xc5\x00\x01s",
              b"\xc6\x00\x00\x00\x01t", b"\xc8\x00\x02\x05hi", b"\xc9\x00\x00\x00\x01\x05!",
              b"\xdc\x00\x01\x01", b"\xdd\x00\x00\x00\x01\x01", b"\xde\x00\x01\x01\x02",
              b"\xdf\x00\x00\x00\x01\x01\x02", b"\xd4\x01x", b"\xd8\x02" + b"y" * 16]
    for data in frames:
        want = msgspec.msgpack.Decoder(ext_hook=_hook).decode(data)
        assert safe_msgpack._Reader(data, _hook).read() == want, data


def test_malformed_frames_fail_in_the_reader_as_in_msgspec():
    rng = random.Random(37)
    seeds = [enc(v) for v in _values()]
    for _ in range(3000):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 3)):
            if not data:
                break
            pos = rng.randrange(len(data))
            action = rng.randrange(3)
            if action == 0:
                data[pos] = rng.randrange(256)
            elif action == 1:
                del data[pos:]
            else:
                data.insert(pos, rng.randrange(256))
        try:
            want: Any = msgspec.msgpack.Decoder(ext_hook=_hook).decode(bytes(data))
        except (msgspec.DecodeError, TypeError, ValueError):
            want = "error"
        try:
            got: Any = safe_msgpack._Reader(bytes(data), _hook).read()
        except (ValueError, TypeError, IndexError, UnicodeDecodeError, struct.error,
                RecursionError, msgspec.DecodeError):
            got = "error"
        assert repr(got) == repr(want), bytes(data)  # repr: NaN equals itself


@pytest.mark.skipif(not HASH_RANDOMISED, reason="without hash randomisation (PYTHONHASHSEED=0) "
                    "str keys are floodable, so the walk does not call their maps clean")
def test_the_walk_settles_frames_of_few_values_and_finds_floodable_maps():
    def quick(data: Any) -> str:
        return safe_msgpack._scan(data, safe_msgpack._QUICK_VALUES)[0]

    clean, floodable, unsettled = (safe_msgpack._CLEAN, safe_msgpack._FLOODABLE,
                                   safe_msgpack._UNSETTLED)
    assert quick(enc(b"x" * 70000)) == clean
    assert quick(memoryview(enc({"data": b"x" * 9000, "m": {"n": [1]}, "t": Ext(3, b"")}))) == clean
    assert quick(enc(list(range(100)))) == unsettled  # more values than it reads
    assert quick(enc({str(i): 0 for i in range(15)})) == clean
    assert quick(enc({(i,): 0 for i in range(5)})) == clean  # a fixmap: bounded anyway
    assert quick(enc({(i,): 0 for i in range(16)})) == floodable
    assert quick(enc({1.5 + i: 0 for i in range(16)})) == floodable
    assert safe_msgpack._scan(enc([{str(i): [i] for i in range(99)}] * 30), None)[0] == clean
    late = enc([list(range(3000)), {(i,): 0 for i in range(16)}])
    assert quick(late) == unsettled and safe_msgpack._scan(late, None)[0] == floodable
    assert safe_msgpack._scan(enc([Ext(3, b"x"), Ext(4, b"y" * 40)]), None) == (clean, True)
    assert safe_msgpack._scan(enc(["x", b"y"]), None) == (clean, False)
    frame = enc({"data": b"x" * 9000})
    for bad in (frame[:-1], frame + b"\x00", b"\xc1", b"\xdd\xff\xff\xff\xff"):
        assert quick(bad) == floodable  # malformed: the reader says where


def test_every_route_of_a_large_frame_refuses_a_colliding_map():
    pairs = colliding_pairs(MAX_SHARED_HASH + 1)
    colliding = native_map_frame([array_key(p) for p in pairs])
    pad = enc("p" * SMALL_FRAME)
    mixed = enc([["s", b"b"]] * 2000)  # str and bytes values: both typed passes refuse
    frames = {
        "alone": colliding,
        "beside-bytes": b"\x92" + enc(b"b" * SMALL_FRAME) + colliding,
        "deep": b"\x91" * (safe_msgpack.CHECKED_DEPTH + 2) + b"\x92" + pad + colliding,
        "after-many-values": b"\x92" + enc(list(range(SMALL_FRAME))) + colliding,
        "after-mixed-values": b"\x92" + mixed + colliding,
    }
    for name, data in frames.items():
        if len(data) <= SMALL_FRAME:
            data = b"\x92" + pad + data
        for exts_likely in (False, True):
            with pytest.raises(DecodeError, match="share one hash"):
                SafeDecoder(_hook).decode(data, exts_likely)
                pytest.fail(f"{name}, exts_likely={exts_likely}")


def test_a_small_frame_goes_to_msgspec_directly():
    # Its worst map is bounded by its size: fewer than SMALL_FRAME / 12 colliding
    # keys (these take 20 bytes each with their values).
    pairs = colliding_pairs(SMALL_FRAME // 20 - 1)
    data = native_map_frame([array_key(p) for p in pairs])
    assert len(data) <= SMALL_FRAME
    assert len(SafeDecoder(_hook).decode(data)) == len(pairs)

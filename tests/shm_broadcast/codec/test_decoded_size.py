"""Issue 37 (7): how much memory a decoded frame takes, per construct, and what stays.

``docs/security-codec.md`` states the bound: a decoded message takes at most
about 102 times its frame's bytes (the worst shapes are CPython's own small
containers: sets of 77 small ints, whose table has just grown to 512 slots,
small sets, one-entry dicts, empty lists), arrays at most about 24
times, and nothing of a message stays in the receiver once the message is
dropped beyond the bounded dtype cache. These tests measure each construct
with ``tracemalloc`` (which sees Python's and numpy's allocations).
"""

from __future__ import annotations

import gc
import struct
import tracemalloc
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from shm_broadcast.codec import wire_format as wf
from shm_broadcast.codec.message_codec import Codec

#: The bound docs/security-codec.md states for any frame (its table: at most 102x).
STATED_BOUND = 110
#: What arrays take at most (docs/security-codec.md: structured dtypes are the most).
ARRAY_BOUND = 32


def _array(items: bytes, n: int) -> bytes:
    return b"\xdd" + struct.pack(">I", n) + items


def _ext(code: int, payload: bytes) -> bytes:
    return msgspec.msgpack.encode(msgspec.msgpack.Ext(code, payload))


def _structured(fields: int, tag: int) -> bytes:
    """An empty array of a structured dtype with ``fields`` fields, distinct per ``tag``."""
    names = [f"t{tag}"] + [f"f{i}" for i in range(1, fields)]
    descr = b"\x00" + msgspec.msgpack.encode([[name, "|b1"] for name in names])
    head = wf.ARRAY_HEAD.pack(0, 0, 1, len(descr)) + struct.pack("<q", 0)
    return _ext(wf.EXT_NDARRAY, head + descr)


@pytest.fixture
def empty_dtype_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(wf, "_DTYPE_CACHE", {})
    monkeypatch.setattr(wf, "_dtype_cache_bytes", 0, raising=False)
    yield


def _traced(fn):  # type: ignore[no-untyped-def]
    """``(result, bytes traced while it is alive, bytes still traced once it is dropped)``."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        out = fn()
        alive = tracemalloc.get_traced_memory()[0] - base
        del out
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    return alive, kept


@pytest.mark.timeout(60)
def test_attack_structured_dtypes_do_not_stay_in_the_receiver(empty_dtype_cache):
    # The frame: arrays of distinct structured dtypes with thousands of
    # fields. The dtypes used to stay in the process-wide cache (256 of any size)
    # after the message was dropped: about 12 times the frame, for good.
    arrays = [_structured(2000, tag) for tag in range(64)]
    msg = _array(b"".join(arrays), len(arrays))
    alive, kept = _traced(lambda: Codec().decode(msg, b"", 0, 0))
    assert alive < ARRAY_BOUND * len(msg), (alive, len(msg))
    assert kept < ARRAY_BOUND * wf.DTYPE_CACHE_BYTES, (kept, len(msg))
    assert sum(map(len, wf._DTYPE_CACHE)) <= wf.DTYPE_CACHE_BYTES


def test_small_structured_dtypes_are_still_shared_through_the_cache(empty_dtype_cache):
    codec = Codec()
    value = [np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8", (2,))]) for _ in range(3)]
    enc = codec.encode(value)
    back = codec.decode(enc.msg, enc.blob_bytes(), 0, enc.blob_len)
    assert back[0].dtype is back[1].dtype is back[2].dtype


_N = 50_000
_CONSTRUCTS = {
    "empty lists": _array(b"\x90" * _N, _N),
    "empty dicts": _array(b"\x80" * _N, _N),
    "one-entry dicts": _array(b"\x81\x01\x00" * _N, _N),
    "sets of five small ints": _array(_ext(wf.EXT_SET, b"\x95\x00\x01\x02\x03\x04") * _N, _N),
    # 77 items: a set's table has just grown (to 512 slots, 8 KiB) for 83 bytes of frame
    "sets of 77 small ints": _array(
        _ext(wf.EXT_SET, b"\xdc\x00\x4d" + bytes(range(77))) * 2000, 2000),
    "empty sets": _array(_ext(wf.EXT_SET, b"\x90") * _N, _N),
    "two-char strings": _array(b"\xa2ab" * _N, _N),
    "ints of 16 bits": _array(b"\xcd\x10\x00" * _N, _N),
}


@pytest.mark.parametrize("name", list(_CONSTRUCTS))
def test_decoded_size_is_within_the_stated_bound(name):
    msg = _CONSTRUCTS[name]
    alive, _ = _traced(lambda: Codec().decode(msg, b"", 0, 0))
    assert alive <= STATED_BOUND * len(msg), (name, alive / len(msg))


def test_arrays_take_a_small_multiple_of_their_descriptors(empty_dtype_cache):
    plain = Codec().encode(np.zeros((), np.float32))
    structured = [_structured(8, tag) for tag in range(2000)]
    for msg, blob in ((_array(plain.msg * _N, _N), plain.blob_bytes()),
                      (_array(b"".join(structured), len(structured)), b"")):
        alive, _ = _traced(lambda msg=msg, blob=blob: Codec().decode(msg, blob, 0, len(blob)))
        assert alive <= ARRAY_BOUND * (len(msg) + len(blob)), alive / len(msg)

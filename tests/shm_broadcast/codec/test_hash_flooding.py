"""Issue 37: the codec's decoder against hash flooding.

A set, frozenset or dict whose items share one hash costs time quadratic in
their number to build (60,000 crafted items: tens of seconds before the fix,
see docs/security-codec.md). Each
attack below decodes a real crafted frame through ``Codec.decode`` and must be
refused with :class:`DecodeError` within a few seconds; legitimate data that
shares hashes a little (``hash(-1) == hash(-2)``) still decodes.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from collections.abc import Callable

import msgspec
import numpy as np
import pytest

from shm_broadcast.codec import wire_format as wf
from shm_broadcast.codec.hash_flooding import (
    HASH_RANDOMISED,
    MAX_COLLISIONS,
    MAX_SHARED_HASH,
    CollisionBudget,
    check_spread,
)
from shm_broadcast.codec.message_codec import Codec
from shm_broadcast.codec.safe_msgpack import SMALL_FRAME
from shm_broadcast.errors import DecodeError
from tests.shm_broadcast.codec.flooding import (
    BOUND_S,
    N,
    array_key,
    bigint_key,
    codec_pairs_frame,
    codec_set_frame,
    colliding_bigints,
    colliding_pairs,
    ext_frame,
    native_map_frame,
    nested_frozensets_frame,
    tuple_key,
)


@pytest.fixture(scope="module")
def pairs() -> list[tuple[int, int]]:
    out = colliding_pairs(N)
    # distinct first items: distinct tuples (a set of them would take the quadratic time)
    assert len({hash(p) for p in out}) == 1 and len({a for a, _ in out}) == N
    return out


@pytest.fixture(scope="module")
def bigints() -> list[int]:
    out = colliding_bigints(N)
    assert len({hash(v) for v in out}) == 1
    return out


def _refused_quickly(msg: bytes) -> str:
    """Decode ``msg``: it must raise DecodeError within BOUND_S; returns the message."""
    start = time.monotonic()
    with pytest.raises(DecodeError, match="share one hash") as info:
        Codec().decode(msg, b"", 0, 0)
    took = time.monotonic() - start
    assert took < BOUND_S, f"refusing took {took:.1f} s"
    return str(info.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code", [wf.EXT_SET, wf.EXT_FROZENSET], ids=["set", "frozenset"])
def test_attack_a_set_of_colliding_tuples_is_refused(pairs, code):
    text = _refused_quickly(codec_set_frame([tuple_key(p) for p in pairs], code))
    assert f"{N} items" in text and f"at most {MAX_SHARED_HASH}" in text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("keys", ["tuples", "bigints"])
def test_attack_a_dict_of_colliding_keys_is_refused(pairs, bigints, keys):
    encoded = ([tuple_key(p) for p in pairs] if keys == "tuples"
               else [bigint_key(v) for v in bigints])
    _refused_quickly(codec_pairs_frame(encoded))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("keys", ["arrays", "tuple-exts", "bigint-exts"])
def test_attack_a_plain_msgpack_map_of_colliding_keys_is_refused(pairs, bigints, keys):
    # msgspec itself builds plain maps, and reads an array key as a tuple and an
    # ext key through the hook: this map never reaches the codec's ext code.
    encoded = {"arrays": lambda: [array_key(p) for p in pairs],
               "tuple-exts": lambda: [tuple_key(p) for p in pairs],
               "bigint-exts": lambda: [bigint_key(v) for v in bigints]}[keys]()
    _refused_quickly(native_map_frame(encoded))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("inside_ext", [False, True], ids=["in-a-dict", "in-a-tuple-ext"])
def test_attack_a_colliding_map_deep_in_ordinary_data_is_refused(pairs, inside_ext):
    colliding = native_map_frame([array_key(p) for p in pairs[:20_000]])
    if inside_ext:  # a tuple holding the map: its payload is decoded by the ext hook
        colliding = msgspec.msgpack.encode(
            msgspec.msgpack.Ext(wf.EXT_TUPLE, b"\x91" + colliding))
    enc = msgspec.msgpack.encode
    msg = b"\x82" + enc("pad") + enc(list(range(3000))) + enc("m") + b"\x91" + colliding
    _refused_quickly(msg)


def test_items_up_to_the_bound_may_share_a_hash():
    # hash(-1) == hash(-2): tuples that differ only in -1/-2 at k places share a hash.
    def grid(k: int) -> set[tuple[int, ...]]:
        return {tuple((i >> j) & 1 and -1 or -2 for j in range(k)) + (7,) for i in range(2 ** k)}

    ok, too_many = grid(4), grid(5)
    assert len({hash(t) for t in ok}) == 1 and len(ok) == MAX_SHARED_HASH
    codec = Codec()
    for value in (ok, frozenset(ok), dict.fromkeys(ok, 1), [ok] * 400):
        enc = codec.encode(value)
        assert codec.decode(enc.msg, b"", 0, 0) == value
    enc = codec.encode(too_many)
    with pytest.raises(DecodeError, match="32 of them share one hash"):
        codec.decode(enc.msg, b"", 0, 0)


@pytest.mark.parametrize("make", [
    lambda: {(i, -i): [i] for i in range(3000)},           # tuple keys, pairs
    lambda: {frozenset({i, i + 1}) for i in range(3000)},  # a set of frozensets
    lambda: {2**70 + i: i for i in range(3000)},           # big-int keys
    lambda: {"s": {(i, i) for i in range(3000)}, "b": b"\xde\xdf" * 3000},
], ids=["tuple-keys", "frozensets", "bigint-keys", "set-and-bytes"])
def test_large_ordinary_sets_and_dicts_still_round_trip(make: Callable[[], object]):
    value = make()
    codec = Codec()
    enc = codec.encode(value)
    assert len(enc.msg) > SMALL_FRAME
    assert codec.decode(enc.msg, b"", 0, 0) == value


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shift", [0, 30, 40, 41])
def test_counting_the_hashes_stays_linear_for_crafted_hash_values(shift):
    # Distinct hash values sharing their low bits lengthen the counting dict's
    # probe sequences by a bounded number of steps, never more: 2**18 values
    # cost a fraction of a second (a quadratic count would take hours).
    values = [i << shift for i in range(1, (1 << 18) + 1)]
    start = time.monotonic()
    check_spread(values, len(values), "a set")
    assert time.monotonic() - start < BOUND_S


def test_unhashable_items_are_still_malformed():
    msg = codec_set_frame([msgspec.msgpack.encode([1]) for _ in range(MAX_SHARED_HASH + 1)])
    with pytest.raises(DecodeError, match="unhashable"):
        Codec().decode(msg, b"", 0, 0)


# ------------------------------------------------- payloads decoded on their own
def _refused_within_bound(msg: bytes, match: str) -> None:
    start = time.monotonic()
    with pytest.raises(DecodeError, match=match):
        Codec().decode(msg, b"", 0, 0)
    took = time.monotonic() - start
    assert took < BOUND_S, f"refusing took {took:.1f} s"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("code", "match"), [
    (wf.EXT_MEMORYVIEW, "a memoryview must be"),
    (wf.EXT_NPSCALAR, "a numpy scalar must be"),
], ids=["memoryview", "npscalar"])
def test_attack_a_colliding_map_in_a_fixed_layout_payload_is_refused_unbuilt(pairs, code, match):
    # These payloads have a fixed layout, decoded with a typed decoder: a map in
    # them is refused at its first byte (the untyped decode built all of it first).
    _refused_within_bound(ext_frame(code, native_map_frame([array_key(p) for p in pairs])),
                          match)


@pytest.mark.timeout(60)
def test_attack_a_colliding_map_in_a_structured_dtype_descriptor_is_refused_unbuilt(pairs):
    # The descriptor length is 16 bits: at most ~3,300 colliding keys fit, so
    # the old cost per array was bounded; what shows the map is not built is
    # that the typed decode refuses it (the untyped one returned a dict, which
    # numpy then refused).
    keys = [array_key(p) for p in pairs[:3000]]
    descr = b"\x00" + native_map_frame(keys)
    head = wf.ARRAY_HEAD.pack(0, 0, 1, len(descr)) + struct.pack("<q", 0)
    msg = ext_frame(wf.EXT_NDARRAY, head + descr)
    _refused_within_bound(msg, "bad array dtype \\(ValidationError")


def test_fixed_layout_payloads_still_round_trip():
    codec = Codec()
    value = [memoryview(b"abcdef").cast("B", (2, 3)), np.float32(1.5),
             np.zeros(2, dtype=[("a", "<i4"), ("b", [("c", "<f8", (2,))])])]
    enc = codec.encode(value)
    blob = enc.blob_bytes()
    got = codec.decode(enc.msg, blob, 0, enc.blob_len)
    assert got[0].tolist() == value[0].tolist() and got[1] == value[1]
    assert got[2].dtype == value[2].dtype


# ------------------------------------------------- nested colliding frozensets
@pytest.mark.timeout(60)
def test_attack_nested_colliding_frozensets_are_refused():
    # Each frozenset is within the bound per container, but every level
    # multiplies the cost of comparing them (quadratic in the frame; see
    # docs/security-codec.md). The message-wide collision budget refuses it.
    msg = nested_frozensets_frame(4)
    _refused_within_bound(msg, f"more than {MAX_COLLISIONS}")


def test_the_collision_budget_is_per_message():
    # hash(-1) == hash(-2): each frozenset holds one collision among tuples.
    value = [frozenset({(-1,), (-2,)}) for _ in range(MAX_COLLISIONS * 3 // 4)]
    codec = Codec()
    for _ in range(3):  # the same Codec: the budget starts afresh for each message
        enc = codec.encode(value)
        assert codec.decode(enc.msg, b"", 0, 0) == value
    enc = codec.encode(value * 2)
    with pytest.raises(DecodeError, match=f"more than {MAX_COLLISIONS}"):
        codec.decode(enc.msg, b"", 0, 0)


def test_frozensets_of_scalars_do_not_draw_on_the_budget():
    value = [frozenset({-1, -2, 5}) for _ in range(MAX_COLLISIONS * 4)]
    codec = Codec()
    enc = codec.encode(value)
    assert codec.decode(enc.msg, b"", 0, 0) == value


def test_collision_budget_alone():
    budget = CollisionBudget()
    budget.take(MAX_COLLISIONS, "a frozenset")
    with pytest.raises(DecodeError, match="a frozenset"):
        budget.take(1, "a frozenset")
    budget.reset()
    budget.take(MAX_COLLISIONS, "a frozenset")
    items = [(-1,), (-2,), (-1, 0), (-2, 0)]
    budget.reset()
    check_spread(items, len(items), "a frozenset", budget)
    assert budget.left == MAX_COLLISIONS - 2


@pytest.mark.timeout(60)
def test_str_keys_are_counted_without_hash_randomisation():
    code = ("import sys; from shm_broadcast.codec import hash_flooding as h; "
            "assert sys.flags.hash_randomization == 0 and not h.HASH_RANDOMISED; "
            "from shm_broadcast.codec.message_codec import Codec; c = Codec(); "
            "v = [{str(i): i for i in range(3000)}, {b'%d' % i for i in range(3000)}]; "
            "e = c.encode(v); assert c.decode(e.msg, b'', 0, 0) == v")
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=30)
    assert bool(sys.flags.hash_randomization) == HASH_RANDOMISED

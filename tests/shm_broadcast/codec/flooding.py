"""Crafted hash collisions, the frames that carry them, and the attacks' sizes.

Python's hashes of tuples and ints are not keyed, so a peer can compute values
that all share one hash:

* an int hashes to its value modulo ``2**61 - 1``: ``k * (2**61 - 1) + c`` for
  every ``k`` share the hash of ``c`` (ints beyond 64 bits: ``EXT_BIGINT``);
* a tuple's hash (CPython 3.8+, xxHash's combine) of ``(a, b)`` is
  ``rotl(rotl(P5 + h(a) * P2, 31) * P1 + h(b) * P2, 31) * P1 + ...`` modulo
  ``2**64``; for any ``a`` the ``b`` that makes the inner sum hit a chosen
  value solves one multiplication by ``P2``, which is invertible, and is an
  int64 whenever the needed ``h(b)`` is a possible int hash (about one ``a`` in
  four).

:func:`colliding_pairs` and :func:`colliding_bigints` build such values in a
fraction of a second; the ``*_frame`` helpers wrap them as the codec
(:class:`~shm_broadcast.codec.message_codec.Codec`) and the object exchanges
(:mod:`shm_broadcast.ranks.group_adapter`) carry sets, dicts and maps.
"""

from __future__ import annotations

import random
import struct

import msgspec

from shm_broadcast.codec import wire_format as wf

__all__ = ["colliding_pairs", "colliding_bigints", "codec_set_frame", "codec_pairs_frame",
           "native_map_frame", "array_key", "tuple_key", "bigint_key", "adapter_frame",
           "ADAPTER_TUPLE", "ADAPTER_SET", "ADAPTER_PAIRS", "ADAPTER_FROZENSET",
           "nested_frozensets_frame", "ext_frame", "N", "BOUND_S"]

#: Items per attack: enough that building the container took tens of seconds before the fix.
N = 60_000
#: What a refusal may take: a generous bound, far below the quadratic build's time.
BOUND_S = 5.0

_MASK = (1 << 64) - 1
_P1, _P2, _P5 = 11400714785074694791, 14029467366897019727, 2870177450012600261
_MODULUS = (1 << 61) - 1
_INV_P2 = pow(_P2, -1, 1 << 64)
#: The ext codes of shm_broadcast.ranks.group_adapter's own format.
ADAPTER_TUPLE, ADAPTER_SET, ADAPTER_FROZENSET, ADAPTER_PAIRS = 1, 2, 3, 4


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _MASK


def _int_with_hash(lane: int) -> int | None:
    """An int64 whose ``hash`` is ``lane`` (read as a signed 64-bit value), if any."""
    signed = lane - (1 << 64) if lane >> 63 else lane
    if 0 <= signed < _MODULUS or (-_MODULUS < signed < 0 and signed != -1):
        return signed
    return None


def colliding_pairs(n: int, seed: int = 37) -> list[tuple[int, int]]:
    """``n`` distinct 2-tuples of int64s that all share one hash."""
    rng = random.Random(seed)
    target = rng.getrandbits(64)
    out: list[tuple[int, int]] = []
    seen: set[int] = set()
    while len(out) < n:
        a = rng.randrange(-(1 << 62), 1 << 62)
        acc = _rotl((_P5 + (hash(a) & _MASK) * _P2) & _MASK, 31) * _P1 & _MASK
        b = _int_with_hash((target - acc) * _INV_P2 & _MASK)
        if b is not None and a not in seen:
            seen.add(a)
            out.append((a, b))
    return out


def colliding_bigints(n: int, residue: int = 12345) -> list[int]:
    """``n`` distinct ints beyond 64 bits that share the hash of ``residue``."""
    return [k * _MODULUS + residue for k in range(1 << 4, (1 << 4) + n)]


def _array(items: list[bytes]) -> bytes:
    return b"\xdd" + struct.pack(">I", len(items)) + b"".join(items)


def _ext(code: int, payload: bytes) -> bytes:
    return msgspec.msgpack.encode(msgspec.msgpack.Ext(code, payload))


def tuple_key(pair: tuple[int, int], code: int = wf.EXT_TUPLE) -> bytes:
    """A tuple as an ext (the codec's ``EXT_TUPLE``, or ``code``)."""
    return _ext(code, msgspec.msgpack.encode(list(pair)))


def array_key(pair: tuple[int, int]) -> bytes:
    """A plain msgpack array, which msgspec reads as a tuple in a map key."""
    return msgspec.msgpack.encode(list(pair))


def bigint_key(value: int) -> bytes:
    """An int beyond 64 bits as the codec's ``EXT_BIGINT``."""
    size = value.bit_length() // 8 + 1
    return _ext(wf.EXT_BIGINT, value.to_bytes(size, "little", signed=True))


def codec_set_frame(items: list[bytes], code: int = wf.EXT_SET) -> bytes:
    """The codec's message of a set (or frozenset) of these encoded items."""
    return _ext(code, _array(items))


def codec_pairs_frame(keys: list[bytes], code: int = wf.EXT_DICT_PAIRS) -> bytes:
    """A dict of these encoded keys (values 0) as ``[key, value]`` pairs in an ext."""
    return _ext(code, _array([b"\x92" + k + b"\x00" for k in keys]))


def native_map_frame(keys: list[bytes]) -> bytes:
    """A plain msgpack map of these encoded keys (values 0)."""
    return b"\xdf" + struct.pack(">I", len(keys)) + b"".join(k + b"\x00" for k in keys)


def adapter_frame(msgpack: bytes) -> bytes:
    """The bytes :func:`shm_broadcast.ranks.group_adapter.decode_object` reads."""
    return b"m" + msgpack


def ext_frame(code: int, payload: bytes) -> bytes:
    """A message that is one ext of ``code`` holding ``payload``."""
    return _ext(code, payload)


def nested_frozensets_frame(depth: int, tuple_code: int = wf.EXT_TUPLE,
                            frozenset_code: int = wf.EXT_FROZENSET, width: int = 16) -> bytes:
    """A frozenset of ``width`` frozensets of ... (``depth`` levels) of colliding tuples.

    Every frozenset holds ``width`` items of one hash (within the bound per
    container), and as ``width`` is even the frozensets of one level share one
    hash too (xor of an even number of equal item hashes cancels): comparing two
    of them compares their items pairwise, so each level multiplies the cost of
    building the outermost one (``width ** (2 * depth)`` comparisons).
    """
    pool = [tuple_key(p, tuple_code) for p in colliding_pairs(width + 1)]
    for _ in range(depth - 1):
        pool = [_ext(frozenset_code, _array([x for j, x in enumerate(pool) if j != i]))
                for i in range(width + 1)]
    return _ext(frozenset_code, _array(pool[:width]))

"""msgpack decoding in time linear in the input, whatever a peer put in its maps.

msgspec builds a msgpack map with ``PyDict_SetItem`` as it reads it, and a
map's keys may be arrays (read as tuples), exts (whatever the ext hook
returns: tuples, frozensets, ints beyond 64 bits) or floats: a peer can make
any number of those share one hash (:mod:`shm_broadcast.codec.hash_flooding`),
and then building the dict takes time quadratic in its size, inside msgspec,
with no hook to stop it. Maps of str, bytes and int keys (ints of 64 bits, as
msgpack carries them; str and bytes only under hash randomisation, else
they count as other keys) cannot be flooded, nor can a map of at most 15 keys (a
*fixmap*) be flooded far. So :class:`SafeDecoder` hands msgspec a frame only
once it is known to hold no large map with other keys:

1. a frame of at most :data:`SMALL_FRAME` bytes goes to msgspec directly (the
   cost of its worst map is bounded by its size; see the bound below);
2. :func:`_scan` walks the frame's structure (in Python, skipping the bytes of
   strings and exts) for up to :data:`_QUICK_VALUES` values: a frame whose bulk
   is a few large strings, bytes or arrays is settled in a few steps;
3. a typed msgspec pass (:func:`_validator`) accepts a frame exactly when its
   maps (down to :data:`CHECKED_DEPTH` levels of containers) have str or int
   keys and its values are not both str and bytes (a msgspec union cannot hold
   both: one pass allows str values, the other bytes); exts are opaque to it,
   their payloads are decoded, and checked, when the ext hook reads them;
4. else :func:`_scan` walks the whole frame, checking the keys of every map of
   more than 15 keys.

A frame with such a map (which a writer with ``exact=False`` sends, and an
attacker crafts) is read by :class:`_Reader`, in Python: it builds a map whose
keys are not all str, int, bytes, bool or None under
:func:`~shm_broadcast.codec.hash_flooding.check_spread`, so more than
:data:`~shm_broadcast.codec.hash_flooding.MAX_SHARED_HASH` keys on one hash raise
:class:`~shm_broadcast.errors.DecodeError`. It returns what msgspec would (same
types, tuples for array keys, ``datetime`` for the timestamp ext).

Cost bound: a frame read by msgspec directly holds fewer than
``SMALL_FRAME / 12`` keys of one hash in one map (a colliding key takes at
least 11 bytes and its value one), hence at most about
``(SMALL_FRAME / 12) ** 2 / 2`` key comparisons, less per byte than the Python
reader's own cost; any other frame costs at most two typed passes, a walk and
the Python reader, each linear in its bytes.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import struct
from collections.abc import Callable
from types import GenericAlias
from typing import Any

import msgspec

from shm_broadcast.codec.hash_flooding import HASH_RANDOMISED, check_spread

__all__ = ["SMALL_FRAME", "CHECKED_DEPTH", "SafeDecoder"]

#: Frames up to this many bytes go to msgspec unchecked (their worst map is bounded).
SMALL_FRAME = 8192
#: Levels of nested containers the typed pass checks; a frame nested deeper fails
#: it and is walked in full (:func:`_scan`), then decoded by msgspec unless the
#: walk finds a map of more than 15 keys of other types.
CHECKED_DEPTH = 6

#: Values the first :func:`_scan` reads before leaving a frame to the typed passes.
_QUICK_VALUES = 32

_Hook = Callable[[int, memoryview], Any]
#: Map keys the typed pass accepts: str ones only while their hashes are keyed.
_KEY: Any = str | int if HASH_RANDOMISED else int


class SafeDecoder:
    """msgspec's untyped decoder with ``ext_hook``, routed as the module docstring says.

    Args:
        ext_hook: Called with ``(code, payload)`` for every ext, as msgspec's.

    Attributes:
        fast: The plain msgspec decoder, for callers that check
            ``len(data) <= SMALL_FRAME`` themselves (the per-message path).
    """

    __slots__ = ("fast", "_hook")

    def __init__(self, ext_hook: _Hook) -> None:
        self.fast = msgspec.msgpack.Decoder(ext_hook=ext_hook)
        self._hook = ext_hook

    def decode(self, data: Any, exts_likely: bool = False) -> Any:
        """The object of msgpack ``data`` (any buffer); ``exts_likely`` as in
        :meth:`decode_large`."""
        if len(data) <= SMALL_FRAME:
            return self.fast.decode(data)
        return self.decode_large(data, exts_likely)

    def decode_large(self, data: Any, exts_likely: bool = False) -> Any:
        """:meth:`decode` for a frame known to be larger than :data:`SMALL_FRAME`.

        Args:
            data: The frame.
            exts_likely: The caller expects exts in the frame (a message that
                carries arrays holds one per array). Only the order of the
                typed passes depends on it, never what is accepted: without
                exts the typed pass that refuses them returns the value in one
                pass, and with exts it fails at the first one, a pass wasted,
                so a caller that knows better says so.

        Raises:
            msgspec.DecodeError: ``data`` is malformed.
            DecodeError: A map's keys share hashes beyond the bound.
        """
        verdict, exts = _scan(data, _QUICK_VALUES)
        if verdict is _UNSETTLED:
            if not (exts or exts_likely):  # likely none: the typed pass's result is the value
                with contextlib.suppress(msgspec.ValidationError):
                    return _validator(str, False).decode(data)
            if _passes(_validator(str, True), data) or _passes(_validator(bytes, True), data):
                return self.fast.decode(data)
            verdict, _ = _scan(data, None)
        if verdict is _FLOODABLE:
            return _Reader(data, self._hook).read()
        return self.fast.decode(data)  # a malformed frame raises here


def _passes(validator: msgspec.msgpack.Decoder[Any], data: Any) -> bool:
    """Whether ``validator`` accepts ``data`` (a malformed frame is not accepted:
    the walk then finds where, and the Python reader reports it)."""
    try:
        validator.decode(data)
    except msgspec.DecodeError:  # ValidationError included
        return False
    return True


@functools.cache
def _validator(text: type, exts: bool) -> msgspec.msgpack.Decoder[Any]:
    """A typed decoder that accepts a frame exactly when every map in it (down to
    :data:`CHECKED_DEPTH` levels) has str or int keys, every string value is of
    type ``text`` (``str`` or ``bytes``: a msgspec union cannot hold both) and,
    unless ``exts``, no value is an ext. Without exts, what it returns is what
    the untyped decoder returns (the same types: a union's ``int`` takes the
    ints, ``float`` the floats).

    msgspec supports no recursive types, so the type is unrolled (its size
    doubles with each level). Built on first use, not at import.
    """
    scalar: Any = None | bool | int | float | text
    if exts:
        scalar = scalar | msgspec.msgpack.Ext
    node = scalar
    for _ in range(CHECKED_DEPTH):  # the types are built at run time: no annotations
        node = scalar | GenericAlias(list, (node,)) | GenericAlias(dict, (_KEY, node))
    return msgspec.msgpack.Decoder(node)


# ---------------------------------------------------------------- the walk
_FIXED, _SIZED, _EXT, _ARRAY, _MAP, _STOP = range(6)
#: Key type bytes whose keys cannot be flooded: fixint, nil, bools, ints of
#: 8-64 bits, negative fixint; and str and bin (fixstr, str8-32, bin8-32) while
#: their hashes are keyed (:data:`~shm_broadcast.codec.hash_flooding.HASH_RANDOMISED`).
_PLAIN_KEY_OPS = frozenset(
    [*range(0x00, 0x80), 0xc0, 0xc2, 0xc3, *range(0xcc, 0xd4), *range(0xe0, 0x100)]
    + ([*range(0xa0, 0xc0), 0xc4, 0xc5, 0xc6, 0xd9, 0xda, 0xdb] if HASH_RANDOMISED else []))
_Count = Callable[[Any, int], tuple[int]]
_COUNTS: dict[int, _Count] = {1: struct.Struct(">B").unpack_from,
                              2: struct.Struct(">H").unpack_from,
                              4: struct.Struct(">I").unpack_from}


def _op_table() -> list[tuple[int, int, int, _Count | None]]:
    """``(kind, n, width, read)`` per type byte: a value of ``n`` bytes
    (``_FIXED``); a length (read by ``read`` from ``width`` bytes, or ``n`` when
    there are none) then that many bytes (``_SIZED``; ``_EXT``: plus the type
    byte); a container of ``n`` items or of a count read from ``width`` bytes."""
    table: list[tuple[int, int, int, _Count | None]] = [(_STOP, 0, 0, None)] * 256

    def put(ops: Any, kind: int, n: int, width: int = 0) -> None:
        for op in ops:
            table[op] = (kind, n, width, _COUNTS.get(width))

    put([*range(0x00, 0x80), *range(0xe0, 0x100), 0xc0, 0xc2, 0xc3], _FIXED, 1)
    put((0xcc, 0xd0), _FIXED, 2)
    put((0xcd, 0xd1), _FIXED, 3)
    put((0xce, 0xd2, 0xca), _FIXED, 5)
    put((0xcf, 0xd3, 0xcb), _FIXED, 9)
    for op in range(0xa0, 0xc0):
        put((op,), _FIXED, 1 + (op & 0x1f))
    for op, n in zip(range(0xd4, 0xd9), (1, 2, 4, 8, 16), strict=True):
        put((op,), _EXT, n)
    for ops, width in (((0xc4, 0xd9), 1), ((0xc5, 0xda), 2), ((0xc6, 0xdb), 4)):
        put(ops, _SIZED, 0, width)
    for op, width in ((0xc7, 1), (0xc8, 2), (0xc9, 4)):
        put((op,), _EXT, 0, width)
    for op in range(0x90, 0xa0):
        put((op,), _ARRAY, op & 0x0f)
    for op in range(0x80, 0x90):
        put((op,), _MAP, op & 0x0f)
    put((0xdc,), _ARRAY, 0, 2)
    put((0xdd,), _ARRAY, 0, 4)
    put((0xde,), _MAP, 0, 2)
    put((0xdf,), _MAP, 0, 4)
    return table  # 0xc1 (never used) stays _STOP


_OPS = _op_table()


#: What :func:`_scan` finds.
_CLEAN, _FLOODABLE, _UNSETTLED = "clean", "floodable", "unsettled"


def _scan(data: Any, budget: int | None) -> tuple[str, bool]:
    """Walk the structure of msgpack ``data`` (the bytes of strings and exts skipped).

    Returns:
        The verdict: ``_CLEAN``: the frame is one well-formed value, and every
        map of more than 15 keys in it has keys of :data:`_PLAIN_KEY_OPS`
        types; ``_FLOODABLE``: a larger map has another key, or the frame is
        malformed (the Python reader then reads it, or reports where it
        fails); ``_UNSETTLED``: ``budget`` values were read before either was
        known. And whether an ext was among the values read.
    """
    end, pos, left, keys, exts = len(data), 0, 1, False, False
    stack: list[tuple[int, bool]] = []
    steps, ops, plain_keys = 0, _OPS, _PLAIN_KEY_OPS
    while True:
        while not left:
            if not stack:
                return (_CLEAN if pos == end else _FLOODABLE), exts
            left, keys = stack.pop()
        if steps == budget:
            return _UNSETTLED, exts
        steps += 1
        if pos >= end:
            return _FLOODABLE, exts
        op = data[pos]
        if keys and not left & 1 and op not in plain_keys:
            return _FLOODABLE, exts
        kind, n, width, read = ops[op]
        left -= 1
        if not kind:  # _FIXED
            pos += n
            continue
        if kind == _STOP or pos + 1 + width > end:
            return _FLOODABLE, exts
        if read is not None:
            n = read(data, pos + 1)[0]
        pos += 1 + width
        if kind == _SIZED:
            pos += n
        elif kind == _EXT:
            pos += 1 + n
            exts = True
        else:
            stack.append((left, keys))
            left, keys = (2 * n, n > 15) if kind == _MAP else (n, False)


# ---------------------------------------------------------------- the Python reader
_B1, _B2, _B4, _B8 = (struct.Struct(f">{c}").unpack_from for c in "BHIQ")
_I1, _I2, _I4, _I8 = (struct.Struct(f">{c}").unpack_from for c in "bhiq")
_F4, _F8 = struct.Struct(">f").unpack_from, struct.Struct(">d").unpack_from
#: Sizes of the fixed-length ext payloads (fixext 1, 2, 4, 8, 16).
_FIXEXT = {0xd4: 1, 0xd5: 2, 0xd6: 4, 0xd7: 8, 0xd8: 16}


class _Reader:
    """One msgpack value read in Python, as msgspec's untyped decoder reads it,
    with maps built under :func:`check_spread`. Nesting costs one Python frame
    per level (deeper than the recursion limit: ``RecursionError``)."""

    __slots__ = ("_buf", "_pos", "_end", "_hook")

    def __init__(self, data: Any, hook: _Hook) -> None:
        self._buf = memoryview(data).cast("B")
        self._pos = 0
        self._end = len(self._buf)
        self._hook = hook

    def read(self) -> Any:
        """The value; raises ``ValueError`` for malformed or trailing bytes."""
        out = self._value(False)
        if self._pos != self._end:
            raise ValueError(f"MessagePack data is malformed: trailing characters "
                             f"(byte {self._pos})")
        return out

    def _take(self, n: int) -> int:
        """Consume ``n`` bytes; returns where they start."""
        start = self._pos
        if n > self._end - start:
            raise ValueError("input data was truncated")
        self._pos = start + n
        return start

    def _value(self, key: bool) -> Any:
        buf = self._buf
        op = buf[self._take(1)]
        if op < 0x80:
            return op
        if op >= 0xe0:
            return op - 0x100
        if op < 0x90:
            return self._map(op & 0x0f)
        if op < 0xa0:
            return self._array(op & 0x0f, key)
        if op < 0xc0:
            return self._str(op & 0x1f)
        if op == 0xc0:
            return None
        if op == 0xc2:
            return False
        if op == 0xc3:
            return True
        if 0xcc <= op <= 0xd3:
            return self._int(op)
        if op == 0xcb:
            return _F8(buf, self._take(8))[0]
        if op == 0xca:
            return _F4(buf, self._take(4))[0]
        if op in (0xd9, 0xda, 0xdb):
            return self._str(self._length(op - 0xd9))
        if op in (0xc4, 0xc5, 0xc6):
            n = self._length(op - 0xc4)
            start = self._take(n)
            return bytes(buf[start:start + n])
        if op in (0xdc, 0xdd):
            return self._array(self._length(op - 0xdb), key)
        if op in (0xde, 0xdf):
            return self._map(self._length(op - 0xdd))
        if op in _FIXEXT:
            return self._ext(_FIXEXT[op])
        if op in (0xc7, 0xc8, 0xc9):
            return self._ext(self._length(op - 0xc7))
        raise ValueError(f"MessagePack data is malformed: invalid opcode {op:#x} "
                         f"(byte {self._pos - 1})")

    def _length(self, width_code: int) -> int:
        """A length of 1, 2 or 4 bytes (``width_code`` 0, 1, 2)."""
        size, unpack = ((1, _B1), (2, _B2), (4, _B4))[width_code]
        n: int = unpack(self._buf, self._take(size))[0]
        return n

    def _int(self, op: int) -> int:
        size, unpack = ((1, _B1), (2, _B2), (4, _B4), (8, _B8),
                        (1, _I1), (2, _I2), (4, _I4), (8, _I8))[op - 0xcc]
        n: int = unpack(self._buf, self._take(size))[0]
        return n

    def _str(self, n: int) -> str:
        start = self._take(n)
        return str(self._buf[start:start + n], "utf-8")

    def _array(self, n: int, key: bool) -> Any:
        if not n:
            return () if key else []
        items = []
        for _ in range(n):  # each item takes a byte at least: truncation ends it
            items.append(self._value(key))
        return tuple(items) if key else items

    def _map(self, n: int) -> dict[Any, Any]:
        if not n:
            return {}
        keys, values, plain = [], [], True
        for _ in range(n):
            if plain and self._pos < self._end:
                plain = self._buf[self._pos] in _PLAIN_KEY_OPS
            keys.append(self._value(True))
            values.append(self._value(False))
        if not plain:
            check_spread(keys, len(keys), "a dict")
        return dict(zip(keys, values, strict=True))

    def _ext(self, n: int) -> Any:
        head = self._pos - 1
        code = _I1(self._buf, self._take(1))[0]
        start = self._take(n)
        if code == -1:  # msgpack's timestamp, which msgspec reads as a datetime
            out: datetime.datetime = msgspec.msgpack.decode(self._buf[head:start + n])
            return out
        return self._hook(code, self._buf[start:start + n])

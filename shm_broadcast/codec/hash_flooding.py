"""Sets and dicts built from a peer's items in time linear in their number.

A set or dict finds an item's slot from its hash: items whose hashes differ
cost a few probes each, but every item that shares its hash with earlier ones
is compared with each of them, so ``n`` items of one hash cost ``n**2 / 2``
comparisons (see ``docs/security-codec.md`` for what a megabyte of them
costs). What a peer can aim at:

* ``str`` and ``bytes`` hash with a key drawn at interpreter start (SipHash):
  a peer cannot make them collide;
* an ``int`` hashes to its value modulo ``2**61 - 1``, so at most 13 ints of
  the 64 bits msgpack carries share a hash; bools and None are few;
* tuples and frozensets combine their items' hashes, floats hash as the
  rational they are, ints beyond 64 bits as above: a peer can make any
  number of tuples, frozensets and big ints share one hash, and many floats.

So before a set, frozenset or dict is built from decoded items,
:func:`check_spread` counts the items per hash in one pass and refuses more
than :data:`MAX_SHARED_HASH` on one hash with :class:`DecodeError`. The count
itself is linear whatever the items: it is a dict keyed by the hash values,
distinct ints of magnitude below ``2**61`` whose own hashes are themselves and
therefore distinct; crafted values (multiples of a large power of two) only
lengthen probe sequences by a bounded number of steps (61 bits, shifted out 5 at
a time). A container of at most :data:`MAX_SHARED_HASH` items cannot exceed the
bound and is built without the count.

Legitimate data shares a hash rarely: equal hashes of unequal values come from
``hash(-1) == hash(-2)`` (so 2**k tuples that differ only in holding -1 or -2 at
``k`` places) and ints ``2**61 - 1`` apart. The bound allows four such places.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from shm_broadcast.errors import DecodeError

__all__ = ["MAX_SHARED_HASH", "check_spread", "set_from", "frozenset_from", "dict_from_pairs"]

#: Most items of one set, frozenset or dict (keys) a decoder accepts on one hash.
MAX_SHARED_HASH = 16

#: Types whose hashes a peer cannot aim at (ints can be big: they are counted).
_KEYED_HASHES = frozenset({str, bytes})


def check_spread(items: Iterable[Any], count: int, what: str) -> None:
    """Refuse ``items`` (``count`` of them) when more than :data:`MAX_SHARED_HASH`
    share one hash.

    Args:
        items: The items (or keys), each hashed once.
        count: How many there are (at most the bound: nothing to check).
        what: What holds them, for the error (``"a set"``, ``"a dict"``).

    Raises:
        DecodeError: Too many items share one hash.
        TypeError: An item is unhashable (as building the container would).
    """
    if count <= MAX_SHARED_HASH:
        return
    most = max(Counter(map(hash, items)).values())
    if most > MAX_SHARED_HASH:
        raise DecodeError(
            f"refused {what} of {count} items: {most} of them share one hash (at most "
            f"{MAX_SHARED_HASH} may), which makes building it take time quadratic in its "
            f"size; such data is crafted, not sent by this library")


def set_from(items: list[Any]) -> set[Any]:
    """``set(items)``, refused when too many items share a hash (:func:`check_spread`)."""
    if len(items) > MAX_SHARED_HASH:  # a smaller set cannot exceed the bound
        check_spread(items, len(items), "a set")
    return set(items)


def frozenset_from(items: list[Any]) -> frozenset[Any]:
    """``frozenset(items)``, refused like :func:`set_from`."""
    if len(items) > MAX_SHARED_HASH:
        check_spread(items, len(items), "a frozenset")
    return frozenset(items)


def dict_from_pairs(pairs: list[Any]) -> dict[Any, Any]:
    """The dict of ``[key, value]`` pairs, refused when too many keys share a hash.

    Raises:
        DecodeError: An item is not a two-item list, or too many keys share a hash.
        TypeError: A key is unhashable.
    """
    if not all(type(p) is list and len(p) == 2 for p in pairs):
        raise DecodeError("corrupt message: a dict's items must be [key, value] pairs")
    if len(pairs) > MAX_SHARED_HASH and not _KEYED_HASHES.issuperset(
            type(p[0]) for p in pairs):
        check_spread((p[0] for p in pairs), len(pairs), "a dict")
    return dict(pairs)

"""Sets and dicts built from a peer's items in time linear in their number.

A set or dict finds an item's slot from its hash: items whose hashes differ
cost a few probes each, but every item that shares its hash with earlier ones
is compared with each of them, so ``n`` items of one hash cost ``n**2 / 2``
comparisons (see ``docs/security-codec.md`` for what a megabyte of them
costs). What a peer can aim at:

* ``str`` and ``bytes`` hash with a key drawn at interpreter start (SipHash):
  a peer cannot make them collide, unless hash randomisation is off
  (``PYTHONHASHSEED=0``, checked once at import: then they are counted as
  any other key);
* an ``int`` hashes to its value modulo ``2**61 - 1``, so at most 13 ints of
  the 64 bits msgpack carries share a hash; bools and None are few;
* tuples and frozensets combine their items' hashes, floats hash as the
  rational they are, ints beyond 64 bits as above: a peer can make any
  number of tuples, frozensets and big ints share one hash, and many floats.

So before a set, frozenset or dict is built from decoded items,
:func:`check_spread` counts the items per hash in one pass and refuses more
than :data:`MAX_SHARED_HASH` on one hash with :class:`DecodeError`. The count
itself is linear whatever the items: it is a dict keyed by the hash values,
which are ints of 64 bits; an int's own hash is its value modulo ``2**61 - 1``,
so at most 8 distinct hash values share one hash there, and comparing two ints
costs a constant: the count's own worst case is a bounded factor over its
best. Crafted values (multiples of a large power of two) only lengthen probe
sequences by a bounded number of steps (61 bits, shifted out 5 at a time). A
container of at most :data:`MAX_SHARED_HASH` items cannot exceed the bound and
is built without the count.

The bound per container caps how many comparisons building it makes, not what
they cost. Tuples compare item by item in order, so comparing two costs at most
their size; frozensets compare by looking each item up in the other, and a
lookup compares the item with every item of its hash there: comparing two
frozensets whose items collide compares those items with each other, and
nesting multiplies that at every level (a frozenset of an even number of
equal-hash items has a hash that depends only on its size, so whole levels of
them collide). So every frozenset built also draws on a :class:`CollisionBudget`
shared by the whole message: each item that shares its hash with an earlier item
of the same frozenset (small ones included) takes one from it, and a message
that takes more than :data:`MAX_COLLISIONS` is refused with
:class:`DecodeError`. Only frozensets multiply (sets and dicts are not hashable,
so never compared as items; tuples compare without lookups), and a frozenset
whose items are all scalars (ints, floats, bools, None, str, bytes) compares
each pair in constant time, so its collisions cost at most the per-container
factor and are not drawn. Counting costs one more hash per item: linear.

Legitimate data shares a hash rarely: equal hashes of unequal values come from
``hash(-1) == hash(-2)`` (so 2**k tuples that differ only in holding -1 or -2 at
``k`` places) and ints ``2**61 - 1`` apart. The bound allows four such places,
and the message-wide budget a few dozen such items in frozensets of containers.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable
from typing import Any

from shm_broadcast.errors import DecodeError

__all__ = ["MAX_SHARED_HASH", "MAX_COLLISIONS", "HASH_RANDOMISED", "CollisionBudget",
           "check_spread", "set_from", "frozenset_from", "dict_from_pairs"]

#: Most items of one set, frozenset or dict (keys) a decoder accepts on one hash.
MAX_SHARED_HASH = 16
#: Most items, over one whole message, that share a hash with an earlier item of
#: their frozenset (frozensets of scalars not counted).
MAX_COLLISIONS = 64

#: Whether str and bytes hashes are keyed per process (``PYTHONHASHSEED`` unset or
#: random); when not, a peer can aim at them and they are counted as other keys.
HASH_RANDOMISED = bool(sys.flags.hash_randomization)

#: Types whose hashes a peer cannot aim at (ints can be big: they are counted).
_KEYED_HASHES: frozenset[type] = frozenset({str, bytes}) if HASH_RANDOMISED else frozenset()
#: Types two of which compare in constant time (str/bytes: up to their length,
#: which their bytes paid for); containers of only these are not drawn on a budget.
_SCALARS: frozenset[type] = frozenset({int, float, bool, type(None), str, bytes})


class CollisionBudget:
    """The hash collisions one message's frozensets may hold (:data:`MAX_COLLISIONS`).

    One per decoder, :meth:`reset` at the start of every message (decoders are
    not thread-safe, nor is this).
    """

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_COLLISIONS

    def reset(self) -> None:
        """Start a new message."""
        self.left = MAX_COLLISIONS

    def take(self, collisions: int, what: str) -> None:
        """Draw ``collisions`` for one container.

        Raises:
            DecodeError: The message now holds more than :data:`MAX_COLLISIONS`.
        """
        self.left -= collisions
        if self.left < 0:
            raise DecodeError(
                f"refused the message: {what} brings its items that share a hash with "
                f"another item of their container to more than {MAX_COLLISIONS} (nested "
                f"colliding tuples and frozensets make comparing them cost a product "
                f"over their levels); such data is crafted, not sent by this library")


def check_spread(items: Iterable[Any], count: int, what: str,
                 budget: CollisionBudget | None = None) -> None:
    """Refuse ``items`` (``count`` of them) when more than :data:`MAX_SHARED_HASH`
    share one hash, or when their collisions exceed what is left of ``budget``.

    Args:
        items: The items (or keys), each hashed once (twice when counted).
        count: How many there are.
        what: What holds them, for the error (``"a set"``, ``"a dict"``).
        budget: The message's collision budget, or ``None`` for the bound alone.

    Raises:
        DecodeError: Too many items share one hash, or the message holds too
            many collisions.
        TypeError: An item is unhashable (as building the container would).
    """
    if count < 2 or (count <= MAX_SHARED_HASH and budget is None):
        return  # a container up to the bound cannot exceed it
    if type(items) is not list:
        items = list(items)
    kinds = set(map(type, items))
    if kinds <= _KEYED_HASHES:
        return
    counted = budget is not None and not kinds <= _SCALARS
    if count > MAX_SHARED_HASH:
        spread = Counter(map(hash, items))
        most = max(spread.values())
        if most > MAX_SHARED_HASH:
            raise DecodeError(
                f"refused {what} of {count} items: {most} of them share one hash (at most "
                f"{MAX_SHARED_HASH} may), which makes building it take time quadratic in its "
                f"size; such data is crafted, not sent by this library")
        distinct = len(spread)
    elif counted:
        distinct = len(set(map(hash, items)))
    else:
        return
    if counted and distinct < count and budget is not None:
        budget.take(count - distinct, what)


def set_from(items: list[Any]) -> set[Any]:
    """``set(items)``, refused when too many items share a hash (:func:`check_spread`)."""
    check_spread(items, len(items), "a set")
    return set(items)


def frozenset_from(items: list[Any], budget: CollisionBudget) -> frozenset[Any]:
    """``frozenset(items)``, refused like :func:`set_from`, and its collisions
    drawn on the message's ``budget``."""
    check_spread(items, len(items), "a frozenset", budget)
    return frozenset(items)


def dict_from_pairs(pairs: list[Any]) -> dict[Any, Any]:
    """The dict of ``[key, value]`` pairs, refused when too many keys share a hash
    (:func:`check_spread`).

    Raises:
        DecodeError: An item is not a two-item list, or too many keys share a hash.
        TypeError: A key is unhashable.
    """
    if not all(type(p) is list and len(p) == 2 for p in pairs):
        raise DecodeError("corrupt message: a dict's items must be [key, value] pairs")
    if len(pairs) > MAX_SHARED_HASH:
        check_spread([p[0] for p in pairs], len(pairs), "a dict")
    return dict(pairs)

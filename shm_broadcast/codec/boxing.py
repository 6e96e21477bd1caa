"""Exact types before msgspec: box every value msgpack would carry lossily.

msgpack turns a tuple or set into a list, a ``bytearray`` or ``memoryview``
into bytes, a dict with tuple keys into an error, and has no int beyond 64
bits. :func:`prep` walks a structure (``Codec(exact=True)``) and wraps each
such value in a :class:`Box` holding its ext code; the codec's encoder hook
turns boxes into exts (see :mod:`shm_broadcast.codec.wire_format`). Values no ext
holds are boxed as ``EXT_PICKLE``, which the hook refuses unless the side
opted in to pickle.

This runs on every message, so the common case is kept cheap: a container
whose items are all of :attr:`TorchTypes.pass_types
<shm_broadcast.codec.wire_format.TorchTypes.pass_types>` costs one C-level type
scan and no copy, and containers are copied only along the path to a value
that changed. :func:`prep_full` is the slow path for the rare message with a
big int or a lone surrogate.
"""

from __future__ import annotations

import functools
import itertools
import operator
from typing import Any

from shm_broadcast.codec.wire_format import (
    EXT_BIGINT,
    EXT_BYTEARRAY,
    EXT_DICT_PAIRS,
    EXT_FROZENSET,
    EXT_MEMORYVIEW,
    EXT_NPSCALAR,
    EXT_PICKLE,
    EXT_SET,
    EXT_SURROGATE_STR,
    EXT_TUPLE,
    INT64_MIN,
    TORCH,
    UINT64_END,
    SourceFailure,
    is_plain_npscalar,
    memoryview_state,
)

__all__ = ["Box", "prep", "prep_full"]

#: Dict key types msgpack carries exactly.
_PLAIN_KEYS = frozenset({str, int})
_LIST_ONLY = frozenset({list})
_DICT_ONLY = frozenset({dict})
#: The ext code of each container msgpack would turn into a list.
_CONTAINER_CODE: dict[type, int] = {tuple: EXT_TUPLE, set: EXT_SET, frozenset: EXT_FROZENSET}
_chain = itertools.chain.from_iterable
_reduce = functools.reduce
_iadd = operator.iadd
#: Lists longer than this are scanned without a list of their items' types.
_TYPE_LIST_MAX = 1 << 16
# The registry's containers under names of this module (TORCH.load() fills them
# in place, so they stay current): prep looks them up once per container, and a
# name bound here by assignment, not by import, compiles ``_PASS.issuperset(...)``
# as a method call (CPython 3.11 builds a bound method object per call for
# ``name.method(...)`` on a name bound by an import; this is on every message).
_PASS = TORCH.pass_types
_TORCH_LEAVES = TORCH.leaves


class Box:
    """Wraps a value the encoder hook must turn into an ext (tuple, set, opaque)."""

    __slots__ = ("code", "value")

    def __init__(self, code: int, value: Any) -> None:
        self.code = code
        self.value = value


def prep(obj: Any) -> Any:
    """Make ``obj`` exact for msgspec: box tuples/sets/odd keys and opaque values.

    Returns ``obj`` itself when nothing needs boxing (the common case costs one
    C-level type scan per container and no copy); containers are copied only
    along the path to a value that changed.
    """
    t = type(obj)
    if t is dict:
        if not _PLAIN_KEYS.issuperset(map(type, obj)):
            return Box(EXT_DICT_PAIRS, [[prep(k), prep(v)] for k, v in obj.items()])
        if _PASS.issuperset(map(type, obj.values())):
            return obj
        new: dict[Any, Any] | None = None
        for k, v in obj.items():
            if type(v) in _PASS:
                continue
            pv = prep(v)
            if pv is not v:
                if new is None:
                    new = dict(obj)
                new[k] = pv
        return obj if new is None else new
    if t is list:
        if _all_pass(obj) or _plain_rows(obj):
            return obj
        new_list: list[Any] | None = None
        for i, v in enumerate(obj):
            if type(v) in _PASS:
                continue
            pv = prep(v)
            if pv is not v:
                if new_list is None:
                    new_list = list(obj)
                new_list[i] = pv
        return obj if new_list is None else new_list
    if t in _PASS:
        return obj
    if t is tuple:
        return Box(EXT_TUPLE, prep(list(obj)))
    if t is set:
        return Box(EXT_SET, prep(list(obj)))
    if t is frozenset:
        return Box(EXT_FROZENSET, prep(list(obj)))
    return _prep_leaf(obj, t)


def _all_pass(items: list[Any]) -> bool:
    """Whether the type of every item of ``items`` is one of ``_PASS``.

    Lists are mostly of one type, and counting the items of a list of their
    types that equal the first one (for types of the ``type`` metaclass a
    pointer comparison) is the cheapest full scan in C: see
    docs/performance.md. A type whose metaclass defines ``__eq__`` could claim
    to equal ``int``; no class msgspec carries does. A mixed list falls back to
    the set test, and so does a huge one, which the list of types would
    double in memory.
    """
    if len(items) > _TYPE_LIST_MAX:
        return _PASS.issuperset(map(type, items))
    types = list(map(type, items))
    if not types:
        return True
    first = types[0]
    if types.count(first) == len(types):
        return first in _PASS
    return _PASS.issuperset(types)


def _plain_rows(obj: list[Any]) -> bool:
    """Whether ``obj`` is a list of plain lists, or of plain str-/int-keyed dicts
    (token ids per request, block tables, per-request records): checked with
    one C-level scan over all the rows' items instead of a call per row."""
    if not obj:
        return False
    row = type(obj[0])
    if row is list:
        if not _LIST_ONLY.issuperset(map(type, obj)):
            return False
        if sum(map(len, obj)) > _TYPE_LIST_MAX:
            return _PASS.issuperset(map(type, _chain(obj)))
        # One flat list of the items (a pointer copy per item, far cheaper than
        # iterating a chain of the rows), then the scan of :func:`_all_pass`.
        return _all_pass(_reduce(_iadd, obj, []))
    if row is dict:
        return (_DICT_ONLY.issuperset(map(type, obj))
                and _PLAIN_KEYS.issuperset(map(type, _chain(obj)))
                and _PASS.issuperset(map(type, _chain(map(dict.values, obj)))))
    return False


def _prep_leaf(obj: Any, t: type) -> Any:
    """A value that is no container: itself when the encoder hook handles it, else boxed."""
    if t is memoryview:  # msgpack would turn it into bytes
        return Box(EXT_MEMORYVIEW, memoryview_state(obj))
    if t is bytearray:  # likewise
        return Box(EXT_BYTEARRAY, obj)
    if t in _TORCH_LEAVES:  # empty until torch is loaded
        return Box(_TORCH_LEAVES[t], obj)
    if t is SourceFailure or t is TORCH.parameter:  # None until torch is loaded
        return obj
    if is_plain_npscalar(obj):
        return Box(EXT_NPSCALAR, obj)
    return Box(EXT_PICKLE, obj)  # refused by the hook unless allow_pickle


def prep_full(obj: Any, exact: bool) -> Any:
    """Like :func:`prep`, but visits every value and boxes ints beyond 64 bits and
    strs with lone surrogates (msgpack holds neither). Only used after the fast
    path failed on one of those, so its cost per element does not matter."""
    t = type(obj)
    if t is int:
        return obj if INT64_MIN <= obj < UINT64_END else Box(EXT_BIGINT, obj)
    if t is str:
        try:
            obj.encode("utf-8")
            return obj
        except UnicodeEncodeError:
            return Box(EXT_SURROGATE_STR, obj)
    if t is dict:
        items = [(prep_full(k, exact), prep_full(v, exact)) for k, v in obj.items()]
        if all(type(k) in _PLAIN_KEYS for k, _ in items):
            return dict(items)
        return Box(EXT_DICT_PAIRS, [[k, v] for k, v in items])
    if t is list or (not exact and t is tuple):
        return [prep_full(v, exact) for v in obj]
    if exact and t in (tuple, set, frozenset):
        return Box(_CONTAINER_CODE[t], [prep_full(v, exact) for v in obj])
    return prep(obj) if exact else obj

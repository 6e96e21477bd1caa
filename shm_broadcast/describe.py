"""Bounded descriptions of values a peer sent, for error messages.

An error that quotes what a peer sent must not depend on that value behaving:
``repr()`` of a decoded int of more than 4300 digits raises ``ValueError``
(CPython's int-to-str limit), ``repr()`` of a list of a million items builds
megabytes of text before ``{x!r:.80}`` cuts it, and a tensor's or array's
``repr`` formats its data. :func:`describe` walks at most a fixed number of
items, writes ints beyond 64 bits as their bit length, tensors and arrays as
their shape and dtype, and anything else that is not plain data as its type
name: it never raises and its cost is bounded by ``limit``, whatever the value.
"""

from __future__ import annotations

from typing import Any

__all__ = ["describe"]

#: Items of one container shown before ``...``.
_ITEMS = 8
#: Containers nested deeper than this are shown by their type and length.
_DEPTH = 4
_PLAIN = (type(None), bool, float)


def describe(value: Any, limit: int = 80) -> str:
    """A description of ``value`` of at most about ``limit`` characters; never raises.

    Plain data reads as its ``repr`` (``['t1', 3]``), cut at ``limit`` with
    ``...``; an int beyond 64 bits as ``<int of N bits>``; a tensor or array as
    ``<Tensor (2, 3) torch.float32>``; a value of any other type as ``<TypeName>``.
    """
    try:
        text = _describe(value, _DEPTH)
    except Exception:  # a hostile __len__ or the like: say what it is, not what it holds
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."


def _describe(value: Any, depth: int) -> str:
    t = type(value)
    if t in _PLAIN:
        return repr(value)
    if t is int:
        if -(1 << 64) < value < 1 << 64:
            return repr(value)
        return f"<int of {value.bit_length()} bits>"
    if t is str or t is bytes:
        shown = repr(value[:_ITEMS * 8])
        return shown if len(value) <= _ITEMS * 8 else f"{shown}... ({len(value)} long)"
    if t in (list, tuple, set, frozenset, dict):
        if depth == 0:
            return f"<{t.__name__} of {len(value)} items>"
        items = list(_first(value.items() if t is dict else value, _ITEMS))
        if t is dict:
            parts = [f"{_describe(k, depth - 1)}: {_describe(v, depth - 1)}" for k, v in items]
        else:
            parts = [_describe(v, depth - 1) for v in items]
        if len(value) > _ITEMS:
            parts.append(f"... ({len(value)} items)")
        body = ", ".join(parts)
        if t is list:
            return f"[{body}]"
        if t is tuple:
            return f"({body}{',' if len(value) == 1 else ''})"
        if t is dict:
            return f"{{{body}}}"
        return f"{t.__name__}({{{body}}})"
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"<{t.__name__} {tuple(shape)} {dtype}>"
    return f"<{t.__name__}>"


def _first(items: Any, n: int) -> Any:
    """The first ``n`` of ``items`` (an iterable), without walking the rest."""
    for i, item in enumerate(items):
        if i == n:
            return
        yield item

"""Argument checks shared by every layer (the bottom package owns them).

One rule everywhere: a value of the wrong type raises ``TypeError`` naming the
argument, the expected type and the type that came; a value of the right type
outside its range raises ``ValueError`` naming the argument, the range and
the value. ``bool`` is never accepted where an int is expected; a NumPy
integer (any ``numbers.Integral`` but ``bool``) is, and comes back a Python
``int`` (:func:`as_int`), so callers use the checked value, not the argument.

Timeouts mean the same in every layer (:func:`check_timeout`): a number of
seconds (or a ``datetime.timedelta``) ``>= 0``, where ``0`` polls once without
waiting, and ``None`` means "the caller's default" (inside coordinator calls,
the group's timeout). No wait is unbounded: there is no "wait forever" value.
Two kinds of timeout have no poll-once form and must be ``> 0``
(:func:`check_timeout` with ``positive=True``): a group's own timeout, the
default of every wait of the group, and a barrier's, where an answer that
arrives after rank 0 gave up would break the group's connections.
"""

from __future__ import annotations

import datetime
import math
import numbers
import operator
import os
from typing import Any

__all__ = [
    "as_int", "check_bool", "check_int", "check_rank", "check_str", "check_timeout", "env_flag",
]

_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"0", "false", "no", "off"})


def env_flag(var: str, default: bool) -> bool:
    """The on/off environment variable ``var`` (``1``/``true``/``yes``/``on`` or
    ``0``/``false``/``no``/``off``, any case; unset or empty: ``default``).

    Raises:
        ValueError: Any other value (names the variable and the value).
    """
    raw = os.environ.get(var, "").strip().lower()
    if raw == "":
        return default
    if raw in _ON:
        return True
    if raw in _OFF:
        return False
    raise ValueError(f"{var} must be 0 or 1, got {raw!r}")


def as_int(value: Any) -> int | None:
    """``value`` as a Python ``int`` if it is an integer, else None.

    An integer is an ``int`` or any other ``numbers.Integral`` (NumPy's
    integer scalars register as one) that is not a ``bool``. An ``int``
    subclass comes back as it is.
    """
    if isinstance(value, int):
        return None if isinstance(value, bool) else value
    if isinstance(value, numbers.Integral):
        return operator.index(value)
    return None


def check_int(value: Any, arg: str, *, minimum: int | None = None,
              maximum: int | None = None) -> int:
    """Return ``value`` if it is an int in ``[minimum, maximum]`` (either bound optional).

    Raises:
        TypeError: ``value`` is not an integer (:func:`as_int`).
        ValueError: ``value`` is outside the bounds.
    """
    n = as_int(value)
    if n is None:
        raise TypeError(f"{arg} must be an int, got {type(value).__name__} ({value!r:.60})")
    too_small = minimum is not None and n < minimum
    too_big = maximum is not None and n > maximum
    if too_small or too_big:
        if maximum is None:
            want = f">= {minimum}"
        elif minimum is None:
            want = f"<= {maximum}"
        else:
            want = f"in [{minimum}, {maximum}]"
        raise ValueError(f"{arg} must be an int {want}, got {n}")
    return n


def check_bool(value: Any, arg: str) -> bool:
    """Return ``value`` if it is a bool.

    Raises:
        TypeError: ``value`` is not a bool (``0``/``1`` and strings included).
    """
    if not isinstance(value, bool):
        raise TypeError(f"{arg} must be a bool, got {type(value).__name__} ({value!r:.60})")
    return value


def check_str(value: Any, arg: str) -> str:
    """Return ``value`` if it is a str.

    Raises:
        TypeError: ``value`` is not a str.
    """
    if not isinstance(value, str):
        raise TypeError(f"{arg} must be a str, got {type(value).__name__} ({value!r:.60})")
    return value


def check_rank(value: Any, world_size: int, arg: str) -> int:
    """Return ``value`` as an int if it is a rank in ``[0, world_size)``.

    Raises:
        TypeError: ``value`` is not an integer (:func:`as_int`).
        ValueError: ``value`` is not in ``[0, world_size)``.
    """
    rank = as_int(value)
    if rank is None:
        raise TypeError(f"{arg} must be an int rank, got {type(value).__name__} ({value!r:.60})")
    if not 0 <= rank < world_size:
        raise ValueError(f"{arg} must be a rank in [0, {world_size}), got {rank}")
    return rank


#: The longest timeout accepted: far beyond any wait, and within what
#: ``datetime.timedelta`` and torch's millisecond timeouts can hold.
MAX_TIMEOUT_S = 1e9


def check_timeout(value: Any, arg: str = "timeout", default: float | None = None, *,
                  positive: bool = False) -> float | None:
    """Return a timeout in seconds: ``value``, or ``default`` when ``value`` is None.

    ``value`` is a number of seconds or a ``datetime.timedelta``. ``0`` means
    poll once without waiting (refused with ``positive=True``); a ``None``
    result (only from a ``None`` default) means the callee's own default.

    Raises:
        TypeError: ``value`` is neither None, a real number nor a timedelta.
        ValueError: ``value`` is negative, NaN, infinite or above
            :data:`MAX_TIMEOUT_S` (or 0 with ``positive``).
    """
    if value is None:
        return default
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{arg} must be a number of seconds, a timedelta or None, got "
            f"{type(value).__name__} ({value!r:.60})"
        )
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        want = "> 0" if positive else ">= 0 (0 polls once)"
        raise ValueError(f"{arg} must be a finite number of seconds {want}, got {value!r}")
    if value > MAX_TIMEOUT_S:
        raise ValueError(f"{arg} must be at most {MAX_TIMEOUT_S:g} s (about 31 years; "
                         f"timedelta and the backends' clocks overflow beyond), got {value!r}")
    return float(value)

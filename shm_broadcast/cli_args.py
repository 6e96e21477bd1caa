"""argparse types shared by the ``groupcoord`` subcommands.

A bad value is an :class:`argparse.ArgumentTypeError`, which argparse turns
into a usage error naming the option (exit status 2); ``nan`` and ``inf``
are never numbers here.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

__all__ = ["MAX_THREADS", "number", "output_path", "size_bytes", "threads"]

#: The most torch threads a bench option sets per process. ``torch.set_num_threads``
#: takes up to a C ``int`` and fails only in the ranks (a traceback each); more
#: than this many threads per process is a typo on any machine, refused up front.
MAX_THREADS = 1024

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def number(kind: type = float, *, minimum: float | None = None, above: float | None = None,
           maximum: float | None = None) -> Callable[[str], float]:
    """A type function for a finite ``kind`` (int or float) within the bounds.

    Args:
        kind: ``int`` or ``float``.
        minimum: Smallest allowed value.
        above: Values must be greater than this.
        maximum: Largest allowed value.
    """
    want = " and ".join(w for w in (
        f">= {minimum}" if minimum is not None else "",
        f"> {above}" if above is not None else "",
        f"<= {maximum}" if maximum is not None else "") if w)
    what = f"{'an int' if kind is int else 'a finite number'}{' ' + want if want else ''}"

    def parse(text: str) -> float:
        try:
            value: float | None = kind(text)
        except (ValueError, OverflowError):
            value = None
        if (value is None or (kind is float and not math.isfinite(value))
                or (minimum is not None and value < minimum)
                or (above is not None and value <= above)
                or (maximum is not None and value > maximum)):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


def size_bytes(text: str) -> int:
    """``4096``, ``64K``, ``1.5M``, ``1G`` (binary units) -> a whole number of bytes > 0."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = _UNITS.get(t[-1:], 1)
    try:
        value = float(t[:-1] if t[-1:] in _UNITS else t) * mult
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"expected a size > 0 like 4096, 64K or 1M, got {text!r}")
    return int(value)


def threads(text: str) -> int | str:
    """``--threads``: ``default`` (torch's own default) or an int from 1 to
    :data:`MAX_THREADS` (a count torch refuses would kill every rank).

    Raises:
        argparse.ArgumentTypeError: Anything else (argparse names the option).
    """
    t = text.strip().lower()
    if t == "default":
        return t
    try:
        value = int(t)
    except ValueError:  # a word, or a digit int() does not take ("²")
        value = 0
    if not 1 <= value <= MAX_THREADS:
        raise argparse.ArgumentTypeError(
            f"expected 'default' or an int from 1 to {MAX_THREADS}, got {text!r}")
    return value


def output_path(text: str) -> str:
    """A file a command writes its results to once it ran: checked before it runs, so
    that a long run is not lost to a path it cannot write (a missing or read-only
    directory, a directory named as the file)."""
    path = os.path.abspath(os.path.expanduser(text))
    directory = os.path.dirname(path)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file to write")
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"the directory of {text!r} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK) or (
            os.path.exists(path) and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written")
    return text

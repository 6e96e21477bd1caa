"""Environment variables set for a block and put back after it (in rank functions,
whose processes the pool reuses for later tests, where pytest's ``monkeypatch``
does not reach)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def environ(**values: str | None) -> Iterator[None]:
    """Set each variable to its value (None: unset it) inside the block; afterwards
    each is as it was before (set to its old value, or unset)."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        _apply(values)
        yield
    finally:
        _apply(saved)


def _apply(values: dict[str, str | None]) -> None:
    """Set each variable to its value; None unsets it."""
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v

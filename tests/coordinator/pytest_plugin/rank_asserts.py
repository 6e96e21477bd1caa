"""Functions with failing asserts, loaded by ``run_call`` itself (under another
module name, so that it rewrites their asserts as a rank does)."""

from __future__ import annotations

import os


def setup_function(function: object) -> None:
    os.write(1, f"setup_function before {getattr(function, '__name__', '')}\n".encode())


def lists_differ(rank: int) -> None:
    left = [1, 2, 3, 4]
    right = [1, 2, 3 + rank, 4]
    assert left == right


def texts_differ(rank: int) -> None:
    assert f"the same line\nrank {rank}" == "the same line\nanother"

"""The environment of a Python child process a test starts with ``subprocess``."""

from __future__ import annotations

import os

__all__ = ["child_env"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**extra: str) -> dict[str, str]:
    """This environment with the checkout first on ``PYTHONPATH`` (kept entries
    follow: a host may carry packages there), plus ``extra``."""
    path = [ROOT, os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), **extra}

"""How long a test's body may run on the ranks: the marker's timeout, or less when
pytest-timeout would end the test first.

pytest-timeout counts from the start of the test (with ``timeout_func_only``,
from the start of its body). When its limit would come before the marker's, the
ranks get what is left of it less :data:`REPORT_MARGIN_S`, so that the plugin
still collects the ranks' stacks, stops them and reports which rank hung, rather
than pytest-timeout's interrupting a wait in the pytest process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["REPORT_MARGIN_S", "TimeLimit", "pytest_timeout_of", "time_limit"]

#: Seconds the plugin keeps for the ranks' stacks, their stop and the report.
REPORT_MARGIN_S = 5.0
#: The least time the ranks get, whatever pytest-timeout leaves.
_MIN_S = 0.5


@dataclass(frozen=True)
class TimeLimit:
    """The seconds the ranks get, and where the limit comes from (for the report)."""

    seconds: float
    source: str


def time_limit(marker_timeout: float, pytest_timeout: float | None,
               elapsed: float) -> TimeLimit:
    """The ranks' time limit.

    Args:
        marker_timeout: The ``distributed`` marker's timeout.
        pytest_timeout: pytest-timeout's limit for the test (None or 0: none).
        elapsed: Seconds of that limit already spent (setup, the ranks' start).
    """
    if pytest_timeout:
        left = pytest_timeout - elapsed - REPORT_MARGIN_S
        if left < marker_timeout:
            return TimeLimit(max(_MIN_S, left),
                             f"what pytest-timeout's {pytest_timeout:g} s left, less "
                             f"{REPORT_MARGIN_S:g} s for this report")
    return TimeLimit(marker_timeout, "the marker's timeout")


def pytest_timeout_of(item: Any) -> tuple[float | None, bool]:
    """pytest-timeout's ``(limit, counts the body only)`` for ``item``; ``(None, False)``
    without pytest-timeout (or one whose settings this cannot read)."""
    try:
        import pytest_timeout

        settings = pytest_timeout._get_item_settings(item)  # noqa: SLF001  # its only reader
        timeout = float(settings.timeout) if settings.timeout else None
        return timeout, bool(settings.func_only)
    except Exception:  # not installed, or another version: the marker's timeout alone
        return None, False

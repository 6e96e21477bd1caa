"""The ranks' time limit: the marker's, or less where pytest-timeout would end first."""

from __future__ import annotations

import pytest

from coordinator.pytest_plugin.time_limit import REPORT_MARGIN_S, pytest_timeout_of, time_limit


def test_the_marker_s_timeout_unless_pytest_timeout_ends_first() -> None:
    assert time_limit(60, None, 3).seconds == 60
    assert time_limit(60, 120, 10).source == "the marker's timeout"
    short = time_limit(60, 30, 10)
    assert short.seconds == 30 - 10 - REPORT_MARGIN_S
    assert "pytest-timeout's 30 s" in short.source
    assert time_limit(60, 5, 4).seconds == 0.5  # never nothing


@pytest.mark.timeout(77)
def test_pytest_timeout_s_limit_is_read(request: pytest.FixtureRequest) -> None:
    timeout, body_only = pytest_timeout_of(request.node)
    active = request.config.pluginmanager.has_plugin("timeout")  # not with -p no:timeout
    assert (timeout, body_only) == ((77.0, False) if active else (None, False))

"""The argument checks every layer shares: TypeError for the type, ValueError for the value."""

from __future__ import annotations

import datetime
import math

import pytest

from shm_broadcast.checks import check_int, check_rank, check_timeout


@pytest.mark.parametrize(
    "value, kw, exc",
    [
        ("3", {}, TypeError), (True, {}, TypeError), (2.0, {}, TypeError), (None, {}, TypeError),
        (0, {"minimum": 1}, ValueError), (9, {"maximum": 8}, ValueError),
        (-1, {"minimum": 0, "maximum": 4}, ValueError),
    ],
    ids=["str", "bool", "float", "none", "below", "above", "outside"],
)
def test_check_int_rejects(value, kw, exc) -> None:
    with pytest.raises(exc, match="n_reader"):
        check_int(value, "n_reader", **kw)


def test_check_int_accepts_the_bounds() -> None:
    assert check_int(1, "x", minimum=1, maximum=1) == 1


@pytest.mark.parametrize("value, exc", [(True, TypeError), ("0", TypeError), (-1, ValueError),
                                        (4, ValueError)], ids=["bool", "str", "neg", "big"])
def test_check_rank_rejects(value, exc) -> None:
    with pytest.raises(exc, match="src"):
        check_rank(value, 4, "src")


@pytest.mark.parametrize("value, exc", [("soon", TypeError), (True, TypeError), (-0.5, ValueError),
                                        (math.nan, ValueError), (math.inf, ValueError),
                                        (1e300, ValueError), (datetime.timedelta.max, ValueError)],
                         ids=["str", "bool", "negative", "nan", "inf", "huge", "timedelta-max"])
def test_check_timeout_rejects(value, exc) -> None:
    with pytest.raises(exc, match="timeout"):
        check_timeout(value)


def test_check_timeout_semantics() -> None:
    assert check_timeout(0) == 0.0  # poll once
    assert check_timeout(1e9) == 1e9  # the longest: still a timedelta, and torch's milliseconds
    datetime.timedelta(seconds=check_timeout(1e9))
    assert check_timeout(None, default=300.0) == 300.0
    assert check_timeout(None) is None
    assert check_timeout(2) == 2.0

"""The ranks' results as one report (no processes: results made by hand)."""

from __future__ import annotations

import pytest

from coordinator.pytest_plugin.protocol import (
    DIED,
    FAILED,
    PASSED,
    SKIPPED,
    STOPPED,
    TIMED_OUT,
    XFAILED,
    RankResult,
)
from coordinator.pytest_plugin.report import failure_report, raise_outcome, trim_stacks

_DUMP = """Thread 0x00007f (most recent call first):
  File "/x/shm_broadcast/ranks/launcher.py", line 153 in _exit_with_parent
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread 0x00007e (most recent call first):
  File "/x/coordinator/group/group_coordinator.py", line 757 in barrier
  File "/t/test_a.py", line 24 in test_a
  File "/x/coordinator/pytest_plugin/rank_call.py", line 54 in run_call
  File "/usr/lib/python3.11/multiprocessing/process.py", line 108 in run
  File "<string>", line 1 in <module>
"""


def test_every_rank_that_did_not_pass_has_a_section_failures_first() -> None:
    results = [RankResult(0, STOPPED, traceback=_DUMP), RankResult(1, FAILED,
               summary="AssertionError: no", traceback="> assert x\nE AssertionError: no"),
               RankResult(2, DIED, summary="killed by signal SIGSEGV"),
               RankResult(3, PASSED)]
    text = failure_report(results, "world_size=4", 60)
    assert "raised: rank(s) [1] of 4" in text and "died: rank(s) [2] of 4" in text
    assert "stopped: rank(s) [0] of 4" in text and "passed: rank(s) [3] of 4" in text
    assert "every rank was killed and reaped" in text
    assert text.index("rank 1: AssertionError: no") < text.index("rank 2: died") \
        < text.index("rank 0: stopped")
    assert "E AssertionError: no" in text and "killed by signal SIGSEGV" in text
    assert "test_a.py\", line 24 in test_a" in text and "run_call" not in text


def test_timeout_names_the_ranks_and_the_limit() -> None:
    text = failure_report([RankResult(0, PASSED), RankResult(1, TIMED_OUT)], "world_size=2", 5)
    assert "timed out: rank(s) [1] of 2 did not finish within 5 s" in text
    assert "(no Python stack came back from the rank)" in text


def test_trim_stacks_keeps_the_test_s_frames() -> None:
    trimmed = trim_stacks(_DUMP)
    assert "_exit_with_parent" not in trimmed and "multiprocessing" not in trimmed
    assert "<string>" not in trimmed and "rank_call.py" not in trimmed
    assert "in barrier" in trimmed and "in test_a" in trimmed


def test_outcomes() -> None:
    raise_outcome([RankResult(0, PASSED), RankResult(1, PASSED)], "w", 1)
    with pytest.raises(pytest.skip.Exception, match="not here"):
        raise_outcome([RankResult(0, SKIPPED, summary="not here")] * 2, "w", 1)
    with pytest.raises(pytest.fail.Exception, match=r"skipped: rank\(s\) \[0\] of 2"):
        raise_outcome([RankResult(0, SKIPPED), RankResult(1, PASSED)], "w", 1)


def test_xfail_raises_matches_the_ranks_exceptions() -> None:
    value_error = RankResult(1, FAILED, summary="ValueError: x",
                             exception_types=("builtins.ValueError", "builtins.Exception"))
    expected = ("known bug", ("builtins.Exception",))
    with pytest.raises(pytest.xfail.Exception, match="known bug"):
        raise_outcome([RankResult(0, PASSED), value_error], "w", 1, expected=expected)
    with pytest.raises(pytest.fail.Exception):  # another exception than the one expected
        raise_outcome([value_error], "w", 1, expected=("b", ("builtins.KeyError",)))
    with pytest.raises(pytest.fail.Exception):  # a rank that died did not raise it
        raise_outcome([value_error, RankResult(0, DIED)], "w", 1, expected=expected)


@pytest.mark.parametrize("status", [SKIPPED, XFAILED])
def test_ranks_stopped_after_a_skip_or_xfail_say_so(status: str) -> None:
    results = [RankResult(0, status, summary="not here"), RankResult(1, STOPPED)]
    text = failure_report(results, "world_size=2", 60)
    assert f"{status}: rank(s) [0] of 2" in text
    assert (f"stopped: rank(s) [1] of 2 were still running after rank(s) [0] {status} "
            "(most likely waiting for it in a collective)") in text
    assert "timed out" not in text and "another rank failed" not in text

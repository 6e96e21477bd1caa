"""What a rank does with one test (``run_call``), here in the test's own process: the
function found by name, rank fixtures filled in, output captured, outcomes told apart."""

from __future__ import annotations

import os
import pickle
from typing import Any

import pytest

from coordinator.pytest_plugin.assertions import assertion_options
from coordinator.pytest_plugin.protocol import (
    FAILED,
    PASSED,
    SKIPPED,
    RankFixture,
    TestCall,
)
from coordinator.pytest_plugin.rank_call import run_call
from tests.coordinator.pytest_plugin import rank_asserts, rank_functions


def _call(name: str, **kwargs: Any) -> TestCall:
    return TestCall(f"rank_functions::{name}", rank_functions.__name__,
                    os.path.abspath(rank_functions.__file__), name, pickle.dumps(kwargs), [])


def test_output_of_the_test_is_captured_and_returned() -> None:
    r = run_call(_call("prints", rank=RankFixture("rank")), 3, 4, 1)
    assert r.status == PASSED and r.rank == 3
    assert "stdout of rank 3" in r.output and "raw stderr" in r.output


def test_outcomes_are_told_apart() -> None:
    skipped = run_call(_call("skips", rank=RankFixture("rank")), 1, 2, 1)
    assert (skipped.status, skipped.summary) == (SKIPPED, "not on rank 1")
    failed = run_call(_call("fails_on_rank_1", rank=1), 1, 2, 1)
    assert failed.status == FAILED and failed.summary == "AssertionError: rank 1 refuses"
    assert failed.exception_types[:2] == ("builtins.AssertionError", "builtins.Exception")
    assert "rank_functions.py" in failed.traceback and "run_call" not in failed.traceback


def test_what_cannot_run_is_named() -> None:
    missing = run_call(_call("no_such_test"), 0, 1, 0)
    assert missing.status == FAILED and "no_such_test is not in module" in missing.summary
    no_tp = run_call(_call("wants_the_tp_group", tp_group=RankFixture("tp_group")), 0, 1, 0)
    assert no_tp.status == FAILED
    assert "fixture 'tp_group' needs model-parallel groups" in no_tp.summary
    coroutine = run_call(_call("is_a_coroutine", rank=0), 0, 1, 0)
    assert coroutine.status == FAILED and "async and generator test functions" in \
        coroutine.summary


def test_failed_asserts_are_explained_as_pytest_does(pytestconfig: pytest.Config) -> None:
    # Under a module name not imported yet: run_call loads the file with its
    # asserts rewritten, as in a rank; explained with this session's options.
    options = assertion_options(pytestconfig)
    call = TestCall("rank_asserts::lists_differ", "plugin_rank_asserts_fresh",
                    os.path.abspath(rank_asserts.__file__), "lists_differ",
                    pickle.dumps({"rank": 1}), [], assertion_options=options)
    r = run_call(call, 1, 2, 1)
    assert r.status == FAILED and r.summary.startswith("AssertionError: assert [1, 2, 3, 4]")
    assert "At index 2 diff: 3 != 4" in r.traceback, r.traceback
    assert r.traceback.startswith("    def lists_differ"), r.traceback  # indented as pytest
    assert "setup_function before lists_differ" in r.output  # the module's xunit setup
    text = run_call(TestCall("rank_asserts::texts_differ", "plugin_rank_asserts_fresh",
                             call.path, "texts_differ", pickle.dumps({"rank": 1}), [],
                             assertion_options=options), 1, 2, 1)
    assert "+ rank 1" in text.traceback and "- another" in text.traceback, text.traceback


def test_xunit_setup_and_teardown_of_a_method_run_in_the_rank() -> None:
    r = run_call(_call("WithSetup.test_uses_setup", rank=RankFixture("rank")), 0, 2, 0)
    assert r.status == PASSED, r.traceback
    assert "teardown_method after test_uses_setup" in r.output


class BrokenStr(Exception):
    """An exception whose ``str()`` itself raises."""

    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")


def raises_broken_str(rank: int) -> None:
    """Rank code of the test below: raise an exception that cannot be turned into text."""
    raise BrokenStr(f"the real problem, on rank {rank}")


def test_an_exception_whose_str_raises_is_reported_as_raised() -> None:
    # Before: str(e) raised in the rank, the rank died, and the report said
    # "died (exit code 1)" without the test's traceback.
    call = TestCall(f"{__name__}::raises_broken_str", __name__, os.path.abspath(__file__),
                    "raises_broken_str", pickle.dumps({"rank": RankFixture("rank")}), [])
    r = run_call(call, 1, 2, 1)
    assert r.status == FAILED and r.summary == "BrokenStr: <BrokenStr: str() failed>", r
    assert "raises_broken_str" in r.traceback and "BrokenStr" in r.traceback, r.traceback
    assert r.exception_types[0].endswith("test_rank_call.BrokenStr")

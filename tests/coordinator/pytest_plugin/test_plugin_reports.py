"""The plugin seen from pytest: generated test files run in a pytest subprocess
(``pytester``), and what its report says.

One run covers the fast cases: a passing test, parametrize ids, a rank that
fails (its traceback in the report), a rank that hangs past the timeout (named,
with its stack). The others (layouts, simulated hosts, a rank that dies, test
classes, fixtures that cannot reach the ranks, skips, xdist) are ``slow``.
"""

from __future__ import annotations

import os
import textwrap

import pytest

import coordinator

pytest_plugins = ["pytester"]

#: The checkout whose ``coordinator`` this process imported: the subprocess uses it too.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(coordinator.__file__)))

_FAST = """
    import time

    import pytest
    import torch


    @pytest.mark.distributed(world_size=2, timeout=30)
    def test_sum(rank, world_size, group):
        out = group.all_reduce(torch.tensor([rank + 1.0]))
        print(f"rank {rank} says hello")
        assert out.item() == world_size * (world_size + 1) / 2


    @pytest.mark.distributed(world_size=2, timeout=30)
    @pytest.mark.parametrize("scale", [2, 3], ids=["double", "triple"])
    def test_scaled(rank, scale):
        assert torch.tensor([rank]).mul(scale).item() == rank * scale


    @pytest.mark.distributed(world_size=2, timeout=30)
    def test_one_rank_fails(rank):
        values = [rank, rank * 10]
        assert values[1] == 0, "only rank 0 gets here"


    @pytest.mark.distributed(world_size=2, timeout=2)
    def test_one_rank_hangs(rank):
        if rank == 0:
            time.sleep(60)
"""


def _line(source: str, text: str) -> int:
    """The line number of the first line of ``source`` (dedented) holding ``text``."""
    lines = textwrap.dedent(source).splitlines()
    return next(i for i, ln in enumerate(lines, 1) if text in ln)


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, source: str,
         *args: str) -> pytest.RunResult:
    monkeypatch.setenv("PYTHONPATH", _ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    (pytester.path / "test_generated.py").write_text(textwrap.dedent(source))
    return pytester.runpytest_subprocess(
        "-p", "coordinator.pytest_plugin", "-p", "no:cacheprovider", "-v",
        *args, timeout=240)


@pytest.mark.timeout(240)
def test_pass_params_failure_and_timeout(pytester: pytest.Pytester,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    res = _run(pytester, monkeypatch, _FAST)
    out = res.stdout.str()
    res.assert_outcomes(passed=3, failed=2)
    res.stdout.fnmatch_lines([
        "*test_generated.py::test_sum PASSED*",
        "*test_generated.py::test_scaled[[]double[]] PASSED*",
        "*test_generated.py::test_scaled[[]triple[]] PASSED*",
        "*test_generated.py::test_one_rank_fails FAILED*",
        "*test_generated.py::test_one_rank_hangs FAILED*",
    ])
    # the failing rank's own traceback, in pytest's format, under its rank
    res.stdout.fnmatch_lines([
        "*distributed test (world_size=2) did not pass on every rank:",
        "*raised: rank(s) [[]1[]] of 2",
        "*passed: rank(s) [[]0[]] of 2",
        "*rank 1: AssertionError: only rank 0 gets here*",
        ">*assert values[[]1[]] == 0, \"only rank 0 gets here\"",
        "E*AssertionError: only rank 0 gets here",
        "E*assert 10 == 0",
        f"*test_generated.py:{_line(_FAST, 'assert values[1] == 0')}: AssertionError",
    ])
    # the hanging rank: named, killed, with where it was
    res.stdout.fnmatch_lines([
        "*timed out: rank(s) [[]0[]] of 2 did not finish within 2 s*",
        "*every rank was killed and reaped*",
        "*rank 0: timed out; its Python stacks*",
        f'*test_generated.py", line {_line(_FAST, "time.sleep(60)")} in test_one_rank_hangs',
    ])
    assert "rank 0 says hello" not in out  # a passing test's output stays captured
    assert "run_call" not in out  # the plugin's own frames are left out

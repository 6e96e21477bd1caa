"""The ranks' results as one pytest outcome.

Every rank passed: the test passes. Otherwise the test fails with one report
(pytest's longrepr, without the plugin's own frames) that has a section per rank
that did not pass: the traceback of a rank that raised, in pytest's format; the
exit of a rank that died; the Python stacks of the ranks stopped after a failure
(or after another rank skipped or xfailed) or still running at the timeout.
Every rank skipped: the test is skipped (the same for ``pytest.xfail``). What
each rank wrote goes to the test's captured output, under a header per rank.
"""

from __future__ import annotations

import sys

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

__all__ = ["print_output", "raise_outcome", "failure_report", "trim_stacks"]


def print_output(results: list[RankResult]) -> None:
    """Write each rank's output to this process's stdout (pytest captures it per test)."""
    for r in results:
        if r.output.strip():
            sys.stdout.write(f"----- rank {r.rank} -----\n{r.output.rstrip()}\n")


def raise_outcome(results: list[RankResult], what: str, timeout: float,
                  limit: str = "the marker's timeout",
                  expected: tuple[str, tuple[str, ...]] | None = None) -> None:
    """Return when every rank passed; else fail, skip or xfail the running test.

    Args:
        results: One per rank, by rank.
        what: The layout, in words (for the report's headline).
        timeout: The ranks' time limit (for the report).
        limit: Where that limit came from, in words.
        expected: The test's ``xfail(raises=...)`` marker, as its reason and the
            :func:`~coordinator.pytest_plugin.protocol.type_names` of the classes
            it names: the test xfails when the ranks that raised raised one of
            them and the others passed or were stopped while they waited for
            them (the exception here is the plugin's, not the rank's).
    """
    import pytest

    statuses = {r.status for r in results}
    if statuses == {PASSED}:
        return
    if statuses == {SKIPPED}:  # reported at the test, as a skip raised in it is
        raise pytest.skip.Exception(results[0].summary or "skipped on every rank",
                                    _use_item_location=True)
    if statuses == {XFAILED}:
        pytest.xfail(results[0].summary or "xfailed on every rank")
    if expected is not None and _as_expected(results, expected[1]):
        pytest.xfail(expected[0])
    pytest.fail(failure_report(results, what, timeout, limit), pytrace=False)


def _as_expected(results: list[RankResult], expected: tuple[str, ...]) -> bool:
    """Whether the ranks that did not pass raised one of the ``expected`` exception
    types, apart from ranks stopped while they waited (most likely for a rank that
    raised): at least one raised, and none died, timed out, skipped or raised
    something else."""
    raised = [r for r in results if r.status == FAILED]
    return bool(raised) and all(set(r.exception_types) & set(expected) for r in raised) and all(
        r.status in (PASSED, FAILED, STOPPED) for r in results)


def failure_report(results: list[RankResult], what: str, timeout: float,
                   limit: str = "the marker's timeout") -> str:
    """The report of a run where some rank did not pass (``limit``: where the time
    limit ``timeout`` came from, in words)."""
    n = len(results)
    by = {s: [r.rank for r in results if r.status == s]
          for s in (FAILED, DIED, TIMED_OUT, STOPPED, SKIPPED, XFAILED, PASSED)}
    lines = [f"distributed test ({what}) did not pass on every rank:"]
    if by[FAILED]:
        lines.append(f"  raised: rank(s) {by[FAILED]} of {n}")
    if by[DIED]:
        lines.append(f"  died: rank(s) {by[DIED]} of {n}")
    if by[TIMED_OUT]:
        lines.append(f"  timed out: rank(s) {by[TIMED_OUT]} of {n} did not finish within "
                     f"{timeout:g} s ({limit})")
    if by[STOPPED]:
        left = by[SKIPPED] + by[XFAILED]
        why = ("another rank failed" if by[FAILED] or by[DIED] or not left
               else f"rank(s) {sorted(left)} {_left_how(by)}")
        lines.append(f"  stopped: rank(s) {by[STOPPED]} of {n} were still running after "
                     f"{why} (most likely waiting for it in a collective)")
    for status in (SKIPPED, XFAILED):
        if by[status]:
            lines.append(f"  {status}: rank(s) {by[status]} of {n} (the others did not)")
    if by[PASSED]:
        lines.append(f"  passed: rank(s) {by[PASSED]} of {n}")
    if by[TIMED_OUT] or by[STOPPED] or by[DIED]:
        lines.append("  every rank was killed and reaped; the next test starts fresh ranks")
    order = (FAILED, DIED, TIMED_OUT, STOPPED)
    for r in sorted((r for r in results if r.status in order),
                    key=lambda r: (order.index(r.status), r.rank)):
        lines.append("")
        lines.append(_section_title(r))
        if r.status == DIED:
            lines.append(f"the rank process exited during the test ({r.summary})")
        text = trim_stacks(r.traceback) if r.status in (TIMED_OUT, STOPPED) else r.traceback
        if text.strip():
            lines.append(text.rstrip())
        elif r.status in (TIMED_OUT, STOPPED):
            lines.append("(no Python stack came back from the rank)")
    return "\n".join(lines)


def _left_how(by: dict[str, list[int]]) -> str:
    """How the ranks that left without failing left: ``skipped``, ``xfailed`` or both."""
    return " or ".join(s for s in (SKIPPED, XFAILED) if by[s])


def _section_title(r: RankResult) -> str:
    if r.status == FAILED:
        title = f" rank {r.rank}: {r.summary} "
    elif r.status == DIED:
        title = f" rank {r.rank}: died ({r.summary}) "
    else:
        title = f" rank {r.rank}: {r.status}; its Python stacks "
    return title.center(78, "_") if len(title) < 76 else "__" + title + "__"


#: Frames of these files are the plugin's and Python's machinery, not the test's.
_MACHINERY = ("/coordinator/pytest_plugin/", "/multiprocessing/", '"<string>"')


def trim_stacks(dump: str) -> str:
    """A rank's :mod:`faulthandler` dump without the plugin's threads and frames:
    drops the threads that only watch the parent process, and the frames of the
    plugin and of :mod:`multiprocessing` below the test."""
    blocks = [b for b in dump.strip().split("\n\n") if b.strip()]
    kept = [b for b in blocks if "_exit_with_parent" not in b] or blocks
    out = []
    for block in kept:
        lines = [ln for ln in block.splitlines()
                 if not (ln.lstrip().startswith("File ") and any(m in ln for m in _MACHINERY))]
        out.append("\n".join(lines))
    return "\n\n".join(out)

"""What crosses the pipe between the pytest process and a rank: a test to run, and
how it went on that rank.

The parent sends ``("run", TestCall)`` or ``("stop",)``; a rank answers each run
with one :class:`RankResult`, and its start with ``("ready",)`` or a failed
:class:`RankResult`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RankFixture", "TestCall", "RankResult", "PASSED", "FAILED", "SKIPPED", "XFAILED",
           "DIED", "STOPPED", "TIMED_OUT", "type_names"]

# What a rank reports.
PASSED = "passed"
FAILED = "failed"
SKIPPED = "skipped"
XFAILED = "xfailed"
# What the parent finds instead of a report.
DIED = "died"
STOPPED = "stopped"
TIMED_OUT = "timed out"


@dataclass(frozen=True)
class RankFixture:
    """Stands for a fixture whose value exists only in a rank (``rank``, ``group``, ...).

    The parent's fixture returns this; the rank puts the value in its place.
    """

    name: str


@dataclass(frozen=True)
class TestCall:
    """One test for the ranks to run.

    Attributes:
        nodeid: pytest's id of the test (for messages).
        module_name: The test module's name in the pytest process.
        path: The test module's file.
        qualname: The function's qualified name in its module (``test_x`` or
            ``TestThing.test_x``).
        kwargs: The function's arguments, pickled (a rank unpickles them once the
            module is imported): values (parametrize arguments, picklable fixtures)
            and :class:`RankFixture` stand-ins.
        sys_path: The pytest process's ``sys.path`` (what makes the module importable).
        tb_style: pytest's ``--tb`` style for the ranks' tracebacks.
        showlocals: pytest's ``--showlocals``: tracebacks with local variables.
        assertion_options: What the ranks' failed asserts are explained with
            (:func:`coordinator.pytest_plugin.assertions.assertion_options`).
        warning_filters: pytest's warning filters for the test, as
            ``(ini filterwarnings, -W options, the test's filterwarnings
            marks)``, applied in the rank as pytest applies them around a
            test; None: pytest's warnings plugin is off.
    """

    __test__ = False  # not a test class, whatever pytest collects it with

    nodeid: str
    module_name: str
    path: str
    qualname: str
    kwargs: bytes
    sys_path: list[str]
    tb_style: str = "long"
    showlocals: bool = False
    assertion_options: dict[str, Any] = field(default_factory=dict)
    warning_filters: tuple[list[str], list[str], list[str]] | None = None


@dataclass
class RankResult:
    """How a test (or a rank's start) went on one rank.

    Attributes:
        rank: The rank.
        status: One of the module's status names.
        summary: ``Type: message`` of a failure, or the reason of a skip.
        traceback: The rank's traceback of a failure (pytest's format), or the
            rank's Python stack when it was stopped or timed out.
        output: What the rank wrote to stdout and stderr during the test.
        reusable: Whether the rank's state is fit for the next test.
        exception_types: ``module.qualname`` of the raised exception's class and of
            its bases (a failure), for ``xfail(raises=...)`` in the pytest process.
        returned: A description of what the test function returned, when not
            None (pytest warns of it); empty otherwise.
    """

    rank: int
    status: str
    summary: str = ""
    traceback: str = ""
    output: str = ""
    reusable: bool = True
    exception_types: tuple[str, ...] = ()
    returned: str = ""


def type_names(cls: type) -> tuple[str, ...]:
    """``module.qualname`` of ``cls`` and of each of its bases (how a class is known
    across processes)."""
    return tuple(f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__)

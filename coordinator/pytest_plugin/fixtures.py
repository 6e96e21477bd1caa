"""The fixtures of a distributed test, and what of its arguments can reach the ranks.

In the pytest process the rank fixtures (``rank``, ``world_size``, ``local_rank``,
``group``, ``tp_group``, ``pp_group``, ``dp_group``) stand for values that exist
only in a rank: they return a :class:`RankFixture`, which each rank replaces by
its own value. Every other argument (parametrize values, other fixtures) is
pickled in the pytest process and sent: values such as ``tmp_path`` work in the
ranks; a fixture that acts on the pytest process itself (``monkeypatch``,
``capsys``, ...) or whose value does not pickle fails the test with a message
naming it.
"""

from __future__ import annotations

import inspect
import pickle
from typing import Any

import pytest

from coordinator.pytest_plugin.marker import MARKER, is_ours
from coordinator.pytest_plugin.protocol import RankFixture

__all__ = ["PROCESS_LOCAL_FIXTURES", "call_arguments", "rank", "world_size", "local_rank",
           "group", "tp_group", "pp_group", "dp_group"]

#: Fixtures that act on the pytest process: the ranks cannot use them.
PROCESS_LOCAL_FIXTURES = frozenset({
    "request", "pytestconfig", "monkeypatch", "capsys", "capsysbinary", "capfd",
    "capfdbinary", "caplog", "recwarn", "record_property", "record_xml_attribute",
    "record_testsuite_property", "cache", "doctest_namespace", "pytester", "testdir",
    "subtests", "tmp_path_factory", "tmpdir_factory",
})


def _stand_in(request: pytest.FixtureRequest, name: str) -> RankFixture:
    mark = request.node.get_closest_marker(MARKER)
    if mark is None or not is_ours(mark.args, mark.kwargs):
        pytest.fail(f"fixture {name!r} exists only in tests marked "
                    f"@pytest.mark.{MARKER}(world_size=...) (it is the rank's value)",
                    pytrace=False)
    return RankFixture(name)


@pytest.fixture
def rank(request: pytest.FixtureRequest) -> RankFixture:
    """This rank's global rank (in a distributed test)."""
    return _stand_in(request, "rank")


@pytest.fixture
def world_size(request: pytest.FixtureRequest) -> RankFixture:
    """The number of ranks (in a distributed test)."""
    return _stand_in(request, "world_size")


@pytest.fixture
def local_rank(request: pytest.FixtureRequest) -> RankFixture:
    """This rank's position on its (simulated) host (in a distributed test)."""
    return _stand_in(request, "local_rank")


@pytest.fixture
def group(request: pytest.FixtureRequest) -> RankFixture:
    """The world :class:`~coordinator.GroupCoordinator` (in a distributed test)."""
    return _stand_in(request, "group")


@pytest.fixture
def tp_group(request: pytest.FixtureRequest) -> RankFixture:
    """This rank's tensor-parallel group (a distributed test with ``tp=``/``pp=``/``dp=``)."""
    return _stand_in(request, "tp_group")


@pytest.fixture
def pp_group(request: pytest.FixtureRequest) -> RankFixture:
    """This rank's pipeline-parallel group (a distributed test with a layout)."""
    return _stand_in(request, "pp_group")


@pytest.fixture
def dp_group(request: pytest.FixtureRequest) -> RankFixture:
    """This rank's data-parallel group (a distributed test with a layout)."""
    return _stand_in(request, "dp_group")


def _argnames(item: pytest.Function) -> list[str]:
    """The names pytest fills in for the test function (parameters without a default)."""
    params = inspect.signature(item.obj).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds and p.default is inspect.Parameter.empty]


def _pickle_problem(value: Any) -> str | None:
    """Why ``value`` does not pickle; None when it does."""
    try:
        pickle.dumps(value)
    except Exception as e:
        return str(e)
    return None


def call_arguments(item: pytest.Function) -> bytes:
    """The test function's arguments, pickled for the ranks.

    Raises:
        pytest.fail.Exception: An argument is a process-local fixture or does not
            pickle (the message names it).
    """
    kwargs: dict[str, Any] = {}
    for name in _argnames(item):
        value = item.funcargs[name]
        if not isinstance(value, RankFixture) and name in PROCESS_LOCAL_FIXTURES:
            pytest.fail(f"{item.nodeid}: fixture {name!r} acts on the pytest process, not on "
                        f"the ranks a distributed test runs on; use it in a test without "
                        f"@pytest.mark.{MARKER}, or pass what the ranks need as a plain value",
                        pytrace=False)
        problem = _pickle_problem(value)
        if problem is not None:
            pytest.fail(f"{item.nodeid}: argument {name!r} (a fixture or parameter) cannot be "
                        f"sent to the ranks: its value, a {type(value).__name__}, does not "
                        f"pickle ({problem}); a distributed test may request the rank fixtures, "
                        f"parameters and fixtures whose values pickle", pytrace=False)
        kwargs[name] = value
    return pickle.dumps(kwargs)

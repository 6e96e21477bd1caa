"""The fixtures of a distributed test, and what of its arguments can reach the ranks.

In the pytest process the rank fixtures (``rank``, ``world_size``, ``local_rank``,
``group``, ``tp_group``, ``pp_group``, ``dp_group``) stand for values that exist
only in a rank: they return a :class:`RankFixture`, which each rank replaces by
its own value. Every other argument (parametrize values, other fixtures) is
pickled in the pytest process and sent: values such as ``tmp_path`` work in the
ranks; a fixture that acts on the pytest process itself (``monkeypatch``,
``capsys``, ...) or whose value does not pickle fails the test with a message
naming it.

Only the test function may request the rank fixtures: another fixture runs once,
in the pytest process, and would compute with the stand-in (``f"cpu:{rank}"``,
``rank == 0``) instead of each rank's value, so a distributed test with a
fixture that requests one fails at setup, naming that fixture
(:func:`check_fixture_requests`, and :func:`_stand_in` for
``request.getfixturevalue``).
"""

from __future__ import annotations

import inspect
import pickle
from typing import Any

import pytest

from coordinator.pytest_plugin.marker import MARKER, is_ours
from coordinator.pytest_plugin.protocol import RankFixture
from coordinator.pytest_plugin.rank_call import RANK_FIXTURES

__all__ = ["PROCESS_LOCAL_FIXTURES", "call_arguments", "check_fixture_requests", "rank",
           "world_size", "local_rank", "group", "tp_group", "pp_group", "dp_group"]

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
    # Asked for by another fixture (request.getfixturevalue; what a fixture names
    # as an argument check_fixture_requests refuses before setup): that fixture
    # runs here, once, and would compute with the stand-in, not a rank's value.
    requester = getattr(getattr(request, "_parent_request", None), "fixturename", None)
    if requester is not None and requester not in RANK_FIXTURES:
        pytest.fail(_requested_by_fixture(request.node.nodeid, requester, [name]),
                    pytrace=False)
    return RankFixture(name)


def _requested_by_fixture(nodeid: str, fixture: str, wanted: list[str]) -> str:
    return (f"{nodeid}: fixture {fixture!r} requests the rank fixture(s) {wanted}, whose "
            f"values exist only in the ranks: a fixture runs once, in the pytest process, "
            f"where it would get a stand-in instead of each rank's value. Request "
            f"{', '.join(map(repr, wanted))} in the test function and derive what you need in "
            f"its body")


def check_fixture_requests(item: pytest.Item) -> None:
    """Fail a distributed test one of whose fixtures (other than the rank fixtures
    themselves) requests a rank fixture, naming both, before any is set up.

    Raises:
        pytest.fail.Exception: Such a fixture is in the test's closure.
    """
    info = getattr(item, "_fixtureinfo", None)
    if info is None:  # not a pytest Function as this pytest makes them: nothing to check
        return
    for name in info.names_closure:
        if name in RANK_FIXTURES:
            continue
        # The definition in effect is the last; one that requests its own name
        # extends the one before it, which then runs too.
        for fixdef in reversed(info.name2fixturedefs.get(name, ())):
            wanted = [a for a in fixdef.argnames if a in RANK_FIXTURES]
            if wanted:
                pytest.fail(_requested_by_fixture(item.nodeid, name, wanted), pytrace=False)
            if name not in fixdef.argnames:
                break


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

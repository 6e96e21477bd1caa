"""The plugin's pytest hooks: register the marker, start a test's pool before its
fixtures, run the marked test's body on the ranks instead of here, close the pools.

The pool is started in ``pytest_runtest_setup``, before any fixture of the test
is set up, so that fixtures that look at this process's children around each
test (a leak check) find the ranks already there; ranks that stay up between
tests are the pool's, not the test's.
"""

from __future__ import annotations

import os
import sys
import time
import unittest
import warnings

import pytest

from coordinator.pytest_plugin.assertions import assertion_options
from coordinator.pytest_plugin.fixtures import call_arguments, check_fixture_requests
from coordinator.pytest_plugin.marker import (
    MARKER,
    MARKER_HELP,
    MarkerOptions,
    is_ours,
    parse_marker,
)
from coordinator.pytest_plugin.pool import START_TIMEOUT_S, PoolSet, PoolStartError
from coordinator.pytest_plugin.protocol import RankResult, TestCall, type_names
from coordinator.pytest_plugin.report import failure_report, print_output, raise_outcome
from coordinator.pytest_plugin.time_limit import pytest_timeout_of, time_limit

__all__ = ["pytest_configure", "pytest_unconfigure", "pytest_runtest_setup",
           "pytest_pyfunc_call", "live_rank_pids"]

_POOLS = pytest.StashKey[PoolSet]()
_OPTIONS = pytest.StashKey[MarkerOptions]()
_STARTED = pytest.StashKey[float]()
_CONFIGS: list[pytest.Config] = []


def live_rank_pids() -> list[int]:
    """Pids of the ranks of every open pool of this process (they outlive tests)."""
    return [pid for c in _CONFIGS if _POOLS in c.stash for pid in c.stash[_POOLS].worker_pids]


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``distributed`` marker and the session's pools (whose ranks start
    from this process's environment and working directory as they are now)."""
    config.addinivalue_line("markers", MARKER_HELP)
    config.stash[_POOLS] = PoolSet(base=(dict(os.environ), os.getcwd()))
    _CONFIGS.append(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop every rank of the session."""
    if _POOLS in config.stash:
        config.stash[_POOLS].close()
        del config.stash[_POOLS]
    if config in _CONFIGS:
        _CONFIGS.remove(config)


#: Fixtures whose values are the model-parallel groups a marker's tp=/pp=/dp= make.
_MODEL_GROUP_FIXTURES = ("tp_group", "pp_group", "dp_group")


def _options(item: pytest.Item) -> MarkerOptions | None:
    mark = item.get_closest_marker(MARKER)
    if mark is None or not isinstance(item, pytest.Function):
        return None
    if not is_ours(mark.args, mark.kwargs):  # another project's marker of the same name
        return None
    if _is_unittest(item):  # pytest runs it through unittest, never through our hook
        pytest.fail(f"{item.nodeid}: the distributed marker does not apply to "
                    f"unittest.TestCase methods; write the test as a function or a method "
                    f"of a plain class", pytrace=False)
    try:
        return parse_marker(mark.args, mark.kwargs)
    except ValueError as e:
        problem = str(e)
    pytest.fail(f"{item.nodeid}: {problem}", pytrace=False)  # outside: no chained error


def _is_unittest(item: pytest.Function) -> bool:
    cls = getattr(item, "cls", None)
    return cls is not None and issubclass(cls, unittest.TestCase)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Check a marked test's options and start its pool (before its fixtures)."""
    started = time.monotonic()  # about when pytest-timeout's clock started
    options = _options(item)
    if options is None:
        return
    wanted = [f for f in _MODEL_GROUP_FIXTURES if f in getattr(item, "fixturenames", ())]
    if wanted and not options.layout.model_parallel:  # before any rank starts
        pytest.fail(f"{item.nodeid}: fixture {wanted[0]!r} needs model-parallel groups: give "
                    f"tp=, pp= or dp= in the distributed marker", pytrace=False)
    check_fixture_requests(item)  # before any rank starts
    item.stash[_OPTIONS] = options
    item.stash[_STARTED] = started
    pool = item.config.stash[_POOLS].get(options.layout)
    try:
        pool.start()
    except PoolStartError as e:
        if not e.results:  # no rank process started: the message says why
            pytest.fail(f"{item.nodeid}: {e}", pytrace=False)
        pytest.fail(failure_report(e.results, f"starting {options.layout.describe()}",
                                   START_TIMEOUT_S, "the limit of a start"), pytrace=False)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run a marked test's body on its ranks; other tests run here as usual."""
    options = pyfuncitem.stash.get(_OPTIONS, None)
    if options is None:
        return None
    call = TestCall(
        nodeid=pyfuncitem.nodeid,
        module_name=pyfuncitem.module.__name__ if pyfuncitem.module else "",
        path=os.fspath(pyfuncitem.path),
        qualname=_qualname(pyfuncitem),
        kwargs=call_arguments(pyfuncitem),
        sys_path=list(sys.path),
        tb_style=_tb_style(pyfuncitem.config),
        showlocals=bool(pyfuncitem.config.getoption("showlocals", False)),
        assertion_options=assertion_options(pyfuncitem.config),
        warning_filters=_warning_filters(pyfuncitem),
    )
    pytest_timeout, body_only = pytest_timeout_of(pyfuncitem)
    elapsed = 0.0 if body_only else time.monotonic() - pyfuncitem.stash[_STARTED]
    limit = time_limit(options.timeout, pytest_timeout, elapsed)
    pool = pyfuncitem.config.stash[_POOLS].get(options.layout)
    results = pool.run(call, limit.seconds)
    print_output(results)
    raise_outcome(results, options.layout.describe(), limit.seconds, limit.source,
                  _expected_exceptions(pyfuncitem))
    _warn_of_returned(pyfuncitem, results)
    return True


def _warning_filters(item: pytest.Function) -> tuple[list[str], list[str], list[str]] | None:
    """The warning filters pytest's warnings plugin applies around ``item`` (None when
    that plugin is off): the ini's, ``-W``'s, and the item's marks', in that order."""
    config = item.config
    if config.pluginmanager.get_plugin("warnings") is None:
        return None
    ini = [str(f) for f in config.getini("filterwarnings")]
    cmdline = [str(f) for f in (config.known_args_namespace.pythonwarnings or [])]
    marks = [str(arg) for mark in item.iter_markers(name="filterwarnings") for arg in mark.args]
    return ini, cmdline, marks


def _warn_of_returned(item: pytest.Function, results: list[RankResult]) -> None:
    """pytest's warning for a test function that returns a value, once for the ranks."""
    returned = [r for r in results if r.returned]
    if not returned:
        return
    what = f"rank {returned[0].rank} returned {returned[0].returned}"
    warning = getattr(pytest, "PytestReturnNotNoneWarning", pytest.PytestWarning)
    warnings.warn(warning(
        f"Expected None, but {item.nodeid} {what}; a test function should return None. "
        f"Did you mean to use `assert` instead of `return`?"), stacklevel=1)


def _expected_exceptions(item: pytest.Function) -> tuple[str, tuple[str, ...]] | None:
    """The reason of the test's ``xfail(raises=...)`` marker (as pytest evaluated it)
    and the names of the exception classes it names; None without one."""
    try:
        from _pytest.skipping import xfailed_key
    except ImportError:  # another pytest: xfail(raises=...) sees the plugin's failure
        return None
    xfailed = item.stash.get(xfailed_key, None)
    if xfailed is None or xfailed.raises is None or item.config.option.runxfail:
        return None
    raises = xfailed.raises if isinstance(xfailed.raises, tuple) else (xfailed.raises,)
    classes = [c for c in raises if isinstance(c, type)]
    if len(classes) < len(raises):  # a matcher (pytest.RaisesExc): only pytest applies it
        return None
    return xfailed.reason, tuple(type_names(c)[0] for c in classes)


def _qualname(item: pytest.Function) -> str:
    name = item.originalname
    return f"{item.cls.__qualname__}.{name}" if item.cls is not None else name


def _tb_style(config: pytest.Config) -> str:
    style = str(config.getoption("tbstyle", "auto"))
    return {"auto": "long", "line": "short", "no": "short"}.get(style, style)

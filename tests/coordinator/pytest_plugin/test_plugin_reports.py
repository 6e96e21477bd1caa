"""The plugin seen from pytest: generated test files run in a pytest subprocess
(``pytester``), and what its report says.

One run covers the fast cases: a passing test, parametrize ids, a rank that
fails (its traceback and the ranks' output in the report), a rank that raises
what ``xfail(raises=...)`` expects while the other waits for it, and the tests
refused at setup (two tests read its report: a pytest subprocess costs seconds
of CPU, importing torch). The others (a rank
that hangs past the timeout, layouts, simulated hosts, a rank that dies, test
classes, fixtures that cannot reach the ranks, skips, xdist) are ``slow``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import coordinator

pytest_plugins = ["pytester"]

#: The checkout whose ``coordinator`` this process imported: the subprocess uses it too.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(coordinator.__file__)))

_FAST = """
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
        print(f"rank {rank} was here")
        values = [rank, rank * 10]
        assert values[1] == 0, "only rank 0 gets here"


    @pytest.mark.xfail(raises=NotImplementedError, reason="rank 1 cannot do it yet")
    @pytest.mark.distributed(world_size=2, timeout=30)
    def test_one_rank_raises_what_xfail_expects(rank, group):
        if rank == 1:
            raise NotImplementedError("not on rank 1")
        group.barrier()  # rank 0 waits for rank 1 until the plugin stops it
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


#: The one run of the fast cases and of the cases refused at setup.
_FAST_RUN: list[pytest.RunResult] = []


def _fast_run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.RunResult:
    """The report of one pytest run of ``_FAST`` followed by ``_REFUSED_AT_SETUP``
    (made by the first test that asks; ``_FAST``'s lines keep their numbers)."""
    if not _FAST_RUN:
        (pytester.path / "conftest.py").write_text(textwrap.dedent(_CANNOT_START_CONFTEST))
        source = textwrap.dedent(_FAST) + "\n\n" + textwrap.dedent(_REFUSED_AT_SETUP)
        res = _run(pytester, monkeypatch, source)
        # the fast cases passed and failed; the refused ones errored at setup
        res.assert_outcomes(passed=3, failed=1, xfailed=1, errors=6)
        _FAST_RUN.append(res)
    return _FAST_RUN[0]


@pytest.mark.timeout(240)
def test_pass_params_and_a_failing_rank(pytester: pytest.Pytester,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    res = _fast_run(pytester, monkeypatch)
    out = res.stdout.str()
    res.stdout.fnmatch_lines([
        "*test_generated.py::test_sum PASSED*",
        "*test_generated.py::test_scaled[[]double[]] PASSED*",
        "*test_generated.py::test_scaled[[]triple[]] PASSED*",
        "*test_generated.py::test_one_rank_fails FAILED*",
        "*test_generated.py::test_one_rank_raises_what_xfail_expects XFAIL*",
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
    res.stdout.fnmatch_lines([  # what the ranks printed, in the failed test's output
        "*Captured stdout call*", "----- rank 0 -----", "rank 0 was here",
        "----- rank 1 -----", "rank 1 was here",
    ])
    assert "rank 0 says hello" not in out  # a passing test's output stays captured
    assert "run_call" not in out  # the plugin's own frames are left out


_AS_IN_PYTEST = """
    import os
    import unittest
    import warnings

    import pytest
    import torch

    torch.set_default_dtype(torch.float64)  # top-level code: holds for every test
    os.environ["SET_AT_IMPORT"] = "yes"


    @pytest.fixture(scope="module")
    def fixture_env():
        os.environ["SET_BY_A_FIXTURE"] = "1"  # this process's: never the ranks'
        yield
        del os.environ["SET_BY_A_FIXTURE"]


    @pytest.mark.distributed(world_size=2)
    def test_module_state_first(rank, fixture_env):
        assert torch.get_default_dtype() == torch.float64
        assert os.environ.get("SET_AT_IMPORT") == "yes"
        assert "SET_BY_A_FIXTURE" not in os.environ


    @pytest.mark.distributed(world_size=2)
    def test_module_state_second(rank, fixture_env):
        assert torch.get_default_dtype() == torch.float64
        assert os.environ.get("SET_AT_IMPORT") == "yes"
        assert "SET_BY_A_FIXTURE" not in os.environ


    @pytest.mark.distributed(world_size=2)
    @pytest.mark.filterwarnings("error::UserWarning")
    def test_warning_made_an_error(rank):
        warnings.warn("a user warning", UserWarning)


    @pytest.mark.distributed(world_size=2)
    def test_warning_made_an_error_by_the_ini(rank):
        warnings.warn("deprecated here", DeprecationWarning)


    @pytest.mark.distributed(world_size=2)
    def test_returns_a_value(rank):
        return rank + 41


    @pytest.mark.distributed(world_size=2)
    def test_skips_everywhere(rank):
        pytest.skip("not here")


    class TestUnit(unittest.TestCase):
        @pytest.mark.distributed(world_size=2)
        def test_in_a_testcase(self):
            pass


    @pytest.mark.distributed(world_size=2)
    def test_tp_group_without_tp(rank, tp_group):
        pass
"""


@pytest.mark.timeout(240)
def test_module_state_environment_warnings_returns_and_refusals(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks do what pytest does: a module's top-level code holds for each of its
    tests, the ranks start from the session's environment (not what a fixture set
    here), warning filters (ini and marks) apply, a returned value warns, a skip is
    reported at the test; a unittest method is refused instead of running here, and
    so is a model group's fixture in a test whose marker makes no model groups."""
    pytester.makeini("[pytest]\nfilterwarnings =\n    error::DeprecationWarning\n")
    res = _run(pytester, monkeypatch, _AS_IN_PYTEST, "-rs", "-W", "default::UserWarning")
    out = res.stdout.str()
    # (a model group's fixture without tp=/pp=/dp= is refused at setup, before
    # any rank starts, as other bad options are: it used to fail on every rank)
    res.assert_outcomes(passed=3, failed=2, skipped=1, errors=2, warnings=1)
    res.stdout.fnmatch_lines([
        "*::test_module_state_first PASSED*", "*::test_module_state_second PASSED*",
        "*::test_warning_made_an_error FAILED*",
        "*::test_warning_made_an_error_by_the_ini FAILED*",
        "*::test_returns_a_value PASSED*",
    ])
    res.stdout.fnmatch_lines(["*UserWarning: a user warning*"])
    res.stdout.fnmatch_lines(["*DeprecationWarning: deprecated here*"])
    res.stdout.fnmatch_lines(["*returned 41*"])
    skip_line = _line(_AS_IN_PYTEST, "def test_skips_everywhere") - 1  # its decorator
    res.stdout.fnmatch_lines([f"SKIPPED [[]1[]] test_generated.py:{skip_line}: not here"])
    assert "does not apply to unittest.TestCase methods" in out
    assert "fixture 'tp_group' needs model-parallel groups: give tp=, pp= or dp=" in out


_LAYOUTS = """
    import os
    import time

    import pytest
    import torch

    from coordinator import parallel_state as ps

    PIDS = os.environ["PLUGIN_TEST_PIDS"]


    @pytest.mark.distributed(world_size=4, timeout=60, tp=2, pp=2)
    def test_tp_pp(rank, tp_group, pp_group, dp_group):
        assert tp_group.ranks == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert pp_group.ranks == [rank % 2, rank % 2 + 2]
        assert dp_group.world_size == 1
        assert tp_group.all_reduce(torch.ones(2)).tolist() == [2.0, 2.0]
        with open(os.path.join(PIDS, f"rank{rank}"), "w") as f:
            f.write(str(os.getpid()))
        os.environ["LEFT_BEHIND"] = "1"


    @pytest.mark.distributed(world_size=4, timeout=60, tp=2, pp=2)
    def test_same_ranks_next_time(rank, tp_group):
        with open(os.path.join(PIDS, f"rank{rank}")) as f:
            assert int(f.read()) == os.getpid()  # the pool's rank, not a new one
        assert "LEFT_BEHIND" not in os.environ  # the environment was put back
        assert ps.get_tp_group() is tp_group


    @pytest.mark.distributed(world_size=4, timeout=60, hosts=2)
    def test_two_hosts(rank, local_rank, group):
        assert local_rank == rank % 2
        assert os.environ["GROUPCOORD_NODE_ID"] == f"host{rank // 2}"
        assert ps.get_node_count() == 2
        assert group.all_reduce(torch.ones(1)).item() == 4


    @pytest.mark.parametrize("n", [
        pytest.param(2, marks=pytest.mark.distributed(world_size=2)),
        pytest.param(3, marks=pytest.mark.distributed(world_size=3)),
    ])
    def test_world_size_per_param(n, world_size, tmp_path):
        assert world_size == n and tmp_path.is_dir()


    class TestInAClass:
        @pytest.mark.distributed(world_size=2)
        def test_method(self, rank):
            assert self.seven() == 7

        def seven(self):
            return 7


    @pytest.mark.distributed(world_size=2)
    def test_destroys_the_world(rank):
        ps.destroy_distributed_environment()


    @pytest.mark.distributed(world_size=2)
    def test_after_the_world_was_destroyed(group):
        assert group.all_reduce(torch.ones(1)).item() == 2  # a fresh pool


    @pytest.mark.distributed(world_size=2)
    def test_skipped_everywhere(rank):
        pytest.skip("not on this machine")


    @pytest.mark.distributed(world_size=2)
    def test_rank_dies(rank):
        if rank == 1:
            os._exit(3)


    @pytest.mark.distributed(world_size=2)
    def test_process_local_fixture(rank, monkeypatch):
        pass


    @pytest.fixture
    def lock():
        import threading

        return threading.Lock()


    @pytest.mark.distributed(world_size=2)
    def test_value_that_does_not_pickle(rank, lock):
        pass


    def test_rank_without_the_marker(rank):
        pass


    @pytest.mark.distributed(world_size=3, tp=2)
    def test_bad_layout():
        pass


    @pytest.mark.distributed(world_size=2, timeout=2)
    def test_one_rank_hangs(rank):
        if rank == 0:
            time.sleep(60)
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_layouts_hosts_reuse_and_refusals(pytester: pytest.Pytester,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    pids = pytester.mkdir("pids")
    monkeypatch.setenv("PLUGIN_TEST_PIDS", str(pids))
    res = _run(pytester, monkeypatch, _LAYOUTS)
    res.assert_outcomes(passed=8, skipped=1, failed=4, errors=2)
    res.stdout.fnmatch_lines([
        "*::test_tp_pp PASSED*",
        "*::test_same_ranks_next_time PASSED*",
        "*::test_two_hosts PASSED*",
        "*::test_world_size_per_param[[]2[]] PASSED*",
        "*::test_world_size_per_param[[]3[]] PASSED*",
        "*::TestInAClass::test_method PASSED*",
        "*::test_destroys_the_world PASSED*",
        "*::test_after_the_world_was_destroyed PASSED*",
        "*::test_skipped_everywhere SKIPPED*",
        "*::test_rank_dies FAILED*",
        "*::test_process_local_fixture FAILED*",
        "*::test_value_that_does_not_pickle FAILED*",
        "*::test_rank_without_the_marker ERROR*",
        "*::test_bad_layout ERROR*",
    ])
    res.stdout.fnmatch_lines_random([
        "*died: rank(s) [[]1[]] of 2*",
        "*rank 1: died (exit code 3)*",
        "*fixture 'monkeypatch' acts on the pytest process, not on the ranks*",
        "*argument 'lock' (a fixture or parameter) cannot be sent to the ranks*",
        "*fixture 'rank' exists only in tests marked @pytest.mark.distributed*",
        "*tp * pp * dp = 2 must divide world_size=3*",
        "*SKIPPED*not on this machine*",
    ])
    # the hanging rank: named, killed, with where it was
    res.stdout.fnmatch_lines([
        "*timed out: rank(s) [[]0[]] of 2 did not finish within 2 s*",
        "*every rank was killed and reaped*",
        "*rank 0: timed out; its Python stacks*",
        f'*test_generated.py", line {_line(_LAYOUTS, "time.sleep(60)")} in test_one_rank_hangs',
    ])


_XDIST = """
    import pytest
    import torch


    @pytest.mark.distributed(world_size=2, timeout=60)
    @pytest.mark.parametrize("k", [1, 2])
    def test_in_a_worker(rank, group, k):
        assert group.all_reduce(torch.full((2,), float(k))).tolist() == [2.0 * k] * 2
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_under_xdist(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_other=textwrap.dedent(_XDIST))
    res = _run(pytester, monkeypatch, _XDIST, "-n", "2", "--dist", "loadfile")
    res.assert_outcomes(passed=4)


_ROBUST = """
    import os
    import signal
    import subprocess
    import time

    import pytest

    CHILD = os.environ["PLUGIN_TEST_CHILD"]
    PYTEST_PID = os.getpid()


    @pytest.mark.distributed(world_size=2, timeout=30)
    def test_lists_differ(rank):
        assert [1, 2, 3] == [1, 2, 3 + rank]


    @pytest.mark.distributed(world_size=2, timeout=30)
    def test_segfault(rank, group):
        print(f"rank {rank} before the crash")  # shown, though rank 1 never returns
        if rank == 1:
            os.kill(os.getpid(), signal.SIGSEGV)
        group.barrier()


    @pytest.mark.distributed(world_size=2, timeout=30)
    def test_child_outlives_its_rank(rank):
        if rank == 1:
            child = subprocess.Popen(["sleep", "120"])
            with open(CHILD, "w") as f:
                f.write(str(child.pid))
            os._exit(1)


    def test_the_child_was_ended():
        with open(CHILD) as f:
            pid = int(f.read())
        try:
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            pass


    @pytest.mark.xfail(raises=LookupError, reason="ranks raise KeyError")
    @pytest.mark.distributed(world_size=2, timeout=30)
    def test_expected_exception(rank):
        raise KeyError(rank)


    @pytest.mark.distributed(num_gpus=2)  # another project's marker of the same name
    def test_another_projects_marker():
        assert os.getpid() == PYTEST_PID  # runs in the pytest process, as usual


    @pytest.mark.distributed(world_size=2, timeout=60)
    def test_sets_a_handler_on_the_stack_signal(rank):
        signal.signal(signal.SIGUSR2, lambda *args: None)  # the next test's stacks still come


    @pytest.mark.timeout(25)
    @pytest.mark.distributed(world_size=2, timeout=60)
    def test_hangs_past_pytest_timeout(rank, group):
        print(f"rank {rank} before the hang")  # shown, though no rank returns
        if rank == 0:
            group.barrier()
        else:
            time.sleep(100)
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_asserts_deaths_children_and_pytest_timeout(pytester: pytest.Pytester,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLUGIN_TEST_CHILD", str(pytester.path / "child"))
    res = _run(pytester, monkeypatch, _ROBUST)
    res.assert_outcomes(passed=3, failed=4, xfailed=1)
    res.stdout.fnmatch_lines([  # pytest's explanation of the comparison, from the rank
        "*rank 1: AssertionError: assert [[]1, 2, 3[]] == [[]1, 2, 4[]]*",
        "E*At index 2 diff: 3 != 4",
    ])
    res.stdout.fnmatch_lines(["*died: rank(s) [[]1[]] of 2*",
                              "*rank 1: died (killed by signal SIGSEGV)*"])
    res.stdout.fnmatch_lines(["*::test_the_child_was_ended PASSED*",
                              "*::test_expected_exception XFAIL*",
                              "*::test_another_projects_marker PASSED*"])
    res.stdout.fnmatch_lines([  # the plugin reports before pytest-timeout ends the test
        "*timed out: rank(s) [[]0, 1[]] of 2 did not finish within * s (what "
        "pytest-timeout's 25 s left, less 5 s for this report)",
        "*rank 1: timed out; its Python stacks*",
        f'*test_generated.py", line {_line(_ROBUST, "time.sleep(100)")} in '
        f"test_hangs_past_pytest_timeout",
    ])
    assert "Timeout (0:00:25)" not in res.stdout.str()
    out = res.stdout.str()
    for text in ("rank 0 before the crash", "rank 1 before the crash",
                 "rank 0 before the hang", "rank 1 before the hang"):
        assert text in out, text


_INTERRUPTED = """
    import os
    import time

    import pytest


    @pytest.mark.distributed(world_size=2, timeout=120)
    def test_waits(rank):
        with open(os.path.join(os.environ["PLUGIN_TEST_PIDS"], f"rank{rank}"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(100)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_ends_the_ranks(pytester: pytest.Pytester) -> None:
    pids = pytester.mkdir("pids")
    (pytester.path / "test_generated.py").write_text(textwrap.dedent(_INTERRUPTED))
    env = {**os.environ, "PLUGIN_TEST_PIDS": str(pids),
           "PYTHONPATH": _ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "coordinator.pytest_plugin", "-p",
         "no:cacheprovider", "-q", "test_generated.py"],
        cwd=pytester.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while len(os.listdir(pids)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.2)  # the files are written
        ranks = [int((pids / name).read_text()) for name in os.listdir(pids)]
        assert len(ranks) == 2
        interrupted = time.monotonic()
        proc.send_signal(signal.SIGINT)  # as Ctrl-C does (the ranks have their own group)
        out, _ = proc.communicate(timeout=60)
        assert time.monotonic() - interrupted < 9, out  # not the 10 s of a graceful stop
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert b"KeyboardInterrupt" in out, out
    assert not any(os.path.exists(f"/proc/{pid}") for pid in ranks), out


_REFUSED_AT_SETUP = """
    import pytest


    @pytest.fixture
    def shard_info(rank, world_size):
        return {"rank": rank, "world_size": world_size}


    @pytest.fixture
    def device(local_rank):
        return f"cpu:{local_rank}"


    @pytest.fixture
    def dynamic(request):
        return request.getfixturevalue("rank")


    @pytest.mark.distributed(world_size=2, timeout=30)
    def test_derived_fixture(rank, shard_info):  # rank is set up before shard_info asks
        assert shard_info["rank"] == rank


    @pytest.mark.distributed(world_size=2, timeout=30)
    def test_derived_device(device):
        pass


    @pytest.mark.distributed(world_size=2, timeout=30)
    def test_dynamic_request(dynamic):
        pass


    @pytest.mark.parametrize("which", [
        pytest.param("inf", marks=pytest.mark.distributed(world_size=2, timeout=float("inf"))),
        pytest.param("huge", marks=pytest.mark.distributed(world_size=2, timeout=1e300)),
    ], ids=["inf", "huge"])
    def test_timeout(rank, which):
        pass


    @pytest.mark.distributed(world_size=3, timeout=30)
    def test_cannot_start(rank):
        pass
"""

#: Makes the ranks of test_cannot_start fail to start (no such start method); the
#: other tests start theirs as the run would have (the variable as inherited).
_CANNOT_START_CONFTEST = """
    import os

    import pytest

    INHERITED = os.environ.get("GROUPCOORD_RANK_START")


    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(item):
        if item.name == "test_cannot_start":
            os.environ["GROUPCOORD_RANK_START"] = "no-such-method"
        elif INHERITED is None:
            os.environ.pop("GROUPCOORD_RANK_START", None)
        else:
            os.environ["GROUPCOORD_RANK_START"] = INHERITED
"""


@pytest.mark.timeout(240)
def test_fixtures_on_rank_fixtures_bad_timeouts_and_failed_starts_error_at_setup(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    res = _fast_run(pytester, monkeypatch)  # (one run with the fast cases)
    res.stdout.fnmatch_lines([  # before, the fixtures silently got the plugin's stand-ins
        "*::test_derived_fixture: fixture 'shard_info' requests the rank fixture(s) "
        "[[]'rank', 'world_size'[]], whose values exist only in the ranks*",
    ])
    res.stdout.fnmatch_lines(["*::test_derived_device: fixture 'device' requests the rank "
                              "fixture(s) [[]'local_rank'[]]*"])
    res.stdout.fnmatch_lines(["*::test_dynamic_request: fixture 'dynamic' requests the rank "
                              "fixture(s) [[]'rank'[]]*"])
    # before: accepted, then an OverflowError in the middle of the run
    res.stdout.fnmatch_lines(["*test_timeout[[]inf[]]: distributed marker: timeout must be "
                              "a number of seconds > 0 and <= 1e+06, got inf"])
    res.stdout.fnmatch_lines(["*test_timeout[[]huge[]]: distributed marker: timeout must be "
                              "a number of seconds > 0 and <= 1e+06, got 1e+300"])
    # before: start_ranks' own ValueError, and the stacks directory left behind
    res.stdout.fnmatch_lines(["*::test_cannot_start: the ranks of world_size=3 could not be "
                              "started: ValueError: *GROUPCOORD_RANK_START*no-such-method*"])


_LEAVES_EARLY = """
    import pytest
    import torch


    class BrokenStr(Exception):
        def __str__(self):
            raise RuntimeError("__str__ is broken")


    @pytest.mark.distributed(world_size=2, timeout=30)
    def test_broken_str(rank):
        if rank == 1:
            raise BrokenStr("the real problem")


    @pytest.mark.distributed(world_size=2, timeout=60)
    @pytest.mark.parametrize("how", ["skip", "xfail"])
    def test_rank_0_leaves(rank, group, how):
        if rank == 0:
            getattr(pytest, how)(f"{how} on rank 0")
        group.all_reduce(torch.ones(1))  # rank 1 waits here for rank 0
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_broken_str_and_a_rank_that_skips_while_others_wait(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    t0 = time.monotonic()
    res = _run(pytester, monkeypatch, _LEAVES_EARLY)
    res.assert_outcomes(failed=3)
    # before: the rank died on str(e), and the report said "died (exit code 1)"
    res.stdout.fnmatch_lines(["*raised: rank(s) [[]1[]] of 2",
                              "*rank 1: BrokenStr: <BrokenStr: str() failed>*",
                              f"*test_generated.py:{_line(_LEAVES_EARLY, 'raise BrokenStr')}: "
                              f"BrokenStr"])
    assert "died" not in res.stdout.str()
    # before: rank 1 waited the marker's whole 60 s and was reported as timed out
    for how in ("skipped", "xfailed"):
        res.stdout.fnmatch_lines([f"*stopped: rank(s) [[]1[]] of 2 were still running after "
                                  f"rank(s) [[]0[]] {how} (most likely waiting for it in a "
                                  f"collective)"])
    assert "timed out" not in res.stdout.str()
    assert time.monotonic() - t0 < 100  # three pool starts, no 60 s wait

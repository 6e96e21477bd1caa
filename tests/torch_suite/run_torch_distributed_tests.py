"""Run PyTorch's own ``distributed_test.py`` on a backend: ``gloo`` or ``groupcoord``.

PyTorch tests its CPU backend with
``torch/testing/_internal/distributed/distributed_test.py`` (it ships in the
wheel), driven by ``test/distributed/test_distributed_spawn.py`` (which does
not): that script reads ``BACKEND``, ``WORLD_SIZE`` and ``TEMP_DIR`` from the
environment and runs ``DistributedTest._DistTestBase``'s tests through
``MultiProcessTestCase``, which spawns ``WORLD_SIZE`` fresh processes per test;
each calls ``dist.init_process_group(BACKEND, ...)`` and runs the test body.
This script does the same with plain :mod:`unittest`, counts passed, skipped
and failed tests, and prints the skip reasons.

Usage::

    python tests/torch_suite/run_torch_distributed_tests.py --backend groupcoord \\
        --world-size 2 [-k PATTERN ...] [--json out.json] [--list]

What runs (the *selection*): the test names of ``_DistTestBase`` that match
:data:`COLLECTIVE_TESTS` (the CPU collectives, point-to-point with and
without the profilers, barriers, groups and object collectives; DDP and model
averaging are out), minus those that ``skips.txt`` beside this file lists for
the backend with a reason, narrowed further by ``-k`` (regular expressions
searched in the name; any may match). ``--all`` starts from every test name
instead.

How ``groupcoord`` is made to look like ``gloo`` to the suite:

* ``distributed_test.py`` decides many skips when it is imported, from the
  literal name: ``@skip_but_pass_in_sandcastle_if(BACKEND != "gloo", ...)``,
  ``@require_backend_is_available({"gloo"})``. With ``--gates gloo`` (the
  default for ``groupcoord``) the module is imported with ``BACKEND=gloo``, so
  exactly the tests that gloo runs are kept; afterwards the module's
  ``BACKEND`` (read when a test runs: the ``init_process_group`` backend,
  ``new_group`` arguments, checks inside test bodies) and the environment's
  ``BACKEND`` are set to ``groupcoord``. ``--gates own`` imports it with the
  backend's own name (tests gated on the literal ``"gloo"`` then skip).
* ``DistTestCases.backend_feature`` (checked when tests run) gets
  ``groupcoord`` in the feature sets gloo has on CPU: ``ddp``, ``subgroup``,
  and ``plugin`` (a backend that is not built into torch is "available").
  The GPU sets (``gpu``, ``cuda``) are left alone: groupcoord is CPU only.

Every process (this one and the ranks that ``MultiProcessTestCase`` spawns,
which import this file as ``__mp_main__``) applies the same set-up from the
environment variables that :func:`main` sets before anything is imported.

Exit status: 0 when nothing failed, 1 otherwise, 2 for bad options.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import time
import unittest
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
SKIPS_FILE = os.path.join(_HERE, "skips.txt")

# Read by every process (the ranks are spawned with this process's environment).
_ENV_BACKEND = "GROUPCOORD_TORCH_SUITE_BACKEND"
_ENV_GATES = "GROUPCOORD_TORCH_SUITE_GATES"

#: The CPU collective tests: collectives, point-to-point, barriers, groups and
#: object collectives (names of ``_DistTestBase``'s tests, searched with re.match).
COLLECTIVE_TESTS = re.compile(
    r"test_(get_rank|get_backend|destroy_|barrier|new_subgroups|coalescing_manager"
    r"|batch_isend_irecv|send_recv|isend|irecv|broadcast|reduce|all_reduce|sparse_all_reduce"
    r"|scatter|gather|all_gather|all_to_all|monitored_barrier)"
)

#: Feature sets of ``DistTestCases.backend_feature`` gloo belongs to on CPU.
_CPU_FEATURES = ("ddp", "subgroup", "plugin")


def _provide_expecttest() -> None:
    """torch's test base class derives from ``expecttest.TestCase``, a test-only package
    this project does not install. Where it is missing, a stand-in whose ``TestCase`` is
    :class:`unittest.TestCase` takes its place: ``distributed_test.py`` calls none of
    expecttest's own methods (``assertExpectedInline``)."""
    try:
        import expecttest  # noqa: F401  the real one, where installed
    except ImportError:
        import types

        stand_in = types.ModuleType("expecttest")
        stand_in.TestCase = unittest.TestCase  # type: ignore[attr-defined]  a module built here
        stand_in.ACCEPT = False  # type: ignore[attr-defined]  read by torch's common_utils
        sys.modules["expecttest"] = stand_in


def _set_up_process() -> Any:
    """Import the suite as the environment says; the test class, or None if unset.

    Called at import in every process: the parent after :func:`main` set the
    environment, each spawned rank when it imports this file as ``__mp_main__``.
    """
    backend = os.environ.get(_ENV_BACKEND)
    if not backend:
        return None
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    import coordinator  # noqa: F401  registers the groupcoord backend with torch.distributed

    _provide_expecttest()
    gates = os.environ.get(_ENV_GATES, backend)
    os.environ["BACKEND"] = gates  # what distributed_test.py reads when imported
    from torch.testing._internal.common_distributed import DistTestCases
    from torch.testing._internal.distributed import distributed_test as suite

    os.environ["BACKEND"] = backend
    suite.BACKEND = backend  # read when a test runs: init_process_group, new_group, bodies
    for feature in _CPU_FEATURES:
        DistTestCases.backend_feature[feature].add(backend)

    class TestDistBackendWithSpawn(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
        """``test_distributed_spawn.py``'s class: fresh rank processes per test."""

        def setUp(self) -> None:
            super().setUp()
            self._spawn_processes()

    # Spawned ranks find the class by name in this module (imported as __mp_main__).
    TestDistBackendWithSpawn.__qualname__ = "TestDistBackendWithSpawn"
    TestDistBackendWithSpawn.__module__ = __name__
    return TestDistBackendWithSpawn


TestDistBackendWithSpawn = _set_up_process()


def read_skips(backend: str, path: str = SKIPS_FILE) -> list[tuple[re.Pattern[str], str]]:
    """The entries of ``skips.txt`` for ``backend``.

    Lines are ``BACKENDS REGEX reason`` separated by whitespace: ``BACKENDS`` is
    ``*`` or a comma list of backend names, ``REGEX`` (no spaces) must match a
    whole test name, the reason is the rest of the line; ``#`` starts a comment
    line.
    """
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            fields = text.split(None, 2)
            if len(fields) != 3:
                raise ValueError(f"{path}:{n}: expected 'BACKENDS REGEX reason', got {text!r}")
            backends, pattern, reason = fields
            if backends == "*" or backend in backends.split(","):
                out.append((re.compile(pattern), reason))
    return out


def select(names: list[str], patterns: list[str], everything: bool,
           skips: list[tuple[re.Pattern[str], str]]) -> tuple[list[str], dict[str, str]]:
    """The test names to run, and the selected names left out by ``skips`` with reasons."""
    chosen = [n for n in names if everything or COLLECTIVE_TESTS.match(n)]
    if patterns:
        chosen = [n for n in chosen if any(re.search(p, n) for p in patterns)]
    run, left_out = [], {}
    for name in chosen:
        reason = next((r for rx, r in skips if rx.fullmatch(name)), None)
        if reason is None:
            run.append(name)
        else:
            left_out[name] = reason
    return run, left_out


class _Result(unittest.TextTestResult):
    """Records each test's outcome, reason and duration by test name."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, dict[str, Any]] = {}
        self._started = 0.0

    def startTest(self, test: unittest.TestCase) -> None:
        self._started = time.monotonic()
        super().startTest(test)

    def _note(self, test: unittest.TestCase, outcome: str, detail: str = "") -> None:
        name = test.id().rsplit(".", 1)[-1]
        self.outcomes[name] = {"outcome": outcome, "detail": detail,
                               "seconds": round(time.monotonic() - self._started, 2)}

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self._note(test, "passed")

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._note(test, "skipped", reason)

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self._note(test, "failed", self._exc_info_to_string(err, test))

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        self._note(test, "failed", self._exc_info_to_string(err, test))

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addExpectedFailure(test, err)
        self._note(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        super().addUnexpectedSuccess(test)
        self._note(test, "failed", "unexpected success")


def build_parser() -> argparse.ArgumentParser:
    """The runner's options."""
    p = argparse.ArgumentParser(
        description="Run torch's distributed_test.py CPU collective tests on a backend.")
    p.add_argument("--backend", choices=("gloo", "groupcoord"), default="groupcoord")
    p.add_argument("--world-size", type=int, default=2, help="ranks per test (default: 2)")
    p.add_argument("-k", dest="patterns", action="append", default=[],
                   help="regular expression searched in test names; repeat for any-of")
    p.add_argument("--all", dest="everything", action="store_true",
                   help="start from every test of the suite, not just the collective tests")
    p.add_argument("--gates", choices=("gloo", "own"), default="gloo",
                   help="the backend name distributed_test.py sees when deciding its "
                        "import-time skips: gloo's (default) or the backend's own")
    p.add_argument("--timeout", type=int, default=60,
                   help="seconds per test before its ranks are killed (default: 60)")
    p.add_argument("--reuse", action="store_true",
                   help="run every test on the same rank processes (fast; torch's way, the "
                        "default, starts fresh ranks for each test)")
    p.add_argument("--list", action="store_true", help="print the selection and exit")
    p.add_argument("--json", dest="json_path", default=None, help="write outcomes here")
    p.add_argument("-v", "--verbose", action="store_true", help="unittest's verbose output")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the selection; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.world_size < 2:
        print("--world-size must be >= 2", file=sys.stderr)
        return 2
    os.environ[_ENV_BACKEND] = args.backend
    os.environ[_ENV_GATES] = "gloo" if args.gates == "gloo" else args.backend
    os.environ["WORLD_SIZE"] = str(args.world_size)
    os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(args.timeout)
    temp = tempfile.TemporaryDirectory(prefix="groupcoord-torch-suite-")
    os.environ["TEMP_DIR"] = temp.name
    global TestDistBackendWithSpawn
    cls = TestDistBackendWithSpawn = _set_up_process()

    names = sorted(n for n in dir(cls) if n.startswith("test_") and callable(getattr(cls, n)))
    run, left_out = select(names, args.patterns, args.everything, read_skips(args.backend))
    if args.list:
        for name in run:
            print(name)
        for name, reason in left_out.items():
            print(f"{name}  (left out: {reason})")
        return 0
    started = time.monotonic()
    try:
        if args.reuse:
            outcomes = _run_reusing_ranks(run, args.world_size, temp.name, args.timeout)
        else:
            suite = unittest.TestSuite(cls(name) for name in run)
            runner = unittest.TextTestRunner(
                resultclass=_Result, verbosity=2 if args.verbose else 1, stream=sys.stderr)
            result = runner.run(suite)
            if not isinstance(result, _Result):  # pragma: no cover - resultclass above
                raise TypeError(f"unexpected unittest result {type(result).__name__}")
            outcomes = result.outcomes
    finally:
        temp.cleanup()
    return _report(args, outcomes, left_out, time.monotonic() - started)


# ------------------------------------------------------------------ --reuse: one set of ranks
def _run_reusing_ranks(names: list[str], world_size: int, temp_dir: str,
                       timeout: float) -> dict[str, dict[str, Any]]:
    """Run ``names`` one after the other on the same ``world_size`` rank processes.

    Each test gets what ``TestDistBackend._run`` gives it in a fresh process: a
    new file store (``init_process_group`` with the backend), the file barrier
    reset, torch's test seed, a barrier before and after, and the process group
    destroyed afterwards. A test that fails or hangs on any rank is reported
    with that rank's traceback and the ranks are replaced, so the next test
    starts clean.
    """
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    ranks: list[tuple[Any, Any]] = []
    outcomes: dict[str, dict[str, Any]] = {}
    try:
        for i, name in enumerate(names):
            method = getattr(TestDistBackendWithSpawn, name)
            if getattr(method, "__unittest_skip__", False):  # unittest skips before setUp
                why = getattr(method, "__unittest_skip_why__", "")
                outcomes[name] = {"outcome": "skipped", "detail": why, "seconds": 0.0}
                print(f"{name} ... skipped ({why})", file=sys.stderr, flush=True)
                continue
            if not ranks:
                ranks = _start_ranks(ctx, world_size)
            started = time.monotonic()
            _reset_barrier_dir(temp_dir)
            init_file = os.path.join(temp_dir, f"init_{i}")
            for _, conn in ranks:
                conn.send((name, init_file))
            results, healthy = _collect(ranks, timeout)
            if not healthy:
                _stop_ranks(ranks, kill=True)
                ranks = []
            outcome, detail = _combine(results)
            outcomes[name] = {"outcome": outcome, "detail": detail,
                              "seconds": round(time.monotonic() - started, 2)}
            print(f"{name} ... {outcome}" + (f" ({detail})" if outcome == "skipped" else ""),
                  file=sys.stderr, flush=True)
    finally:
        _stop_ranks(ranks, kill=False)
    return outcomes


def _start_ranks(ctx: Any, world_size: int) -> list[tuple[Any, Any]]:
    ranks = []
    for rank in range(world_size):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_rank_loop, args=(rank, world_size, child, os.getpid()),
                           daemon=True)
        proc.start()
        child.close()
        ranks.append((proc, parent))
    return ranks


def _stop_ranks(ranks: list[tuple[Any, Any]], kill: bool) -> None:
    for proc, conn in ranks:
        if not kill:
            try:
                conn.send(None)
            except OSError:
                kill = True
        proc.join(timeout=0 if kill else 10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
        conn.close()


def _reset_barrier_dir(temp_dir: str) -> None:
    """What ``Barrier.init`` does in torch's parent: no rank's barrier file left."""
    barrier_dir = os.path.join(temp_dir, "barrier")
    os.makedirs(barrier_dir, exist_ok=True)
    for f in os.listdir(barrier_dir):
        os.unlink(os.path.join(barrier_dir, f))
    os.makedirs(os.path.join(temp_dir, "test_dir"), exist_ok=True)


def _collect(ranks: list[tuple[Any, Any]],
             timeout: float) -> tuple[list[tuple[str, str] | None], bool]:
    """Each rank's ``(outcome, detail)`` (None: none came), and whether every rank
    answered without a failure (otherwise the ranks are replaced).

    Once a rank reports a failure the others get a few seconds more: they are
    likely waiting in a collective the failed rank will never join.
    """
    from multiprocessing.connection import wait

    results: list[tuple[str, str] | None] = [None] * len(ranks)
    deadline = time.monotonic() + timeout
    pending = {conn: i for i, (_, conn) in enumerate(ranks)}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for conn in wait(list(pending), timeout=left):
            i = pending.pop(conn)  # type: ignore[call-overload]  wait() returns our conns
            try:
                results[i] = conn.recv()  # type: ignore[union-attr]  a Connection
            except EOFError:
                results[i] = ("failed", f"rank {i} exited (code {ranks[i][0].exitcode})")
                deadline = min(deadline, time.monotonic() + 5)
                continue
            if results[i][0] == "failed":  # type: ignore[index]  set just above
                deadline = min(deadline, time.monotonic() + 5)
    for i in pending.values():
        results[i] = None
    return results, all(r is not None and r[0] != "failed" for r in results)


def _combine(results: list[tuple[str, str] | None]) -> tuple[str, str]:
    """One outcome from the ranks', as ``MultiProcessTestCase`` decides: a failure or a
    missing answer on any rank fails the test; otherwise rank 0's skip skips it."""
    for i, r in enumerate(results):
        if r is None:
            return "failed", f"rank {i} did not finish in time"
        if r[0] == "failed":
            return "failed", f"rank {i}:\n{r[1]}"
    first = results[0]
    if first is not None and first[0] == "skipped":
        return "skipped", first[1]
    return "passed", ""


def _rank_loop(rank: int, world_size: int, conn: Any, parent_pid: int) -> None:
    """A rank of ``--reuse``: run each test name received until ``None``."""
    from shm_broadcast.ranks.launcher import die_with_parent

    die_with_parent(parent_pid)  # a killed runner leaves no rank waiting in a collective
    cls = TestDistBackendWithSpawn
    while True:
        msg = conn.recv()
        if msg is None:
            return
        name, init_file = msg
        conn.send(_run_in_rank(cls, name, rank, world_size, init_file))


def _run_in_rank(cls: Any, name: str, rank: int, world_size: int,
                 init_file: str) -> tuple[str, str]:
    """``TestDistBackend._run`` and ``MultiProcessTestCase.run_test`` for one test, here."""
    import traceback
    from datetime import timedelta

    import torch.distributed as dist
    from torch.testing._internal import common_utils
    from torch.testing._internal.common_distributed import TEST_SKIPS
    from torch.testing._internal.distributed import distributed_test as suite

    test = cls(name)
    test.rank = rank
    test.file_name = init_file
    suite.Barrier.barrier_id = 0
    try:
        dist.init_process_group(
            init_method=f"file://{init_file}", backend=suite.BACKEND, world_size=world_size,
            rank=rank,
            timeout=timedelta(seconds=suite.CUSTOM_PG_TIMEOUT.get(name, suite.default_pg_timeout)))
        test._barrier()
        common_utils.set_rng_seed()
        getattr(test, name)()
        test._barrier()
        return "passed", ""
    except unittest.SkipTest as e:
        return "skipped", str(e)
    except SystemExit as e:  # torch's skip decorators exit with a code naming the reason
        reason = next((s.message for s in TEST_SKIPS.values() if s.exit_code == e.code), None)
        return ("skipped", reason) if reason else ("failed", f"sys.exit({e.code!r})")
    except BaseException:
        return "failed", traceback.format_exc()
    finally:
        if dist.is_initialized():
            # the test may have broken the group; the next test makes its own
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _error_line(detail: str) -> str:
    """The exception line of a failure's text (torch appends a repro hint after it)."""
    text = detail.split("To execute this test, run", 1)[0].strip()
    return text.splitlines()[-1] if text else detail.strip()[:200]


def _report(args: argparse.Namespace, outcomes: dict[str, dict[str, Any]],
            left_out: dict[str, str], elapsed: float) -> int:
    counts = {k: sum(o["outcome"] == k for o in outcomes.values())
              for k in ("passed", "skipped", "failed")}
    print(f"\nbackend={args.backend} world_size={args.world_size} gates={args.gates}: "
          f"{counts['passed']} passed, {counts['skipped']} skipped, {counts['failed']} failed "
          f"({len(left_out)} left out by skips.txt) in {elapsed:.0f} s")
    reasons: dict[str, list[str]] = {}
    for name, o in outcomes.items():
        if o["outcome"] == "skipped":
            reasons.setdefault(o["detail"], []).append(name)
    for reason, tests in sorted(reasons.items()):
        print(f"  skipped ({reason}): {', '.join(sorted(tests))}")
    for name, o in sorted(outcomes.items()):
        if o["outcome"] == "failed":
            print(f"  FAILED {name}: {_error_line(o['detail'])}")
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump({"backend": args.backend, "world_size": args.world_size,
                       "gates": args.gates, "counts": counts, "seconds": round(elapsed, 1),
                       "tests": outcomes, "left_out": left_out}, f, indent=1, sort_keys=True)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())

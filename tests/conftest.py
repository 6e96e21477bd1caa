"""Shared fixtures: per-world-size rank pools and a leak check around every test."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import gc
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

from coordinator.pytest_plugin import live_rank_pids
from coordinator.testing import DistributedPool, live_pool_pids
from shm_broadcast.lifecycle import leftovers
from shm_broadcast.lifecycle.channel_dirs import list_channel_dirs
from shm_broadcast.lifecycle.reaper import MARKER as REAPER_MARKER
from shm_broadcast.lifecycle.segment import (
    SHM_DIR,
    list_orphan_records,
    list_segments,
)
from shm_broadcast.ranks.launcher import fork_server_pid
from tests.faults.rig import live_rig_pids

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The flight-recorder dumps that failing calls write during the tests go to a
#: directory of this test process (its ranks inherit the variable), removed at
#: exit, instead of the temp directory's default prefix. Tests that read dumps
#: set their own prefix.
_TRACE_DIR = tempfile.mkdtemp(prefix="groupcoord-test-traces-")
#: Ranks start as forks of a server that imported torch once (a spawned rank
#: imports it again: about 2.5 s of CPU each on the 2-core CI machine, for a few
#: hundred ranks). Tests of the spawn path pass ``start_method="spawn"``.
os.environ.setdefault("GROUPCOORD_RANK_START", "forkserver")
os.environ.setdefault("GROUPCOORD_TRACE_DUMP", os.path.join(_TRACE_DIR, "rank_"))
atexit.register(shutil.rmtree, _TRACE_DIR, True)


#: The longest test files (measured on the 2-core CI machine, ~20-55 s each;
#: then the longest shm_broadcast files, which collection order would put
#: last), collected first: with ``--no-loadscope-reorder`` xdist's ``loadfile``
#: hands out whole files in collection order, so long files started early keep
#: the workers finishing together.
_LONG_FILES = (
    "tests/faults/test_fault_matrix.py",
    "tests/multihost/test_two_hosts.py",
    "tests/coordinator/p2p/test_shm_links.py",
    "tests/shm_broadcast/queue/test_channel_security.py",
    "tests/shm_broadcast/queue/test_mq_processes.py",
    "tests/coordinator/test_group_coordinator.py",
    "tests/coordinator/test_testing_harness.py",
    "tests/coordinator/test_errors_and_failures.py",
    "tests/test_examples.py",
    "tests/coordinator/stateless/test_stateless_security.py",
    "tests/faults/test_bounded_waits.py",
    "tests/coordinator/p2p/test_async_p2p.py",
    "tests/shm_broadcast/waiting/test_predictive.py",
    "tests/coordinator/engine/test_demo_cli.py",
    "tests/coordinator/stateless/test_stateless_replay.py",
    "tests/device_comms/cuda/custom_allreduce/test_handle_attacks.py",
    "tests/shm_broadcast/codec/test_decoded_size.py",
    "tests/shm_broadcast/lifecycle/test_channel_dir_cleanup.py",
    "tests/shm_broadcast/queue/test_confirmed_enqueue.py",
    "tests/shm_broadcast/waiting/test_pauses.py",
    "tests/shm_broadcast/queue/test_general_payloads.py",
    "tests/shm_broadcast/ranks/test_launcher.py",
    "tests/shm_broadcast/ranks/test_agreement.py",
    "tests/shm_broadcast/ranks/test_tcp_store.py",
    "tests/shm_broadcast/lifecycle/test_exit_cleanup.py",
    # one ~20 s test (PyTorch's suite in a child process): collected last, it
    # ended the run alone
    "tests/torch_suite/test_torch_suite.py",
)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: pytest without xdist ignores it
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: ``PYTEST_XDIST_AUTO_NUM_WORKERS`` if set; else one worker more
    than the CPUs this process may use, at most four (most tests wait on
    timeouts, sleeps and peers, so the extra worker fills the CPUs they leave
    idle); one where a CUDA GPU is visible, so that two GPU test files never
    share the device (their timings assume it is theirs)."""
    import torch

    text = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if text:
        return int(text)
    if torch.cuda.is_available():
        return 1
    usable = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
              else os.cpu_count() or 1)
    return min(usable, 3) + 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the long files first (a stable sort: the rest keep their order)."""
    order = {name: i for i, name in enumerate(_LONG_FILES)}
    items.sort(key=lambda item: order.get(item.nodeid.split("::", 1)[0], len(order)))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Leave what collection imported (torch, transformers, every test module)
    out of this process's garbage collections: those objects live as long as
    the process, and frozen, full collections no longer walk them."""
    gc.freeze()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the project's sources once, before any rank starts.

    The suite starts hundreds of processes that import these packages; where
    ``PYTHONDONTWRITEBYTECODE`` is set (as in CI images) none of them writes
    bytecode, so each would compile every module it imports from source again
    (about 0.25 s a process on a 2-core machine). Files that cannot be written
    (a read-only checkout) are left to compile on import, as before.
    """
    import compileall

    for pkg in ("coordinator", "device_comms", "shm_broadcast", "tests"):
        compileall.compile_dir(os.path.join(_ROOT, pkg), quiet=2)


# A process's exit reaper and resource tracker live as long as the process (and so
# does its fork server: see _is_ignored): not leaks of the test.
_IGNORED_CHILDREN = ("resource_tracker", REAPER_MARKER)


def _processes(pids: set[int]) -> list[psutil.Process]:
    """The processes of ``pids`` that still exist."""
    out = []
    for pid in sorted(pids):
        with contextlib.suppress(psutil.NoSuchProcess):
            out.append(psutil.Process(pid))
    return out


def _is_ignored(p: psutil.Process) -> bool:
    try:
        cmd = " ".join(p.cmdline())
        if p.status() == psutil.STATUS_ZOMBIE:
            return True
        # The fork server lives as long as this process; its children (ranks it
        # forked, with its command line) are the test's.
        return p.pid == fork_server_pid() or any(k in cmd for k in _IGNORED_CHILDREN)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return True


def _read_ppid(pid: int) -> int | None:
    """``pid``'s parent pid now, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses
    return int(stat.rsplit(b")", 1)[1].split()[1])


class _ProcessTable:
    """The processes below this one, from a table of parent pids kept up to date cheaply.

    The leak check needs this process's tree (and the pool workers' within it)
    at each test's start and end, and samples it every 50 ms while a test runs.
    Reading every ``/proc/<pid>/stat`` each time (what psutil's
    ``children(recursive=True)`` does, once per tree) costs milliseconds.
    Instead the table keeps each pid's parent as last read. A process's parent
    changes only when that parent dies (the orphan is adopted by init or a
    subreaper), so a look lists ``/proc``, forgets the pids that are gone, and
    reads ``stat`` only for new pids, for pids whose parent is gone, and for
    the few the table puts below ``root`` (an orphan whose dead parent
    lingers as a zombie is among them): the tree it returns is the one
    ``/proc`` holds. A pid that ended and was handed out again between two
    looks would be missed: the kernel hands out every other free pid first,
    which no test does between two looks.
    """

    def __init__(self) -> None:
        self._ppids: dict[int, int] = {}
        self._lock = threading.Lock()

    def below(self, root: int) -> dict[int, int]:
        """``{pid: parent pid}`` of every process below ``root`` now."""
        with self._lock:
            live = {int(n) for n in os.listdir("/proc") if n.isdigit()}
            for pid in self._ppids.keys() - live:
                del self._ppids[pid]
            # New pids, and orphans whose parent is gone (adopted by init or a
            # subreaper, such as a pid namespace's init)
            stale = {pid for pid, ppid in self._ppids.items() if ppid not in live}
            for pid in (live - self._ppids.keys()) | stale:
                ppid = _read_ppid(pid)
                if ppid is None:
                    self._ppids.pop(pid, None)
                else:
                    self._ppids[pid] = ppid
            # An orphan of a parent that lingers as a zombie was below it when
            # the parent lived: re-read what the table has below root.
            for pid in _descendants({root}, self._ppids):
                ppid = _read_ppid(pid)
                if ppid is None:
                    del self._ppids[pid]
                else:
                    self._ppids[pid] = ppid
            return {pid: self._ppids[pid] for pid in _descendants({root}, self._ppids)}


_PROCESSES = _ProcessTable()


def _descendants(roots: set[int], ppids: dict[int, int]) -> set[int]:
    """Pids below ``roots`` (not the roots themselves) in the tree ``ppids``."""
    kids: dict[int, list[int]] = {}
    for pid, ppid in ppids.items():
        kids.setdefault(ppid, []).append(pid)
    out: set[int] = set()
    todo = list(roots)
    while todo:
        for child in kids.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _pool_family(tree: dict[int, int]) -> set[int]:
    """Pids of pool workers (``dist_pool``'s and the pytest plugin's ranks) and their
    descendants (allowed to outlive a test); the workers are this process's
    descendants (children, or children of its fork server), so ``tree`` (this
    process's) holds them."""
    pids = set(live_pool_pids()) | set(live_rank_pids())
    return pids | _descendants(pids, tree)


@pytest.fixture(scope="session")
def dist_pool() -> Iterator[Callable[..., DistributedPool]]:
    """``dist_pool(world_size)`` returns a live, reusable :class:`DistributedPool`."""
    pools: dict[int, DistributedPool] = {}

    def get(world_size: int) -> DistributedPool:
        if world_size not in pools:
            pools[world_size] = DistributedPool(world_size)
        return pools[world_size]

    yield get
    # Each pool waits for its ranks to leave their groups: close them side by side.
    errors: list[BaseException] = []

    def close(pool: DistributedPool) -> None:
        try:
            pool.close()
        except BaseException as e:  # re-raised below, in the fixture's own thread
            errors.append(e)

    closers = [threading.Thread(target=close, args=(p,), name=f"close-pool-{ws}")
               for ws, p in pools.items()]
    for t in closers:
        t.start()
    for t in closers:
        t.join()
    if errors:
        raise errors[0]


class _TreeWatch:
    """Every pid seen in this process's tree while a test runs (sampled on a thread).

    A segment may be blamed on a test only if its owner belonged to the test's
    process tree: other processes on the machine (another suite, a crashed
    server) leave their own segments, which are not this test's fault.
    """

    def __init__(self, me: psutil.Process, interval: float = 0.05) -> None:
        self.me, self.interval = me, interval
        self.seen: set[int] = {me.pid}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="no-leaks-watch", daemon=True)
        self._thread.start()

    def sample(self, tree: dict[int, int] | None = None) -> set[int]:
        """This process and its descendants now (``tree``: as just read)."""
        now = set(_PROCESSES.below(self.me.pid) if tree is None else tree)
        self.seen |= now
        return now | {self.me.pid}

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _record_pid(record: str) -> int:
    """Owner pid in an owner record's name ``gc_<kind>_<pid>_<hex>.owner``."""
    m = leftovers.SEGMENT_RE.match(record[: -len(leftovers.RECORD_SUFFIX)])
    return int(m.group("pid")) if m else -1


class _Leaks:
    """Our files that appeared during a test and belong to the test's processes."""

    def __init__(self) -> None:
        self.segs_before = {s.name for s in list_segments()}
        self.records_before = set(list_orphan_records())
        self.dirs_before = {d.path for d in list_channel_dirs()}
        self._found: tuple[list[str], list[str], list[str]] = ([], [], [])

    def find(self, mine: set[int], allowed: set[int]) -> list[str]:
        """Problems found now (empty when nothing leaked)."""
        def ours(pid: int) -> bool:
            return pid not in allowed and pid in mine

        segs = [s.name for s in list_segments() if s.name not in self.segs_before and ours(s.pid)]
        records = [r for r in list_orphan_records() if r not in self.records_before
                   and ours(_record_pid(r))]
        dirs = [d.path for d in list_channel_dirs()
                if d.path not in self.dirs_before and ours(d.pid)]
        problems = []
        if segs:
            problems.append(f"leaked /dev/shm segments {segs}")
        if records:
            problems.append(f"leaked owner records without a segment {records}")
        if dirs:
            problems.append(f"leaked channel directories {dirs}")
        self._found = (segs, records, dirs)
        return problems

    def remove(self) -> None:
        """Remove what the last :meth:`find` reported (so later tests start clean)."""
        segs, records, dirs = self._found
        for name in segs:
            leftovers.unlink_segment(name)
        for r in records:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, r))
        for d in dirs:
            leftovers.remove_channel_dir(d)


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail a test that leaves behind a child process, a ``gc_*`` /dev/shm segment,
    an owner record without its segment, or a queue channel directory.

    Only the test's own processes (alive or dead) and the files they created
    count. Owners and their reapers remove files asynchronously after a kill,
    so the check retries for up to 5 s.
    """
    me = psutil.Process(os.getpid())
    leaks = _Leaks()
    kids_before = set(_PROCESSES.below(me.pid))
    watch = _TreeWatch(me)
    try:
        yield
    finally:
        watch.stop()
    deadline = time.monotonic() + 5.0
    while True:
        below = _PROCESSES.below(me.pid)  # one look for every tree below
        allowed = _pool_family(below)
        # Idle fault-rig workers outlive a test as pool workers do; their files
        # are still checked (the rig also checks each case's files itself).
        idle = allowed | live_rig_pids()
        tree = watch.sample(below)
        kids = [
            c for c in _processes(tree - {me.pid} - kids_before - idle)
            if not _is_ignored(c)
        ]
        files = leaks.find(tree | watch.seen, allowed)
        if (not kids and not files) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    problems = []
    if kids:
        problems.append(f"leaked processes {[(k.pid, k.name()) for k in kids]}")
        for k in kids:
            with contextlib.suppress(psutil.NoSuchProcess):
                k.kill()
    if files:
        problems.extend(files)
        leaks.remove()
    if problems:
        pytest.fail("test leaked resources: " + "; ".join(problems))


@pytest.fixture
def cleanup_serial() -> Iterator[None]:
    """Run the test alone among the tests that use this fixture, in every pytest
    process of the machine.

    ``groupcoord cleanup --yes`` removes every orphan of this user, so a test that
    runs it would take the orphans another test left on purpose (pytest-xdist runs
    test files side by side); a test that plants a file cleanup keeps would make
    another's ``cleanup --yes`` exit 2. The lock is ``flock`` on ``/dev/shm`` itself: the
    resource it guards, and nothing is left behind. The wait is bounded.
    """
    fd = os.open("/dev/shm" if os.path.isdir("/dev/shm") else ".", os.O_RDONLY)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail("another test held the cleanup lock on /dev/shm for 120 s")
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture) -> Callable[[list[str]], tuple[Any, str, str]]:
    """``groupcoord <argv>`` in this process, for options refused before anything
    starts: ``(exit status, stdout, stderr)``."""
    from coordinator.cli import main

    def run(argv: list[str]) -> tuple[Any, str, str]:
        try:
            code: Any = main(argv)
        except SystemExit as e:
            code = e.code
        out = capsys.readouterr()
        if isinstance(code, str):  # sys.exit("text"): Python prints it and exits 1
            return 1, out.out, out.err + code + "\n"
        return code, out.out, out.err

    return run

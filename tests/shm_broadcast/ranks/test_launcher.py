"""The process launcher: outcomes per rank, deaths that spare the others, reaping."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from shm_broadcast.ranks.launcher import (
    START_METHOD_ENV,
    describe_exit,
    fork_server_pid,
    per_rank_env,
    spawn_group,
    start_ranks,
    stop_ranks,
)
from tests.child_env import child_env
from tests.processes import running

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

pytestmark = pytest.mark.timeout(180)

#: The process that imported this module (a fork server's child that finds its
#: server's pid here got the module from the server).
IMPORTED_IN = os.getpid()


# ------------------------------------------------------------------ rank code
def _mixed(rank: int, world_size: int, victim: int) -> int:
    """Rank ``victim`` dies by SIGKILL, rank 1 raises, the others outlive both and return."""
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1:
        raise KeyError("rank one fails on purpose")
    time.sleep(2.0)  # the other two are gone by now
    return rank * 10


def _sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(3600)


def _env_value(rank: int, world_size: int) -> str | None:
    return os.environ.get("GC_LAUNCHER_PROBE")


def _idle_child(conn) -> None:
    conn.recv()


def _send_whether_imported_here(conn) -> None:
    conn.send(os.getpid() == IMPORTED_IN)


def _print_and_register_exit(rank: int, world_size: int, path: str) -> None:
    """Print a line, and leave a file from an exit handler."""
    import atexit

    print(f"rank {rank} says hello", flush=True)
    atexit.register(lambda: open(path, "w").close())


def _frozen_objects(rank: int, world_size: int) -> int:
    import gc

    return gc.get_freeze_count()


def _environment_and_parent(rank: int, world_size: int) -> tuple[str | None, str | None, int]:
    """The probe variables and this rank's operating-system parent."""
    return (os.environ.get("GC_LAUNCHER_LATE"), os.environ.get("GC_LAUNCHER_GONE"),
            os.getppid())


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("world_size", [pytest.param(3, marks=pytest.mark.slow), 4])
def test_each_rank_reports_its_own_outcome(world_size: int) -> None:
    victim = world_size - 1
    outs = spawn_group(_mixed, world_size, (victim,), timeout=120)
    assert [o.rank for o in outs] == list(range(world_size))
    assert outs[victim].exitcode == -signal.SIGKILL and not outs[victim].ok
    assert not outs[1].ok and outs[1].error.startswith("KeyError:"), outs[1]
    for r in range(world_size):
        if r not in (victim, 1):
            assert outs[r].ok and outs[r].result == r * 10 and outs[r].exitcode == 0


def test_a_rank_past_the_timeout_is_killed_and_reaped() -> None:
    me = psutil.Process()
    before = {c.pid for c in me.children(recursive=True)}
    t0 = time.monotonic()
    outs = spawn_group(_sleep_forever, 2, timeout=3)  # started or not, the ranks are killed
    assert time.monotonic() - t0 < 60
    assert all(not o.ok and o.error is None and o.exitcode is None for o in outs), outs
    left = {c.pid for c in me.children(recursive=True)} - before
    assert not [p for p in left if running(p) and p != fork_server_pid()]


def test_env_reaches_each_rank() -> None:
    outs = spawn_group(_env_value, 2, env=[{"GC_LAUNCHER_PROBE": "a"},
                                           {"GC_LAUNCHER_PROBE": "b"}], timeout=120)
    assert [o.result for o in outs] == ["a", "b"]


def test_the_fork_server_imports_no_module_outside_the_project(tmp_path) -> None:
    """A module that may initialise CUDA when imported (a test's, a user's) is
    imported by each rank, never by the fork server, whose children could not
    use CUDA then. A fresh process, so that this is the server's first start."""
    script = tmp_path / "first_start.py"
    script.write_text(
        "from shm_broadcast.ranks.launcher import start_ranks, stop_ranks\n"
        "from tests.shm_broadcast.ranks.test_launcher import _send_whether_imported_here\n"
        "if __name__ == '__main__':\n"
        "    procs, conns = start_ranks(_send_whether_imported_here, 1, lambda r, c: (c,),\n"
        "                               name='probe', duplex=False, start_method='forkserver')\n"
        "    print(conns[0].recv() if conns[0].poll(60) else 'silent')\n"
        "    stop_ranks(procs, conns, wait_first=10)\n")
    done = subprocess.run([sys.executable, str(script)], env=child_env(), cwd=_ROOT,
                          capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:1] == ["True"], (done.stdout, done.stderr)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_ranks_write_to_the_starters_stdout_of_the_moment_and_run_exit_handlers(
        tmp_path, method: str) -> None:
    """A rank prints to the stdout its starter has when it starts (a fork server
    started earlier holds an older one), and its exit handlers run."""
    if method == "forkserver":  # (a spawned rank starts from nothing an earlier start left)
        spawn_group(_environment_and_parent, 1, timeout=120, start_method=method)
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile("w+") as out:
        os.dup2(out.fileno(), 1)
        try:
            outs = spawn_group(_print_and_register_exit, 1, (str(tmp_path / "exited"),),
                               timeout=120, start_method=method)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        out.seek(0)
        printed = out.read()
    assert outs[0].ok, outs
    assert "rank 0 says hello" in printed, printed
    assert (tmp_path / "exited").exists()


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_ranks_see_the_environment_of_the_moment_they_start(monkeypatch, method: str) -> None:
    """Whichever way a rank starts, it sees the caller's environment as it is at
    the start (a fork server started earlier holds an older one)."""
    monkeypatch.setenv("GC_LAUNCHER_GONE", "set before the first start")
    if method == "forkserver":  # the server starts now (a spawned rank keeps nothing)
        spawn_group(_environment_and_parent, 1, timeout=120, start_method=method)
    monkeypatch.setenv("GC_LAUNCHER_LATE", "set later")
    monkeypatch.delenv("GC_LAUNCHER_GONE")
    outs = spawn_group(_environment_and_parent, 2, timeout=120, start_method=method)
    assert [o.result[:2] for o in outs] == [("set later", None)] * 2, outs
    spawned = [o.result[2] == os.getpid() for o in outs]
    assert spawned == [method == "spawn"] * 2, (method, outs)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_forked_rank_leaves_what_it_inherited_out_of_garbage_collection(method: str) -> None:
    """A fork server's child freezes the objects it inherited (an imported torch:
    about 180,000, which each full collection would walk); a spawned one has
    nothing inherited to freeze."""
    outs = spawn_group(_frozen_objects, 1, timeout=120, start_method=method)
    frozen = outs[0].result
    assert (frozen > 10_000) if method == "forkserver" else frozen == 0, (method, outs)


def test_a_load_time_variable_changed_since_the_fork_server_started_means_spawn(
        monkeypatch) -> None:
    """The OpenMP runtime read OMP_NUM_THREADS when the server loaded torch: with
    another value now, the ranks are spawned, and see it."""
    spawn_group(_environment_and_parent, 1, timeout=120, start_method="forkserver")
    value = str(int(os.environ.get("OMP_NUM_THREADS", "1")) + 1)
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    monkeypatch.setenv("GC_LAUNCHER_LATE", value)
    outs = spawn_group(_environment_and_parent, 1, timeout=120, start_method="forkserver")
    assert outs[0].result == (value, None, os.getpid()), outs


def _compiler_cache_dir_and_parent(rank: int, world_size: int) -> tuple[str | None, int]:
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR"), os.getppid()


def test_the_compilers_cache_directory_set_since_the_server_started_keeps_the_server(
        monkeypatch, tmp_path) -> None:
    """torch's first compile in a process sets TORCHINDUCTOR_CACHE_DIR there; read
    at each use, not at load, it does not send the ranks to be spawned, and they
    see the value of the moment."""
    spawn_group(_compiler_cache_dir_and_parent, 1, timeout=120, start_method="forkserver")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    outs = spawn_group(_compiler_cache_dir_and_parent, 1, timeout=120, start_method="forkserver")
    assert outs[0].result[0] == str(tmp_path), outs
    assert outs[0].result[1] != os.getpid(), f"spawned, not forked by the server: {outs}"


@pytest.mark.parametrize("how, value, exc, match", [
    ("argument", "fork", ValueError, r"start_method must be one of \['spawn', 'forkserver'\], "
                                     r"got 'fork'"),
    ("argument", 1, TypeError, "start_method must be a str .* got int"),
    ("environment", "threads", ValueError, f"{START_METHOD_ENV} must be one of .* got 'threads'"),
])
def test_an_unknown_start_method_is_refused(monkeypatch, how, value, exc, match) -> None:
    kwargs = {}
    if how == "argument":
        kwargs["start_method"] = value
    else:
        monkeypatch.setenv(START_METHOD_ENV, value)
    with pytest.raises(exc, match=match):
        start_ranks(_idle_child, 1, lambda r, child: (child,), name="gc-launcher-test",
                    duplex=True, **kwargs)


def test_stop_ranks_terminates_reaps_and_closes() -> None:
    procs, conns = start_ranks(_idle_child, 2, lambda r, child: (child,),
                               name="gc-launcher-test", duplex=True)
    pids = [p.pid for p in procs]
    stop_ranks(procs, conns)
    assert all(c.closed for c in conns)
    assert not [p for p in pids if running(p)]


@pytest.mark.parametrize(
    "env, exc, match",
    [
        ([{}], ValueError, "env must be one mapping or 2 mappings"),
        ([{}, {}, {}], ValueError, "got 3"),
    ],
    ids=["too-few", "too-many"],
)
def test_per_rank_env_rejects_a_wrong_count(env, exc, match) -> None:
    with pytest.raises(exc, match=match):
        per_rank_env(env, 2)


@pytest.mark.parametrize(
    "env, match",
    [
        ("A=1", "env must be a mapping of str to str, or a sequence"),
        (b"A=1", "env must be a mapping of str to str, or a sequence"),
        (5, "env must be a mapping of str to str, or a sequence"),
        ([("A", "1"), ("B", "2")], r"env\[0\] must be a mapping of str to str, got tuple"),
        ({"A": 1}, r"env must map str to str .*'A': 1 \(str to int\)"),
        ({1: "a"}, r"env must map str to str .*1: 'a' \(int to str\)"),
        ([{"A": "1"}, {"A": None}], r"env\[1\] must map str to str"),
    ],
    ids=["str", "bytes", "int", "list-of-pairs", "int-value", "int-key", "none-value"],
)
def test_per_rank_env_rejects_what_is_not_str_mappings(env, match) -> None:
    with pytest.raises(TypeError, match=match):
        per_rank_env(env, 2)


@pytest.mark.parametrize("world_size", [0, -1, True, 1.5])
def test_spawn_group_rejects_a_bad_world_size(world_size) -> None:
    with pytest.raises((TypeError, ValueError), match="world_size"):
        spawn_group(_env_value, world_size)


@pytest.mark.parametrize("code, words", [(0, "exit code 0"), (3, "exit code 3"),
                                         (-9, "killed by signal SIGKILL"),
                                         (None, "still running")])
def test_describe_exit(code, words) -> None:
    assert describe_exit(code) == words


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("kwargs", "error"), [
    ({"timeout": "5"}, TypeError), ({"timeout": True}, TypeError),
    ({"timeout": -1.0}, ValueError), ({"timeout": float("nan")}, ValueError),
    ({"timeout": 0}, ValueError), ({"timeout": float("inf")}, ValueError),
    ({"timeout": None}, TypeError),
    ({"pin_cpus": "yes"}, TypeError), ({"pin_cpus": 1}, TypeError),
])
def test_spawn_group_refuses_a_bad_timeout_or_pin_cpus(kwargs: dict, error: type) -> None:
    """Refused before any rank starts, naming the argument: these used to reach
    torch's store (raw errors) or the ranks."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    (name,) = kwargs
    with pytest.raises(error, match=name):
        spawn_group(_env_value, 1, **kwargs)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before

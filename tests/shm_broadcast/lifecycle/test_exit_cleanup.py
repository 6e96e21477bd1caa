"""Nothing is left behind, however a process ends: signals, threads, application handlers.

Each case runs a real child process (``python -m`` this file) that creates a
MessageQueue with one local reader slot -- a ring segment, its owner record,
and a channel directory holding the writer's sockets and its owner record --
then is sent a signal. The test checks the exit status the process would
have had without groupcoord, that the application's handler ran, and that
every file is gone (immediately where the cleanup runs inside the process,
within a few seconds where the reaper does it after the death).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import psutil
import pytest

from shm_broadcast.lifecycle import leftovers
from shm_broadcast.lifecycle.segment import SHM_DIR
from tests.child_env import ROOT
from tests.shm_broadcast.lifecycle_helpers import reaper_of, unshare_prefix, wait_exit, wait_gone

SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGHUP": signal.SIGHUP, "SIGINT": signal.SIGINT}


@dataclass(frozen=True)
class Case:
    """How the application treats the signal, and what must follow."""

    handler: str  # none | before-exit | after-reraise | after-osexit
    where: str  # main | thread: the thread that creates the queue

    def exit_status(self, sig: int) -> int:
        """The status the process has without groupcoord (Python's own for SIGINT:
        an uncaught KeyboardInterrupt ends the process by SIGINT)."""
        return {"none": -sig, "before-exit": 40 + sig, "after-reraise": -sig,
                "after-osexit": 60 + sig}[self.handler]

    def synchronous(self, sig: int) -> bool:
        """Whether the files are gone before the process is (no reaper needed)."""
        if self.handler == "before-exit":
            return True  # sys.exit in the handler: atexit
        # "none": SIGINT is KeyboardInterrupt, then atexit; SIGTERM/SIGHUP: our
        # handler, installed by the main thread (for a queue made in another
        # thread: at the main thread's next bytecode, before the child reports).
        # Otherwise the handler ends the process without atexit: the reaper cleans.
        return self.handler == "none"


CASES = [Case(h, w) for h in ("none", "before-exit", "after-reraise", "after-osexit")
         for w in ("main", "thread")]


def _start(*args: str, prefix: tuple[str, ...] = ()) -> tuple[subprocess.Popen, dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "tests.shm_broadcast.lifecycle.test_exit_cleanup", *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        raise AssertionError(f"child exited ({proc.returncode}) before reporting")
    return proc, json.loads(line)


def _files(info: dict[str, Any]) -> list[str]:
    seg = os.path.join(SHM_DIR, info["segment"])
    return [seg, seg + ".owner", info["dir"]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig_name", list(SIGNALS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.handler}-{c.where}")
def test_signal_leaves_nothing_and_keeps_the_exit_status(case: Case, sig_name: str,
                                                         tmp_path: Any) -> None:
    sig = SIGNALS[sig_name]
    marker = tmp_path / "marker"
    proc, info = _start("signal", case.handler, case.where, str(sig), str(marker))
    try:
        files = _files(info)
        assert all(os.path.lexists(p) for p in files), info
        # Ours only where the signal was left at its default (Python's SIGINT
        # handler and the application's are never replaced).
        assert info["our_handler"] == (case.handler == "none" and sig != signal.SIGINT), info
        assert sorted(os.listdir(info["dir"])) == ["c", "owner", "p", "w"]
        reaper = reaper_of(proc.pid)
        proc.send_signal(sig)
        assert proc.wait(30) == case.exit_status(sig)
    finally:
        proc.kill()
        proc.wait(30)
    if case.synchronous(sig):
        assert [p for p in files if os.path.lexists(p)] == [], "must be removed before the exit"
    assert wait_gone(*files) == [], "left behind"
    ran = marker.read_text() if marker.exists() else ""
    if case.handler == "none":
        assert ran == ("KeyboardInterrupt" if sig == signal.SIGINT else "")
    else:
        assert ran == f"app handler {sig}", "the application's handler must run"
    assert wait_exit(reaper), "the reaper must exit once its owner is gone"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig_name", ["SIGINT", "SIGTERM"])
def test_a_process_that_carries_on_after_a_signal_keeps_its_queue(sig_name: str) -> None:
    """SIGINT caught as KeyboardInterrupt, or an application SIGTERM handler that
    only takes note: the process lives on, so nothing may be removed yet."""
    proc, info = _start("carry-on", str(SIGNALS[sig_name]))
    try:
        proc.send_signal(SIGNALS[sig_name])
        after = json.loads(proc.stdout.readline())
        assert after["present"] == [True, True, True], after
        assert after["queue_usable"], after
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait(30)
    assert [p for p in _files(info) if os.path.lexists(p)] == [], "removed at the normal exit"


@pytest.mark.timeout(60)
def test_reaper_cleans_after_sigkill_and_is_restarted_if_killed() -> None:
    proc, info = _start("two-queues")
    try:
        first = reaper_of(proc.pid)
        first.kill()  # the owner lives on without a reaper ...
        os.kill(proc.pid, signal.SIGUSR1)  # ... and creates another queue
        second_info = json.loads(proc.stdout.readline())
        second = reaper_of(proc.pid)
        assert second.pid != first.pid and second_info["reaper"] == second.pid
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait(30)
    # The new reaper learnt about both queues.
    assert wait_gone(*_files(info), *_files(second_info)) == []
    assert wait_exit(second)


@pytest.mark.timeout(60)
def test_a_forked_child_removes_nothing_of_its_parent() -> None:
    proc, info = _start("fork")
    try:
        child = json.loads(proc.stdout.readline())
        assert child["child_exit"] == [0, 0], child  # normal exit, and os._exit
        assert child["present"] == [True, True, True], "a forked child removed the parent's files"
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait(30)
    assert [p for p in _files(info) if os.path.lexists(p)] == []


@pytest.mark.timeout(60)
def test_the_init_of_a_pid_namespace_keeps_ignoring_a_default_sigterm(tmp_path: Any) -> None:
    """As pid 1 (a container without an init), Python ignores a default SIGTERM from
    outside. A handler of ours would remove the queue's files and let the process
    carry on without them: none is installed there."""
    prefix = unshare_prefix()
    proc, info = _start("signal", "none", "main", str(int(signal.SIGTERM)),
                        str(tmp_path / "marker"), prefix=prefix)
    init = psutil.Process(proc.pid).children()[0]  # unshare forks the namespace's init
    try:
        assert info["pid"] == 1
        init.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert init.is_running() and init.status() != psutil.STATUS_ZOMBIE
        assert [os.path.lexists(p) for p in _files(info)] == [True, True, True]
    finally:
        init.kill()  # the namespace ends with its init, and its reaper with it
        proc.wait(30)
        leftovers.unlink_segment(info["segment"])  # so nobody was left to clean up
        leftovers.remove_channel_dir(info["dir"])


# ---------------------------------------------------------------------- child process
def _report(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def _make_queue() -> Any:
    from shm_broadcast import MessageQueue

    return MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2)


def _describe(mq: Any) -> dict[str, Any]:
    from shm_broadcast.lifecycle import exit_cleanup

    return {"pid": os.getpid(), "segment": mq._impl.ring.name, "dir": mq._impl._channel_dir,
            "reaper": exit_cleanup.reaper_pid()}


def _present(info: dict[str, Any]) -> list[bool]:
    return [os.path.lexists(p) for p in _files(info)]


def _child_signal(handler: str, where: str, sig: int, marker: str) -> None:
    def app_handler(signum: int, frame: Any) -> None:
        with open(marker, "w") as f:
            f.write(f"app handler {signum}")
        if handler == "before-exit":
            sys.exit(40 + signum)
        if handler == "after-osexit":
            os._exit(60 + signum)
        signal.signal(signum, signal.SIG_DFL)  # after-reraise: the usual idiom
        os.kill(os.getpid(), signum)

    if signal.getsignal(sig) == signal.SIG_IGN:
        # The cases start from the signal's default disposition; a suite run
        # under nohup hands its children SIGHUP ignored (which the queues'
        # cleanup leaves alone, as it should).
        signal.signal(sig, signal.SIG_DFL)
    if handler.startswith("before"):
        signal.signal(sig, app_handler)
    queues: list[Any] = []
    if where == "main":
        queues.append(_make_queue())
    else:
        t = threading.Thread(target=lambda: queues.append(_make_queue()))
        t.start()
        t.join()
    if handler.startswith("after"):
        signal.signal(sig, app_handler)
    from shm_broadcast.lifecycle import exit_cleanup

    ours = signal.getsignal(sig) == exit_cleanup._REGISTRY._on_signal
    try:  # reported inside: a SIGINT right after the report raises in here
        _report(**_describe(queues[0]), our_handler=ours)
        while True:
            time.sleep(0.05)
    except KeyboardInterrupt:
        with open(marker, "w") as f:
            f.write("KeyboardInterrupt")
        raise


def _child_carry_on(sig: int) -> None:
    noted = threading.Event()
    if sig != signal.SIGINT:
        signal.signal(sig, lambda s, f: noted.set())
    mq = _make_queue()
    info = _describe(mq)
    try:
        _report(**info)
        while not noted.is_set():
            time.sleep(0.05)
    except KeyboardInterrupt:
        pass
    usable = not mq._impl.closed and mq._impl.ring is not None and not mq._impl.ring.closed
    _report(present=_present(info), queue_usable=usable)
    mq.close()


def _child_two_queues() -> None:
    more = threading.Event()
    signal.signal(signal.SIGUSR1, lambda s, f: more.set())
    keep = [_make_queue()]
    first = _describe(keep[0])
    _report(**first)
    more.wait(30)
    # The pid read before the kill: once the reaper is dead, a lookup finds none.
    reaper = psutil.Process(first["reaper"])
    deadline = time.monotonic() + 10  # the first reaper was killed: wait until it is
    while reaper.is_running() and reaper.status() != psutil.STATUS_ZOMBIE:
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    keep.append(_make_queue())
    _report(**_describe(keep[1]))
    time.sleep(60)


def _child_fork() -> None:
    mq = _make_queue()
    info = _describe(mq)
    _report(**info)
    codes = []
    for how in ("exit", "_exit"):
        pid = os.fork()
        if pid == 0:
            if how == "exit":
                sys.exit(0)  # runs atexit in the child: must not touch the parent's files
            os._exit(0)
        codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    time.sleep(0.3)  # a (wrong) reaper of the child would act now
    _report(child_exit=codes, present=_present(info))
    mq.close()


if __name__ == "__main__":
    # A process started in the background of a non-interactive shell (a CI script's
    # `cmd &`) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt
    # handler. The cases model a process started normally: Python's own SIGINT handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    what, args = sys.argv[1], sys.argv[2:]
    if what == "signal":
        _child_signal(args[0], args[1], int(args[2]), args[3])
    elif what == "carry-on":
        _child_carry_on(int(args[0]))
    elif what == "two-queues":
        _child_two_queues()
    elif what == "fork":
        _child_fork()

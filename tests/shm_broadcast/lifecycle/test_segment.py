"""SharedSegment lifecycle: SIGTERM unlinks, the reaper cleans after SIGKILL, cleanup removes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Any

import pytest

from shm_broadcast import SharedSegment, ShmSpaceError, list_segments
from shm_broadcast.lifecycle.segment import SHM_DIR, shm_free_bytes
from tests.shm_broadcast.lifecycle_helpers import kill_with_reaper, wait_gone


def _cleanup(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shm_broadcast.cli", "cleanup", *args],
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.timeout(90)
def test_sigterm_unlinks_before_death_and_sigkill_is_cleaned_by_the_reaper(procs):
    term = procs.start(segment_owner)
    kill = procs.start(segment_owner)
    names = {}
    for _ in range(2):
        _, name = procs.get()
        names[int(name.split("_")[2])] = name
    term_name, kill_name = names[term.pid], names[kill.pid]
    assert os.path.exists(os.path.join(SHM_DIR, term_name))

    os.kill(term.pid, signal.SIGTERM)
    term.join(30)
    assert term.exitcode == -signal.SIGTERM
    assert not os.path.exists(os.path.join(SHM_DIR, term_name)), "SIGTERM must unlink"
    assert not os.path.exists(os.path.join(SHM_DIR, term_name + ".owner"))

    os.kill(kill.pid, signal.SIGKILL)
    kill.join(30)
    path = os.path.join(SHM_DIR, kill_name)
    assert not wait_gone(path, path + ".owner"), \
        "the reaper must remove a SIGKILLed owner's segment"


@pytest.mark.usefixtures("cleanup_serial")  # cleanup --yes takes any orphan
@pytest.mark.timeout(90)
def test_owner_killed_with_its_reaper_leaves_an_orphan_that_cleanup_removes(procs):
    owner = procs.start(segment_owner)
    _, name = procs.get()
    kill_with_reaper(owner.pid)
    owner.join(30)
    time.sleep(0.2)
    assert os.path.exists(os.path.join(SHM_DIR, name)), "nobody left to clean up"
    listed = _cleanup()
    assert listed.returncode == 0 and f"orphan   {name}" in listed.stdout, listed.stdout
    assert os.path.exists(os.path.join(SHM_DIR, name)), "without --yes nothing is removed"
    removed = _cleanup("--yes")
    assert f"removed  {name}" in removed.stdout, removed.stdout + removed.stderr
    assert not os.path.exists(os.path.join(SHM_DIR, name))
    assert not os.path.exists(os.path.join(SHM_DIR, name + ".owner"))
    assert name not in {s.name for s in list_segments()}


@pytest.mark.usefixtures("cleanup_serial")  # cleanup --yes takes any orphan
@pytest.mark.timeout(30)
def test_cleanup_leaves_live_segments_alone():
    with SharedSegment.create("test", 4096) as seg:
        out = _cleanup("--yes", "--all")
        assert out.returncode == 0
        assert f"in use   {seg.name}" in out.stdout
        assert os.path.exists(os.path.join(SHM_DIR, seg.name))


@pytest.mark.timeout(30)
def test_creation_fails_cleanly_when_dev_shm_is_too_small():
    free = shm_free_bytes()
    if free < 0:
        pytest.skip("no /dev/shm on this platform")
    with pytest.raises(ShmSpaceError, match="groupcoord cleanup"):
        SharedSegment.create("test", free + (1 << 30))
    assert not any(s.pid == os.getpid() for s in list_segments())


# ---------------------------------------------------------------------- child processes
# Spawned by the ``procs`` fixture as ``fn(*args, out_queue)``; each reports through
# the queue (``("ok", ...)`` or ``("error", traceback)``) and never fails silently.
def segment_owner(out: Any) -> None:
    """Create a segment and wait until killed, in slices: Python runs the signal
    handler in the main thread between bytecodes, and the signal may be taken by
    the queue's feeder thread (docs/lifecycle.md, "Limits")."""
    try:
        seg = SharedSegment.create("test", 4096)
        out.put(("segment", seg.name))
        for _ in range(6000):
            time.sleep(0.1)
    except BaseException:
        out.put(("error", 0, traceback.format_exc()))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("holder", ["segment", "queue-writer"])
def test_an_owner_dropped_without_close_frees_its_name(holder: str) -> None:
    """A segment (or a queue writer nobody closed) that is collected unlinks its name
    then, not only when the process ends."""
    import gc

    from shm_broadcast import MessageQueue

    obj: Any = (SharedSegment.create("test", 4096) if holder == "segment"
                else MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2))
    mine = [n for n in os.listdir(SHM_DIR) if f"_{os.getpid()}_" in n
            and not n.endswith(".owner")]
    assert mine
    del obj
    gc.collect()
    assert not [n for n in mine if os.path.exists(os.path.join(SHM_DIR, n))]


_FORK_DROP = """
import gc, os, sys
from shm_broadcast import SharedSegment
seg = SharedSegment.create("test", 4096)
path = os.path.join("/dev/shm", seg.name)
pid = os.fork()
if pid == 0:  # the child's copy is collected: it owns nothing
    del seg
    gc.collect()
    os._exit(0 if os.path.exists(path) else 3)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), os.path.exists(path))
seg.close()
"""


@pytest.mark.timeout(60)
def test_a_forked_childs_copy_of_an_owner_unlinks_nothing() -> None:
    out = subprocess.run([sys.executable, "-c", _FORK_DROP], capture_output=True, text=True,
                         timeout=50, check=True)
    assert out.stdout.split() == ["0", "True"], out.stdout + out.stderr


_EXIT_RACE = """
import os, sys, threading, time
from shm_broadcast import MessageQueue


def churn():
    while True:
        MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2).close()


keep = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)  # the reaper is up
threading.Thread(target=churn, daemon=True).start()
time.sleep(float(sys.argv[1]))
# While the thread is somewhere in making or removing a queue: os._exit, or an
# interpreter exit (atexit handlers run while the daemon thread still does).
if sys.argv[2] == "os._exit":
    os._exit(0)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["os._exit", "exit"])
def test_a_process_that_ends_while_a_thread_makes_queues_leaves_nothing(
        tmp_path: Any, how: str) -> None:
    """Names are registered with the exit paths before they exist: whenever the process
    ends, the reaper knows every segment and channel directory it made (the
    children's directories go to ``tmp_path``: ``XDG_RUNTIME_DIR``); and an
    interpreter exit does not wait on the thread's sockets."""
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path))
    pids = []
    for i in range(6):
        p = subprocess.Popen([sys.executable, "-c", _EXIT_RACE, str(0.2 + 0.037 * i), how],
                             env=env, stderr=subprocess.PIPE)
        try:
            _, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            pytest.fail(f"the process did not end ({how}) within 30 s")
        assert p.returncode == 0, err.decode()[-2000:]
        pids.append(p.pid)
    deadline = time.monotonic() + 10
    while True:
        left = [n for n in os.listdir(SHM_DIR) if any(f"_{pid}_" in n for pid in pids)]
        dirs = os.listdir(tmp_path)
        if not left and not dirs or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left and not dirs, (left, dirs)


_LATE_CREATE = """
import atexit, os, secrets
from shm_broadcast import MessageQueue
from shm_broadcast.lifecycle import exit_cleanup
from shm_broadcast.lifecycle.segment import _shm_open, _record_path, write_owner_record

name = f"gc_test_{os.getpid()}_{secrets.token_hex(4)}"


def finish_creation():
    # Runs after groupcoord's own exit handler (atexit is last in, first out): a
    # thread that registered ``name`` before the exit and makes its files after.
    os.close(_shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    write_owner_record(_record_path(name))


atexit.register(finish_creation)
keep = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
exit_cleanup.add_segment(name)
print(name, flush=True)
"""


@pytest.mark.timeout(60)
def test_files_a_thread_finishes_after_the_exit_handler_are_removed_by_the_reaper() -> None:
    """The exit handler removes what exists and leaves the names with the reaper: a
    creation another thread completes after it (the owner record written after the
    handler ran) is removed once the process is gone."""
    out = subprocess.run([sys.executable, "-c", _LATE_CREATE], capture_output=True, text=True,
                         timeout=50, check=True)
    name = out.stdout.strip()
    paths = [os.path.join(SHM_DIR, name), os.path.join(SHM_DIR, name + ".owner")]
    deadline = time.monotonic() + 10
    while any(os.path.lexists(p) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in paths if os.path.lexists(p)]
    for p in left:
        os.unlink(p)
    assert not left, left

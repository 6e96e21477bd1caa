"""The fault rig: rank processes reused across fault cases, fresh ones where a fault killed one.

Starting a rank costs 1-2 s (importing torch), far more than most fault
cases take, so the rig keeps worker processes that join a new world for each
case (a fresh gloo world on a store the rig hosts, so any rank may die) and
leave it afterwards. A case's culprit of a destructive fault (``kill``,
``stop``, ``raise``) does not come back: the rig kills and reaps it (a
stopped one with ``SIGKILL``) and starts a replacement in the background.
Survivors are reused only after they tore their groups down within the time
allowed; anything else (a rank that hangs, crashes, or does not tear down)
is killed and replaced, and reported as a problem of the case.

After every case the rig checks, on the machine's ``/dev/shm`` and channel
directories, that nothing owned by the case's processes remains (the dead
culprit's files are removed by its exit reaper, which must also be gone),
waiting up to 5 s for asynchronous clean-up.

Times: every process reads ``time.monotonic()`` (``CLOCK_MONOTONIC``, one
clock for the whole machine), so the fault time a culprit reports and the
time a survivor raised are directly comparable.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import psutil

from shm_broadcast.ranks.launcher import describe_exit, die_with_parent, start_ranks, stop_ranks
from tests.faults.contract import DESTRUCTIVE

__all__ = ["CaseRun", "FaultRig", "live_rig_pids"]

_RIGS: weakref.WeakSet[FaultRig] = weakref.WeakSet()
_START_S = 60.0  # a worker's start (imports) on a loaded machine
_TEARDOWN_S = 15.0  # a survivor's teardown after a case
_CLEANUP_S = 5.0  # reapers and owners removing files asynchronously


def live_rig_pids() -> set[int]:
    """Pids of every live rig worker (idle workers outlive the test that started them)."""
    return {w.pid for rig in list(_RIGS) for w in rig.workers}


@dataclass
class CaseRun:
    """What one case did.

    Attributes:
        spec: The case.
        records: Per rank, its report (None: it never finished, e.g. the culprit).
        fault_t: When the culprit injected its fault (monotonic clock), or None.
        exits: Per rank whose process ended during the case, its exit in words.
        exit_t: Per such rank, when the rig saw its process end (monotonic clock).
        recovered: Per rank, the report of the recovery step (when it ran).
        problems: What went wrong in the harness's eyes (hangs, crashes, leaks).
        elapsed: Wall seconds of the case.
    """

    spec: dict[str, Any]
    records: list[dict[str, Any] | None]
    fault_t: float | None = None
    exits: dict[int, str] = field(default_factory=dict)
    exit_t: dict[int, float] = field(default_factory=dict)
    recovered: list[dict[str, Any] | None] | None = None
    problems: list[str] = field(default_factory=list)
    elapsed: float = 0.0


class _Worker:
    def __init__(self, parent_pid: int) -> None:
        procs, conns = start_ranks(_worker_main, 1, lambda _r, child: (child, parent_pid),
                                   name="gc-fault-rank", duplex=True)
        self.proc, self.conn = procs[0], conns[0]
        self.pid: int = self.proc.pid
        self.idle = False

    def wait_idle(self, deadline: float) -> bool:
        while not self.idle:
            left = deadline - time.monotonic()
            if left <= 0 or not self.conn.poll(left):
                return False
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                return False
            self.idle = msg[0] == "idle"
        return True

    def kill(self) -> None:
        stop_ranks([self.proc], [self.conn], term_grace=0.0)


class FaultRig:
    """Reusable rank processes for fault cases (see the module docstring)."""

    def __init__(self) -> None:
        self.workers: list[_Worker] = []
        self._size = 0  # workers kept (the largest world size asked for)
        _RIGS.add(self)

    # ------------------------------------------------------------------ pool
    def _top_up(self) -> None:
        while len(self.workers) < self._size:
            self.workers.append(_Worker(os.getpid()))

    def _take(self, n: int) -> list[_Worker]:
        self._size = max(self._size, n)
        self._top_up()
        chosen: list[_Worker] = []
        deadline = time.monotonic() + _START_S
        for w in sorted(self.workers, key=lambda w: not w.idle):  # idle ones first
            if len(chosen) == n:
                break
            if w.idle or w.wait_idle(deadline):
                chosen.append(w)
            else:
                self._drop(w)
        if len(chosen) < n:
            raise RuntimeError(f"fault rig: only {len(chosen)} of {n} workers started")
        return chosen

    def _drop(self, w: _Worker) -> None:
        if w in self.workers:
            self.workers.remove(w)
        w.kill()

    def close(self) -> None:
        """Stop and reap every worker."""
        for w in list(self.workers):
            with contextlib.suppress(BrokenPipeError, OSError):
                w.conn.send(("stop",))
        stop_ranks([w.proc for w in self.workers], [w.conn for w in self.workers],
                   wait_first=5.0)
        self.workers = []
        _RIGS.discard(self)

    # ------------------------------------------------------------------ one case
    def run(self, spec: dict[str, Any], world_size: int) -> CaseRun:
        """Run one case (``spec``: op, fault, culprit, transport, timeout) on fresh groups."""
        import torch.distributed as dist

        t_start = time.monotonic()
        ranks = self._take(world_size)
        store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                              wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
        run = CaseRun(spec, [None] * world_size)
        for r, w in enumerate(ranks):
            w.idle = False
            w.conn.send(("case", spec, r, world_size, store.port))
        pids = [w.pid for w in ranks]
        try:
            self._collect(ranks, run)
            self._finish(ranks, run)
        except BaseException:
            for w in ranks:
                self._drop(w)
            raise
        finally:
            del store
        self._check_files(pids, run)
        run.elapsed = time.monotonic() - t_start
        return run

    def _collect(self, ranks: list[_Worker], run: CaseRun) -> None:
        """Every rank's report; the culprit's fault time; deaths."""
        timeout = float(run.spec["timeout"])
        culprit, destructive = run.spec["culprit"], run.spec["fault"] in DESTRUCTIVE
        pending = {r for r in range(len(ranks)) if not (destructive and r == culprit)}
        watch = set(range(len(ranks)))
        start_deadline = time.monotonic() + _START_S + 30
        while pending:
            # Each survivor must report within timeout + 2 s of the fault; the rig
            # waits longer (a late report is the test's to judge, a hang is ours).
            deadline = (run.fault_t + timeout + 30) if run.fault_t is not None else start_deadline
            left = deadline - time.monotonic()
            if left <= 0:
                run.problems.append(f"rank(s) {sorted(pending)} did not finish within "
                                    f"timeout + 30 s of the fault (hang)")
                return
            owner = {ranks[r].conn: r for r in watch}
            owner.update({ranks[r].proc.sentinel: r for r in watch})
            for obj in wait(list(owner), timeout=min(left, 1.0)):
                r = owner[obj]
                if r not in watch:
                    continue  # its process ended earlier in this batch
                if obj is ranks[r].conn:
                    try:
                        msg = ranks[r].conn.recv()
                    except (EOFError, OSError):
                        msg = None
                    if msg is not None and msg[0] == "fault":
                        run.fault_t = msg[1]
                        continue
                    if msg is not None and msg[0] == "done":
                        run.records[r] = msg[1]
                        pending.discard(r)
                        continue
                    if msg is not None and msg[0] == "error":
                        run.problems.append(f"rank {r} failed outside the step: {msg[1]}")
                        pending.discard(r)
                        continue
                ranks[r].proc.join(2.0)
                if ranks[r].proc.exitcode is not None:
                    run.exit_t[r] = time.monotonic()
                    run.exits[r] = describe_exit(ranks[r].proc.exitcode)
                    watch.discard(r)
                    if r in pending:
                        pending.discard(r)
                        run.problems.append(f"rank {r} exited during the case "
                                            f"({run.exits[r]}) without a report")

    def _finish(self, ranks: list[_Worker], run: CaseRun) -> None:
        """Kill the culprit of a destructive fault, recover if asked, tear down survivors."""
        culprit, fault = run.spec["culprit"], run.spec["fault"]
        if fault in DESTRUCTIVE:
            w = ranks[culprit]
            if fault == "stop" and w.proc.exitcode is None:
                os.kill(w.pid, signal.SIGKILL)
            w.proc.join(10.0)
            run.exit_t.setdefault(culprit, time.monotonic())
            run.exits.setdefault(culprit, describe_exit(w.proc.exitcode))
            self._drop(w)
            self._top_up()  # its replacement starts while the others tear down
        live = [r for r, w in enumerate(ranks) if w in self.workers and r not in run.exits]
        if run.problems:
            for r in live:
                self._drop(ranks[r])
            return
        if run.spec.get("recover") and _all_mismatch_or_ok(run):
            run.recovered = [None] * len(ranks)
            for r in live:
                ranks[r].conn.send(("recover",))
            deadline = time.monotonic() + float(run.spec["timeout"]) + 30
            for r in live:
                ok = ranks[r].conn.poll(max(0.0, deadline - time.monotonic()))
                msg = ranks[r].conn.recv() if ok else None
                if msg is None or msg[0] != "recovered":
                    run.problems.append(f"rank {r} did not finish the recovery step: {msg}")
                else:
                    run.recovered[r] = msg[1]
        for r in live:
            with contextlib.suppress(BrokenPipeError, OSError):
                ranks[r].conn.send(("teardown",))
        deadline = time.monotonic() + _TEARDOWN_S
        for r in live:
            if not ranks[r].wait_idle(deadline):
                run.problems.append(f"rank {r} did not tear its groups down within "
                                    f"{_TEARDOWN_S:g} s")
                self._drop(ranks[r])

    def _check_files(self, pids: list[int], run: CaseRun) -> None:
        """Nothing of the case's processes in /dev/shm or channel directories, and
        no exit reaper of a dead one, within 5 s."""
        from shm_broadcast.lifecycle.channel_dirs import list_channel_dirs
        from shm_broadcast.lifecycle.reaper import MARKER
        from shm_broadcast.lifecycle.segment import list_orphan_records, list_segments

        mine = set(pids)
        deadline = time.monotonic() + _CLEANUP_S
        while True:
            left = [f"segment {s.name}" for s in list_segments() if s.pid in mine]
            left += [f"owner record {r}" for r in list_orphan_records()
                     if any(f"_{p}_" in r for p in mine)]
            left += [f"channel dir {d.path}" for d in list_channel_dirs() if d.pid in mine]
            dead = [p for p in mine if not psutil.pid_exists(p)]
            left += [f"exit reaper {p.pid} of dead rank pid {owner}"
                     for p in psutil.process_iter(["cmdline"])
                     for owner in dead
                     if _is_reaper_of(p, MARKER, owner)]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if left:
            run.problems.append(f"left behind after the case: {left}")


def _is_reaper_of(p: psutil.Process, marker: str, owner: int) -> bool:
    cmd = p.info.get("cmdline") or []
    return marker in cmd and str(owner) in cmd[cmd.index(marker) + 1 : cmd.index(marker) + 2]


def _all_mismatch_or_ok(run: CaseRun) -> bool:
    """Whether every rank's step ended well or in a mismatch (the group is meant to stay usable)."""
    for rec in run.records:
        if rec is None:
            return False
        for c in rec["calls"]:
            if not c["ok"] and "CollectiveMismatch" not in c["classes"] and c["error"] not in (
                    "TypeError", "ValueError"):
                return False
    return True


# ---------------------------------------------------------------------- the worker
def _worker_main(conn: Connection, parent_pid: int) -> None:
    """A rig worker: run cases until told to stop (an injected ``raise`` ends it)."""
    die_with_parent(parent_pid)
    import torch

    torch.set_num_threads(1)
    from tests.faults import rank_side

    conn.send(("idle",))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        if msg[0] == "case":
            _, spec, rank, world_size, port = msg
            try:
                rank_side.run_case(conn, spec, rank, world_size, port)
            except rank_side.InjectedFault:
                raise  # out of the process, as an uncaught exception
            except Exception as e:
                import traceback

                conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        elif msg[0] == "recover":
            conn.send(("recovered", rank_side.recover(rank, world_size)))
        elif msg[0] == "teardown":
            rank_side.teardown()
            conn.send(("idle",))

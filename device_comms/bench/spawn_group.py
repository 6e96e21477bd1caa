"""Start a few local ranks with a gloo world group and collect what each returns.

A small launcher for the collectives benchmark (and tests that need ranks to
die on purpose): ``device_comms`` may not import ``coordinator``, whose
harness is the general one. Unlike that harness, this one does **not** stop
the others when a rank dies: each rank's outcome (its return value, its
exception text, or its exit code) is reported, so a test can kill a rank and
check what the survivors saw. The rendezvous store lives in the parent, so
ranks keep working when any of them dies. Every child is reaped before
:func:`spawn_group` returns, and children die with the parent
(``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import datetime
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Mapping, Sequence

__all__ = ["RankOutcome", "spawn_group"]


@dataclass
class RankOutcome:
    """What one rank did.

    Attributes:
        rank: The rank.
        ok: Whether ``fn`` returned.
        result: Its return value (when ``ok``).
        error: ``"<Type>: message"`` and traceback when ``fn`` raised.
        exitcode: Process exit code (negative: killed by that signal; None: still
            running when killed at the timeout).
    """

    rank: int
    ok: bool = False
    result: Any = None
    error: str | None = None
    exitcode: int | None = None


def spawn_group(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    env: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
    timeout: float = 300.0,
    pin_cpus: bool = False,
) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes.

    Each child initialises ``torch.distributed`` (gloo, world group) first.

    Args:
        fn: Module-level function; its result must be picklable.
        world_size: Number of ranks (>= 1).
        args: Extra arguments for ``fn``.
        env: Extra environment variables, one mapping or one per rank.
        timeout: Seconds before ranks still running are killed.
        pin_cpus: Bind rank ``r`` (all its threads) to the ``r``-th allowed CPU
            (round robin), as MPI launchers do by default for benchmarks.

    Returns:
        One :class:`RankOutcome` per rank, by rank.
    """
    import torch.distributed as dist

    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    envs = _per_rank(env, world_size)
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
    )
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    try:
        for r in range(world_size):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child,
                args=(fn, r, world_size, store.port, tuple(args), envs[r], child, os.getpid(), timeout,
                      pin_cpus),
                name=f"gc-bench-rank{r}",
                daemon=True,
            )
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        return _collect(procs, conns, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(10.0)
            p.close()
        for c in conns:
            c.close()
        del store


def _collect(procs: list[Any], conns: list[Connection], timeout: float) -> list[RankOutcome]:
    n = len(procs)
    out = [RankOutcome(r) for r in range(n)]
    have: set[int] = set()
    deadline = time.monotonic() + timeout
    live = dict(enumerate(conns))
    while live and time.monotonic() < deadline:
        ready = wait(list(live.values()), timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        for c in ready:
            r = conns.index(c)  # type: ignore[arg-type]
            try:
                kind, payload = c.recv()  # type: ignore[union-attr]
            except (EOFError, OSError):
                live.pop(r, None)  # exited without a message
                continue
            if kind == "ok":
                out[r].ok, out[r].result = True, payload
            else:
                out[r].error = payload
            have.add(r)
            live.pop(r, None)
    grace = time.monotonic() + 10.0
    for r, p in enumerate(procs):
        p.join(max(0.0, grace - time.monotonic()))
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(5.0)
        out[r].exitcode = p.exitcode if r in have or p.exitcode is not None else None
    return out


def _per_rank(env: Any, n: int) -> list[dict[str, str]]:
    if env is None:
        return [{} for _ in range(n)]
    if isinstance(env, Mapping):
        return [dict(env) for _ in range(n)]
    envs = [dict(e) for e in env]
    if len(envs) != n:
        raise ValueError(f"env must be one mapping or {n} mappings (one per rank), got {len(envs)}")
    return envs


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    env: dict[str, str],
    conn: Connection,
    parent_pid: int,
    timeout: float,
    pin_cpus: bool,
) -> None:
    if pin_cpus and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})  # before any thread starts
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:
        os._exit(1)
    os.environ.update(env)
    import torch.distributed as dist

    try:
        store = dist.TCPStore(
            "127.0.0.1", port, world_size + 1, is_master=False,
            timeout=datetime.timedelta(seconds=timeout),
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        result = fn(rank, world_size, *args)
        msg: tuple[str, Any] = ("ok", result)
    except BaseException as e:  # report, do not hang the parent
        msg = ("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    try:
        conn.send(msg)
    except (BrokenPipeError, OSError):
        pass
    conn.close()
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # a dead peer can make teardown fail; we are exiting anyway
        pass

"""Run functions on several real processes with torch.distributed initialised.

Two entry points:

* :func:`run_distributed` — one-shot: start ``world_size`` fresh processes,
  initialise the distributed environment (gloo on a free port), run
  ``fn(rank, world_size, *args)`` on each, return the results ordered by rank.
* :class:`DistributedPool` — the same, but the processes stay up between
  :meth:`~DistributedPool.run` calls. Starting a rank costs seconds (importing
  torch), so a test suite that runs many small distributed checks keeps one
  pool per world size.

Both watch every rank at once. The first rank that raises has its exception
re-raised in the caller (with the rank and the remote traceback attached, the
way :mod:`concurrent.futures` does); a rank that dies without a result raises
:class:`~coordinator.errors.RankDiedError`; running past ``timeout`` raises
:class:`~coordinator.errors.DistributedTimeout` naming the ranks that did not
finish. In every case all ranks are killed and reaped, so a broken collective
never hangs a test run. Ranks also die with their parent process, whichever of its threads started
them (:func:`shm_broadcast.ranks.launcher.die_with_parent`).

Example (a pytest test)::

    def _check_sum(rank, world_size):
        from coordinator.parallel_state import get_world_group
        import torch
        return get_world_group().all_reduce(torch.tensor([rank])).item()

    def test_sum():
        results = run_distributed(_check_sum, 2)   # -> [1, 1], one entry per rank

``fn`` must be importable by the child (a module-level function).
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import time
import traceback
import weakref
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from coordinator.errors import (
    DistributedTimeout,
    GroupCoordError,
    RankDiedError,
    RankFailedError,
)
from shm_broadcast.ranks.launcher import (
    describe_exit,
    die_with_parent,
    free_port,
    per_rank_env,
    start_ranks,
    stop_ranks,
)

__all__ = ["run_distributed", "DistributedPool", "free_port", "live_pool_pids"]

DEFAULT_TIMEOUT = 120.0
_POOLS: weakref.WeakSet[DistributedPool] = weakref.WeakSet()


def live_pool_pids() -> set[int]:
    """Pids of the worker processes of every open :class:`DistributedPool`."""
    return {pid for pool in list(_POOLS) for pid in pool.worker_pids}


class _RemoteTraceback(GroupCoordError):
    """Carries a rank's traceback text as the ``__cause__`` of a re-raised error."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = DEFAULT_TIMEOUT,
    env: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes.

    Args:
        fn: A module-level function; its return value must be picklable.
        world_size: Number of ranks (>= 1).
        *args: Extra arguments passed to ``fn`` on every rank (picklable).
        backend: torch.distributed backend of the world group.
        timeout: Seconds (a finite number > 0) before every rank is killed and
            :class:`DistributedTimeout` is raised; also the limit of the ranks' start.
        env: Extra environment variables: one mapping of str to str for all
            ranks, or a sequence of ``world_size`` such mappings (one per rank).

    Returns:
        ``fn``'s return values, ordered by rank.

    Raises:
        TypeError: ``timeout`` or ``env`` is of the wrong type.
        ValueError: ``timeout`` is not finite and > 0, or ``env`` holds the wrong
            number of mappings.
        Exception: The first exception raised by any rank, re-raised here with
            ``rank`` and the remote traceback attached.
        RankFailedError: A rank raised something that is not an
            :class:`Exception` (``KeyboardInterrupt``, ``SystemExit``), or an
            exception that does not pickle.
        RankDiedError: A rank exited without returning.
        DistributedTimeout: ``timeout`` elapsed.
    """
    timeout = _check_timeout(timeout, "timeout")
    with DistributedPool(world_size, backend=backend, env=env, start_timeout=timeout) as pool:
        return pool.run(fn, *args, timeout=timeout)


class DistributedPool:
    """Persistent ranks with the distributed environment initialised, reused across runs.

    After any failure (exception, death, timeout) the pool kills its ranks and
    restarts fresh ones on the next :meth:`run`. After each successful run the
    ranks tear down any model-parallel groups the function left behind (the
    world group stays), so runs do not leak state into each other.

    Args:
        world_size: Number of ranks.
        backend: torch.distributed backend.
        env: Extra environment variables: one mapping of str to str for all
            ranks, or a sequence of ``world_size`` such mappings (one per rank).
        start_timeout: Seconds (a finite number > 0) allowed for the ranks to
            start and initialise.

    Raises:
        TypeError: An argument is of the wrong type (the message names it).
        ValueError: An argument is out of range (the message names it).
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        env: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
        start_timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str, got {type(backend).__name__}")
        self.world_size = world_size
        self.backend = backend
        self._envs = per_rank_env(env, world_size)
        self._start_timeout = _check_timeout(start_timeout, "start_timeout")
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._closed = False
        _POOLS.add(self)

    @property
    def worker_pids(self) -> list[int]:
        """Pids of the live ranks (empty when not started)."""
        return [p.pid for p in self._procs if p.pid is not None]

    def run(self, fn: Callable[..., Any], *args: Any,
            timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on every rank; see :func:`run_distributed`.

        Raises:
            TypeError: ``fn`` is not callable, or ``timeout`` is not a number.
            ValueError: ``timeout`` is not finite and > 0.
        """
        if self._closed:
            raise RuntimeError("this DistributedPool is closed; create a new one")
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        timeout = _check_timeout(timeout, "timeout")  # before anything reaches a rank
        if not self._procs:
            self._start()
        # Whatever ends this call early (a send that fails, Ctrl-C between two
        # sends) stops the ranks: a rank that got the call would otherwise leave
        # its reply queued, and the next run() would read it as its own.
        try:
            for c in self._conns:
                with contextlib.suppress(BrokenPipeError, OSError):
                    c.send(("run", fn, args))  # a dead rank is reported by _collect
            return self._collect(timeout, what=getattr(fn, "__qualname__", repr(fn)))
        except BaseException:
            self._shutdown(graceful=False)
            raise

    def close(self) -> None:
        """Stop and reap every rank. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._shutdown(graceful=True)
        _POOLS.discard(self)

    def __enter__(self) -> DistributedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _start(self) -> None:
        port, me = free_port(), os.getpid()
        self._procs, self._conns = start_ranks(
            _worker_main, self.world_size,
            lambda rank, child: (rank, self.world_size, port, self.backend, child,
                                 self._envs[rank], me),
            name="groupcoord-rank", duplex=True)
        self._collect(self._start_timeout, what="startup")

    def _collect(self, timeout: float, what: str) -> list[Any]:
        n = self.world_size
        results: list[Any] = [None] * n
        pending = set(range(n))
        eof: set[int] = set()
        # Everything after the ranks got work is inside the try: however this
        # ends early, the ranks are stopped, so no reply is left queued.
        try:
            deadline = time.monotonic() + timeout
            by_conn = {c: r for r, c in enumerate(self._conns)}
            by_sentinel = {p.sentinel: r for r, p in enumerate(self._procs)}
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    ranks = sorted(pending)
                    raise DistributedTimeout(
                        f"{what}: rank(s) {ranks} of {n} did not finish within {timeout:.1f}s; "
                        f"all ranks were killed. A collective probably waits for a rank that "
                        f"never calls it, or the timeout is too short for this machine.",
                        ranks,
                    )
                ready = wait(
                    [self._conns[r] for r in pending - eof]
                    + [self._procs[r].sentinel for r in pending],
                    timeout=min(left, 1.0),
                )
                ready.sort(key=lambda o: 0 if o in by_conn else 1)  # results before deaths
                for obj in ready:
                    if obj in by_conn:
                        r = by_conn[obj]
                        if r not in pending:
                            continue
                        try:
                            msg = obj.recv()
                        except (EOFError, OSError):
                            eof.add(r)  # the sentinel reports the death
                            continue
                        self._handle(r, msg, results)
                        pending.discard(r)
                    else:
                        r = by_sentinel[obj]
                        if r not in pending:
                            continue
                        msg = _try_recv(self._conns[r])
                        if msg is not None:  # it answered, then exited
                            self._handle(r, msg, results)
                            pending.discard(r)
                        else:
                            self._procs[r].join(1.0)
                            code = self._procs[r].exitcode
                            raise RankDiedError(
                                f"{what}: rank {r} of {n} exited without a result "
                                f"({describe_exit(code)}); all ranks were killed.",
                                r,
                            )
        except BaseException:
            self._shutdown(graceful=False)
            raise
        return results

    def _handle(self, rank: int, msg: tuple[Any, ...], results: list[Any]) -> None:
        kind = msg[0]
        if kind == "ok":
            results[rank] = msg[1]
            return
        _, blob, type_name, text, tb = msg
        exc: Any = None
        if blob is not None:
            try:
                exc = pickle.loads(blob)
            except Exception:
                exc = None
        header = f"rank {rank} of {self.world_size} raised {type_name}"
        if not isinstance(exc, Exception) and exc is not None:
            # KeyboardInterrupt, SystemExit, ...: re-raised here they would stop
            # the caller (end a pytest session, exit a script) for a rank's failure.
            raise RankFailedError(
                f"{header} (not an Exception, so not re-raised here): {text}\n"
                f"remote traceback:\n{tb}", rank, tb)
        if isinstance(exc, Exception):
            exc.__cause__ = _RemoteTraceback(f"\n{header}; remote traceback:\n{tb}")
            exc.groupcoord_rank = rank  # type: ignore[attr-defined]  # read by the caller
            if hasattr(exc, "add_note"):
                exc.add_note(f"(raised on {header.split(' raised')[0]})")
            raise exc
        raise RankFailedError(f"{header}: {text}\nremote traceback:\n{tb}", rank, tb)

    def _shutdown(self, graceful: bool) -> None:
        procs, conns = self._procs, self._conns
        self._procs, self._conns = [], []
        if graceful:
            for c in conns:
                with contextlib.suppress(BrokenPipeError, OSError):
                    c.send(("stop",))
        # SIGTERM before SIGKILL: ranks unlink the memory they own on SIGTERM.
        stop_ranks(procs, conns, wait_first=10.0 if graceful else 0.0)


def _try_recv(conn: Connection) -> Any:
    """A pending message on ``conn``, or None at EOF / when nothing is there."""
    try:
        return conn.recv() if conn.poll() else None
    except (EOFError, OSError):
        return None


def _worker_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    conn: Connection,
    env: dict[str, str],
    parent_pid: int,
) -> None:
    """A pooled rank: initialise, report, then run functions until told to stop."""
    die_with_parent(parent_pid)
    try:
        ps = _init_rank(rank, world_size, port, backend, env)
    except BaseException as e:  # report startup failures like task failures
        _send_error(conn, e)
        return
    conn.send(("ok", None))
    try:
        _serve(conn, ps, rank, world_size)
    finally:
        try:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()
        except BaseException:
            pass
        conn.close()


def _init_rank(rank: int, world_size: int, port: int, backend: str,
               env: dict[str, str]) -> Any:
    """Environment, thread count and the world group; returns ``parallel_state``."""
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    import torch

    from coordinator import parallel_state as ps

    if "OMP_NUM_THREADS" not in env:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    ps.init_distributed_environment(
        world_size=world_size, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
        local_rank=rank, backend=backend)
    return ps


def _serve(conn: Connection, ps: Any, rank: int, world_size: int) -> None:
    """Run each ``("run", fn, args)``; stop at ``("stop",)``, EOF or the first failure."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        _, fn, args = msg
        try:
            result = fn(rank, world_size, *args)
        except BaseException as e:
            _send_error(conn, e)
            return  # a failed run leaves groups in an unknown state: stop
        try:
            _reset_between_runs(ps)
            conn.send(("ok", result))
        except BaseException as e:
            _send_error(conn, e)
            return


def _reset_between_runs(ps: Any) -> None:
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def _send_error(conn: Connection, e: BaseException) -> None:
    tb = traceback.format_exc()
    try:
        blob: bytes | None = pickle.dumps(e)
    except Exception:  # the exception itself does not pickle
        blob = None
    with contextlib.suppress(BrokenPipeError, OSError):
        conn.send(("err", blob, type(e).__name__, _safe_str(e), tb))


def _safe_str(e: BaseException) -> str:
    """``str(e)``, or a stand-in when the exception's ``__str__`` itself raises (the
    report of the rank's failure must still go out)."""
    try:
        return str(e)
    except Exception:
        return f"<{type(e).__name__}: str() failed>"


def _check_timeout(value: Any, name: str) -> float:
    """``value`` as seconds: a finite number > 0 (not a bool); ``name`` is the
    argument's name for the message."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number of seconds (int or float), got "
                        f"{type(value).__name__} {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)

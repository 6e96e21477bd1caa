"""Local rank processes: start them, tie them to their parent, stop and reap them.

The one process launcher of the project. :mod:`coordinator.testing` (tests and
the demo) and the benchmarks build on it; it lives in the bottom package so
that every layer may use it.

Two ways to use it:

* the primitives (:func:`start_ranks`, :func:`stop_ranks`,
  :func:`die_with_parent`, ...), for a harness with its own message protocol
  (``coordinator.testing.DistributedPool`` keeps its ranks between runs and
  stops them all at the first failure);
* :func:`spawn_group`, one-shot ranks with a gloo world group whose outcomes
  are reported one by one: a rank that dies does **not** stop the others, so a
  test can kill a rank on purpose and check what the survivors saw.

What holds for every rank started here: it inherits no threads, CUDA state or
objects of its parent; it dies with its parent process, whichever thread
started it (:func:`die_with_parent`); :func:`stop_ranks`
sends SIGTERM first (ranks unlink the shared memory they own on SIGTERM), then
SIGKILL, reaps every process and unlinks the segments still owned by a dead
rank.

How a rank starts (``start_method``, or the environment variable
:data:`START_METHOD_ENV`):

* ``spawn`` (the default): a fresh interpreter, which imports torch again
  (seconds of CPU on a small machine);
* ``forkserver``: a fork of this process's ``multiprocessing`` fork server,
  which imported torch (and the target's module, if it is one of this
  project's, which never touch a GPU at import: a server that initialised
  CUDA would fork children that cannot use it) once, when it started (the
  first such start in this process). A rank starts in a fraction of the time,
  which is what a test suite that starts hundreds of ranks wants. As under
  ``spawn``, the rank has this process's environment, stdout and stderr of
  the moment (taken on before the target is unpickled, so before its module
  is imported), its working directory and ``sys.path``, and its exit handlers
  run. What differs: the modules the server imported and the main script's
  module-level code (which a child runs first, as a spawned one does) see
  the environment and stderr the server started with, and the umask and
  resource limits are the server's. So where a
  variable that libraries read at load (``OMP_*``, ``MKL_*``, ``TORCH*``,
  ``CUDA*``... see :data:`LOAD_TIME_PREFIXES`) has changed since the server
  started, where the ranks are pinned to CPUs (the OpenMP runtime sized its
  pool before the pin), or where another part of the program started the fork
  server first (what it loaded is unknown), the ranks are spawned instead.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import multiprocessing as mp
import os
import random
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from shm_broadcast.checks import check_bool, check_int, check_timeout
from shm_broadcast.lifecycle.owner_identity import pid_exists
from shm_broadcast.ranks.tcp_store import client_store, master_store

__all__ = [
    "LOAD_TIME_PREFIXES",
    "RUN_TIME_VARIABLES",
    "START_METHODS",
    "START_METHOD_ENV",
    "RankOutcome",
    "describe_exit",
    "die_with_parent",
    "fork_server_pid",
    "free_port",
    "per_rank_env",
    "pin_to_cpu",
    "spawn_group",
    "start_process",
    "start_ranks",
    "stop_ranks",
]

EnvArg = Mapping[str, str] | Sequence[Mapping[str, str]] | None

#: The ways :func:`start_ranks` starts a rank (see the module docstring).
START_METHODS = ("spawn", "forkserver")
#: The environment variable that picks the start method where the caller does not.
START_METHOD_ENV = "GROUPCOORD_RANK_START"
#: Environment variables with these prefixes may be read when torch and its
#: libraries load (the OpenMP runtime reads ``OMP_NUM_THREADS`` then): a fork
#: server whose value differs from this process's is not used (but for
#: :data:`RUN_TIME_VARIABLES`).
LOAD_TIME_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH_",
                      "CUDA", "NVIDIA_", "NCCL_", "LD_", "PYTHON", "MALLOC_")
#: Variables of those prefixes that torch sets in the process itself when it first
#: compiles (Inductor's cache directory) and reads at each use, never at load: a
#: child has the value of the moment with the rest of the environment, so a change
#: does not make the fork server's preloaded modules stale, and a process that
#: compiled keeps starting its ranks from the server.
RUN_TIME_VARIABLES = frozenset({"TORCHINDUCTOR_CACHE_DIR"})


# ---------------------------------------------------------------- primitives
def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago.

    Chosen below the kernel's ephemeral range when possible: a port from that
    range (what ``bind(0)`` returns) may be taken by any outgoing connection of
    another process (gloo opens many) before the caller binds it again.
    """
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(_FIXED_LOW, low) if low > _FIXED_LOW + 64 else 0
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, port))
                return int(s.getsockname()[1])
        except OSError:
            if port == 0:
                raise
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


_FIXED_LOW = 20000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def per_rank_env(env: EnvArg, n: int) -> list[dict[str, str]]:
    """``env`` as one dict per rank: one mapping for all, or exactly ``n`` of them.

    Args:
        env: None, a mapping of str to str (every rank), or a sequence (list,
            tuple) of ``n`` such mappings, one per rank.
        n: The number of ranks.

    Raises:
        TypeError: ``env`` is not one of those, or maps a key or a value that is
            not a str (the message names ``env`` and what came).
        ValueError: A sequence of mappings whose length is not ``n``.
    """
    if env is None:
        return [{} for _ in range(n)]
    if isinstance(env, Mapping):
        return [_str_env(env, "env") for _ in range(n)]
    # A str is a Sequence too: refused here, not read as a sequence of characters.
    if not isinstance(env, Sequence) or isinstance(env, (str, bytes, bytearray)):
        raise TypeError(f"env must be a mapping of str to str, or a sequence of {n} such "
                        f"mappings (one per rank), got {type(env).__name__} {env!r}")
    envs = [_str_env(e, f"env[{i}]") for i, e in enumerate(env)]
    if len(envs) != n:
        raise ValueError(f"env must be one mapping or {n} mappings (one per rank), got {len(envs)}")
    return envs


def _str_env(env: Any, name: str) -> dict[str, str]:
    """``env`` (a mapping of str to str) as a dict; ``name``: how the message calls it."""
    if not isinstance(env, Mapping):
        raise TypeError(f"{name} must be a mapping of str to str, got "
                        f"{type(env).__name__} {env!r}")
    for k, v in env.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"{name} must map str to str (environment variables), got "
                            f"{k!r}: {v!r} ({type(k).__name__} to {type(v).__name__})")
    return dict(env)


def describe_exit(code: int | None) -> str:
    """A process exit code in words (``killed by signal SIGKILL``, ``exit code 1``)."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# Seconds between the SIGTERM a rank sends itself when its parent is gone and the
# SIGKILL: enough for its SIGTERM handler to unlink what it owns, short enough
# that no rank lingers.
PARENT_GONE_GRACE_S = 2.0


def die_with_parent(parent_pid: int) -> None:
    """In a child: die when the parent *process* dies; exit now if it already has.

    A daemon thread watches, once a second and at once when it closes, the
    pipe a ``multiprocessing`` parent keeps open until it exits
    (``multiprocessing.parent_process().sentinel``), and the parent pid
    (``getppid()`` changes when the parent dies, also while a forked copy of
    the parent still holds the pipe). A child whose operating-system parent is
    not ``parent_pid`` (a fork server's child) watches, besides that pipe and
    its own parent, ``parent_pid`` itself through a pidfd (readable once that
    process has exited; where pidfds are missing, the pid once a second). When
    the parent is gone the child sends itself SIGTERM (ranks unlink the shared
    memory they own on it), then SIGKILL after :data:`PARENT_GONE_GRACE_S`.
    ``PR_SET_PDEATHSIG`` is not used: it fires when the parent's *thread* that
    started the child exits, so ranks started from a short-lived thread would
    die with it.
    """
    os_parent = os.getppid()
    parent = mp.parent_process()
    sentinel = parent.sentinel if parent is not None and parent.pid == parent_pid else None
    pidfd: int | None = None
    watch_pid: int | None = None
    if os_parent != parent_pid:  # a fork server's child (or the parent died before this line)
        watch_pid = parent_pid
        try:
            pidfd = os.pidfd_open(parent_pid)
        except ProcessLookupError:
            os._exit(1)
        except (AttributeError, OSError):  # no pidfds here: the pid, once a second
            pidfd = None
    threading.Thread(target=_exit_with_parent, args=(os_parent, sentinel, pidfd, watch_pid),
                     name="die-with-parent", daemon=True).start()
    if watch_pid is not None and not pid_exists(watch_pid):
        os._exit(1)


def _exit_with_parent(os_parent: int, sentinel: int | None, pidfd: int | None,
                      pid: int | None) -> None:
    """Wait until the parent process is gone, then end this process.

    ``sentinel`` is the parent's pipe (end of file once it exited), ``pidfd``
    a pidfd of ``pid`` (readable once it exited), ``pid`` the parent's pid when
    it is not ``os_parent`` (this process's parent at the start, which changes
    when that one dies).
    """
    poller = select.poll()
    for fd in (sentinel, pidfd):
        if fd is not None:
            poller.register(fd, select.POLLIN | select.POLLHUP)
    while os.getppid() == os_parent:
        gone = False
        for fd, ev in poller.poll(1000):
            if ev & select.POLLNVAL:
                poller.unregister(fd)  # closed here by mistake: the other checks remain
                if fd == pidfd:
                    pidfd = None
            elif fd == pidfd or ev & select.POLLHUP or os.read(fd, 4096) == b"":
                gone = True  # the pidfd is readable, or the pipe's end closed: exited
        if gone or (pid is not None and pidfd is None and not pid_exists(pid)):
            break
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(PARENT_GONE_GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)


def pin_to_cpu(rank: int) -> None:
    """Bind this process (call before any thread starts) to the ``rank``-th allowed CPU."""
    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})


def start_ranks(
    target: Callable[..., None],
    world_size: int,
    args_of: Callable[[int, Connection], tuple[Any, ...]],
    *,
    name: str,
    duplex: bool,
    start_method: str | None = None,
    pinned: bool = False,
) -> tuple[list[Any], list[Connection]]:
    """Start ``world_size`` children running ``target(*args_of(rank, pipe_end))``.

    Args:
        target: Module-level function the child runs.
        world_size: Number of children.
        args_of: ``(rank, child's pipe end) -> target's arguments``.
        name: Process name prefix (the rank is appended).
        duplex: Whether the pipes carry messages both ways.
        start_method: One of :data:`START_METHODS`; None: the value of
            :data:`START_METHOD_ENV`, else ``spawn`` (see the module docstring).
        pinned: The children pin themselves to CPUs (always spawned).

    Returns:
        The processes and the parent's ends of their pipes, by rank. If a
        start fails, the ranks already started are stopped before re-raising.

    Raises:
        TypeError: ``start_method`` is neither a str nor None.
        ValueError: ``start_method`` (or the environment variable) names no
            start method.
    """
    method = _method(start_method)
    procs: list[Any] = []
    conns: list[Connection] = []
    try:
        for rank in range(world_size):
            parent, child = mp.Pipe(duplex=duplex)
            conns.append(parent)
            p = start_process(target, args_of(rank, child), name=f"{name}{rank}",
                              start_method=method, pinned=pinned)
            child.close()
            procs.append(p)
    except BaseException:
        stop_ranks(procs, conns)
        raise
    return procs, conns


def start_process(target: Callable[..., None], args: tuple[Any, ...], *, name: str,
                  start_method: str | None = None, pinned: bool = False) -> Any:
    """Start one daemon child running ``target(*args)``, the way :func:`start_ranks` does.

    For a harness with its own queues and events: ``multiprocessing`` objects
    of the ``spawn`` context (queues, events, pipes) may be passed in ``args``
    whichever way the child starts.

    Args:
        target: Module-level function the child runs.
        args: Its arguments (picklable).
        name: Process name.
        start_method: As for :func:`start_ranks`.
        pinned: The child pins itself to a CPU (always spawned).

    Returns:
        The started ``multiprocessing`` process.

    Raises:
        TypeError: ``start_method`` is neither a str nor None.
        ValueError: ``start_method`` (or the environment variable) names no
            start method.
    """
    ctx, env = _start_context(target, _method(start_method), pinned)
    if env is None:
        p = ctx.Process(target=target, args=args, name=name, daemon=True)
    else:
        p = ctx.Process(target=_run_forked, args=(_StarterState(env), target, *args),
                        name=name, daemon=True)
    p.start()
    return p


class _ForkServerEnv:
    """What this module knows of the process's fork server."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: The environment it started with (None: not started by this module).
        self.env: dict[str, str] | None = None
        #: Another's server was running before this module's first start.
        self.foreign = False


_FORK_SERVER = _ForkServerEnv()


def _load_time(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that libraries may read when they load."""
    return {k: v for k, v in env.items()
            if k.startswith(LOAD_TIME_PREFIXES) and k not in RUN_TIME_VARIABLES}


def fork_server_pid() -> int | None:
    """The pid of this process's ``multiprocessing`` fork server; None while none
    was started (only multiprocessing's private state tells; a Python without it
    says None). The server lives as long as this process: not a leaked child."""
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    return pid if isinstance(pid, int) else None


def _method(start_method: str | None) -> str:
    """The start method named by the argument, else by the environment, else spawn."""
    if start_method is None:
        method = os.environ.get(START_METHOD_ENV, "spawn")
        if method not in START_METHODS:
            raise ValueError(f"environment variable {START_METHOD_ENV} must be one of "
                             f"{list(START_METHODS)}, got {method!r}")
        return method
    if not isinstance(start_method, str):
        raise TypeError(f"start_method must be a str (one of {list(START_METHODS)}) or None, "
                        f"got {type(start_method).__name__}")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {list(START_METHODS)}, "
                         f"got {start_method!r}")
    return start_method


def _start_context(target: Callable[..., None], method: str,
                   pinned: bool) -> tuple[Any, dict[str, str] | None]:
    """The ``multiprocessing`` context to start a child with, and the environment a
    fork server's child must take on (None: spawned, it inherits it)."""
    if method == "spawn" or pinned or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn"), None
    env = dict(os.environ)
    ctx = mp.get_context("forkserver")
    with _FORK_SERVER.lock:
        if _FORK_SERVER.env is None and not _FORK_SERVER.foreign:
            if fork_server_pid() is not None:  # another's: what it loaded, and how, is unknown
                _FORK_SERVER.foreign = True
            else:
                # Takes effect when the server starts, at the first start below.
                ctx.set_forkserver_preload(["torch", *_preloadable(target)])
                _FORK_SERVER.env = env
        if _FORK_SERVER.foreign or _load_time(env) != _load_time(_FORK_SERVER.env or {}):
            return mp.get_context("spawn"), None
    return ctx, env


#: The packages whose modules never initialise a GPU when imported (the house
#: rule), so the fork server may import them: a server that initialised CUDA
#: would fork children that cannot use it.
_PRELOADABLE = ("shm_broadcast", "device_comms", "coordinator")


def _preloadable(target: Callable[..., None]) -> list[str]:
    """The target's module, where the fork server may import it (else each child does)."""
    module = getattr(target, "__module__", None)
    if isinstance(module, str) and module.split(".", 1)[0] in _PRELOADABLE:
        return [module]
    return []


class _StarterState:
    """The starting process's environment, stdout and stderr, taken on by a fork
    server's child while it unpickles its arguments: before the target's module
    is imported, as a spawned child has them from the start."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from multiprocessing import reduction

        stdio: list[Any] = []
        for fd in (1, 2):  # handed over as descriptors (the server's are its own)
            try:
                os.fstat(fd)
            except OSError:
                stdio.append(None)
            else:
                stdio.append(reduction.DupFd(fd))
        return (_take_starter_state, (self.env, *stdio))


def _take_starter_state(env: dict[str, str], *stdio: Any) -> None:
    os.environ.clear()
    os.environ.update(env)
    for target_fd, dup in zip((1, 2), stdio, strict=True):
        if dup is not None:
            fd = dup.detach()
            if fd != target_fd:  # it may arrive on that number where the server had it closed
                os.dup2(fd, target_fd)
                os.close(fd)


def _run_forked(_state: None, target: Callable[..., None], *args: Any) -> None:
    """A fork server's child (the starter's state already taken on): run ``target``,
    then the exit handlers, which the server's ``os._exit`` skips before Python 3.13.

    What the child holds when it starts (the server's imported torch and
    preloaded modules, about 180,000 objects that live as long as the process,
    and the unpickled target and arguments) is frozen out of the cyclic garbage
    collector first: its full collections then walk only what the rank made
    since. Frozen objects are never collected, so a cycle among them that the
    rank drops stays allocated; the server makes no garbage of its own between
    forks, and the target and arguments live for the whole run anyway."""
    gc.freeze()
    try:
        target(*args)
    finally:
        if sys.version_info < (3, 13):  # in the order of a spawned child's exit
            from multiprocessing import util

            # multiprocessing's finalizers and children first (it runs once)
            util._exit_function()  # type: ignore[attr-defined]  # noqa: SLF001
            atexit._run_exitfuncs()  # noqa: SLF001 - what 3.13's fork server calls


def _signal_all(procs: Sequence[Any], sig: int) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(p.pid, sig)


def stop_ranks(procs: Sequence[Any], conns: Sequence[Connection] = (),
               term_grace: float = 2.0, wait_first: float = 0.0) -> None:
    """Stop and reap every process; close pipes; unlink segments orphaned by a dead rank.

    Args:
        procs: The processes (``multiprocessing.Process``).
        conns: Pipe ends to close afterwards.
        term_grace: Seconds between SIGTERM and SIGKILL.
        wait_first: Seconds to let them exit by themselves (after a stop
            command) before any signal.
    """
    from shm_broadcast.lifecycle.segment import list_segments, remove_segment

    pids = {p.pid for p in procs if p.pid is not None}
    deadline = time.monotonic() + wait_first
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    _signal_all([p for p in procs if p.is_alive()], signal.SIGTERM)
    deadline = time.monotonic() + term_grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    _signal_all([p for p in procs if p.is_alive()], signal.SIGKILL)
    for p in procs:
        p.join(10.0)
        with contextlib.suppress(ValueError):  # still running after SIGKILL + 10 s: init's
            p.close()
    for seg in list_segments():
        if seg.pid in pids and not seg.owner_alive:
            remove_segment(seg.name)
    for c in conns:
        c.close()


# ---------------------------------------------------------------- spawn_group
@dataclass
class RankOutcome:
    """What one rank of :func:`spawn_group` did.

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
    env: EnvArg = None,
    timeout: float = 300.0,
    pin_cpus: bool = False,
    start_method: str | None = None,
) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes.

    Each child initialises ``torch.distributed`` (gloo, world group) first. The
    rendezvous store lives in the parent, so ranks keep working when any of
    them dies. Every child is reaped before this returns.

    Args:
        fn: Module-level function; its result must be picklable.
        world_size: Number of ranks (>= 1).
        args: Extra arguments for ``fn``.
        env: Extra environment variables, one mapping or one per rank.
        timeout: Seconds before ranks still running are killed (> 0).
        pin_cpus: Bind rank ``r`` (all its threads) to the ``r``-th allowed CPU
            (round robin), as MPI launchers do by default for benchmarks.
        start_method: How the ranks start (see :func:`start_ranks`).

    Returns:
        One :class:`RankOutcome` per rank, by rank.

    Raises:
        TypeError: ``timeout`` is not a number of seconds, or ``pin_cpus``
            not a bool (before any rank starts).
        ValueError: ``timeout`` is not finite and > 0, or ``world_size`` < 1.
    """
    world_size = check_int(world_size, "world_size", minimum=1)
    # Checked before any rank starts: the store and each rank's wait use them.
    if timeout is None:
        raise TypeError("timeout must be a number of seconds > 0 (ranks still running then "
                        "are killed), got None")
    timeout = check_timeout(timeout, "timeout", positive=True)  # type: ignore[assignment]
    pin_cpus = check_bool(pin_cpus, "pin_cpus")
    envs = per_rank_env(env, world_size)
    me = os.getpid()
    # The rendezvous store serves the ranks until they have all ended.
    store = master_store("127.0.0.1", 0, world_size + 1, datetime.timedelta(seconds=timeout))
    port = store.port
    try:
        procs, conns = start_ranks(
            _spawn_child, world_size,
            lambda r, child: (fn, r, world_size, port, tuple(args), envs[r], child, me,
                              timeout, pin_cpus),
            name="gc-rank", duplex=False, start_method=start_method, pinned=pin_cpus)
        try:
            return _collect_outcomes(procs, conns, timeout)
        finally:
            stop_ranks(procs, conns, term_grace=0.0)
    finally:
        # The ranks have ended: stop serving now (a store has no close(); its
        # server stops with the last reference), also when a traceback keeps
        # this frame alive.
        del store


def _collect_outcomes(procs: list[Any], conns: list[Connection],
                      timeout: float) -> list[RankOutcome]:
    """Each rank's message (or its silence at the deadline), then the exit code of each
    rank that reported, after a grace of up to 10 s."""
    out = [RankOutcome(r) for r in range(len(procs))]
    deadline = time.monotonic() + timeout
    live = {c: r for r, c in enumerate(conns)}
    while live and time.monotonic() < deadline:
        for c in wait(list(live), timeout=min(1.0, max(0.0, deadline - time.monotonic()))):
            if not isinstance(c, Connection):  # wait() returns what it was given
                continue
            r = live.pop(c)
            try:
                kind, payload = c.recv()
            except (EOFError, OSError):
                continue  # exited without a message
            if kind == "ok":
                out[r].ok, out[r].result = True, payload
            else:
                out[r].error = payload
    # Ranks that reported (or closed their pipe) get a grace to exit; ranks still
    # silent at the deadline are past the timeout and are killed by the caller.
    grace = time.monotonic() + 10.0
    for r, p in enumerate(procs):
        if conns[r] not in live:
            p.join(max(0.0, grace - time.monotonic()))
        out[r].exitcode = p.exitcode
    return out


def _spawn_child(fn: Callable[..., Any], rank: int, world_size: int, port: int,
                 args: tuple[Any, ...], env: dict[str, str], conn: Connection,
                 parent_pid: int, timeout: float, pin_cpus: bool) -> None:
    if pin_cpus:
        pin_to_cpu(rank)  # before any thread starts
    die_with_parent(parent_pid)
    os.environ.update(env)
    import torch.distributed as dist

    try:
        store = client_store("127.0.0.1", port, world_size + 1,
                             datetime.timedelta(seconds=timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        msg: tuple[str, Any] = ("ok", fn(rank, world_size, *args))
    except BaseException as e:  # report, do not hang the parent
        msg = ("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with contextlib.suppress(OSError):  # the parent is gone
        conn.send(msg)
    conn.close()
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # a dead peer can make teardown fail; we are exiting anyway
        pass

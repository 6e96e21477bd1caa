"""A rank process of the plugin's pool: start, run tests until told to stop, reset between.

Start: the environment and working directory the pytest process had when the
session began (not whatever fixtures and earlier tests made of them by the time
the pool starts), plus that of its
:class:`~coordinator.pytest_plugin.marker.Layout`
(simulated host's node id, ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``), torch's thread
count, the world group (gloo, and our communicators), then the model-parallel
groups when the layout has them. Answers ``("ready",)``.

Each test: import its module if it is new to the rank (its top-level code then
holds for every later test, as in pytest), run it
(:func:`coordinator.pytest_plugin.rank_call.run_call`), then put
back what a test may change in the process
(:class:`~coordinator.pytest_plugin.process_state.ProcessState`: environment,
working directory, torch's settings, random states, ...); model-parallel groups
a layout-less test created are destroyed (as
:class:`coordinator.testing.DistributedPool` does). A rank whose world group, or
whose layout's groups, are no longer the ones it started with reports itself not
reusable, and the parent starts a fresh pool for the next test.

Each rank leads a process group of its own, which the processes a test starts
join: when the parent stops the ranks it kills these groups too, so a child a
test left running (or one that outlived a rank that died) is not left behind; a
child that starts a session of its own (``start_new_session=True``) escapes
this. Being outside the terminal's foreground group, ranks do not get the
terminal's Ctrl-C: the parent, interrupted, kills them.

On ``SIGUSR2`` (from the parent, when the rank is stopped or timed out) the rank
writes every thread's Python stack to its dump file (:mod:`faulthandler`, which
works while the main thread waits inside a C call).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
from multiprocessing.connection import Connection
from typing import IO, Any

from coordinator.pytest_plugin.marker import Layout
from coordinator.pytest_plugin.process_state import ProcessState
from coordinator.pytest_plugin.protocol import (
    FAILED,
    PASSED,
    SKIPPED,
    XFAILED,
    RankResult,
    TestCall,
)
from shm_broadcast.ranks.launcher import die_with_parent

__all__ = ["STACK_SIGNAL", "output_path", "rank_main"]

#: The signal that makes a rank write its Python stacks to its dump file.
STACK_SIGNAL = signal.SIGUSR2

_dump_file: IO[str] | None = None  # open for the process's life: faulthandler writes to it


def rank_main(rank: int, layout: Layout, port: int, conn: Connection, parent_pid: int,
              dump_path: str, base: tuple[dict[str, str], str] | None = None) -> None:
    """The rank process: start, then serve tests until ``("stop",)`` or EOF.

    ``base``: the environment and working directory the rank starts from (the
    pytest process's when the session began), whatever the pytest process's are
    when the pool starts; None: as inherited.
    """
    global _dump_file
    os.setpgid(0, 0)  # a group of its own: the parent ends what the rank leaves running
    die_with_parent(parent_pid)
    _dump_file = open(dump_path, "w")  # noqa: SIM115  # kept open until the process exits
    _listen_for_stacks()
    if base is not None:
        os.environ.clear()
        os.environ.update(base[0])
        with contextlib.suppress(OSError):
            os.chdir(base[1])
    try:
        state = _RankState(rank, layout, port)
    except BaseException as e:
        from coordinator.pytest_plugin.rank_call import format_failure, safe_str

        conn.send(RankResult(rank, FAILED, summary=f"{type(e).__name__}: {safe_str(e)}",
                             traceback=format_failure(e, "native"), reusable=False))
        return
    conn.send(("ready",))
    try:
        _serve(conn, state, output_path(dump_path))
    finally:
        state.close()
        conn.close()


def _listen_for_stacks(again: bool = False) -> None:
    """Install the handler that writes the stacks on :data:`STACK_SIGNAL`; ``again``:
    once more, after a test set a handler of its own on the signal (putting the
    process back then leaves it at ``SIG_DFL``, and faulthandler's ``register``
    alone keeps a registration it believes current). The signal is held
    meanwhile, so one the parent sends then reaches the new handler."""
    if _dump_file is None:
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {STACK_SIGNAL})
    try:
        if again:
            faulthandler.unregister(STACK_SIGNAL)
        faulthandler.register(STACK_SIGNAL, file=_dump_file, all_threads=True, chain=False)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {STACK_SIGNAL})


def output_path(dump_path: str) -> str:
    """The file a rank's test output goes to, beside its stack dump file."""
    return dump_path + ".out"


def _serve(conn: Connection, state: _RankState, output: str) -> None:
    from coordinator.pytest_plugin.rank_call import import_test_module, run_call, safe_str

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        call: TestCall = msg[1]
        # The module's top-level code runs once, before the state every test of the
        # rank starts from is saved: it holds for each of them, as in pytest.
        import_test_module(call)
        saved = ProcessState.save()
        result = run_call(call, state.rank, state.layout.world_size, state.local_rank, output)
        stack_signal_set = signal.getsignal(STACK_SIGNAL) is not saved.handlers.get(STACK_SIGNAL)
        # After a failure peers may wait in a collective (and the reset's own
        # collectives with them): the parent replaces the whole pool instead.
        result.reusable = result.status in (PASSED, SKIPPED, XFAILED)
        try:
            saved.restore()
            if stack_signal_set:
                _listen_for_stacks(again=True)
            if result.reusable:
                result.reusable = state.reset()
        except BaseException as e:  # the next test needs a fresh rank
            result.reusable = False
            result.output += (f"\n[groupcoord pytest plugin] reset after the test failed: "
                              f"{type(e).__name__}: {safe_str(e)}")
        conn.send(result)


class _RankState:
    """This rank's place in the layout, and the groups it started with."""

    def __init__(self, rank: int, layout: Layout, port: int) -> None:
        self.rank, self.layout = rank, layout
        self.local_rank = layout.local_rank(rank)
        os.environ.update(layout.rank_env(rank))
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(self.local_rank),
                           "WORLD_SIZE": str(layout.world_size),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        import torch

        from coordinator import parallel_state as ps

        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // layout.world_size))
        self.world = ps.init_distributed_environment(
            world_size=layout.world_size, rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=self.local_rank)
        self.groups: tuple[Any, ...] = ()
        if layout.model_parallel:
            tp, pp, dp = layout.model_parallel_sizes()
            ps.initialize_model_parallel(tp, pp, dp)
            self.groups = self._model_groups()

    @staticmethod
    def _model_groups() -> tuple[Any, ...]:
        from coordinator import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return ()
        return (ps.get_tp_group(), ps.get_pp_group(), ps.get_dp_group())

    def reset(self) -> bool:
        """Put the groups back as the layout has them; False when only a fresh rank can."""
        from coordinator import parallel_state as ps

        if ps.get_world_group() is not self.world:
            return False
        if not self.layout.model_parallel:
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
            return True
        now = self._model_groups()
        return len(now) == len(self.groups) and all(
            a is b for a, b in zip(now, self.groups, strict=True))

    def close(self) -> None:
        from coordinator import parallel_state as ps

        try:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()
        except BaseException:  # exiting anyway; the parent reaps what is left
            pass

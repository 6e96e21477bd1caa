"""A rank stopped or killed inside a group's set-up exchange: its peers raise our errors.

After the argument agreement, set-up goes on with object exchanges over the
CPU group (node membership, queue handles, the shared-memory workspace). The
victim rank replaces one set-up function of its own process with one that
stops (SIGSTOP) or kills (SIGKILL) the process on entry, so the fault lands
exactly there; the other ranks run the library unchanged and must raise
``CommTimeout`` (stopped) or ``PeerDiedError`` (killed) naming the victim,
within the timeout plus a margin, instead of gloo's bare ``RuntimeError``.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import signal
import time
from typing import Any

import pytest

from coordinator.testing import free_port
from shm_broadcast.ranks.launcher import start_process
from tests.start_together import release_and_collect

TIMEOUT = 2.0


def _rank(rank: int, ws: int, port: int, victim: int, fault: str, call: str, point: str,
          out: Any, go: Any) -> None:
    """One rank (a fork of the fork server, torch already imported): say it is
    ready, wait for the other, set up, and report what the faulted call raised."""
    from coordinator import parallel_state as ps

    out.put(("ready", rank))
    go.wait(60)  # both start the 2 s init together
    ps.init_distributed_environment(ws, rank, f"tcp://127.0.0.1:{port}", rank, timeout=TIMEOUT)
    if call != "initialize_model_parallel":
        ps.initialize_model_parallel(ws)
    if rank == victim:
        mod, fn = point.split(":")
        m = importlib.import_module(mod)
        orig = getattr(m, fn)

        def trap(*a: Any, **k: Any) -> Any:
            os.kill(os.getpid(), signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
            return orig(*a, **k)

        setattr(m, fn, trap)
    ps.get_world_group().barrier()
    t0 = time.monotonic()
    try:
        if call == "create_mq_broadcaster":
            ps.get_tp_group().create_mq_broadcaster()
        elif call == "create_single_reader_mq_broadcasters":
            ps.get_tp_group().create_single_reader_mq_broadcasters(0, blocking=True)
        else:
            ps.initialize_model_parallel(ws)
        o: dict[str, Any] = {"cls": None}
    except Exception as e:
        o = {"cls": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__],
             "msg": str(e), "peers": [int(p) for p in (getattr(e, "peers", None) or [])]}
    o["t"] = time.monotonic() - t0
    out.put(("done", rank, o))
    out.close()
    out.join_thread()  # (sent before the exit)
    os._exit(0)  # skip a teardown that would wait for the stopped or killed peer


CASES = [
    pytest.param("create_mq_broadcaster", "shm_broadcast.queue.process_group:in_the_same_node_as",
                 "stop", 0, id="mq-stop"),
    pytest.param("initialize_model_parallel", "device_comms.cpu.communicator:open_workspace",
                 "kill", 1, id="initmp-workspace-kill"),
    pytest.param("create_mq_broadcaster", "shm_broadcast.queue.process_group:in_the_same_node_as",
                 "kill", 0, id="mq-kill", marks=pytest.mark.slow),
    pytest.param("create_single_reader_mq_broadcasters",
                 "shm_broadcast.ranks.topology:in_the_same_node_as", "stop", 1, id="srmq-stop",
                 marks=pytest.mark.slow),
    pytest.param("initialize_model_parallel", "device_comms.cpu.communicator:open_workspace",
                 "stop", 1, id="initmp-workspace-stop", marks=pytest.mark.slow),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("call,point,fault,victim", CASES)
def test_peers_of_a_rank_lost_in_set_up_raise_our_error_naming_it(
        call: str, point: str, fault: str, victim: int) -> None:
    ws, port = 2, free_port()
    ctx = mp.get_context("spawn")
    msgs, go = ctx.Queue(), ctx.Event()
    procs = [start_process(_rank, (r, ws, port, victim, fault, call, point, msgs, go),
                           name=f"gc-setup-{r}") for r in range(ws)]
    survivors = [r for r in range(ws) if r != victim]
    try:  # the 2 s init must not time out: every rank has imported before it starts
        out: dict[int, dict[str, Any]] = release_and_collect(msgs, go, ws, survivors)
    finally:
        for p in procs:
            p.kill()  # SIGKILL ends a stopped process too
            p.join(10)
        msgs.close()
        msgs.join_thread()
    want = "CommTimeout" if fault == "stop" else "PeerDiedError"
    for r, o in out.items():
        assert o["cls"] == want and "GroupCoordError" in o["mro"], (r, o)
        assert o["peers"] == [victim], (r, o)
        assert o["t"] < TIMEOUT + 3.0, (r, o)

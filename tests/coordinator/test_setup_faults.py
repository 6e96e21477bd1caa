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

import json
import subprocess
import sys

import pytest

from coordinator.testing import free_port
from tests.child_env import child_env
from tests.start_together import READY, start_together

TIMEOUT = 2.0

RANK = f"TIMEOUT = {TIMEOUT!r}\n" + """
import importlib, json, os, signal, sys, time
rank, ws, port, victim, fault, call, point = (int(sys.argv[1]), int(sys.argv[2]),
    int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6], sys.argv[7])
from coordinator import parallel_state as ps
""" + READY + """
ps.init_distributed_environment(ws, rank, f"tcp://127.0.0.1:{port}", rank, timeout=TIMEOUT)
if call != "initialize_model_parallel":
    ps.initialize_model_parallel(ws)
if rank == victim:
    mod, fn = point.split(":")
    m = importlib.import_module(mod)
    orig = getattr(m, fn)
    def trap(*a, **k):
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
    out = {"cls": None}
except Exception as e:
    out = {"cls": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__],
           "msg": str(e), "peers": [int(p) for p in (getattr(e, "peers", None) or [])]}
out["t"] = time.monotonic() - t0
print(json.dumps(out), flush=True)
os._exit(0)
"""

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
    env = child_env(OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(ws), str(port), str(victim),
                               fault, call, point], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env)
             for r in range(ws)]
    try:
        start_together(dict(enumerate(procs)), within=60)  # the 2 s init must not time out
        survivors = [r for r in range(ws) if r != victim]
        out = {r: json.loads(procs[r].communicate(timeout=90)[0].strip().splitlines()[-1])
               for r in survivors}
    finally:
        for p in procs:
            p.kill()  # SIGKILL ends a stopped process too
            p.wait(10)
    want = "CommTimeout" if fault == "stop" else "PeerDiedError"
    for r, o in out.items():
        assert o["cls"] == want and "GroupCoordError" in o["mro"], (r, o)
        assert o["peers"] == [victim], (r, o)
        assert o["t"] < TIMEOUT + 3.0, (r, o)

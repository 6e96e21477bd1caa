"""init_distributed_environment when a rank never arrives: our errors, naming it, in time.

The missing rank is simply not started (as if it was killed or stopped before
the call). torch's rendezvous raises its own store errors naming a key; the
survivors must raise ``CommTimeout`` (or ``PeerDiedError`` when rank 0's store
went away) naming the ranks they waited for, within the timeout plus a grace.
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
import json, sys, time
from coordinator import parallel_state as ps
rank, ws, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
""" + READY + """
t0 = time.monotonic()
try:
    ps.init_distributed_environment(ws, rank, f"tcp://127.0.0.1:{port}", rank, timeout=TIMEOUT)
    out = {"cls": None}
except Exception as e:
    out = {"cls": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__],
           "msg": str(e), "peers": list(getattr(e, "peers", None) or [])}
out["t"] = time.monotonic() - t0
print(json.dumps(out), flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,missing", [
    # ranks that do come must reach rank 0's store within its 2 s connect timeout: they
    # import first and start the call together; the four-rank case stays slow-marked
    pytest.param(2, (1,), marks=pytest.mark.slow), (3, (2,)),
    pytest.param(4, (1, 3), marks=pytest.mark.slow),
    pytest.param(2, (0,), marks=pytest.mark.slow), (3, (0,))], ids=str)
def test_ranks_that_never_arrive_are_named(world_size: int, missing: tuple[int, ...]) -> None:
    port = free_port()
    env = child_env()
    ranks = [r for r in range(world_size) if r not in missing]
    procs = {r: subprocess.Popen([sys.executable, "-c", RANK, str(r), str(world_size), str(port)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 env=env) for r in ranks}
    try:
        start_together(procs, within=60)
        out = {r: json.loads(p.communicate(timeout=90)[0].strip().splitlines()[-1])
               for r, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
            p.wait(10)
    for r, o in out.items():
        assert "GroupCoordError" in o.get("mro", []), (r, o)
        assert o["t"] < TIMEOUT + 2.0 + 2.0, (r, o)  # + client_store's grace + a loaded machine
        if 0 in missing:  # nobody serves the store: the others name rank 0
            assert o["cls"] == "CommTimeout" and o["peers"] == [0], (r, o)
        elif r == 0:  # the store's host sees whose keys never came
            assert o["cls"] == "CommTimeout" and o["peers"] == list(missing), (r, o)
        else:  # the others lose rank 0's store when rank 0 gives up, or time out too
            assert o["cls"] in ("CommTimeout", "PeerDiedError") and o["peers"], (r, o)
        assert "init_distributed_environment" in o["msg"], (r, o)

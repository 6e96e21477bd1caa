"""init_distributed_environment when a rank never arrives: our errors, naming it, in time.

The missing rank is simply not started (as if it was killed or stopped before
the call). torch's rendezvous raises its own store errors naming a key; the
survivors must raise ``CommTimeout`` (or ``PeerDiedError`` when rank 0's store
went away) naming the ranks they waited for, within the timeout plus a grace.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest

from coordinator.testing import free_port
from shm_broadcast.ranks.launcher import start_process
from tests.start_together import release_and_collect

TIMEOUT = 2.0


def _rank(rank: int, ws: int, port: int, out: Any, go: Any) -> None:
    """One rank that comes: say it is ready, wait for the others, then init the world.

    The ranks are forks of the test process's fork server (torch and the library
    already imported, as a ``python -c`` rank first had to), and start the call
    together: the ranks that do come must reach rank 0's store within its 2 s
    connect timeout."""
    from coordinator import parallel_state as ps

    out.put(("ready", rank))
    go.wait(60)
    t0 = time.monotonic()
    try:
        ps.init_distributed_environment(ws, rank, f"tcp://127.0.0.1:{port}", rank,
                                        timeout=TIMEOUT)
        o: dict[str, Any] = {"cls": None}
    except Exception as e:
        o = {"cls": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__],
             "msg": str(e), "peers": list(getattr(e, "peers", None) or [])}
    o["t"] = time.monotonic() - t0
    out.put(("done", rank, o))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,missing", [
    # ranks that do come must reach rank 0's store within its 2 s connect timeout: they
    # start the call together; the four-rank case stays slow-marked
    pytest.param(2, (1,), marks=pytest.mark.slow), (3, (2,)),
    pytest.param(4, (1, 3), marks=pytest.mark.slow),
    pytest.param(2, (0,), marks=pytest.mark.slow), (3, (0,))], ids=str)
def test_ranks_that_never_arrive_are_named(world_size: int, missing: tuple[int, ...]) -> None:
    port = free_port()
    ctx = mp.get_context("spawn")
    out, go = ctx.Queue(), ctx.Event()
    ranks = [r for r in range(world_size) if r not in missing]
    procs = {r: start_process(_rank, (r, world_size, port, out, go), name=f"gc-init-{r}")
             for r in ranks}
    try:
        got = release_and_collect(out, go, len(ranks), ranks)
    finally:
        for p in procs.values():
            p.join(10)
            if p.is_alive():
                p.kill()
            p.join(10)
        out.close()
        out.join_thread()
    for r, o in got.items():
        assert "GroupCoordError" in o.get("mro", []), (r, o)
        assert o["t"] < TIMEOUT + 2.0 + 2.0, (r, o)  # + client_store's grace + a loaded machine
        if 0 in missing:  # nobody serves the store: the others name rank 0
            assert o["cls"] == "CommTimeout" and o["peers"] == [0], (r, o)
        elif r == 0:  # the store's host sees whose keys never came
            assert o["cls"] == "CommTimeout" and o["peers"] == list(missing), (r, o)
        else:  # the others lose rank 0's store when rank 0 gives up, or time out too
            assert o["cls"] in ("CommTimeout", "PeerDiedError") and o["peers"], (r, o)
        assert "init_distributed_environment" in o["msg"], (r, o)

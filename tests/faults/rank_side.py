"""What a rank does in one fault case (runs in the rig's worker processes).

A case: join a fresh world (the rig's store, the case's transport), build the
TP group over the whole world with the case's timeout, warm every path up,
then make the *step*: the op under test, then the follow-up all-reduce
(:data:`~tests.faults.ops.FOLLOW_UP`). The culprit injects its fault instead
of the op:

* ``kill``: it reports the fault time and SIGKILLs itself;
* ``stop``: it reports the fault time and SIGSTOPs itself (the rig kills it
  once the others are done);
* ``raise``: an exception is raised in its code in place of the call and
  propagates out of the process, which exits as any Python program with an
  uncaught exception does (exit status 1, ``atexit`` handlers run);
* ``exit-late`` (a test of its own, not in the matrix): it tears its groups
  down (its connections close), lingers :data:`LINGER_S` and exits, as an
  application that cleans up on an error before it exits;
* ``skip``: it goes straight to the follow-up call;
* ``other-op`` / ``dtype`` / ``shape``: it makes another op, or the op with
  another dtype or shape, then (if that returned) the follow-up.

Each rank reports, for each call it made, the result's correctness or the
error it raised (class, text, ``peers``, and the time on the machine-wide
monotonic clock), then waits for the rig: ``recover`` runs one more step of
good calls (a broadcast through the TP broadcaster and an all-reduce) to show
the group still works and returns right answers, ``teardown`` destroys the
groups and reports the rank idle for the next case.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

from tests.faults.contract import DESTRUCTIVE
from tests.faults.ops import FOLLOW_UP, OPS, Op, other_op, same_result

__all__ = ["InjectedFault", "run_case", "teardown"]


_JOIN_S = 60.0
#: How long an ``exit-late`` culprit lives on after closing its connections.
LINGER_S = 0.5


class InjectedFault(RuntimeError):
    """The exception the ``raise`` fault throws in the culprit's code."""


def _set_transport(transport: str, rank: int, world_size: int) -> None:
    os.environ["GROUPCOORD_CPU_SHM"] = "0" if transport == "gloo" else "1"
    for var in ("GROUPCOORD_NODE_ID", "GROUPCOORD_HOST_IP"):
        os.environ.pop(var, None)
    if transport == "hier":  # ranks [0, n/2) on one simulated host, the rest on another
        os.environ["GROUPCOORD_NODE_ID"] = f"host{rank * 2 // world_size}"
        os.environ["GROUPCOORD_HOST_IP"] = "127.0.0.1"


def _join(spec: dict[str, Any], rank: int, world_size: int, port: int) -> Any:
    """The world (store in the rig) and the TP group over it, timeout ``spec['timeout']``."""
    import torch.distributed as dist

    from coordinator import parallel_state as ps

    _set_transport(spec["transport"], rank, world_size)
    timeout = float(spec["timeout"])
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    # Joining is not under test: the default group (which no op uses) gets a long
    # timeout, so a rank that starts late on a loaded machine still joins. Every
    # group of the case gets the case's timeout from init_distributed_environment.
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=_JOIN_S))
    ps.init_distributed_environment(world_size, rank, "env://", rank, timeout=timeout)
    ps.initialize_model_parallel(world_size)
    return ps.get_tp_group()


def _warm_up(g: Any, rank: int, world_size: int) -> None:
    """Every path the step uses, once (queue, collectives, objects, p2p), then a barrier."""
    for op in (OPS["broadcast_tensor_dict-mq"], OPS["all_reduce"], OPS["broadcast_object-cpu"],
               OPS["send_recv"], FOLLOW_UP):
        if not same_result(op.call(g, rank, world_size, None), op.expect(rank, world_size)):
            raise AssertionError(f"warm-up {op.name} gave a wrong result on rank {rank}")
    g.barrier()


def _outcome(g: Any, op: Op, rank: int, world_size: int, bad: str | None,
             want: Any) -> dict[str, Any]:
    """Make one call; what it returned (checked against ``want``) or raised."""
    try:
        got = op.call(g, rank, world_size, bad)
    except Exception as e:
        t = time.monotonic()
        return {"call": op.name, "ok": False, "t": t, "error": type(e).__name__,
                "classes": [c.__name__ for c in type(e).__mro__],
                "text": str(e), "peers": [p for p in getattr(e, "peers", ())],
                "err_op": getattr(e, "op", None), "seq": getattr(e, "call", None)}
    return {"call": op.name, "ok": True, "t": time.monotonic(),
            "right": bool(want is _ANY or same_result(got, want))}


_ANY = object()


def _fault(conn: Connection, fault: str) -> None:
    """The destructive faults: report the time, then die / stop / raise."""
    conn.send(("fault", time.monotonic()))
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)  # the rig kills it; SIGCONT is never sent
    elif fault == "exit-late":
        import gc

        teardown()
        gc.collect()  # the groups' gloo connections close with their last reference
        time.sleep(LINGER_S)
        os._exit(1)
    raise InjectedFault(f"injected fault: rank {os.environ.get('RANK', '?')} raised "
                        f"instead of calling")


def run_case(conn: Connection, spec: dict[str, Any], rank: int, world_size: int,
             port: int) -> None:
    """One case on this rank; reports ``("done", record)`` (a culprit of ``kill``,
    ``stop`` or ``raise`` reports ``("fault", t)`` and never finishes)."""
    os.environ["RANK"] = str(rank)
    g = _join(spec, rank, world_size, port)
    _warm_up(g, rank, world_size)
    rec: dict[str, Any] = {"rank": rank, "mode": g.comm.mode,
                           "queue": "writer" if rank == 0 else g.mq_broadcaster.transport,
                           "calls": []}
    op, fault, culprit = OPS[spec["op"]], spec["fault"], spec["culprit"]
    me_bad = rank == culprit
    step: list[tuple[Op, str | None]] = [(op, None), (FOLLOW_UP, None)]
    if me_bad and fault in DESTRUCTIVE:
        _fault(conn, fault)
    elif me_bad and fault == "skip":
        step = [(FOLLOW_UP, None)]
    elif me_bad and fault == "other-op":
        step = [(other_op(op), None), (FOLLOW_UP, None)]
    elif me_bad:
        step = [(op, fault), (FOLLOW_UP, None)]
    if me_bad:
        conn.send(("fault", time.monotonic()))
    for call, bad in step:
        want = _ANY if bad is not None or call.name.endswith("(other op)") else call.expect(
            rank, world_size)
        out = _outcome(g, call, rank, world_size, bad, want)
        rec["calls"].append(out)
        if not out["ok"]:
            break
    conn.send(("done", rec))


def recover(rank: int, world_size: int) -> dict[str, Any]:
    """A step of good calls after the fault: each must return the right answer."""
    from coordinator import parallel_state as ps

    g = ps.get_tp_group()
    out = []
    for op in (OPS["broadcast_tensor_dict-mq"], OPS["all_reduce"], OPS["broadcast_object-mq"]):
        out.append(_outcome(g, op, rank, world_size, None, op.expect(rank, world_size)))
        if not out[-1]["ok"]:
            break
    return {"rank": rank, "calls": out}


def teardown() -> None:
    """Destroy every group this case made (the rank stays for the next case)."""
    from coordinator import parallel_state as ps

    ps.destroy_distributed_environment()

"""Rank code of the two-host tests, started by ``torchrun`` on each simulated host.

``python -m tests.multihost.ranks --case CASE --out DIR [--timeout S] ...``

Nothing here says which host a rank is on: torchrun sets ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``, and the
library must find out the rest (no ``GROUPCOORD_NODE_ID``, no
``GROUPCOORD_HOST_IP``). Each rank writes ``DIR/<case>-rank<r>.json`` (on its
own host's ``/tmp``); the driver (:mod:`tests.multihost.scenarios`) reads both
hosts' files and judges. Ranks compute references locally, so a result file
holds facts and booleans, not tensors.

Cases (world of 4: ranks 0, 1 on the first host, 2, 3 on the second):

* ``tp``: one TP group over both hosts: node detection, the TP queue (local
  reader over shared memory, remote readers over CURVE TCP), broadcast of
  tensor dicts, hierarchical all-reduce, all-gather, reduce-scatter, objects,
  single-reader result queues back to rank 0 across the hosts;
* ``pp``: TP=2 inside each host (shared memory), PP=2 across them: tensor
  dicts hop between the hosts in both directions, plain ``send``/``recv``;
* ``fault``: an engine-like loop (``--workload tp`` or ``pp``) until a fault
  lands right before op ``--at-op`` of step ``--at-step`` (``--fault kill``:
  rank ``--victim`` SIGKILLs itself; ``--fault link``: it holds back while
  the driver takes the link down). Each surviving rank records what it
  raised, when, and in which op; then leaves the groups and exits with
  status 3.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from coordinator import parallel_state as ps
from device_comms import ReduceOp

#: Exit status of a rank that raised as the fault case expects.
FAULT_EXIT = 3


# ---------------------------------------------------------------- helpers
def _input(rank: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-50, 50, shape, generator=g, dtype=dtype)


def _metadata(step: int) -> dict[str, Any]:
    return {
        "step": step,
        "req_ids": [f"r{step}-{i}" for i in range(step % 5 + 1)],
        "positions": torch.arange(step, step + 7, dtype=torch.int64),
        "block_table": torch.arange(12, dtype=torch.int32).view(3, 4) + step,
        "temperature": torch.full((3,), 0.5 + step, dtype=torch.bfloat16),
    }


def _same_dict(got: dict[str, Any], sent: dict[str, Any]) -> bool:
    if got.keys() != sent.keys():
        return False
    for k, v in sent.items():
        if isinstance(v, torch.Tensor):
            if not (torch.equal(got[k], v) and got[k].dtype == v.dtype):
                return False
        elif got[k] != v:
            return False
    return True


def _write(out: Path, name: str, data: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{name}.tmp"
    tmp.write_text(json.dumps(data, default=str))
    os.replace(tmp, out / name)


def _identity() -> dict[str, Any]:
    return {"rank": int(os.environ["RANK"]), "local_rank": int(os.environ["LOCAL_RANK"]),
            "hostname": socket.gethostname(), "pid": os.getpid(),
            "node_id_env": os.environ.get("GROUPCOORD_NODE_ID"),
            "host_ip_env": os.environ.get("GROUPCOORD_HOST_IP")}


# ---------------------------------------------------------------- case: tp
def case_tp(args: argparse.Namespace) -> dict[str, Any]:
    """One TP group spanning both hosts."""
    from shm_broadcast.ranks.host_address import host_ip
    from shm_broadcast.ranks.topology import node_assignment

    ps.initialize_model_parallel(tensor_model_parallel_size=4)
    tp = ps.get_tp_group()
    rank, n = tp.rank_in_group, tp.world_size
    mq = tp.mq_broadcaster
    out: dict[str, Any] = {
        "same_node": ps.in_the_same_node_as(tp, source_rank=0),
        "nodes": node_assignment(tp.cpu_group),
        "host_ip": host_ip(),
        "comm_mode": getattr(tp.device_communicator, "mode", None),
        "mq_transport": mq.transport if mq is not None else None,
    }
    if rank == 0:
        h = mq.export_handle()
        out.update(remote_pub=h.remote_pub, remote_ctl=h.remote_ctl,
                   curve_server_key=h.curve_server_key is not None,
                   handle_client_secret=h.curve_client_secret is not None)
    ok = True
    for step in range(12):
        sent = _metadata(step)
        ok &= _same_dict(tp.broadcast_tensor_dict(sent if rank == 0 else None), sent)
    out["tensor_dict_ok"] = bool(ok)

    xs = [_input(r, (5, 33), torch.float32, 1) for r in range(n)]
    red = tp.all_reduce(xs[rank])
    out["all_reduce_float_err"] = float((red - torch.stack(xs).sum(0)).abs().max())
    out["all_reduce_float_bits"] = int(red.view(torch.int32).to(torch.int64).sum())
    ints = [_input(r, (1000,), torch.int64, 2) for r in range(n)]
    out["all_reduce_int_ok"] = torch.equal(tp.all_reduce(ints[rank]), torch.stack(ints).sum(0))
    out["all_reduce_max_ok"] = torch.equal(tp.all_reduce(ints[rank], ReduceOp.MAX),
                                           torch.stack(ints).amax(0))
    big = [_input(r, (3 << 18,), torch.int32, 6) for r in range(n)]  # 3 MiB: in pieces
    out["all_reduce_big_ok"] = torch.equal(tp.all_reduce(big[rank]), torch.stack(big).sum(0))
    out["all_gather_ok"] = torch.equal(tp.all_gather(xs[rank], dim=0), torch.cat(xs, 0))
    rs_in = [_input(r, (n * 3, 8), torch.int32, 3) for r in range(n)]
    out["reduce_scatter_ok"] = torch.equal(tp.reduce_scatter(rs_in[rank], dim=0),
                                           torch.stack(rs_in).sum(0)[rank * 3: rank * 3 + 3])
    obj = {"from": "last", "ids": [1, 2], "host": socket.gethostname()}
    got = tp.broadcast_object(obj if rank == n - 1 else None, src=n - 1)
    out["object_ok"] = got["ids"] == [1, 2] and got["from"] == "last"
    out["object_host"] = got["host"]
    out.update(_results_to_rank0(tp, args.timeout))
    if rank == 0:
        out["security_stats"] = mq.security_stats()
    tp.barrier()
    return out


def _results_to_rank0(tp: Any, timeout: float) -> dict[str, Any]:
    """Every rank writes its result to rank 0 over a single-reader queue (TCP across hosts)."""
    rank, n = tp.rank_in_group, tp.world_size
    writer, readers = tp.create_single_reader_mq_broadcasters(reader_rank_in_group=0,
                                                              blocking=True)
    out: dict[str, Any] = {}
    try:
        if rank == 0:
            got = {r: q.dequeue(timeout=timeout) for r, q in enumerate(readers)
                   if q is not None}
            out["results_ok"] = got == {r: {"rank": r, "tokens": [r] * 3} for r in range(1, n)}
            out["result_transports"] = {str(r): q.transport for r, q in enumerate(readers)
                                        if q is not None}
        else:
            writer.enqueue({"rank": rank, "tokens": [rank] * 3})
    finally:
        for q in [writer, *readers]:
            if q is not None:
                q.close()
    return out


# ---------------------------------------------------------------- case: pp
def case_pp(args: argparse.Namespace) -> dict[str, Any]:
    """TP=2 inside each host, PP=2 across the hosts."""
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    tp, pp = ps.get_tp_group(), ps.get_pp_group()
    out: dict[str, Any] = {
        "tp_same_node": ps.in_the_same_node_as(tp, 0),
        "pp_same_node": ps.in_the_same_node_as(pp, 0),
        "tp_comm_mode": getattr(tp.device_communicator, "mode", None),
        "pp_comm_mode": getattr(pp.device_communicator, "mode", None),
        "tp_mq_transport": tp.mq_broadcaster.transport if tp.mq_broadcaster else None,
    }
    tr = tp.rank_in_group
    ok = True
    for step in range(6):
        hidden = _input(tr, (4, 64), torch.float32, 10 + step)
        if pp.is_first_rank:
            pp.send_tensor_dict({"hidden": hidden, "residual": hidden * 2, "step": step})
            back = pp.recv_tensor_dict()  # the last stage answers: sampled tokens
            ok &= torch.equal(back["tokens"], hidden.argmax(-1)) and back["step"] == step
        else:
            got = pp.recv_tensor_dict()
            ok &= (got["step"] == step and torch.equal(got["hidden"], hidden)
                   and torch.equal(got["residual"], hidden * 2))
            pp.send_tensor_dict({"tokens": got["hidden"].argmax(-1), "step": step})
    out["pp_tensor_dicts_ok"] = bool(ok)
    t = _input(tr, (257,), torch.float64, 20)
    if pp.is_first_rank:
        pp.send(t, dst=1)
        out["pp_send_recv_ok"] = True
    else:
        out["pp_send_recv_ok"] = torch.equal(pp.recv(t.shape, t.dtype, src=0), t)
    xs = [_input(r, (9,), torch.int64, 5) for r in range(2)]
    out["tp_all_reduce_ok"] = torch.equal(tp.all_reduce(xs[tr]), xs[0] + xs[1])
    pp.barrier()
    return out


# ---------------------------------------------------------------- case: fault
class _Loop:
    """The engine-like step loop of the fault case; knows which op runs.

    The fault lands at a chosen point: at step ``--at-step``, right before op
    ``--at-op``, rank ``--victim`` either SIGKILLs itself (``--fault kill``)
    or holds back until the driver has taken the link down (``--fault
    link``: it writes ``holding`` and waits for ``link-down`` in its host's
    out directory). Either way its peers are inside that op when it happens.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.op = "init"
        self.step = -1
        self.rank = int(os.environ["RANK"])

    def _enter(self, op: str) -> None:
        self.op = op
        a = self.args
        if self.rank != a.victim or self.step != a.at_step or op != a.at_op:
            return
        if a.fault == "kill":
            _write(a.out, "kill", {"rank": self.rank, "t": time.time(), "op": op})
            os.kill(os.getpid(), signal.SIGKILL)
        _write(a.out, "holding", {"rank": self.rank, "t": time.time(), "op": op})
        end = time.monotonic() + 60
        while not (a.out / "link-down").exists():
            if time.monotonic() > end:
                raise RuntimeError("the driver never took the link down")
            time.sleep(0.01)

    def run(self) -> dict[str, Any]:
        a = self.args
        tp_size = 4 if a.workload == "tp" else 2
        self.op = "initialize_model_parallel"
        ps.initialize_model_parallel(tensor_model_parallel_size=tp_size,
                                     pipeline_model_parallel_size=4 // tp_size)
        tp, pp = ps.get_tp_group(), ps.get_pp_group()
        x = torch.full((64,), self.rank + 1, dtype=torch.int64)
        want = torch.full((64,), sum(r + 1 for r in tp.ranks), dtype=torch.int64)
        for self.step in range(a.at_step + 1000):
            self._enter("broadcast_tensor_dict")
            meta = tp.broadcast_tensor_dict(_metadata(self.step) if tp.rank_in_group == 0
                                            else None)
            if meta["step"] != self.step:
                return {"outcome": "wrong_result", "op": self.op, "steps": self.step}
            self._enter("all_reduce")
            if not torch.equal(tp.all_reduce(x), want):
                return {"outcome": "wrong_result", "op": self.op, "steps": self.step}
            if a.workload == "pp":
                self._pp_hop(pp)
            time.sleep(a.pace)
        return {"outcome": "no_error", "steps": self.step}

    def _pp_hop(self, pp: Any) -> None:
        h = torch.full((16,), float(self.step))
        if pp.is_first_rank:
            self._enter("send_tensor_dict")
            pp.send_tensor_dict({"hidden": h, "step": self.step})
            self._enter("recv_tensor_dict")
            back = pp.recv_tensor_dict()
        else:
            self._enter("recv_tensor_dict")
            back = pp.recv_tensor_dict()
            self._enter("send_tensor_dict")
            pp.send_tensor_dict({"hidden": back["hidden"], "step": self.step})
        if back["step"] != self.step or not torch.equal(back["hidden"], h):
            raise AssertionError(f"wrong pipeline result at step {self.step}")


def case_fault(args: argparse.Namespace) -> dict[str, Any]:
    """Run the loop until the fault; report the error this rank raised."""
    loop = _Loop(args)
    try:
        out = loop.run()
    except Exception as e:  # what the fault made this rank raise is the result
        out = {"outcome": "raised", "t_raise": time.time(), "op": loop.op, "step": loop.step,
               "error_type": type(e).__name__,
               "error_mro": [c.__name__ for c in type(e).__mro__],
               "message": str(e), "traceback": traceback.format_exc()[-3000:]}
    return out


# ---------------------------------------------------------------- main
_CASES: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "tp": case_tp, "pp": case_pp, "fault": case_fault}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The rank's command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m tests.multihost.ranks")
    p.add_argument("--case", action="append", choices=sorted(_CASES), required=True,
                   help="case to run (repeat to run several in one launch)")
    p.add_argument("--out", type=Path, default=Path("/tmp/out"))
    p.add_argument("--timeout", type=float, default=60.0, help="the groups' timeout (s)")
    p.add_argument("--workload", choices=("tp", "pp"), default="tp")
    p.add_argument("--fault", choices=("kill", "link"), default="kill")
    p.add_argument("--victim", type=int, default=3, help="rank that dies or holds back")
    p.add_argument("--at-op", default="all_reduce",
                   choices=("broadcast_tensor_dict", "all_reduce", "send_tensor_dict",
                            "recv_tensor_dict"))
    p.add_argument("--at-step", type=int, default=5)
    p.add_argument("--pace", type=float, default=0.01, help="seconds between loop steps")
    return p.parse_args(argv)


def _leave_groups(limit_s: float) -> dict[str, Any]:
    """Destroy the groups, bounded: a rank whose peers vanished must still exit."""
    done = threading.Event()
    info: dict[str, Any] = {}

    def destroy() -> None:
        t = time.monotonic()
        try:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()
            info["cleanup"] = "ok"
        except Exception as e:
            info["cleanup"] = f"{type(e).__name__}: {e}"
        info["cleanup_s"] = time.monotonic() - t
        done.set()

    threading.Thread(target=destroy, daemon=True).start()
    if not done.wait(limit_s):
        info["cleanup"] = f"did not finish within {limit_s} s"
    return info


def main(argv: list[str] | None = None) -> int:
    """Run the cases in order; write one result file per case; the exit status."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    me = _identity()
    ps.init_distributed_environment(timeout=args.timeout)
    for case in args.case:
        res = {**me, "case": case, **_CASES[case](args)}
        if res.get("outcome") == "raised":
            res.update(_leave_groups(limit_s=args.timeout + 5))
            _write(args.out, f"{case}-rank{me['rank']}.json", res)
            return FAULT_EXIT
        ps.destroy_model_parallel()
        _write(args.out, f"{case}-rank{me['rank']}.json", res)
    ps.destroy_distributed_environment()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

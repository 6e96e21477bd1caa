"""``groupcoord bench p2p``: point-to-point between two pipeline stages, link vs CPU group vs gloo.

Two ranks; per size, rank 0 sends and rank 1 sends it back: the round trip
is two hand-offs between stages (rank 0's clock). Two kinds of call
(``--calls``):

* ``dict``: a pipeline-style dict (``hidden_states`` and ``residual``, half
  the bytes each, plus a step number) with ``send_tensor_dict`` /
  ``recv_tensor_dict``;
* ``tensor``: one tensor with ``send`` / ``recv``, and the same exchange with
  ``torch.distributed``'s own ``send`` / ``recv`` on a gloo group (``gloo``,
  the baseline: unsigned, unchecked).

The same processes measure each transport in alternating blocks: a group
whose directions settled on shared-memory links (:mod:`coordinator.p2p.shm_links`,
the default between ranks of a host, settled by the first call each way; a
tensor's send there meets its receiver) and one held to the CPU group (its
first calls made with ``GROUPCOORD_P2P_SHM=0``: metadata over gloo, then a
gloo send per tensor, each signed; single tensors take the signed
send/recv). Example::

    groupcoord bench p2p --calls dict tensor --sizes 1K 16K 1M 8M --threads 1 default
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from shm_broadcast.cli_args import output_path

__all__ = ["add_args", "run"]

_GROUPS = ("link", "cpu-group")
#: The transports each kind of call is measured on.
_TRANSPORTS = {"dict": _GROUPS, "tensor": (*_GROUPS, "gloo")}


def add_args(p: argparse.ArgumentParser) -> None:
    """Options of ``groupcoord bench p2p``."""
    from coordinator.bench.cli import _positive, parse_size, parse_threads

    p.add_argument("--calls", nargs="+", choices=list(_TRANSPORTS), default=["dict", "tensor"],
                   help="dict: send/recv_tensor_dict; tensor: send/recv of one tensor, with "
                        "torch.distributed's gloo send/recv as the baseline (default: both)")
    p.add_argument("--sizes", nargs="+", type=parse_size, default=[16 << 10, 256 << 10, 1 << 20,
                                                                    8 << 20],
                   help="bytes of tensors per call (default 16K 256K 1M 8M)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--threads", nargs="+", type=parse_threads, default=[1, "default"],
                   help="torch threads per rank: 1, default (torch's default in this "
                        "process) or N (default: 1 default)")
    p.add_argument("--iters", type=_positive(int), default=200,
                   help="round trips per block (default 200)")
    p.add_argument("--rounds", type=_positive(int), default=3,
                   help="blocks per transport (default 3)")

    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", type=output_path)
    p.add_argument("--timeout", type=_positive(float), default=900.0,
                   help="seconds before the ranks are killed (default 900)")


def bench_rank(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Rank side: round trips per call kind, transport and size, in interleaved blocks."""
    import torch

    from coordinator import GroupCoordinator

    torch.set_num_threads(cfg["threads"])
    groups = {t: GroupCoordinator([[0, 1]], rank, "gloo", True, group_name=f"p2p-{t}")
              for t in _GROUPS}
    dtype = getattr(torch, cfg["dtype"])
    samples: dict[str, dict[str, dict[int, list[float]]]] = {
        c: {t: {s: [] for s in cfg["sizes"]} for t in _TRANSPORTS[c]} for c in cfg["calls"]}
    try:
        _settle(groups, rank)
        for size in cfg["sizes"]:
            half = torch.randn(max(1, size // 2 // dtype.itemsize)).to(dtype)
            payload = {"dict": {"hidden_states": half, "residual": half.clone(), "step": 7},
                       "tensor": torch.cat([half, half])}
            for _ in range(cfg["rounds"]):
                for call in cfg["calls"]:
                    for t in _TRANSPORTS[call]:
                        g = groups["link" if t == "gloo" else t]
                        samples[call][t][size] += _block(g, rank, call, t, payload[call],
                                                         cfg["iters"])
    finally:
        for g in groups.values():
            g.destroy()
    return {"threads": torch.get_num_threads(), "samples": samples}


def _settle(groups: dict[str, Any], rank: int) -> None:
    """Settle both directions of each group with a first tensor, as an engine's
    first ``send`` does: the CPU-group one with links off."""
    import torch

    for t, g in groups.items():
        if t == "cpu-group":
            os.environ["GROUPCOORD_P2P_SHM"] = "0"
        try:
            if rank == 0:
                g.send(torch.ones(1), 1)
                g.recv((1,), torch.float32, 1)
            else:
                g.send(g.recv((1,), torch.float32, 0), 0)
        finally:
            os.environ.pop("GROUPCOORD_P2P_SHM", None)


def _block(g: Any, rank: int, call: str, transport: str, payload: Any,
           iters: int) -> list[float]:
    """``iters`` timed round trips (after 10 untimed ones), in microseconds."""
    one_trip = _gloo_trip if transport == "gloo" else _dict_trip if call == "dict" else _tensor_trip
    out = []
    g.barrier()
    for i in range(iters + 10):
        t0 = time.perf_counter()
        one_trip(g, rank, payload)
        if i >= 10:
            out.append((time.perf_counter() - t0) * 1e6)
    return out


def _dict_trip(g: Any, rank: int, d: dict[str, Any]) -> None:
    if rank == 0:
        g.send_tensor_dict(d, 1)
        g.recv_tensor_dict(1)
    else:
        g.send_tensor_dict(g.recv_tensor_dict(0), 0)


def _tensor_trip(g: Any, rank: int, t: Any) -> None:
    if rank == 0:
        g.send(t, 1)
        g.recv(t.shape, t.dtype, 1)
    else:
        g.send(g.recv(t.shape, t.dtype, 0), 0)


def _gloo_trip(g: Any, rank: int, t: Any) -> None:
    """The same round trip with torch.distributed on the group's gloo group."""
    import torch
    import torch.distributed as dist

    peer = g.ranks[1 - rank]
    buf = torch.empty_like(t)
    if rank == 0:
        dist.send(t, peer, group=g.cpu_group)
        dist.recv(buf, peer, group=g.cpu_group)
    else:
        dist.recv(buf, peer, group=g.cpu_group)
        dist.send(buf, peer, group=g.cpu_group)


def _row(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"p50": statistics.median(s), "p99": s[min(len(s) - 1, int(0.99 * len(s)))],
            "n": len(s)}


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 on success, 1 when a rank failed."""
    import torch

    from coordinator.errors import DistributedTimeout, RankFailedError
    from coordinator.testing import run_distributed

    report: list[dict[str, Any]] = []
    print(f"groupcoord bench p2p: 2 ranks, {args.dtype}, {args.rounds} x {args.iters} round "
          f"trips per transport and size (rank 0's clock), blocks interleaved", flush=True)
    args.sizes = list(dict.fromkeys(args.sizes))  # a size named twice is one point
    for threads in args.threads:
        if threads == "default":  # this process's, as the ranks' harness caps theirs
            threads = torch.get_num_threads()
        cfg = {"sizes": args.sizes, "dtype": args.dtype, "threads": threads,
               "iters": args.iters, "rounds": args.rounds,
               "calls": list(dict.fromkeys(args.calls))}
        try:
            got = run_distributed(bench_rank, 2, cfg, timeout=args.timeout)[0]
        except (RankFailedError, DistributedTimeout) as e:
            print(f"groupcoord bench p2p: failed: {str(e).splitlines()[0]}", file=sys.stderr)
            return 1
        for call in cfg["calls"]:
            report += _print_call(call, got["threads"], args.sizes, got["samples"][call])
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"rows": report, "argv": sys.argv, "cpus": os.cpu_count(),
                       "loadavg": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M:%S")},
                      f, indent=1)
        print(f"wrote {args.json_path}")
    return 0


def _print_call(call: str, threads: int, sizes: list[int],
                samples: dict[str, dict[int, list[float]]]) -> list[dict[str, Any]]:
    """Print one call kind's table; its report rows. ``speedup``: the link's p50
    against the CPU group's (and ``vs_gloo`` against plain gloo, for tensors)."""
    from device_comms.bench.report import human_bytes

    transports = _TRANSPORTS[call]
    print(f"\n{call}s, {threads} thread(s) per rank, round trip p50/p99 us")
    print(f"{'size':>8}  " + "  ".join(f"{t:>19}" for t in transports)
          + "  link vs cpu-group" + ("  link vs gloo" if "gloo" in transports else ""))
    rows = []
    for size in sizes:
        r = {t: _row(samples[t][size]) for t in transports}
        row = {"call": call, "threads": threads, "size": size, **r,
               "speedup": r["cpu-group"]["p50"] / r["link"]["p50"]}
        line = f"{human_bytes(size):>8}  " + "  ".join(
            f"{r[t]['p50']:>9.1f}/{r[t]['p99']:<9.1f}" for t in transports)
        line += f"  {row['speedup']:>16.2f}x"
        if "gloo" in r:
            row["vs_gloo"] = r["gloo"]["p50"] / r["link"]["p50"]
            line += f"  {row['vs_gloo']:>11.2f}x"
        print(line, flush=True)
        rows.append(row)
    return rows

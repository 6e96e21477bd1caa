"""``groupcoord bench p2p``: tensor dicts between two pipeline stages, link vs CPU group.

Two ranks, one pipeline group each way. Per size, rank 0 sends a
pipeline-style dict (``hidden_states`` and ``residual``, half the bytes each,
plus a step number) with ``send_tensor_dict`` and rank 1 sends it back: the
round trip is two hand-offs between stages. The same processes measure two
groups in alternating blocks: one whose directions settled on shared-memory
links (:mod:`coordinator.shm_links`, the default between ranks of a host) and
one held to the CPU group (its first dicts sent with ``GROUPCOORD_P2P_SHM=0``:
metadata over gloo, then a gloo send per tensor). Example::

    groupcoord bench p2p --sizes 16K 256K 1M 8M --threads 1 default --json p2p.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

__all__ = ["add_args", "run"]

_TRANSPORTS = ("link", "cpu-group")


def add_args(p: argparse.ArgumentParser) -> None:
    """Options of ``groupcoord bench p2p``."""
    from coordinator.engine.bench.cli import _positive, parse_size, parse_threads

    p.add_argument("--sizes", nargs="+", type=parse_size, default=[16 << 10, 256 << 10, 1 << 20,
                                                                    8 << 20],
                   help="bytes of tensors per dict (default 16K 256K 1M 8M)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--threads", nargs="+", type=parse_threads, default=[1, "default"],
                   help="torch threads per rank: 1, default (torch's default in this "
                        "process) or N (default: 1 default)")
    p.add_argument("--iters", type=_positive(int), default=200, help="round trips per block (default 200)")
    p.add_argument("--rounds", type=_positive(int), default=3, help="blocks per transport (default 3)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH")
    p.add_argument("--timeout", type=_positive(float), default=900.0,
                   help="seconds before the ranks are killed (default 900)")


def bench_rank(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Rank side: round trips per transport and size, in interleaved blocks."""
    import torch

    from coordinator import GroupCoordinator

    torch.set_num_threads(cfg["threads"])
    groups = {t: GroupCoordinator([[0, 1]], rank, "gloo", True, group_name=f"p2p-{t}")
              for t in _TRANSPORTS}
    dtype = getattr(torch, cfg["dtype"])
    samples: dict[str, dict[int, list[float]]] = {t: {s: [] for s in cfg["sizes"]}
                                                  for t in _TRANSPORTS}
    try:
        _settle(groups, rank)
        for size in cfg["sizes"]:
            half = torch.randn(max(1, size // 2 // dtype.itemsize)).to(dtype)
            d = {"hidden_states": half, "residual": half.clone(), "step": 7}
            for _ in range(cfg["rounds"]):
                for t, g in groups.items():
                    samples[t][size] += _block(g, rank, d, cfg["iters"])
    finally:
        for g in groups.values():
            g.destroy()
    return {"threads": torch.get_num_threads(), "samples": samples}


def _settle(groups: dict[str, Any], rank: int) -> None:
    """Settle both directions of each group: the CPU-group one with links off."""
    import torch

    for t, g in groups.items():
        if t == "cpu-group":
            os.environ["GROUPCOORD_P2P_SHM"] = "0"
        try:
            if rank == 0:
                g.send_tensor_dict({"x": torch.ones(1)}, 1)
                g.recv_tensor_dict(1)
            else:
                g.send_tensor_dict(g.recv_tensor_dict(0), 0)
        finally:
            os.environ.pop("GROUPCOORD_P2P_SHM", None)


def _block(g: Any, rank: int, d: dict[str, Any], iters: int) -> list[float]:
    out = []
    g.barrier()
    for i in range(iters + 10):
        t0 = time.perf_counter()
        if rank == 0:
            g.send_tensor_dict(d, 1)
            g.recv_tensor_dict(1)
        else:
            g.send_tensor_dict(g.recv_tensor_dict(0), 0)
        if i >= 10:
            out.append((time.perf_counter() - t0) * 1e6)
    return out


def _row(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"p50": statistics.median(s), "p99": s[min(len(s) - 1, int(0.99 * len(s)))],
            "n": len(s)}


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 on success, 1 when a rank failed."""
    from coordinator.errors import DistributedTimeout, RankFailedError
    from coordinator.testing import run_distributed
    from device_comms.bench.report import human_bytes

    import torch

    report: list[dict[str, Any]] = []
    print(f"groupcoord bench p2p: 2 ranks, {args.dtype}, {args.rounds} x {args.iters} round "
          f"trips per transport and size (rank 0's clock), blocks interleaved", flush=True)
    print(f"{'threads':>7} {'size':>8}  {'link p50/p99 us':>17}  {'cpu-group p50/p99 us':>21}  "
          f"{'x':>6}")
    for threads in args.threads:
        if threads == "default":  # this process's, as the ranks' harness caps theirs
            threads = torch.get_num_threads()
        cfg = {"sizes": args.sizes, "dtype": args.dtype, "threads": threads,
               "iters": args.iters, "rounds": args.rounds}
        try:
            got = run_distributed(bench_rank, 2, cfg, timeout=args.timeout)[0]
        except (RankFailedError, DistributedTimeout) as e:
            print(f"groupcoord bench p2p: failed: {str(e).splitlines()[0]}", file=sys.stderr)
            return 1
        for size in args.sizes:
            rows = {t: _row(got["samples"][t][size]) for t in _TRANSPORTS}
            ratio = rows["cpu-group"]["p50"] / rows["link"]["p50"]
            report.append({"threads": got["threads"], "size": size, **rows, "speedup": ratio})
            print(f"{got['threads']:>7} {human_bytes(size):>8}  "
                  f"{rows['link']['p50']:>8.1f}/{rows['link']['p99']:<8.1f}  "
                  f"{rows['cpu-group']['p50']:>10.1f}/{rows['cpu-group']['p99']:<10.1f}  "
                  f"{ratio:>5.1f}x", flush=True)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"rows": report, "argv": sys.argv, "cpus": os.cpu_count(),
                       "loadavg": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M:%S")},
                      f, indent=1)
        print(f"wrote {args.json_path}")
    return 0

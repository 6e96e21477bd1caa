"""Plain ``send``/``recv`` between two local ranks: on a settled link vs gloo.

Two ranks, one CPU ``GroupCoordinator``. A first tensor dict settles each
direction on a shared-memory link (``coordinator/link_tensors.py``); then
rank 0 sends a float32 tensor to rank 1 and rank 1 sends it back (a round
trip, rank 0's clock), with ``GroupCoordinator.send``/``recv`` and, in
alternating blocks of the same processes, with ``torch.distributed``'s own
``send``/``recv`` on a gloo group. Prints p50/p99 per size and the ratio.

Not part of the package or the test suite. Run from the repository root::

    python docs/bench/link_send_recv.py --sizes 1K 64K 1M 8M --iters 200 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _rank(rank: int, world_size: int, sizes: list[int], iters: int, rounds: int,
          threads: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from coordinator import GroupCoordinator

    torch.set_num_threads(threads)
    g = GroupCoordinator([[0, 1]], rank, "gloo", True, group_name="bench-p2p")
    gloo = dist.new_group([0, 1], backend="gloo")
    if rank == 0:  # settle both directions on links
        g.send_tensor_dict({"x": torch.ones(1)}, 1)
        g.recv_tensor_dict(1)
    else:
        g.recv_tensor_dict(0)
        g.send_tensor_dict({"x": torch.ones(1)}, 0)
    times: dict[str, dict[int, list[float]]] = {"link": {}, "gloo": {}}

    def ours(x: torch.Tensor) -> None:
        if rank == 0:
            g.send(x, 1)
            g.recv(x.shape, x.dtype, 1)
        else:
            g.send(g.recv(x.shape, x.dtype, 0), 0)

    def theirs(x: torch.Tensor) -> None:
        if rank == 0:
            dist.send(x, 1, group=gloo)
            dist.recv(x, 1, group=gloo)
        else:
            dist.recv(x, 0, group=gloo)
            dist.send(x, 0, group=gloo)

    for _ in range(rounds):
        for n in sizes:
            x = torch.ones(n // 4)
            for name, fn in (("link", ours), ("gloo", theirs)):
                for _ in range(5):
                    fn(x)
                got = times[name].setdefault(n, [])
                for _ in range(iters):
                    t0 = time.perf_counter()
                    fn(x)
                    got.append((time.perf_counter() - t0) * 1e6)
    g.destroy()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["1K", "64K", "1M", "8M"])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    from coordinator.testing import run_distributed

    sizes = [_bytes(s) for s in a.sizes]
    res = run_distributed(_rank, 2, sizes, a.iters, a.rounds, a.threads, timeout=600)[0]
    print(f"round trip, rank 0's clock, us ({a.rounds} x {a.iters} per cell, "
          f"{a.threads} torch thread(s) per rank)")
    print(f"{'size':>8} {'link p50':>10} {'link p99':>10} {'gloo p50':>10} {'gloo p99':>10} "
          f"{'x (p50)':>8}")
    for text, n in zip(a.sizes, sizes):
        link, gloo = sorted(res["link"][n]), sorted(res["gloo"][n])
        lp, gp = statistics.median(link), statistics.median(gloo)
        print(f"{text:>8} {lp:>10.1f} {link[int(0.99 * len(link))]:>10.1f} {gp:>10.1f} "
              f"{gloo[int(0.99 * len(gloo))]:>10.1f} {gp / lp:>7.1f}x")


if __name__ == "__main__":
    main()

"""Page faults of a new result tensor: ``torch.empty`` against the engine's result pool.

Not part of the package or the test suite. In a fresh process per case (the
malloc heap's history decides what ``torch.empty`` faults), allocate a new
float32 result and copy a message into it, ``--calls`` times, rebinding the
result each time as ``y = group.all_reduce(x)`` does; report the page faults
per call and the median time of calls 2 onwards (docs/performance.md, "Page
faults on a new result")::

    python docs/bench/result_page_faults.py --sizes-mib 1 4 16
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _case(alloc: str, nbytes: int, calls: int) -> dict[str, float]:
    """One case in this process: ``alloc`` is ``torch`` or ``pool``."""
    import torch

    from device_comms.cpu_shm import host_alloc

    torch.set_num_threads(1)
    count = nbytes // 4
    x = torch.ones(count)
    faults, times = [], []
    y = None
    for _ in range(calls):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        y = torch.empty(count) if alloc == "torch" else host_alloc.empty(count, torch.float32)
        y.copy_(x)
        times.append((time.perf_counter() - t0) * 1e6)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    del y
    rest = faults[1:]
    return {"faults_per_call": sum(rest) / len(rest),
            "calls_faulting": sum(f > 100 for f in rest),
            "p50_us": statistics.median(times[1:])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16])
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--case", nargs=2, metavar=("ALLOC", "BYTES"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(_case(args.case[0], int(args.case[1]), args.calls)))
        return 0
    print(f"{'result':>9} {'alloc':>6} {'faults/call':>12} {'calls faulting':>15} {'p50 us':>8}")
    env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for mib in args.sizes_mib:
        for alloc in ("torch", "pool"):
            out = subprocess.run([sys.executable, __file__, "--calls", str(args.calls), "--case",
                                  alloc, str(int(mib * (1 << 20)))],
                                 capture_output=True, text=True, check=True, env=env)
            r = json.loads(out.stdout)
            print(f"{mib:7g}Mi {alloc:>6} {r['faults_per_call']:12.1f} "
                  f"{r['calls_faulting']:>9}/{args.calls - 1:<5} {r['p50_us']:8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``groupcoord bench collectives --via torch``: the groupcoord torch.distributed backend vs gloo.

What a library written against plain ``torch.distributed`` gets: every rank
builds a process group of the backend under test (``--backend``, default
``groupcoord``) and a gloo group over the same ranks, and times
``dist.all_reduce`` (in place), ``dist.all_gather_into_tensor`` and
``dist.reduce_scatter_tensor`` (outputs preallocated; called by their newer
names ``all_gather_single`` / ``reduce_scatter_single`` where torch has them)
on each. A third variant,
``direct``, is the same op on a
:class:`~device_comms.cpu.communicator.CpuCommunicator` called directly (our
engine without torch.distributed in between); ``ours median - direct
median`` is the process group's overhead per call (the dispatch through
``torch.distributed``, the backend's argument checks and work object, and
whatever it does to honour torch's in-place contract: our communicator's
``all_reduce`` returns a new tensor, ``dist.all_reduce`` must leave the sum in
the caller's tensor).

Sizes are the full buffer, as in ``groupcoord bench collectives``: the tensor
of ``all_reduce``, the output of ``all_gather``, the input of
``reduce_scatter``; default 1 KiB to 16 MiB in powers of 4.

Torch threads per rank (``--threads``): ``1`` and ``default`` (torch's own
default) unless given; the settings are timed in the same processes.

Timing: for each op, dtype and size, ``--rounds`` rounds; in a round every
thread setting and variant runs one block of ``--block`` calls, the variants'
order rotating from round to round (machine noise hits all alike). Before
every call the ranks meet at the communicator's shared-memory barrier, so a
sample is one collective started by all ranks together; its latency is the
slowest rank's time. Reported per point: the median of the rounds' medians
and the p99 of all samples for each variant (``ours`` is the backend under
test), gloo's median over ours (> 1: ours is faster) and the overhead. Each
point also checks once that the three variants agree (exactly for
``all_gather``, to float tolerance for the reductions, whose sums the backends
may order differently).

Without ``--via torch`` the command is ``device_comms``' benchmark
(:mod:`device_comms.bench.collectives`), unchanged: :func:`add_args` adds that
benchmark's options plus this one's, and :func:`run` hands it the parsed
arguments.

Run: ``groupcoord bench collectives --via torch --world-sizes 2 4 --json torch.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from device_comms.bench.report import load_average
from shm_broadcast.cli_args import number

__all__ = ["add_args", "run", "bench_rank", "format_table"]

_TORCH_OPS = ("all_reduce", "all_gather", "reduce_scatter")
_DEFAULT_SIZES = [1 << s for s in range(10, 25, 2)]  # 1 KiB .. 16 MiB, powers of 4


def add_args(parser: argparse.ArgumentParser) -> None:
    """``groupcoord bench collectives``' options: device_comms' benchmark's and ``--via``."""
    from device_comms.bench.collectives import add_bench_args

    add_bench_args(parser)
    parser.add_argument("--via", choices=("direct", "torch"), default="direct",
                        help="direct (default): our communicator vs raw gloo; torch: "
                             "dist.all_reduce/all_gather_into_tensor/reduce_scatter_tensor "
                             "on the groupcoord backend vs gloo, with our communicator "
                             "called directly for the process group's overhead per call")
    parser.add_argument("--backend", default="groupcoord",
                        help="--via torch: the backend compared with gloo (default groupcoord; "
                             "gloo itself is the control: what the harness reads between two "
                             "identical groups)")
    parser.add_argument("--rounds", type=number(int, minimum=1), default=5,
                        help="--via torch: interleaved rounds per point (default 5)")
    parser.add_argument("--block", type=number(int, minimum=1), default=None,
                        help="--via torch: calls per variant and round (default: about 64 MB "
                             "moved per block, 4 to 50 calls)")


def run(args: argparse.Namespace) -> int:
    """Run ``groupcoord bench collectives``; returns the exit status."""
    if args.via != "torch":
        from device_comms.bench.collectives import run_bench

        return run_bench(args)
    from device_comms.bench.collectives import fill_defaults

    fill_defaults(args, dtypes=["float32"], world_sizes=[2, 4])
    problem = _check_args(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    return _run_torch(args)


def _check_args(args: argparse.Namespace) -> str | None:
    """The option error to print (exit status 2), or None."""
    if args.device != "cpu":
        return "--via torch: only --device cpu (the groupcoord backend is for CPU tensors)"
    for ws in args.world_sizes:
        if ws < 2:
            return f"--world-sizes: every world size must be >= 2, got {ws}"
    bad = [op for op in args.ops if op not in _TORCH_OPS]
    if bad:
        return f"--via torch: --ops must be among {list(_TORCH_OPS)}, got {bad}"
    if not _config(args)["sizes"]:
        return (f"no size is left between --min-bytes ({args.min_bytes}) and --max-bytes "
                f"({args.max_bytes})")
    return None


def _config(args: argparse.Namespace) -> dict[str, Any]:
    from device_comms.bench.collectives import DECODE_SIZES

    sizes = args.sizes or [
        s for s in (DECODE_SIZES if args.decode else _DEFAULT_SIZES)
        if (args.min_bytes is None or s >= args.min_bytes)
        and (args.max_bytes is None or s <= args.max_bytes)
    ]
    return {"ops": list(args.ops), "dtypes": list(args.dtypes), "sizes": sizes,
            "threads": [str(t) for t in args.threads] if args.threads else ["1", "default"],
            "rounds": args.rounds, "block": args.block, "backend": args.backend,
            "workspace_bytes": args.workspace_bytes}


def _run_torch(args: argparse.Namespace) -> int:
    import torch

    from coordinator.testing import run_distributed

    cfg = _config(args)
    # torch's own default, read here: the rank harness sets its ranks' thread count
    cfg["default_threads"] = torch.get_num_threads()
    load_before = load_average()
    print(f"# load average before: {load_before} (timings are noisy on a busy machine)",
          flush=True)
    records: list[dict[str, Any]] = []
    for ws in args.world_sizes:
        print(f"# world size {ws}: {cfg['backend']} vs gloo through torch.distributed", flush=True)
        results = run_distributed(bench_rank, ws, cfg, timeout=args.timeout)
        records.extend(results[0])
        print(format_table(results[0]), flush=True)
    if args.json_path:
        meta = {"command": " ".join(["groupcoord", *sys.argv[1:]]),
                "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                "loadavg_before": load_before, "loadavg_after": load_average(),
                "backend": cfg["backend"]}
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
        print(f"wrote {args.json_path}")
    return 0


def format_table(rows: list[dict[str, Any]]) -> str:
    """The records as a text table, one line per point and thread setting."""
    head = (f"{'ws':>3} {'op':<15}{'dtype':<9}{'bytes':>10}{'threads':>8}"
            f"{'ours med':>10}{'ours p99':>10}{'gloo med':>10}{'gloo p99':>10}"
            f"{'direct':>9}{'gloo/ours':>10}{'pg ovh us':>10}{'ok':>4}")
    lines = [head]
    for r in rows:
        threads = str(r["threads"]) if r["threads_setting"] != "default" else f"d={r['threads']}"
        lines.append(
            f"{r['world_size']:>3} {r['op']:<15}{r['dtype']:<9}{r['bytes']:>10}{threads:>8}"
            f"{r['ours_median_us']:>10.1f}{r['ours_p99_us']:>10.1f}"
            f"{r['gloo_median_us']:>10.1f}{r['gloo_p99_us']:>10.1f}"
            f"{r['direct_median_us']:>9.1f}{r['gloo_over_ours']:>10.1f}"
            f"{r['pg_overhead_us']:>10.1f}{'y' if r['results_match'] else 'N':>4}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- per rank
def bench_rank(rank: int, world_size: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Run on every rank (gloo world initialised); rank 0 returns the records, the others []."""
    import torch
    import torch.distributed as dist

    import coordinator  # noqa: F401  registers the groupcoord backend
    from device_comms.cpu.communicator import CpuCommunicator

    counts = [cfg["default_threads"] if t == "default" else int(t) for t in cfg["threads"]]
    ours = dist.new_group(backend=cfg["backend"])
    gloo = dist.new_group(backend="gloo")
    comm = CpuCommunicator(gloo, torch.device("cpu"), unique_name="bench_torch_direct",
                           workspace_bytes=cfg["workspace_bytes"])
    groups = {"ours": ours, "gloo": gloo}
    records: list[dict[str, Any]] = []
    try:
        for op in cfg["ops"]:
            for dname in cfg["dtypes"]:
                for nbytes in cfg["sizes"]:
                    point = _Point(op, getattr(torch, dname), nbytes, rank, world_size)
                    recs = point.measure(comm, groups, cfg, counts)
                    if rank == 0:
                        records.extend(recs)
    finally:
        comm.destroy()
        dist.destroy_process_group(ours)
        dist.destroy_process_group(gloo)
    return records if rank == 0 else []


class _Point:
    """One op, dtype and size: the three variants' calls, their check and timing."""

    def __init__(self, op: str, dtype: Any, nbytes: int, rank: int, ws: int) -> None:
        import torch

        self.op, self.dtype, self.nbytes, self.ws = op, dtype, nbytes, ws
        item = torch.empty((), dtype=dtype).element_size()
        numel = max(ws, nbytes // item // ws * ws)
        gen = torch.Generator().manual_seed(1234 + rank)
        self.full = torch.randn(numel, generator=gen).to(dtype)

    def calls(self, comm: Any, groups: dict[str, Any]) -> dict[str, Callable[[], Any]]:
        """The variants' calls by name (fresh buffers); each returns its result tensor."""
        out = {name: _torch_call(self.op, group, self.full, self.ws)
               for name, group in groups.items()}
        out["direct"] = _direct_call(self.op, comm, self.full, self.ws)
        return out

    def agree(self, calls: dict[str, Callable[[], Any]]) -> bool:
        """Whether the variants' first results agree (fresh ``calls``, each run once)."""
        import torch

        got = {name: call().clone() for name, call in calls.items()}
        ref = got["gloo"]
        if self.op == "all_gather":
            return all(torch.equal(t, ref) for t in got.values())
        tol = 2e-2 if self.dtype in (torch.bfloat16, torch.float16) else 1e-4
        return all(torch.allclose(t.float(), ref.float(), rtol=tol, atol=tol * self.ws)
                   for t in got.values())

    def measure(self, comm: Any, groups: dict[str, Any], cfg: dict[str, Any],
                counts: list[int]) -> list[dict[str, Any]]:
        """Records for every thread setting (every rank returns them)."""
        import torch
        import torch.distributed as dist

        from shm_broadcast.ranks.group_adapter import object_group

        same = self.agree(self.calls(comm, groups))
        calls = self.calls(comm, groups)
        block = cfg["block"] or max(4, min(50, (64 << 20) // self.nbytes))
        # samples[variant][setting][round]: this rank's times, microseconds
        samples: dict[str, list[list[list[float]]]] = {
            v: [[[] for _ in range(cfg["rounds"])] for _ in counts] for v in calls}
        for n in counts:  # warm up every variant at every setting
            torch.set_num_threads(n)
            for call in calls.values():
                for _ in range(2):
                    call()
        names = list(calls)
        for r in range(cfg["rounds"]):
            order = names[r % len(names):] + names[: r % len(names)]
            for i, n in enumerate(counts):
                torch.set_num_threads(n)
                for name in order:
                    _time(calls[name], block, samples[name][i][r], comm.barrier)
        torch.set_num_threads(counts[0])
        everyone = object_group(dist.group.WORLD).all_gather((samples, same))
        recs = []
        for i, n in enumerate(counts):
            rec: dict[str, Any] = {
                "world_size": self.ws, "op": self.op,
                "dtype": str(self.dtype).removeprefix("torch."), "bytes": self.nbytes,
                "threads": n, "threads_setting": cfg["threads"][i], "rounds": cfg["rounds"],
                "block": block, "backend": cfg["backend"],
                "results_match": all(v[1] for v in everyone),
            }
            for name in names:
                rounds = [[max(v[0][name][i][r][j] for v in everyone) for j in range(block)]
                          for r in range(cfg["rounds"])]
                rec[f"{name}_median_us"] = statistics.median(statistics.median(s) for s in rounds)
                rec[f"{name}_p99_us"] = _pct([t for s in rounds for t in s], 0.99)
                rec[f"{name}_round_medians_us"] = [statistics.median(s) for s in rounds]
            rec["gloo_over_ours"] = rec["gloo_median_us"] / rec["ours_median_us"]
            rec["pg_overhead_us"] = rec["ours_median_us"] - rec["direct_median_us"]
            recs.append(rec)
        return recs


def _torch_call(op: str, group: Any, full: Any, ws: int) -> Callable[[], Any]:
    """``op`` through ``torch.distributed`` on ``group``, buffers preallocated."""
    import torch
    import torch.distributed as dist

    if op == "all_reduce":
        buf = full.clone()

        def all_reduce() -> Any:
            dist.all_reduce(buf, group=group)  # in place: values grow, the time does not
            return buf
        return all_reduce
    if op == "all_gather":
        part, gathered = full[: full.numel() // ws].clone(), torch.empty_like(full)
        # newer torch calls all_gather_into_tensor all_gather_single (the old name warns)
        gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

        def all_gather() -> Any:
            gather_into(gathered, part, group=group)
            return gathered
        return all_gather
    scattered = torch.empty(full.numel() // ws, dtype=full.dtype)
    scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def reduce_scatter() -> Any:
        scatter_into(scattered, full, group=group)
        return scattered
    return reduce_scatter


def _direct_call(op: str, comm: Any, full: Any, ws: int) -> Callable[[], Any]:
    """``op`` on our communicator, called directly (it returns new tensors)."""
    if op == "all_reduce":
        return lambda: comm.all_reduce(full)
    if op == "all_gather":
        part = full[: full.numel() // ws].clone()
        return lambda: comm.all_gather(part, 0)
    return lambda: comm.reduce_scatter(full, 0)


def _time(fn: Callable[[], Any], k: int, into: list[float], sync: Callable[[], None]) -> None:
    clock = time.perf_counter
    for _ in range(k):
        sync()  # ranks start each sample together (the shared-memory barrier)
        t0 = clock()
        fn()
        into.append((clock() - t0) * 1e6)


def _pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]

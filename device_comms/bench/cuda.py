"""``groupcoord bench collectives --device cuda``: GPU all-reduce latency.

On one GPU, three things are timed with CUDA events, per call:

* the custom all-reduce's one-shot and two-shot kernels at 2/4/8 *virtual
  ranks* (:class:`~device_comms.cuda.custom_allreduce.virtual.VirtualRanks`: every
  rank's kernel on its own stream, concurrently), replayed from a CUDA graph
  that holds ``--calls`` back-to-back all-reduces;
* :class:`~device_comms.cuda.pynccl.PyNcclCommunicator` at world size 1, out of
  place eager and graph-replayed (NCCL copies the input to the output), and
  in place eager (NCCL enqueues nothing then: the column prices the host path);
* torch's NCCL all_reduce at world size 1, eager (the baseline engines know;
  torch's in-place all_reduce of a group of one enqueues no GPU work, so a
  graph of it is empty and not timed).

Every custom all-reduce point runs before the first NCCL communicator is made,
so the virtual ranks' concurrent kernels never share the device with NCCL's
streams.

The custom all-reduce columns stop at its 8 MiB limit; NCCL goes on to 64 MiB.

NCCL refuses two ranks on one GPU, so world size 1 is the only NCCL point a
single-GPU host can measure; it prices NCCL's fixed cost per call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from device_comms.errors import CollectiveTimeout

__all__ = ["run_cuda_bench"]

_DEFAULT_SIZES = [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20,
                  16 << 20, 64 << 20]
_CUSTOM_MAX = 8 << 20
_KERNEL_TIMEOUT_S = 2.0
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _event_time(fn: Callable[[], Any], reps: int, per: int) -> list[float]:
    """Microseconds per call for ``reps`` runs of ``fn`` (each doing ``per`` calls)."""
    out = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        out.append(start.elapsed_time(stop) * 1000.0 / per)
    return out


def _graph(body: Callable[[], Any], capture_ctx: Any = None) -> torch.cuda.CUDAGraph:
    import contextlib

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()  # warm-up outside the capture (allocations, compilation)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with (capture_ctx if capture_ctx is not None else contextlib.nullcontext(),
          torch.cuda.graph(g)):
        body()
    return g


def _stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"p50_us": statistics.median(s), "p99_us": s[min(len(s) - 1, int(0.99 * len(s)))]}


def _bench_virtual(n: int, variant: str, nbytes: int, dtype: torch.dtype, calls: int,
                   reps: int) -> dict[str, float]:
    from device_comms.cuda.custom_allreduce.virtual import VirtualRanks

    numel = nbytes // torch.tensor([], dtype=dtype).element_size()
    # A short kernel timeout: a point whose ranks cannot meet fails in seconds
    # (checked after the warm-up replays) instead of stalling every timed replay.
    with VirtualRanks(n, "cuda:0", max(nbytes, 1 << 20), timeout=_KERNEL_TIMEOUT_S) as vr:
        xs = [torch.randn(numel, dtype=dtype, device="cuda") for _ in range(n)]
        vr.all_reduce(xs, variant=variant)  # one eager call first: it fails fast
        torch.cuda.synchronize()
        vr.check_errors()
        g = _graph(lambda: [vr.all_reduce(xs, variant=variant) for _ in range(calls)], vr.capture())
        for _ in range(3):
            g.replay()
            torch.cuda.synchronize()
            vr.check_errors()
        samples = _event_time(g.replay, reps, calls)
        torch.cuda.synchronize()
        vr.check_errors()
    return _stats(samples)


def _bench_nccl(nbytes: int, dtype: torch.dtype, calls: int, reps: int,
                nccl: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from device_comms.cuda.pynccl import PyNcclCommunicator

    numel = nbytes // torch.tensor([], dtype=dtype).element_size()
    x = torch.randn(numel, dtype=dtype, device="cuda")
    out: dict[str, Any] = {}
    with PyNcclCommunicator(dist.group.WORLD, torch.device("cuda", 0)) as comm:
        y = torch.empty_like(x)

        def eager() -> list[Any]:
            return [comm.all_reduce(x, y) for _ in range(calls)]

        out["pynccl_eager"], out["pynccl_graph"] = _eager_and_graph(eager, reps, calls)

        # In place, as torch's all_reduce below. NCCL at one rank then enqueues no GPU
        # work, so only the eager call is timed (a graph of it would be empty).
        def inplace() -> list[Any]:
            return [comm.all_reduce(y, y) for _ in range(calls)]

        inplace()
        out["pynccl_eager_inplace"] = _stats(_event_time(inplace, reps, calls))
    z = x.clone()

    def torch_eager() -> list[Any]:
        return [dist.all_reduce(z, group=nccl) for _ in range(calls)]

    torch_eager()
    out["torch_nccl_eager"] = _stats(_event_time(torch_eager, reps, calls))
    return out


def _eager_and_graph(eager: Callable[[], Any], reps: int, calls: int,
                     ) -> tuple[dict[str, float], dict[str, float]]:
    """Stats of ``eager`` run directly, then replayed from a graph (destroyed before return:
    NCCL keeps a communicator alive while a graph that captured it exists)."""
    eager()
    eager_stats = _stats(_event_time(eager, reps, calls))
    g = _graph(eager)
    g.replay()
    graph_stats = _stats(_event_time(g.replay, reps, calls))
    torch.cuda.synchronize()
    del g
    return eager_stats, graph_stats


def _init_world() -> bool:
    """A one-rank gloo world over a file store (no port, no network); True if made here."""
    import tempfile

    import torch.distributed as dist

    if not dist.is_initialized():
        fd, path = tempfile.mkstemp(prefix="groupcoord-bench-cuda-")
        os.close(fd)
        os.unlink(path)  # the store creates it; removed again with the group
        dist.init_process_group("gloo", init_method=f"file://{path}", world_size=1, rank=0)
        return True
    return False


def _virtual_row(nbytes: int, dtype: torch.dtype, args: argparse.Namespace,
                 failed: list[str]) -> dict[str, Any]:
    """The custom all-reduce's points of one size, each printed as it ends. A point that
    times out is recorded as its error and appended to ``failed``; once one has, the
    remaining points are skipped (they would mostly wait out their timeouts too)."""
    from device_comms.cuda.custom_allreduce.eligibility import ALIGNMENT, call_eligible

    row: dict[str, Any] = {"bytes": nbytes, "dtype": str(dtype).removeprefix("torch.")}
    probe = torch.empty(nbytes // torch.tensor([], dtype=dtype).element_size(), dtype=dtype,
                        device="meta")  # the per-call rule, without memory
    if not call_eligible(probe, _CUSTOM_MAX):
        print(f"# {row['dtype']} {nbytes} B: not eligible for the custom all-reduce "
              f"(a positive multiple of {ALIGNMENT} bytes up to {_CUSTOM_MAX}); NCCL only")
    else:
        for n in args.world_sizes:
            for variant in ("oneshot", "twoshot"):
                key = f"{variant}_x{n}"
                if failed:
                    row[key] = {"error": f"skipped after {failed[0]} failed"}
                    continue
                try:
                    row[key] = _bench_virtual(n, variant, nbytes, dtype, args.calls, args.reps)
                except CollectiveTimeout as e:
                    row[key] = {"error": str(e)}
                    failed.append(f"{row['dtype']} {nbytes} B {key}")
                print(f"# {row['dtype']} {nbytes} B {key}: {row[key]}", flush=True)
    return row


def _print_table(rows: list[dict[str, Any]], world_sizes: list[int]) -> None:
    cols = [f"{v}_x{n}" for n in world_sizes for v in ("oneshot", "twoshot")]
    cols += ["pynccl_graph", "pynccl_eager", "pynccl_eager_inplace", "torch_nccl_eager"]
    print("| bytes | dtype | " + " | ".join(cols) + " |")
    print("|---:|---|" + "---:|" * len(cols))
    for r in rows:
        cells = [f"{r[c]['p50_us']:.1f}" if "p50_us" in r.get(c, {}) else
                 ("FAIL" if c in r else "-") for c in cols]
        print(f"| {r['bytes']} | {r['dtype']} | " + " | ".join(cells) + " |")
    print("(p50 microseconds per call, CUDA events; p99 in the JSON)")


def run_cuda_bench(args: argparse.Namespace) -> int:
    """Run the GPU benchmark; returns the exit status (1 if a point failed)."""
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("--device cuda needs a CUDA GPU; none is visible")
        return 2
    made_world = _init_world()
    try:
        rows = _measure(args)
    finally:
        if made_world:
            dist.destroy_process_group()
    _print_table(rows, args.world_sizes)
    if args.json_path:
        meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                "time": time.strftime("%Y-%m-%d %H:%M:%S"), "pid": os.getpid()}
        with open(args.json_path, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.json_path}")
    failed = sorted({k for r in rows for k, v in r.items() if isinstance(v, dict) and "error" in v})
    if failed:
        print(f"# {len(failed)} column(s) with failed points: {failed}")
    return 1 if failed else 0


def _whole_elements(nbytes: int, dtype: torch.dtype) -> int:
    """``nbytes`` rounded down to whole elements of ``dtype`` (at least one)."""
    size = torch.tensor([], dtype=dtype).element_size()
    return max(size, nbytes // size * size)


def _measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every point: the custom all-reduce's first, then NCCL's (see the module docstring)."""
    import torch.distributed as dist

    sizes = args.sizes or _DEFAULT_SIZES
    args.world_sizes = [n for n in args.world_sizes if n in (2, 4, 6, 8)] or [2, 4, 8]
    points = [(_whole_elements(n, _DTYPES[d]), _DTYPES[d])
              for d in args.dtypes if d in _DTYPES for n in sizes]
    failed: list[str] = []
    rows = [_virtual_row(nbytes, dtype, args, failed) for nbytes, dtype in points]
    print("# custom all-reduce points done", flush=True)
    nccl = dist.new_group([0], backend="nccl")
    for row, (nbytes, dtype) in zip(rows, points, strict=True):
        row.update(_bench_nccl(nbytes, dtype, args.calls, args.reps, nccl))
        print(f"# {row['dtype']} {nbytes} B NCCL: "
              + ", ".join(f"{k} {row[k]['p50_us']:.1f}" for k in row if "nccl" in k), flush=True)
    print(f"# device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"calls per replay {args.calls}, replays {args.reps}")
    return rows

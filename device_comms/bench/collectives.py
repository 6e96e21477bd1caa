"""``groupcoord bench collectives``: CPU shared-memory collectives against raw gloo.

For each world size, fresh ranks are started (:func:`shm_broadcast.ranks.launcher.spawn_group`);
each builds a :class:`~device_comms.cpu.communicator.CpuCommunicator` over the
world group and times, for every op, dtype and size, our call and the raw
``torch.distributed`` gloo call **in the same run, interleaved in blocks** (so
machine noise hits both alike). A sample is one collective, started by all
ranks together (a shared-memory barrier of a few microseconds precedes every
sample, so skew left over from the previous call is not charged to the next);
its latency is the slowest rank's time (the collective is done when every rank
is done).
Reported: median and p99 per op and size, and the ratio of gloo's median to
ours (> 1: we are faster).

Sizes are the full buffer: the tensor of ``all_reduce``, the *output* of
``all_gather``, the *input* of ``reduce_scatter`` (as nccl-tests count) and
each rank's *input* of ``all_to_allv``.

"Raw gloo" is ``dist.all_reduce`` in place, ``all_gather_single`` /
``reduce_scatter_single`` into preallocated outputs: gloo does not pay for the
new output tensor our API returns, so the comparison is conservative.

``all_to_allv`` splits are uneven and skewed like MoE routing
(:func:`routing_splits`): destination ``j`` is popular in proportion to
``1 / (j + 1)``, each rank's share is jittered by its own seeded noise, and each
rank sends nothing to one peer (world size > 2). Rows are up to 4 KiB (a
hidden state of 2048 bf16). Raw gloo is ``dist.all_to_all_single`` with the
same splits on byte views (moving rows needs no arithmetic), output
preallocated; ours gets ``recv_sizes`` too, as gloo must.

``dispatch_combine`` is one MoE layer's traffic
(:mod:`device_comms.bench.dispatch_combine`): our all-gather path
(``all_gatherv_rows`` of hidden states and router logits, then
``reduce_scatterv``) against two baselines in the same interleaved blocks, the
token all-to-all path on our communicator (``a2a_*``: counts all-gather, then
``all_to_allv`` there and back) and raw gloo doing the all-gather path with
padded calls. Its size is the bytes of all ranks' hidden states
(``tokens = size // (--hidden * element size)``); every variant's result is
checked once (``checks`` in the record).

Torch threads per rank (``--threads``): ``1``; ``default``, torch's own default
(the number of cores, what an engine that computes with every core has: each
rank's kernels would then oversubscribe the CPUs, see
:mod:`device_comms.cpu_shm.engine_threads`); or a number ``N``. Several settings
(``--threads 1 default``) are timed in the same processes, interleaved in
blocks like ours and gloo. Without the option each rank uses
``max(1, cpus // world_size)`` (as the test harness does). The table headers
and every record say which setting ran and how many threads a rank had.
Ranks are not bound to
CPUs unless ``--pin`` is given: binding makes our latency steadier on a busy
machine (where the scheduler likes to put both ranks on one CPU) but makes
gloo several times slower (its I/O threads share the rank's CPU), which would
flatter the comparison.

Run: ``python -m device_comms.bench.collectives --world-sizes 2 4 --json out.json
--plot out.png`` (``groupcoord bench collectives ...`` is the same).
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from device_comms.bench.report import load_average
from shm_broadcast import cli_args
from shm_broadcast.cli_args import number, output_path

__all__ = ["add_bench_args", "run_bench", "main"]

_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_allv", "dispatch_combine")
_DEFAULT_OPS = _OPS[:3]
_DTYPES = ("float32", "bfloat16", "float16", "int32", "int64")
_DEFAULT_SIZES = [1 << s for s in range(10, 27, 2)]  # 1 KiB .. 64 MiB, powers of 4
#: ``--decode``: what a tensor-parallel decode step all-reduces per layer (one hidden row of
#: 4,096-8,192 values per sequence, 1-16 sequences, bfloat16 or float32: 8-512 KiB), with
#: 1 and 4 KiB below and 1 and 16 MiB above for the slopes around it.
DECODE_SIZES = [1 << 10, 4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10,
                256 << 10, 512 << 10, 1 << 20, 16 << 20]


def _parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMG" else t
    try:
        value = int(float(num) * mult)
    except (ValueError, OverflowError):  # not a number, or not a finite one
        raise argparse.ArgumentTypeError(
            f"size must look like 4096, 64K or 16M, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def threads_for(setting: int | str | None, world_size: int) -> int | None:
    """Torch threads a rank sets for ``--threads`` (None: leave torch's default)."""
    if setting == "default":
        return None
    if setting is None:
        return max(1, (os.cpu_count() or 1) // world_size)
    return int(setting)


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """Add this benchmark's options to ``parser``."""
    parser.add_argument("--world-sizes", type=int, nargs="+", default=None,
                        help="world sizes to run (default: 2 4; --device cuda: 2 4 8)")
    parser.add_argument("--ops", nargs="+", choices=_OPS, default=list(_DEFAULT_OPS),
                        help="collectives to time (default: all_reduce all_gather "
                             "reduce_scatter); dispatch_combine: one MoE layer's traffic, the "
                             "all-gather path vs the token all-to-all path vs raw gloo")
    parser.add_argument("--dtypes", nargs="+", choices=_DTYPES, default=None,
                        help="dtypes (default: float32 bfloat16; --device cuda: bfloat16; "
                             "--via torch: float32)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--sizes", type=_parse_size, nargs="+", default=None,
                       help="buffer sizes (e.g. 1K 64K 1M); default 1K..64M in powers of 4")
    which.add_argument("--decode", action="store_true",
                       help="decode-step sizes: 1K 4K 8K 16K 32K 64K 128K 256K 512K 1M 16M "
                            "(--min-bytes/--max-bytes still apply)")
    parser.add_argument("--min-bytes", type=_parse_size, default=None,
                        help="drop smaller default sizes")
    parser.add_argument("--max-bytes", type=_parse_size, default=None,
                        help="drop larger default sizes")
    parser.add_argument("--hidden", type=number(int, above=0), default=4096,
                        help="dispatch_combine: hidden width in elements; a size is the bytes "
                             "of all ranks' hidden states, tokens = size // (hidden * element "
                             "size) (default: 4096)")
    parser.add_argument("--experts", type=number(int, above=0), default=64,
                        help="dispatch_combine: experts (router logits per token), a multiple "
                             "of every world size (default: 64)")
    parser.add_argument("--topk", type=number(int, above=0), default=2,
                        help="dispatch_combine: experts per token on the all-to-all path "
                             "(default: 2)")
    parser.add_argument("--max-iters", type=int, default=400, help="samples per point, at most")
    parser.add_argument("--min-iters", type=int, default=16, help="samples per point, at least")
    parser.add_argument("--budget-mb", type=number(float, above=0), default=1024.0,
                        help="per point and implementation, about this many MB are moved "
                             "(sets iterations)")
    parser.add_argument("--threads", type=cli_args.threads, nargs="+", default=None,
                        help="torch threads per rank: 1, default (torch's own default, the "
                             "core count) or N; several settings are timed interleaved in one "
                             "run (default: max(1, cpus // world size))")
    parser.add_argument("--workspace-bytes", type=_parse_size, default=None,
                        help="CpuCommunicator workspace (default: its own default)")
    parser.add_argument("--json", dest="json_path", default=None, type=output_path,
                        help="write results as JSON here")
    parser.add_argument("--plot", dest="plot_path", default=None, type=output_path,
                        help="write a log-log PNG plot here (needs matplotlib: "
                             "pip install groupcoord[plot])")
    parser.add_argument("--timeout", type=number(float, above=0), default=1800.0,
                        help="seconds per world size")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: shared-memory collectives vs gloo over processes; cuda: custom "
                             "all-reduce at virtual ranks and NCCL at world size 1 on one GPU")
    parser.add_argument("--calls", type=int, default=20,
                        help="--device cuda: all-reduces per captured graph")
    parser.add_argument("--reps", type=int, default=50, help="--device cuda: graph replays timed")
    parser.add_argument("--pin", action="store_true",
                        help="bind rank r (all its threads) to CPU r %% cpus; helps us, hurts gloo "
                             "(its I/O threads then share the rank's CPU), so off by default")


def fill_defaults(args: argparse.Namespace, dtypes: list[str], world_sizes: list[int]) -> None:
    """Give ``--dtypes`` and ``--world-sizes`` the defaults of the chosen path where the
    command line left them out (an explicit list is kept as given)."""
    if args.dtypes is None:
        args.dtypes = list(dtypes)
    if args.world_sizes is None:
        args.world_sizes = list(world_sizes)


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed ``args``; returns the exit status."""
    if args.device == "cuda":
        from device_comms.bench.cuda import run_cuda_bench

        fill_defaults(args, dtypes=["bfloat16"], world_sizes=[2, 4, 8])
        return run_cuda_bench(args)
    fill_defaults(args, dtypes=["float32", "bfloat16"], world_sizes=[2, 4])
    problem = _check_cpu_args(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    load_before = load_average()
    print(f"# load average before: {load_before} (timings are noisy on a busy machine)", flush=True)
    records = _run_world_sizes(args, _rank_config(args))
    if records is None:
        return 1
    _write_outputs(args, records, load_before)
    return 0


def _check_cpu_args(args: argparse.Namespace) -> str | None:
    """The option error to print (exit status 2), or None."""
    for ws in args.world_sizes:
        if ws < 2:
            return f"--world-sizes: every world size must be >= 2, got {ws}"
    if args.min_iters < 1 or args.max_iters < args.min_iters:
        return "--min-iters must be >= 1 and <= --max-iters"
    if not _rank_config(args)["sizes"]:
        return (f"no size is left between --min-bytes ({args.min_bytes}) and --max-bytes "
                f"({args.max_bytes})")
    if "dispatch_combine" in args.ops:
        odd = [ws for ws in args.world_sizes if args.experts % ws]
        if odd:
            return (f"--experts: dispatch_combine shards the experts evenly over the ranks, so "
                    f"--experts must be a multiple of every world size, got {args.experts} "
                    f"for world sizes {odd}")
        if args.topk > args.experts:
            return f"--topk must be <= --experts ({args.experts}), got {args.topk}"
    if args.plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return "--plot needs matplotlib: pip install 'groupcoord[plot]'"
    return None


def _rank_config(args: argparse.Namespace) -> dict[str, Any]:
    """What every rank needs to know: ops, dtypes, sizes, iteration budget."""
    sizes = args.sizes or [
        s for s in (DECODE_SIZES if args.decode else _DEFAULT_SIZES)
        if (args.min_bytes is None or s >= args.min_bytes)
        and (args.max_bytes is None or s <= args.max_bytes)
    ]
    return {
        "ops": list(args.ops), "dtypes": list(args.dtypes), "sizes": sizes,
        "min_iters": args.min_iters, "max_iters": args.max_iters,
        "budget": int(args.budget_mb * (1 << 20)),
        "threads": list(args.threads) if args.threads else [None],
        "workspace_bytes": args.workspace_bytes,
        "moe_shape": {"hidden": args.hidden, "experts": args.experts, "topk": args.topk},
    }


def _run_world_sizes(args: argparse.Namespace,
                     cfg: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Fresh ranks per world size; rank 0's records, or None when a rank failed."""
    from device_comms.bench.report import format_table
    from shm_broadcast.ranks.launcher import describe_exit, spawn_group

    records: list[dict[str, Any]] = []
    for ws in args.world_sizes:
        print(f"# world size {ws}: starting {ws} ranks ...", flush=True)
        # Resolve through the package so children can import it under `python -m` too.
        rank_fn = importlib.import_module("device_comms.bench.collectives").bench_rank
        outcomes = spawn_group(rank_fn, ws, (cfg,), timeout=args.timeout, pin_cpus=args.pin)
        bad = [o for o in outcomes if not o.ok]
        if bad:
            for o in bad:
                print(f"rank {o.rank} failed ({describe_exit(o.exitcode)}): {o.error}",
                      file=sys.stderr)
            return None
        records.extend(outcomes[0].result)
        print(format_table(outcomes[0].result), flush=True)
    return records


def _write_outputs(args: argparse.Namespace, records: list[dict[str, Any]],
                   load_before: list[float] | None) -> None:
    from device_comms.bench.report import write_json, write_plot

    meta = {
        "command": shlex.join(sys.argv),
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "loadavg_before": load_before,
        "loadavg_after": load_average(),
        "pinned": args.pin,
        "threads": ["cpus/world_size"] if not args.threads else [str(t) for t in args.threads],
    }
    if args.json_path:
        write_json(args.json_path, records, meta)
        print(f"wrote {args.json_path}")
    if args.plot_path:
        write_plot(args.plot_path, records)
        print(f"wrote {args.plot_path}")


# ---------------------------------------------------------------------- per rank
def bench_rank(rank: int, world_size: int, cfg: dict[str, Any]) -> list[dict[str, Any]] | None:
    import torch
    import torch.distributed as dist

    from device_comms.cpu.communicator import CpuCommunicator

    default = torch.get_num_threads()  # torch's own default, before anything set it
    counts = [threads_for(t, world_size) or default for t in cfg["threads"]]
    torch.set_num_threads(counts[0])
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError("torch.distributed is not initialised")
    comm = CpuCommunicator(
        world, torch.device("cpu"), unique_name="bench", workspace_bytes=cfg["workspace_bytes"],
    )
    records: list[dict[str, Any]] = []
    try:
        for op in cfg["ops"]:
            for dname in cfg["dtypes"]:
                dtype = getattr(torch, dname)
                for nbytes in cfg["sizes"]:
                    recs = _bench_point(comm, op, dtype, nbytes, cfg, rank, world_size, counts)
                    if rank == 0:
                        records.extend(recs)
    finally:
        comm.destroy()
    return records if rank == 0 else None


def _bench_point(
    comm: Any, op: str, dtype: Any, nbytes: int, cfg: dict[str, Any], rank: int, ws: int,
    counts: list[int],
) -> list[dict[str, Any]]:
    """One record per thread setting; the settings' samples interleave in blocks."""
    import torch
    import torch.distributed as dist

    from shm_broadcast.ranks.group_adapter import object_group

    calls, checks, extra = _point_calls(comm, op, dtype, nbytes, cfg, rank, ws)
    iters = int(min(cfg["max_iters"], max(cfg["min_iters"], cfg["budget"] // max(1, nbytes))))
    block = max(1, min(20, iters // 4))
    for n in counts:
        torch.set_num_threads(n)
        for _ in range(3):
            for call in calls.values():
                call()
    # times[name][i]: the samples of variant `name` at thread setting i
    times: dict[str, list[list[float]]] = {name: [[] for _ in counts] for name in calls}
    while len(times["shm"][0]) < iters:
        k = min(block, iters - len(times["shm"][0]))
        for i, n in enumerate(counts):
            torch.set_num_threads(n)
            for name, call in calls.items():
                _time(call, k, times[name][i], comm.barrier)
    torch.set_num_threads(counts[0])
    # msgpack over gloo (never pickle): the same path as the library's setup exchanges
    everyone = object_group(dist.group.WORLD).all_gather((times, checks))
    passed = {name: all(v[1][name] for v in everyone) for name in checks}
    recs = []
    for i, n in enumerate(counts):
        setting = cfg["threads"][i]
        rec: dict[str, Any] = {
            "world_size": ws, "op": op, "dtype": str(dtype).removeprefix("torch."),
            "bytes": nbytes, "iters": iters, "mode": comm.mode,
            "threads": n,
            "threads_setting": "cpus/world_size" if setting is None else str(setting),
            "engine_threads": comm.describe()["engine_threads"],
        }
        for name in calls:
            slowest = [max(v[0][name][i][j] for v in everyone) for j in range(iters)]
            rec[f"{name}_p50_us"] = _pct(slowest, 50)
            rec[f"{name}_p99_us"] = _pct(slowest, 99)
        rec["results_match"] = all(passed.values())
        if len(passed) > 1:
            rec["checks"] = passed
        recs.append({**rec, **extra})
    return recs


def _point_calls(
    comm: Any, op: str, dtype: Any, nbytes: int, cfg: dict[str, Any], rank: int, ws: int
) -> tuple[dict[str, Callable[[], Any]], dict[str, bool], dict[str, Any]]:
    """The calls to time by variant (ours, ``shm``, first), whether each variant's
    result checked out on this rank, and record extras."""
    if op == "dispatch_combine":
        from device_comms.bench import dispatch_combine

        shape = dispatch_combine.Shape(**cfg["moe_shape"])
        return dispatch_combine.point_calls(comm, dtype, nbytes, rank, ws, shape)
    ours, raw, same, extra = _paired_calls(comm, op, dtype, nbytes, rank, ws)
    return {"shm": ours, "gloo": raw}, {"shm_vs_gloo": same}, extra


def _paired_calls(
    comm: Any, op: str, dtype: Any, nbytes: int, rank: int, ws: int
) -> tuple[Callable[[], Any], Callable[[], Any], bool, dict[str, Any]]:
    """Our call, the raw gloo call, whether their results agree, and record extras."""
    import torch
    import torch.distributed as dist

    item = torch.empty((), dtype=dtype).element_size()
    numel = max(ws, nbytes // item // ws * ws)
    gen = torch.Generator().manual_seed(1234 + rank)
    if dtype.is_floating_point:
        full = torch.randn(numel, generator=gen).to(dtype)
    else:
        full = torch.randint(-100, 100, (numel,), generator=gen, dtype=dtype)
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    extra: dict[str, Any] = {}
    if op == "all_reduce":
        x, y = full, full.clone()

        def ours() -> Any:
            return comm.all_reduce(x)

        def raw() -> Any:
            return dist.all_reduce(y)

        check = (comm.all_reduce(x), _gloo_copy(dist.all_reduce, full))
    elif op == "all_to_allv":
        ours, raw, check, extra = _all_to_allv_point(comm, full, rank, ws)
    elif op == "all_gather":
        x = full[: numel // ws].clone()
        out = torch.empty(numel, dtype=dtype)

        def ours() -> Any:
            return comm.all_gather(x, 0)

        def raw() -> Any:
            return ag(out, x)

        raw()
        check = (comm.all_gather(x, 0), out.clone())
    else:
        x = full
        out = torch.empty(numel // ws, dtype=dtype)

        def ours() -> Any:
            return comm.reduce_scatter(x, 0)

        def raw() -> Any:
            return rs(out, x)

        raw()
        check = (comm.reduce_scatter(x, 0), out.clone())
    exact = op in ("all_gather", "all_to_allv") or not dtype.is_floating_point
    same = bool(torch.equal(*check)) if exact else bool(
        torch.allclose(check[0].float(), check[1].float(), rtol=2e-2, atol=2e-2 * ws)
    )
    return ours, raw, same, extra


def routing_splits(rows: int, ws: int, rank: int) -> list[int]:
    """Rows ``rank`` sends each rank: skewed like MoE routing (see the module docstring).

    Deterministic in ``(rows, ws, rank)``, so every rank knows every rank's
    splits (and with them its own receive sizes).
    """
    import torch

    gen = torch.Generator().manual_seed(4321 + 17 * rank + ws)
    weights = [(1.0 / (j + 1)) * float(torch.empty(1).log_normal_(0.0, 0.5, generator=gen))
               for j in range(ws)]
    if ws > 2:
        weights[(rank + 1) % ws] = 0.0  # one peer gets nothing from this rank
    total = sum(weights)
    exact = [rows * w / total for w in weights]
    out = [int(e) for e in exact]
    for j in sorted(range(ws), key=lambda j: exact[j] - out[j], reverse=True)[: rows - sum(out)]:
        out[j] += 1  # largest remainders: the splits sum to rows
    return out


def _all_to_allv_point(comm: Any, full: Any, rank: int, ws: int) -> tuple[Any, Any, Any, Any]:
    """``(ours, raw gloo, (our result, gloo's result), record extras)`` of one point.

    The extras: ``row_bytes``, and ``hot_share``, the fraction of every rank's
    rows that goes to the busiest receiver.
    """
    import torch
    import torch.distributed as dist

    item = full.element_size()
    width = max(1, min(4096 // item, full.numel() // (4 * ws)))  # row of at most 4 KiB
    rows = full.numel() // width
    x = full[: rows * width].view(rows, width)
    splits = [routing_splits(rows, ws, r) for r in range(ws)]
    send, recv = splits[rank], [splits[r][rank] for r in range(ws)]
    out = x.new_empty((sum(recv), width))
    xb = x.reshape(-1).view(torch.uint8).view(rows, width * item)
    ob = out.reshape(-1).view(torch.uint8).view(sum(recv), width * item)

    def raw() -> None:
        dist.all_to_all_single(ob, xb, output_split_sizes=recv, input_split_sizes=send)

    raw()
    hot = max(sum(splits[r][j] for r in range(ws)) for j in range(ws)) / max(1, ws * rows)
    extra = {"row_bytes": width * item, "hot_share": round(hot, 3)}
    check = (comm.all_to_allv(x, send), out.clone())
    return (lambda: comm.all_to_allv(x, send, recv)), raw, check, extra


def _gloo_copy(fn: Callable[..., Any], t: Any) -> Any:
    y = t.clone()
    fn(y)
    return y


def _time(fn: Callable[[], Any], k: int, into: list[float], sync: Callable[[], None]) -> None:
    clock = time.perf_counter
    for _ in range(k):
        sync()  # ranks start each sample together (a ~5 us shared-memory barrier)
        t0 = clock()
        fn()
        into.append((clock() - t0) * 1e6)


def _pct(samples: list[float], q: float) -> float:
    if q == 50:
        return float(statistics.median(samples))
    s = sorted(samples)
    return float(s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))])


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m device_comms.bench.collectives``."""
    parser = argparse.ArgumentParser(
        prog="python -m device_comms.bench.collectives",
        description="CPU shared-memory collectives vs gloo",
    )
    add_bench_args(parser)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

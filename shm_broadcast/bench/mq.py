"""``groupcoord bench mq``: MessageQueue against gloo and pickle-over-zmq.

One writer (this process) and 1 or 3 local reader processes per transport.
For every payload of :mod:`shm_broadcast.bench.payloads` and every transport
it measures, in the same run and interleaved payload by payload (so machine
noise hits all transports alike):

* **round trip** (``rt_p50_us``/``rt_p99_us``): the writer sends the payload
  to every reader, each reader decodes it and replies with a tiny ack, the
  writer has received every ack. The MessageQueue acks through one
  single-reader MessageQueue per reader; the baselines use their own
  transport back (see :mod:`shm_broadcast.bench.baselines`);
* **throughput** (``msgs_per_s``/``MB_per_s``): the writer streams N payloads
  back to back, every reader decodes all of them and acks once at the end;
  MB/s counts the payload's size (msgpack + raw tensor bytes) once per
  message, whatever the transport puts on the wire;
* **idle** (MessageQueue only): the readers wait ``idle_s`` seconds with no
  message while their CPU time is read with psutil, then one-way wake-up
  latency (writer's enqueue -> reader's dequeue returns, same-host monotonic
  clock) is sampled after gaps long enough for the readers to park (0.25 s),
  with the writer busy in between (reported) and with it sleeping too.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from shm_broadcast.bench.baselines import GlooDriver, ZmqPickleDriver
from shm_broadcast.bench.payloads import make_payload, payload_names
from shm_broadcast.bench.wake import bare_wake_latencies, busy_wait, wake_gaps
from shm_broadcast.codec.message_codec import Codec
from shm_broadcast.queue.message_queue import (
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_MAX_CHUNKS,
    MessageQueue,
)
from shm_broadcast.ranks.launcher import stop_ranks

__all__ = ["BenchConfig", "MqDriver", "run_bench", "format_table"]

_READY_S = 120.0


@dataclass
class BenchConfig:
    """What ``groupcoord bench mq`` measures.

    Attributes:
        readers: Reader-process counts to run (each a separate setup).
        payloads: Payload names (see :func:`payload_names`).
        seconds: Target duration of each measurement (round trips; stream).
        min_iters: Fewest iterations per measurement.
        max_iters: Most iterations per measurement.
        baselines: Also measure gloo and pickle+zmq.
        idle_s: Idle period for the CPU measurement (0 skips the idle test).
        wake_samples: Wake-up latency samples after the idle period.
        chunk_bytes: Ring chunk size of the measured queue (default: the queue's).
        chunks: Ring chunks of the measured queue (default: the queue's).
    """

    readers: list[int] = field(default_factory=lambda: [1, 3])
    payloads: list[str] = field(default_factory=payload_names)
    seconds: float = 1.0
    min_iters: int = 5
    max_iters: int = 5000
    baselines: bool = True
    idle_s: float = 5.0
    wake_samples: int = 20
    chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
    chunks: int = DEFAULT_MAX_CHUNKS


# ---------------------------------------------------------------- MessageQueue
def _mq_reader(handle: Any, rank: int, handles: Any) -> None:
    fwd = MessageQueue.create_from_handle(handle, rank)
    back = MessageQueue(1, 1, [0], max_chunk_bytes=1 << 16, max_chunks=4,
                        name=f"bench-ack-{rank}", writer_rank=rank)
    try:
        handles.put((rank, back.export_handle()))
        fwd.wait_until_ready(_READY_S)
        back.wait_until_ready(_READY_S)
        while True:
            cmd, n = fwd.dequeue()
            if cmd == "stop":
                break
            if cmd == "idle":
                for _ in range(n):
                    msg = fwd.dequeue()
                    back.enqueue(time.perf_counter() - msg["t"])
                continue
            for _ in range(n):
                fwd.dequeue()
                if cmd == "rt":
                    back.enqueue(1)
            if cmd == "stream":
                back.enqueue(1)
    finally:
        back.close()
        fwd.close()


class MqDriver:
    """The writer of a MessageQueue whose readers are fresh processes.

    Args:
        n_readers: Reader processes (all local).
        ctx: A ``multiprocessing`` spawn context.
        chunk_bytes: Ring chunk size.
        chunks: Ring chunks.
    """

    label = "shm_broadcast MessageQueue"

    def __init__(self, n_readers: int, ctx: Any, chunk_bytes: int, chunks: int) -> None:
        self._ctx = ctx
        ranks = list(range(1, n_readers + 1))
        self._fwd = MessageQueue(n_readers, n_readers, ranks, max_chunk_bytes=chunk_bytes,
                                 max_chunks=chunks, name="bench-mq", writer_rank=0)
        self._back: list[MessageQueue] = []
        q = ctx.Queue()
        handle = self._fwd.export_handle()
        self._procs = [ctx.Process(target=_mq_reader, args=(handle, r, q), daemon=True)
                       for r in ranks]
        try:
            for p in self._procs:
                p.start()
            got = dict(q.get(timeout=_READY_S) for _ in ranks)
            self._back = [MessageQueue.create_from_handle(got[r], 0) for r in ranks]
            self._fwd.wait_until_ready(_READY_S)
            for b in self._back:
                b.wait_until_ready(_READY_S)
        except BaseException:
            self.close(stop=False)
            raise

    @property
    def pids(self) -> list[int]:
        """Reader process ids."""
        return [p.pid for p in self._procs]

    def rt(self, obj: Any, n: int) -> list[float]:
        """``n`` round trips of ``obj`` (seconds each)."""
        fwd, backs = self._fwd, self._back
        fwd.enqueue(("rt", n))
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            fwd.enqueue(obj)
            for b in backs:
                b.dequeue()
            out.append(time.perf_counter() - t0)
        return out

    def stream(self, obj: Any, n: int) -> float:
        """Seconds to deliver ``n`` messages to every reader."""
        fwd = self._fwd
        fwd.enqueue(("stream", n))
        t0 = time.perf_counter()
        for _ in range(n):
            fwd.enqueue(obj)
        for b in self._back:
            b.dequeue()
        return time.perf_counter() - t0

    def idle(self, idle_s: float, samples: int, gap_s: float = 0.25) -> dict[str, Any]:
        """Idle CPU of the readers over ``idle_s``, then wake-up latencies.

        Wake-ups are sampled twice: with the writer busy between samples (the
        engine case: only the readers idle; this is the reported number) and
        with the writer sleeping too (its own cold start then adds to it).
        Gaps are randomised around ``gap_s`` (see :mod:`shm_broadcast.bench.wake`),
        and the same gaps are replayed on a bare sleeping process: the
        platform's wake-up floor, measured in the same run.
        """
        procs = [psutil.Process(pid) for pid in self.pids]
        self._fwd.enqueue(("idle", 2 * samples + 1))
        time.sleep(0.2)  # let the readers park before measuring
        before = [p.cpu_times() for p in procs]
        t0 = time.monotonic()
        time.sleep(idle_s)
        elapsed = time.monotonic() - t0
        after = [p.cpu_times() for p in procs]
        cpu = [100.0 * ((a.user + a.system) - (b.user + b.system)) / elapsed
               for a, b in zip(after, before, strict=True)]
        gaps = wake_gaps(samples + 1, gap_s)
        warm = self._wake(gaps, busy=True)
        first = max(warm[: len(self._back)])
        cold = self._wake(gaps[1:], busy=False)
        warm.sort()
        cold.sort()
        floor = bare_wake_latencies(self._ctx, gaps[1:], busy=True)
        floor_p50 = _pct(floor, 50)
        return {
            "idle_s": round(elapsed, 2),
            "idle_cpu_percent_max": round(max(cpu), 2),
            "idle_cpu_percent": [round(c, 2) for c in cpu],
            "wake_samples": len(warm),
            "wake_p50_us": round(_pct(warm, 50) * 1e6, 1),
            "wake_p99_us": round(_pct(warm, 99) * 1e6, 1),
            "wake_after_idle_us": round(first * 1e6, 1),
            "wake_writer_also_idle_p50_us": round(_pct(cold, 50) * 1e6, 1),
            "floor_wake_p50_us": round(floor_p50 * 1e6, 1),
            "floor_wake_p99_us": round(_pct(floor, 99) * 1e6, 1),
            "wake_x_floor": round(_pct(warm, 50) / floor_p50, 2) if floor_p50 > 0 else None,
        }

    def _wake(self, gaps: list[float], busy: bool) -> list[float]:
        """One-way latencies of messages sent ``gaps`` apart (readers parked)."""
        out: list[float] = []
        for gap in gaps:
            if busy:
                busy_wait(gap)
            else:
                time.sleep(gap)
            self._fwd.enqueue({"t": time.perf_counter()})
            out.extend(b.dequeue() for b in self._back)
        return out

    def close(self, stop: bool = True) -> None:
        """Stop the readers and close every queue."""
        try:
            if stop and not self._fwd.closed:
                self._fwd.enqueue(("stop", 0), timeout=10)
        except Exception:
            pass
        finally:
            stop_ranks(self._procs, wait_first=20.0)
            for b in self._back:
                b.close()
            self._fwd.close()


# ------------------------------------------------------------------ measuring
def _pct(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return float("nan")
    i = min(len(sorted_values) - 1, int(round(p / 100 * (len(sorted_values) - 1))))
    return sorted_values[i]


def _measure(drivers: list[Any], obj: Any, size: int, cfg: BenchConfig) -> list[dict[str, Any]]:
    """Measure every driver on ``obj``, interleaved in rounds so that load
    changes on a shared machine hit all transports alike."""
    rounds = 3
    iters = []
    for d in drivers:
        warm = d.rt(obj, 3)
        per = max(statistics.median(warm), 1e-7)
        iters.append(int(min(cfg.max_iters, max(cfg.min_iters, cfg.seconds / per))))
        d.rt(obj, min(50, max(3, iters[-1] // 10)))
    lat: list[list[float]] = [[] for _ in drivers]
    for r in range(rounds):
        for k, d in enumerate(drivers):
            # the rounds share iters[k] exactly: --max-iters caps the samples taken
            lat[k].extend(d.rt(obj, iters[k] // rounds + (r < iters[k] % rounds)))
    out = []
    for k, d in enumerate(drivers):
        n_stream = iters[k]
        secs = d.stream(obj, n_stream)
        ls = sorted(lat[k])
        out.append({
            "rt_iters": len(ls),
            "rt_p50_us": round(_pct(ls, 50) * 1e6, 1),
            "rt_p99_us": round(_pct(ls, 99) * 1e6, 1),
            "stream_msgs": n_stream,
            "msgs_per_s": round(n_stream / secs, 1),
            "MB_per_s": round(n_stream * size / secs / 1e6, 1),
        })
    return out


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every configured measurement; returns the JSON-ready report."""
    ctx = mp.get_context("spawn")
    load_start = [round(x, 2) for x in os.getloadavg()]
    codec = Codec()
    sizes = {}
    for name in cfg.payloads:
        enc = codec.encode(make_payload(name, 0))
        sizes[name] = len(enc.msg) + enc.blob_len
    rows: list[dict[str, Any]] = []
    idle: list[dict[str, Any]] = []
    for n_readers in cfg.readers:
        log(f"[bench mq] {n_readers} reader(s): starting processes")
        drivers: list[Any] = []
        try:
            drivers.append(MqDriver(n_readers, ctx, cfg.chunk_bytes, cfg.chunks))
            if cfg.baselines:
                drivers.append(GlooDriver(n_readers, ctx))
                drivers.append(ZmqPickleDriver(n_readers, ctx))
            for name in cfg.payloads:
                obj = make_payload(name, 0)
                for d, r in zip(drivers, _measure(drivers, obj, sizes[name], cfg), strict=True):
                    row = {"readers": n_readers, "payload": name, "payload_bytes": sizes[name],
                           "method": d.label, **r}
                    rows.append(row)
                    log(f"[bench mq]   {name:>5} {d.label:<28} p50 {r['rt_p50_us']:>10.1f} us")
            if cfg.idle_s > 0:
                res = drivers[0].idle(cfg.idle_s, cfg.wake_samples)
                idle.append({"readers": n_readers, **res})
                log(f"[bench mq]   idle: {res}")
        finally:
            for d in reversed(drivers):
                d.close()
    _add_ratios(rows)
    return {
        "definitions": {
            "rt": "writer sends the payload to every reader, each decodes it and acks; time "
                  "until the writer has every ack",
            "stream": "writer sends N payloads back to back, readers decode all and ack once; "
                      "MB/s counts payload bytes (msgpack + raw tensors) once per message",
            "idle": "reader CPU (psutil) while waiting idle_s with no message; then one-way "
                    "wake-up latency writer enqueue -> reader dequeue",
            "floor_wake": "same gaps replayed on a bare process sleeping in poll() on a Unix "
                          "datagram socket: the platform's wake-up floor (bench_wake.py)",
            "x_vs_mq": "baseline rt_p50 / MessageQueue rt_p50, same run",
        },
        "config": asdict(cfg),
        "host": {"hostname": socket.gethostname(), "cpus": os.cpu_count(),
                 "python": platform.python_version(), "machine": platform.machine(),
                 "loadavg_at_start": load_start,
                 "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "results": rows,
        "idle": idle,
    }


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    mq = {(r["readers"], r["payload"]): r for r in rows if r["method"] == MqDriver.label}
    for r in rows:
        base = mq.get((r["readers"], r["payload"]))
        if base is not None and base["rt_p50_us"] > 0:
            r["x_vs_mq"] = float(f"{r['rt_p50_us'] / base['rt_p50_us']:.3g}")  # never rounds to 0


def format_table(report: dict[str, Any]) -> str:
    """Render the report as a fixed-width text table."""
    head = (f"{'readers':>7} {'payload':>7} {'bytes':>9}  {'method':<28} {'rt p50 us':>10} "
            f"{'rt p99 us':>10} {'msg/s':>9} {'MB/s':>8} {'p50 vs mq':>9}")
    lines = [head, "-" * len(head)]
    for r in report["results"]:
        ratio = "" if r["method"] == MqDriver.label else f"{r.get('x_vs_mq', float('nan')):.3g}x"
        lines.append(
            f"{r['readers']:>7} {r['payload']:>7} {r['payload_bytes']:>9}  {r['method']:<28} "
            f"{r['rt_p50_us']:>10.1f} {r['rt_p99_us']:>10.1f} {r['msgs_per_s']:>9.0f} "
            f"{r['MB_per_s']:>8.1f} {ratio:>9}")
    for i in report["idle"]:
        lines.append(
            f"idle ({i['readers']} reader(s)): max reader CPU {i['idle_cpu_percent_max']}% of a "
            f"core over {i['idle_s']} s; wake-up one-way p50 {i['wake_p50_us']} us, p99 "
            f"{i['wake_p99_us']} us ({i['wake_samples']} samples, writer busy; first after the "
            f"idle period {i['wake_after_idle_us']} us; writer idle too: p50 "
            f"{i['wake_writer_also_idle_p50_us']} us); bare-process wake-up floor, same run: "
            f"p50 {i.get('floor_wake_p50_us')} us, queue = {i.get('wake_x_floor')}x floor")
    return "\n".join(lines)

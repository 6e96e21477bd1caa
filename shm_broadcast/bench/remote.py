"""``groupcoord bench mq-remote``: the queue's TCP path against plain zmq.

``groupcoord bench mq`` measures local readers (shared memory). This bench
measures what a reader on another host gets: the writer's zmq TCP endpoint,
authenticated and encrypted with CURVE. Two processes, A (this one) and an
echo process B, on loopback:

* **groupcoord queue (CURVE)**: A writes queue ``ping`` whose only reader, B,
  is remote; B answers every message on its queue ``pong`` whose only reader,
  A, is remote too. Every hop is encoded by the codec (no pickle), sealed and
  authenticated by CURVE.
* **pickle + zmq TCP**: ``pickle.dumps`` over plain TCP PUB/SUB in both
  directions, the way hand-rolled remote broadcasters ship metadata
  (unauthenticated, and the receiver unpickles what arrives).
* **raw bytes zmq TCP**: the payload's encoded size as opaque bytes over the
  same plain PUB/SUB, no codec and no cipher: the transport's floor.

One round trip = A sends the payload until A holds B's echo, decoded. The
transports run interleaved, in rounds, payload by payload, so load changes on
a shared machine hit all of them alike; ``x_vs_mq`` is a transport's p50 over
the queue's, in the same run. ``--threads`` sets torch's intra-op threads in
both processes (default: torch's own default).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import zmq

from shm_broadcast.bench.payloads import make_payload, payload_names
from shm_broadcast.cli_args import MAX_THREADS, number, output_path
from shm_broadcast.codec.message_codec import Codec
from shm_broadcast.queue.message_queue import MessageQueue
from shm_broadcast.queue.transport import bind
from shm_broadcast.ranks.launcher import stop_ranks

__all__ = ["EchoDied", "QueueEcho", "ZmqEcho", "measure_all", "add_args", "run"]

_READY_S = 60.0
_RECV_MS = 60_000
_ROUNDS = 4
_DEFAULT_PAYLOADS = ["256B", "4KB", "64KB", "1MB"]


def _set_threads(threads: int) -> None:
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


class EchoDied(RuntimeError):
    """The echo process B exited while A waited for it."""


def _first_message(conn: Any, proc: Any, what: str) -> Any:
    """What echo process ``proc`` sends first on ``conn``: its endpoint or handle.

    Raises:
        EchoDied: ``proc`` exited before sending it (told at once, with its
            exit status: its own traceback is on stderr above).
        TimeoutError: Nothing came within ``_READY_S`` seconds.
    """
    deadline = time.monotonic() + _READY_S
    while not conn.poll(0.05):
        # Polled once more after it is seen dead: it may have sent, then exited.
        if not proc.is_alive() and not conn.poll(0):
            raise EchoDied(f"the {what} echo process exited (exit status {proc.exitcode}) "
                           f"before it started")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the {what} echo process did not start within {_READY_S:.0f} s")
    return conn.recv()


# ------------------------------------------------------------------ the queue
def _queue_echo(ping_handle: Any, conn: Any, threads: int) -> None:
    """Process B: read every ping as remote rank 1, answer on its own queue."""
    _set_threads(threads)
    ping = MessageQueue.create_from_handle(ping_handle, rank=1)
    pong = MessageQueue(1, 0, connect_ip="127.0.0.1", name="bench-pong")
    try:
        conn.send(pong.export_handle())
        ping.wait_until_ready(_READY_S)
        pong.wait_until_ready(_READY_S)
        while True:
            msg = ping.dequeue(timeout=_READY_S)
            if isinstance(msg, str) and msg == "stop":
                break
            pong.enqueue(msg, timeout=_READY_S)
    finally:
        ping.close()
        pong.close()


class QueueEcho:
    """Round trips through two MessageQueues with one remote (TCP, CURVE) reader each."""

    label = "groupcoord queue (CURVE)"

    def __init__(self, ctx: Any, threads: int) -> None:
        self._ping = MessageQueue(1, 0, connect_ip="127.0.0.1", name="bench-ping")
        self._pong: MessageQueue | None = None
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_queue_echo, daemon=True,
                                 args=(self._ping.export_handle(), child, threads))
        self._proc.start()
        try:
            self._pong = MessageQueue.create_from_handle(
                _first_message(parent, self._proc, "queue"), rank=0)
            self._ping.wait_until_ready(_READY_S)
            self._pong.wait_until_ready(_READY_S)
        except BaseException:
            self.close()
            raise

    def rt(self, obj: Any, n: int) -> list[float]:
        """``n`` round trips of ``obj``, seconds each."""
        ping, pong, out = self._ping, self._pong, []
        if pong is None:
            raise RuntimeError("the echo queue is closed")
        for _ in range(n):
            t0 = time.perf_counter()
            ping.enqueue(obj, timeout=_READY_S)
            pong.dequeue(timeout=_READY_S)
            out.append(time.perf_counter() - t0)
        return out

    def close(self) -> None:
        """Stop the echo process and close both queues."""
        try:
            if not self._ping.closed and self._pong is not None:
                self._ping.enqueue("stop", timeout=5)
        except Exception:
            pass
        finally:
            stop_ranks([self._proc], wait_first=10)
            self._ping.close()
            if self._pong is not None:
                self._pong.close()


# --------------------------------------------------------------------- zmq
def _pub_sub(ctx: zmq.SyncContext) -> tuple[zmq.SyncSocket, zmq.SyncSocket]:
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    for s in (pub, sub):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.RCVTIMEO, _RECV_MS)
    sub.subscribe(b"")
    return pub, sub


def _zmq_echo(a_pub: str, conn: Any, use_pickle: bool, threads: int) -> None:
    """Process B of a zmq baseline: echo every frame (unpickled and re-pickled if asked)."""
    _set_threads(threads)
    ctx = zmq.Context()
    pub, sub = _pub_sub(ctx)
    try:
        sub.connect(a_pub)
        conn.send(bind(pub, "tcp://127.0.0.1:*"))
        while True:
            frame = sub.recv()
            if frame == b"stop":
                break
            if use_pickle and frame != b"sync":  # the bench's own child: trusted bytes
                frame = pickle.dumps(pickle.loads(frame), protocol=pickle.HIGHEST_PROTOCOL)
            pub.send(frame)
    finally:
        pub.close(0)
        sub.close(0)
        ctx.term()


class ZmqEcho:
    """Round trips over plain TCP PUB/SUB, pickled objects or raw bytes."""

    def __init__(self, ctx: Any, threads: int, use_pickle: bool) -> None:
        self.label = "pickle + zmq TCP" if use_pickle else "raw bytes zmq TCP"
        self._pickle = use_pickle
        self._zctx = zmq.Context()
        self._pub, self._sub = _pub_sub(self._zctx)
        endpoint = bind(self._pub, "tcp://127.0.0.1:*")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_zmq_echo, daemon=True, args=(
            endpoint, child, use_pickle, threads))
        self._proc.start()
        try:
            self._sub.connect(_first_message(parent, self._proc, "zmq"))
            self._sync()
        except BaseException:
            self.close()
            raise

    def _sync(self) -> None:
        """Ping until the echo answers: both subscriptions are then in place."""
        deadline = time.monotonic() + _READY_S
        while not self._sub.poll(20):
            if not self._proc.is_alive():
                raise EchoDied(f"the zmq echo process exited (exit status {self._proc.exitcode}) "
                               f"before it subscribed")
            if time.monotonic() > deadline:
                raise TimeoutError("the zmq echo process did not subscribe")
            self._pub.send(b"sync")
        while self._sub.poll(100):  # late answers to earlier syncs
            self._sub.recv()

    def rt(self, obj: Any, n: int) -> list[float]:
        """``n`` round trips of ``obj`` (``bytes`` of its encoded size when raw)."""
        pub, sub, out = self._pub, self._sub, []
        for _ in range(n):
            t0 = time.perf_counter()
            if self._pickle:
                pub.send(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
                pickle.loads(sub.recv())
            else:
                pub.send(obj)
                sub.recv()
            out.append(time.perf_counter() - t0)
        return out

    def close(self) -> None:
        """Stop the echo process and close the sockets."""
        try:
            self._pub.send(b"stop")
            time.sleep(0.02)
        finally:
            stop_ranks([self._proc], wait_first=10)
            self._pub.close(0)
            self._sub.close(0)
            self._zctx.term()


# ------------------------------------------------------------------ measuring
def _pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def _measure(drivers: list[Any], objs: list[Any], iters: int) -> list[dict[str, Any]]:
    """Round trips of every driver, interleaved in rounds; ``objs[k]`` goes to driver ``k``."""
    lat: list[list[float]] = [[] for _ in drivers]
    for d, obj in zip(drivers, objs, strict=True):
        d.rt(obj, max(10, iters // 10))  # warm up caches, allocators, the cipher
    for _ in range(_ROUNDS):
        for k, (d, obj) in enumerate(zip(drivers, objs, strict=True)):
            lat[k].extend(d.rt(obj, -(-iters // _ROUNDS)))
    return [{"method": d.label, "rt_iters": len(ls),
             "rt_p50_us": round(_pct(ls, 50) * 1e6, 1),
             "rt_p99_us": round(_pct(ls, 99) * 1e6, 1),
             "rt_mean_us": round(statistics.fmean(ls) * 1e6, 1)}
            for d, ls in zip(drivers, lat, strict=True)]


def measure_all(payloads: list[str], iters: int, threads: int = 0, baselines: bool = True,
                log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the bench; returns the JSON-ready report (``results`` rows, one per transport
    and payload, with ``x_vs_mq`` on the baselines)."""
    ctx = mp.get_context("spawn")
    codec, rows = Codec(), []
    drivers: list[Any] = []
    try:
        drivers.append(QueueEcho(ctx, threads))
        if baselines:
            drivers += [ZmqEcho(ctx, threads, True), ZmqEcho(ctx, threads, False)]
        for name in payloads:
            obj = make_payload(name, 0)
            enc = codec.encode(obj)
            size = len(enc.msg) + enc.blob_len
            objs = [obj, obj, bytes(size)][: len(drivers)]
            res = _measure(drivers, objs, iters)
            for r in res:
                r.update(payload=name, payload_bytes=size,
                         x_vs_mq=float(f"{r['rt_p50_us'] / res[0]['rt_p50_us']:.3g}"))
                log(f"[bench mq-remote] {name:>5} {r['method']:<26} p50 {r['rt_p50_us']:>9.1f} us"
                    f"  p99 {r['rt_p99_us']:>9.1f} us")
            rows += res
    finally:
        for d in reversed(drivers):
            d.close()
    return {"definitions": {"rt": "A sends the payload to B over TCP loopback, B decodes and "
                                  "echoes it, A holds the decoded echo",
                            "x_vs_mq": "transport rt p50 / groupcoord queue rt p50, same run"},
            "config": {"payloads": payloads, "iters": iters, "rounds": _ROUNDS,
                       "torch_threads": threads or "torch default"},
            "host": {"cpus": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()]},
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "results": rows}


def add_args(parser: argparse.ArgumentParser) -> None:
    """Options of ``groupcoord bench mq-remote``."""
    parser.add_argument("--payloads", nargs="+", default=_DEFAULT_PAYLOADS,
                        choices=payload_names(), help="payloads to send")
    parser.add_argument("--iters", type=number(int, minimum=_ROUNDS), default=2000,
                        help=f"round trips per transport and payload (split over {_ROUNDS} "
                             f"interleaved rounds; at least {_ROUNDS}; default 2000)")
    parser.add_argument("--threads", type=number(int, minimum=0, maximum=MAX_THREADS), default=0,
                        help=f"torch intra-op threads per process, 0 to {MAX_THREADS} (0: torch's "
                             f"default)")
    parser.add_argument("--no-baselines", action="store_true", help="measure only the queue")
    parser.add_argument("--json", dest="json_path", type=output_path,
                        help="also write the report as JSON")


def run(args: argparse.Namespace) -> int:
    """Run ``groupcoord bench mq-remote``.

    Options are checked by :func:`add_args`'s types (argparse exits 2 naming
    the option).

    Returns:
        0, or 1 when an echo process died (its exit status on stderr).
    """
    try:
        report = measure_all(args.payloads, args.iters, args.threads, not args.no_baselines)
    except EchoDied as e:
        print(f"groupcoord bench mq-remote: {e}", file=sys.stderr)
        return 1
    print(f"{'payload':>7} {'bytes':>8}  {'method':<26} {'p50 us':>9} {'p99 us':>9} "
          f"{'vs queue':>8}")
    for r in report["results"]:
        print(f"{r['payload']:>7} {r['payload_bytes']:>8}  {r['method']:<26} "
              f"{r['rt_p50_us']:>9.1f} {r['rt_p99_us']:>9.1f} {r['x_vs_mq']:>7.2f}x")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def main() -> int:
    """Stand-alone entry: ``python path/to/remote.py [options]`` measures whichever
    ``shm_broadcast`` is first on ``PYTHONPATH`` (an A/B of two checkouts with
    ``--no-baselines``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())

"""Baseline transports for ``groupcoord bench mq``, measured like the queue.

Every driver offers the same three measurements, each preceded by a command
message the readers obey:

* ``rt(obj, n)``: ``n`` round trips; one round trip = the writer sends ``obj``
  to every reader, each reader decodes it and replies with a tiny ack, the
  writer has received every ack. Returns the latencies in seconds.
* ``stream(obj, n)``: the writer sends ``n`` messages back to back, each
  reader decodes all of them and acks once at the end. Returns seconds.
* ``close()``: stop the readers and release everything.

Baselines:

* :class:`GlooDriver`: ``torch.distributed`` gloo ``broadcast_object_list``
  from rank 0; the ack comes back with ``broadcast_object_list`` from the
  reader (1 reader) or ``gather_object`` to rank 0 (several readers).
* :class:`ZmqPickleDriver`: ``pickle.dumps`` over a pyzmq ``ipc://`` PUB/SUB,
  acks over PUSH/PULL -- what a hand-rolled broadcaster usually does. Its
  sockets are files in a fresh private directory (``0700``, see
  :mod:`shm_broadcast.lifecycle.channel_dirs`), so only this user's processes can
  connect; commands and acks are raw bytes, and only the measured payloads
  are pickled, between the bench's own processes.
"""

from __future__ import annotations

import os
import pickle
import struct
import time
from datetime import timedelta
from typing import Any

import zmq

from shm_broadcast.lifecycle.channel_dirs import new_channel_dir, remove_channel_dir
from shm_broadcast.ranks.launcher import free_port, stop_ranks

__all__ = ["GlooDriver", "ZmqPickleDriver"]

_JOIN_S = 20.0
_GLOO_TIMEOUT_S = 120
_ZMQ_RECV_TIMEOUT_MS = 120_000


def _reap(procs: list[Any]) -> None:
    """Readers exit after their stop command; whatever does not is killed."""
    stop_ranks(procs, wait_first=_JOIN_S)


# ----------------------------------------------------------------------- gloo
def _gloo_back(dist: Any, world: int, rank: int, value: Any) -> None:
    if world == 2:
        box = [value]
        dist.broadcast_object_list(box, src=1)
    else:
        dist.gather_object(value, [None] * world if rank == 0 else None, dst=0)


def _gloo_reader(port: int, rank: int, world: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=_GLOO_TIMEOUT_S))
    try:
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            cmd, n = box[0]
            if cmd == "stop":
                break
            for _ in range(n):
                dist.broadcast_object_list([None], src=0)
                if cmd == "rt":
                    _gloo_back(dist, world, rank, 1)
            if cmd == "stream":
                _gloo_back(dist, world, rank, 1)
    finally:
        dist.destroy_process_group()


class GlooDriver:
    """Rank 0 of a fresh gloo group whose other ranks are reader processes.

    Args:
        n_readers: Reader processes to start.
        ctx: A ``multiprocessing`` spawn context.
    """

    label = "gloo broadcast_object_list"

    def __init__(self, n_readers: int, ctx: Any) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("the gloo baseline needs a process without a default group")
        self._dist = dist
        self._world = n_readers + 1
        port = free_port()
        self._procs = [ctx.Process(target=_gloo_reader, args=(port, r, self._world), daemon=True)
                       for r in range(1, self._world)]
        for p in self._procs:
            p.start()
        try:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                    world_size=self._world,
                                    timeout=timedelta(seconds=_GLOO_TIMEOUT_S))
        except BaseException:
            for p in self._procs:
                p.kill()
            _reap(self._procs)
            raise

    def _cmd(self, cmd: str, n: int) -> None:
        self._dist.broadcast_object_list([(cmd, n)], src=0)

    def rt(self, obj: Any, n: int) -> list[float]:
        """``n`` round trips of ``obj`` (seconds each)."""
        dist, world = self._dist, self._world
        self._cmd("rt", n)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            dist.broadcast_object_list([obj], src=0)
            _gloo_back(dist, world, 0, None)
            out.append(time.perf_counter() - t0)
        return out

    def stream(self, obj: Any, n: int) -> float:
        """Seconds to deliver ``n`` messages to every reader."""
        dist = self._dist
        self._cmd("stream", n)
        t0 = time.perf_counter()
        for _ in range(n):
            dist.broadcast_object_list([obj], src=0)
        _gloo_back(dist, self._world, 0, None)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Stop the readers and destroy the group."""
        try:
            if self._dist.is_initialized():
                self._cmd("stop", 0)
                self._dist.destroy_process_group()
        finally:
            _reap(self._procs)


# ------------------------------------------------------------------------ zmq
_CMD = struct.Struct("<4sq")  # command (b"sync", b"rt\0\0", b"strm", b"stop"), count


def _zmq_reader(pub_addr: str, pull_addr: str, rank: int) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    push = ctx.socket(zmq.PUSH)
    for s in (sub, push):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.SNDHWM, 0)
    sub.connect(pub_addr)
    sub.subscribe(b"")
    push.connect(pull_addr)
    synced = False
    try:
        while True:
            cmd, n = _CMD.unpack(sub.recv())
            if cmd == b"sync":
                if not synced:
                    push.send(struct.pack("<q", rank))
                    synced = True
                continue
            if cmd == b"stop":
                break
            for _ in range(n):
                pickle.loads(sub.recv())  # the measured decode; the socket is private
                if cmd == b"rt\0\0":
                    push.send(b"1")
            if cmd == b"strm":
                push.send(b"1")
    finally:
        sub.close(0)
        push.close(0)
        ctx.term()


class ZmqPickleDriver:
    """pickle over a pyzmq ipc:// PUB/SUB, acks over PUSH/PULL.

    Args:
        n_readers: Reader processes to start.
        ctx: A ``multiprocessing`` spawn context.
    """

    label = "pickle + zmq ipc PUB/SUB"

    def __init__(self, n_readers: int, ctx: Any) -> None:
        self._n = n_readers
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pull = self._ctx.socket(zmq.PULL)
        for s in (self._pub, self._pull):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
        self._dir = new_channel_dir()  # private: no other user reaches these sockets
        pub_addr = f"ipc://{os.path.join(self._dir, 'w')}"
        pull_addr = f"ipc://{os.path.join(self._dir, 'p')}"
        self._pull.setsockopt(zmq.RCVTIMEO, _ZMQ_RECV_TIMEOUT_MS)
        self._pub.bind(pub_addr)
        self._pull.bind(pull_addr)
        self._procs = [ctx.Process(target=_zmq_reader, args=(pub_addr, pull_addr, r), daemon=True)
                       for r in range(1, n_readers + 1)]
        for p in self._procs:
            p.start()
        try:
            self._sync()
        except BaseException:
            self.close()
            raise

    @property
    def socket_dir(self) -> str:
        """The private directory holding the driver's two sockets."""
        return self._dir

    def _sync(self) -> None:
        seen: set[int] = set()
        deadline = time.monotonic() + 60
        while len(seen) < self._n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"zmq baseline readers did not connect; seen {sorted(seen)}")
            self._pub.send(_CMD.pack(b"sync", 0))
            if self._pull.poll(20):
                (rank,) = struct.unpack("<q", self._pull.recv())
                seen.add(rank)

    def rt(self, obj: Any, n: int) -> list[float]:
        """``n`` round trips of ``obj`` (seconds each)."""
        pub, pull, readers = self._pub, self._pull, self._n
        pub.send(_CMD.pack(b"rt\0\0", n))
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            pub.send(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
            for _ in range(readers):
                pull.recv()
            out.append(time.perf_counter() - t0)
        return out

    def stream(self, obj: Any, n: int) -> float:
        """Seconds to deliver ``n`` messages to every reader."""
        pub, pull = self._pub, self._pull
        pub.send(_CMD.pack(b"strm", n))
        t0 = time.perf_counter()
        for _ in range(n):
            pub.send(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        for _ in range(self._n):
            pull.recv()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Stop the readers and close the sockets."""
        try:
            if not self._pub.closed:
                self._pub.send(_CMD.pack(b"stop", 0))
                time.sleep(0.05)
        finally:
            _reap(self._procs)
            self._pub.close(0)
            self._pull.close(0)
            self._ctx.term()
            remove_channel_dir(self._dir)

"""An object-level process group over a TCPStore, outside torch.distributed's global state.

:class:`StatelessProcessGroup` lets one process join several independent groups
(say an engine's data-parallel coordinator group and a KV-transfer group)
without ``torch.distributed.init_process_group``. It moves picklable Python
objects only; it is meant for setup handshakes and control messages.

Protocol (all through the store, keys prefixed with the group's name)::

    send_obj(dst)      set  p2p/<src>-><dst>/<seq>             recv_obj deletes it
    broadcast_obj(src) set  bcast/<src>/<seq>                  each reader adds 1 to
                                                               .../acks; the last
                                                               reader deletes both
    all_gather_obj     set  gather/<seq>/<rank>, read all;    last reader cleans up
    barrier            set  barrier/<seq>/<rank>, wait all;   rank 0 deletes them in
                                                               barrier seq+1

Sequence numbers are per peer (p2p) or per source (broadcast), so the store
holds only messages not yet read. Blocking calls take a timeout and raise
:class:`~coordinator.errors.CommTimeout` naming the group, the operation and
the peer(s) that did not answer. Objects are pickled (these carry arbitrary
objects such as queue handles; the hot path uses the message queue instead).
"""

from __future__ import annotations

import datetime
import pickle
import time
from collections import defaultdict
from typing import Any

import torch.distributed as dist

from coordinator.errors import CommTimeout, StoreConnectionError
from shm_broadcast.checks import check_int, check_rank, check_timeout

__all__ = ["StatelessProcessGroup"]

_DEFAULT_TIMEOUT = 300.0


class StatelessProcessGroup:
    """A group of ``world_size`` processes sharing a TCPStore.

    Build with :meth:`create`. Ranks are ``0 .. world_size-1``; rank 0 hosts
    the store and must outlive the others' use of the group.

    Attributes:
        rank: This process's rank.
        world_size: Number of processes.
        name: Key prefix, also used in error messages.
        store: The underlying ``torch.distributed.Store``.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: dist.Store,
        name: str = "stateless",
        timeout: float = _DEFAULT_TIMEOUT,
    ) -> None:
        _check_rank_world(rank, world_size)
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.name = name
        self.timeout: float = check_timeout(timeout, positive=True)  # type: ignore[assignment]
        self._send_seq: dict[int, int] = defaultdict(int)
        self._recv_seq: dict[int, int] = defaultdict(int)
        self._bcast_seq: dict[int, int] = defaultdict(int)
        self._gather_seq = 0
        self._barrier_seq = 0

    @classmethod
    def create(
        cls,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout: float = _DEFAULT_TIMEOUT,
        name: str = "stateless",
    ) -> "StatelessProcessGroup":
        """Create a group: rank 0 listens on ``host:port``, others connect.

        Args:
            host: Address of rank 0's store.
            port: Port of the store (rank 0 binds it).
            rank: This process's rank.
            world_size: Number of processes.
            timeout: Default seconds for blocking operations.
            name: Key prefix (groups sharing a store need distinct names).

        Raises:
            ValueError: Bad rank/world_size/port.
        """
        _check_rank_world(rank, world_size)
        check_int(port, "port", minimum=1, maximum=65535)
        if not isinstance(host, str) or not host:
            raise ValueError(f"host must be a non-empty str, got {host!r}")
        store = dist.TCPStore(
            host_name=host,
            port=port,
            world_size=world_size,
            is_master=(rank == 0),
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
        )
        return cls(rank, world_size, store, name=name, timeout=timeout)

    # ------------------------------------------------------------------ p2p
    def send_obj(self, obj: Any, dst: int) -> None:
        """Send ``obj`` to rank ``dst`` (returns once stored; does not wait for dst)."""
        self._check_peer(dst, "dst")
        key = self._key(f"p2p/{self.rank}->{dst}/{self._send_seq[dst]}")
        self._send_seq[dst] += 1
        self.store.set(key, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def recv_obj(self, src: int, timeout: float | None = None) -> Any:
        """Receive the next object sent by rank ``src``."""
        self._check_peer(src, "src")
        key = self._key(f"p2p/{src}->{self.rank}/{self._recv_seq[src]}")
        self._recv_seq[src] += 1
        data = self._get(key, timeout, "recv_obj", [src])
        self.store.delete_key(key)
        return pickle.loads(data)

    # ------------------------------------------------------------------ collectives
    def broadcast_obj(self, obj: Any | None, src: int, timeout: float | None = None) -> Any:
        """Broadcast ``obj`` from rank ``src``; every rank returns it."""
        _check_in_range(src, self.world_size, "src")
        seq = self._bcast_seq[src]
        self._bcast_seq[src] += 1
        key = self._key(f"bcast/{src}/{seq}")
        if self.rank == src:
            if self.world_size > 1:
                self.store.set(key, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
            return obj
        data = self._get(key, timeout, "broadcast_obj", [src])
        self._ack_and_clean(key + "/acks", self.world_size - 1, [key])
        return pickle.loads(data)

    def all_gather_obj(self, obj: Any, timeout: float | None = None) -> list[Any]:
        """Gather one object from every rank; returns the list ordered by rank."""
        seq = self._gather_seq
        self._gather_seq += 1
        base = self._key(f"gather/{seq}")
        self.store.set(f"{base}/{self.rank}", pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        keys = [f"{base}/{r}" for r in range(self.world_size)]
        self._wait(keys, timeout, "all_gather_obj")
        out = [obj if r == self.rank else pickle.loads(self.store.get(k)) for r, k in enumerate(keys)]
        self._ack_and_clean(f"{base}/done", self.world_size, keys)
        return out

    def barrier(self, timeout: float | None = None) -> None:
        """Block until every rank has entered the barrier.

        Every rank may exit right after a final barrier: rank 0, which hosts
        the store, returns only after every other rank's wait has returned
        (each confirms with one best-effort counter increment). Rank 0
        deletes each barrier's keys during the next one.

        Raises:
            CommTimeout: Some rank did not arrive within ``timeout`` seconds
                (the message lists which).
        """
        seq = self._barrier_seq
        self._barrier_seq += 1
        self.store.set(self._key(f"barrier/{seq}/{self.rank}"), b"1")
        self._wait([self._key(f"barrier/{seq}/{r}") for r in range(self.world_size)], timeout, "barrier")
        left = self._key(f"barrier/{seq}/left")
        if self.rank != 0:
            # Tell the store's host that our wait has returned. Best effort: the
            # barrier is complete for us, and the host may leave once it sees us.
            try:
                self.store.add(left, 1)
            except (RuntimeError, dist.DistError):
                pass
            return
        # The host stays until every other rank's wait has returned, so its exit
        # (or close()) cannot cut off a rank that arrived last and is still waiting.
        t = self._seconds(timeout)
        deadline = time.monotonic() + t
        while self.store.add(left, 0) < self.world_size - 1:
            if time.monotonic() > deadline:
                raise CommTimeout(
                    f"stateless group {self.name!r} (rank 0/{self.world_size}), op barrier: "
                    f"not every rank confirmed leaving the barrier within {t:.1f}s"
                )
            time.sleep(0.001)
        self._delete([left])  # every other rank has counted itself
        if seq > 0:  # everyone has left barrier seq-1
            self._delete([self._key(f"barrier/{seq - 1}/{r}") for r in range(self.world_size)])

    def close(self) -> None:
        """Drop the store connection (rank 0 stops serving the others)."""
        self.store = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StatelessProcessGroup({self.name!r}, rank={self.rank}, world_size={self.world_size})"

    # ------------------------------------------------------------------ internals
    def _seconds(self, timeout: Any) -> float:
        """A call's timeout: its own (0 polls once) or the group's."""
        return check_timeout(timeout, default=self.timeout)  # type: ignore[return-value]

    def _key(self, suffix: str) -> str:
        return f"{self.name}/{suffix}"

    def _check_peer(self, r: Any, arg: str) -> None:
        _check_in_range(r, self.world_size, arg)
        if r == self.rank:
            raise ValueError(f"{arg}={r} is this rank; point-to-point needs another rank")

    def _wait(self, keys: list[str], timeout: float | None, op: str) -> None:
        if self.store is None:
            raise RuntimeError(f"stateless group {self.name!r} is closed")
        t = self._seconds(timeout)
        try:
            self.store.wait(keys, datetime.timedelta(seconds=t))
        except dist.DistNetworkError as e:
            raise StoreConnectionError(
                f"stateless group {self.name!r} (rank {self.rank}/{self.world_size}), op {op}: "
                f"lost the connection to the store on rank 0; rank 0 has probably exited or "
                f"closed the group ({str(e).splitlines()[0]})"
            ) from e
        except (RuntimeError, dist.DistError) as e:
            missing = [i for i, k in enumerate(keys) if not self._exists(k)]
            raise CommTimeout(
                f"stateless group {self.name!r} (rank {self.rank}/{self.world_size}), op {op}: "
                f"rank(s) {missing} did not answer within {t:.1f}s. Check that they are alive "
                f"and call {op} too."
            ) from e

    def _get(self, key: str, timeout: float | None, op: str, peers: list[int]) -> bytes:
        try:
            self._wait([key], timeout, op)
        except CommTimeout as e:
            t = self._seconds(timeout)
            raise CommTimeout(
                f"stateless group {self.name!r} (rank {self.rank}/{self.world_size}), op {op}: "
                f"rank(s) {peers} did not answer within {t:.1f}s. Check that they are alive "
                f"and call the matching operation."
            ) from e.__cause__
        return self.store.get(key)

    def _ack_and_clean(self, counter: str, readers: int, keys: list[str]) -> None:
        """Count this reader; the last one deletes ``keys``. Best effort: the store's
        host may already have left after its own last use of the group."""
        try:
            if self.store.add(counter, 1) == readers:
                self._delete(keys + [counter])
        except (RuntimeError, dist.DistError):
            pass

    def _delete(self, keys: list[str]) -> None:
        for k in keys:
            try:
                self.store.delete_key(k)
            except (RuntimeError, dist.DistError):
                return

    def _exists(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except (RuntimeError, dist.DistError):
            return False


def _check_in_range(r: Any, world_size: int, arg: str) -> None:
    check_rank(r, world_size, arg)


def _check_rank_world(rank: Any, world_size: Any) -> None:
    check_int(world_size, "world_size", minimum=1)
    check_rank(rank, world_size, "rank")

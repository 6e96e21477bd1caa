"""An object-level process group over a TCPStore, outside torch.distributed's global state.

:class:`StatelessProcessGroup` lets one process join several independent groups
(say an engine's data-parallel coordinator group and a KV-transfer group)
without ``torch.distributed.init_process_group``. It moves plain Python
objects (see :func:`shm_broadcast.ranks.group_adapter.encode_object`: ``None``,
numbers, str, bytes and lists/tuples/dicts/sets of them, and CPU tensors
and arrays); it is meant for setup handshakes and control messages. vLLM's
tensor calls (``broadcast``, ``send``, ``recv``, ``all_reduce``) are made of
these object calls.

Security (see ``docs/security-stateless.md``; the sealing itself is
:mod:`coordinator.stateless.store_sealing`, where the secret comes from
:mod:`coordinator.stateless.group_secret`):

* **The store binds the address it was given.** Rank 0 binds a listening
  socket to ``host:port`` itself and hands it to the TCPStore
  (``master_listen_fd``); ``127.0.0.1`` is reachable from this host only.
* **Every value is sealed.** Each value is encrypted and authenticated with
  ChaCha20-Poly1305 (a fresh 12-byte random nonce per value) under a key
  derived with HKDF-SHA256 from the group's secret and the session, which
  hashes a fresh random nonce of *every* rank
  (:mod:`coordinator.stateless.session_agreement`: nothing recorded in an
  earlier incarnation of the group authenticates in this one); the associated
  data binds the group (name, store port, size, session) and the key the value
  is stored under. A value that fails authentication is never decoded: the
  reader replaces it by an empty marker (only if it is still the value it
  refused: ``compare_set``), looks again with a back-off
  (:mod:`coordinator.stateless.retry_delay`: each look at most one fetch and
  one ``compare_set``) and fetches a value again only once a writer replaced
  the marker; at its timeout it raises
  :class:`~coordinator.errors.AuthenticationError`.
* **No pickle.** Values are msgpack (msgspec). ``allow_pickle=True`` (on
  every rank) opts into pickle for other objects; a received pickle is
  otherwise refused without being read.
* **The secret** is the ``secret`` argument, else the hex environment
  variable :data:`SECRET_ENV` (set by the launcher for every rank), else, for
  a loopback ``host`` only, a random secret that rank 0 writes to a file only
  its user can read (``/dev/shm/groupcoord-<uid>/``, mode 0700/0600) and the
  other ranks read (removed at the first barrier, on ``close()`` or at exit).
  A group on a non-loopback address without a secret raises
  ``ValueError``; ``insecure=True`` turns authentication off explicitly.

Protocol (all through the store, keys prefixed with the group's name)::

    session, session/writes, session/<N_0 hex>/...
                       see coordinator.stateless.session_agreement: written when a
                       rank joins, read in its first call (before that call takes
                       a sequence number); the last rank to agree deletes them
    send_obj(dst)      set  p2p/<src>-><dst>/<seq>             recv_obj deletes it
    broadcast_obj(src) set  bcast/<seq>/<rank> ([its src,     last reader cleans up
                            obj on src only]), read all;
    all_gather_obj     set  gather/<seq>/<rank>, read all;    last reader cleans up
    barrier            set  barrier/<seq>/<rank>, wait all;   others set
                            barrier/<seq>/left/<rank>;         rank 0 deletes them in
                                                               barrier seq+1

Sequence numbers are per peer (p2p) or one for all broadcasts, so the store
holds only messages not yet read. Broadcasts share one sequence whatever
their source, and every rank reads every rank's record, so every rank sees
which source each named: if they differ, all raise ``CollectiveMismatch``
(as ``all_reduce`` does for different reduce ops), and the next broadcast
still pairs every rank with the same call, never with a value left over from
an earlier one. The ``done`` counters decide only
when keys are deleted, never what is read. Blocking calls take a timeout and
raise :class:`~coordinator.errors.CommTimeout` naming the group, the operation
and the peer(s) that did not answer. That holds also when the store itself does
not answer (rank 0 stopped by SIGSTOP or a debugger, its host cut off): every
store request runs through :class:`~shm_broadcast.ranks.store_calls.StoreCalls`,
whose answer is awaited until the call's deadline plus a grace of
``_ANSWER_GRACE_S``; once rank 0 runs again, the group carries on.
"""

from __future__ import annotations

import contextlib
import datetime
import secrets
import socket
import time
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from coordinator.errors import (
    AuthenticationError,
    ClosedError,
    CollectiveMismatch,
    CommTimeout,
    PeerRejectedError,
    StoreConnectionError,
)
from coordinator.stateless.group_secret import (
    SECRET_ENV,
    remove_quietly,
    secret_plan,
    uses_key_file,
)
from coordinator.stateless.retry_delay import RetryDelay
from coordinator.stateless.session_agreement import SessionAgreement
from coordinator.stateless.store_sealing import Sealer
from device_comms import ReduceOp
from device_comms.reduce_op import check_reduce_op
from shm_broadcast.checks import check_bool, check_int, check_rank, check_timeout
from shm_broadcast.ranks.group_adapter import (
    decode_object,
    encode_failure,
    encode_object,
)
from shm_broadcast.ranks.store_calls import StoreCalls
from shm_broadcast.ranks.tcp_store import master_store, rank0_store_client, unbracket_host

__all__ = ["SECRET_ENV", "StatelessProcessGroup"]

_DEFAULT_TIMEOUT = 300.0
# What a reader writes over a value it refused (with compare_set, so only over
# that value): no sealed or framed value is empty, and fetching it moves no bytes.
_REFUSED = b""
# Why a reader that only ever found the key empty waited in vain.
_EMPTY_LOOK = ("every fetch found it empty: the empty marker a reader leaves over a value it "
               "refused (another reader of this key refused one), or the key deleted between "
               "the reader's wait and its get (by a process without the secret)")
# How much longer than a call's own deadline its store request may take to be
# answered before the store counts as not answering (the store's own timeout
# ends a healthy wait at the deadline; the answer then takes milliseconds).
_ANSWER_GRACE_S = 0.5
# What a best-effort store call (acks, deletes, a barrier's "left" record) may
# meet when the store's host has left or stopped; the call is then skipped.
_BEST_EFFORT = (RuntimeError, dist.DistError, CommTimeout, StoreConnectionError)


class StatelessProcessGroup:
    """A group of ``world_size`` processes sharing a TCPStore.

    Build with :meth:`create`. Ranks are ``0 .. world_size-1``; rank 0 hosts
    the store and must outlive the others' use of the group.

    Args:
        rank: This process's rank.
        world_size: Number of processes.
        store: A store every rank reaches (rank 0's, usually from :meth:`create`).
        name: Key prefix, also used in error messages.
        timeout: Default seconds for blocking operations (> 0).
        secret: The group's shared secret (>= 16 bytes); None reads
            :data:`SECRET_ENV`, else, for a ``TCPStore`` on a loopback
            address, rank 0 makes one and shares it through a private file.
        insecure: No secret: values are neither authenticated nor encrypted
            (still never unpickled unless ``allow_pickle``).
        allow_pickle: Pickle objects msgpack cannot carry, and accept pickled
            values from peers. Every rank must agree. Lets any holder of the
            secret (with ``insecure``, anyone reaching the store) run code here.

    Attributes:
        rank: This process's rank.
        world_size: Number of processes.
        name: Key prefix, also used in error messages.
        store: The underlying ``torch.distributed.Store``.
        rejected_values: Values and session records ignored so far because they
            failed authentication (or answered another session).

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: No secret is given or in the environment, the store is not
            a loopback ``TCPStore`` and ``insecure`` is false; or the secret
            is malformed.
        AuthenticationError: No authentic session record from rank 0 arrived
            within ``timeout``.

    Rank 0's constructor waits for no other rank; another rank's constructor
    waits (up to ``timeout``) for rank 0's session record, so rank 0 must be
    constructed by then, and for no other rank. The session is agreed in each
    rank's first call that sends or receives a value, within that call's
    timeout (see :mod:`coordinator.stateless.session_agreement`): on rank 0
    once every rank has been constructed, on another rank once rank 0's first
    such call has confirmed the session. That call raises ``CommTimeout``
    naming the ranks that were not constructed in time (or rank 0, if it made
    no such call in time), or ``AuthenticationError`` naming the session
    records it refused (replayed from an earlier incarnation of the group, or
    forged). A call that raised took no sequence number: calling it again
    pairs with the peers' same call.
    """

    def __init__(self, rank: int, world_size: int, store: dist.Store, name: str = "stateless",
                 timeout: float = _DEFAULT_TIMEOUT, *, secret: bytes | None = None,
                 insecure: bool = False, allow_pickle: bool = False,
                 _secret_source: Callable[[], bytes | None] | None = None) -> None:
        rank, world_size = _check_rank_world(rank, world_size)
        _check_name(name)
        if not isinstance(store, dist.Store):
            raise TypeError(f"store must be a torch.distributed.Store (a TCPStore, usually from "
                            f"create()), got {type(store).__name__} ({store!r:.60})")
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.name = name
        self.timeout: float = check_timeout(timeout, positive=True)  # type: ignore[assignment]
        self.allow_pickle = check_bool(allow_pickle, "allow_pickle")
        self._rejected = 0
        self._send_seq: dict[int, int] = defaultdict(int)
        self._recv_seq: dict[int, int] = defaultdict(int)
        self._bcast_seq = 0
        self._gather_seq = 0
        self._barrier_seq = 0
        self._key_file: str | None = None
        self._calls = StoreCalls(store, f"stateless group {name!r}", _describe(store, rank),
                                 [] if rank == 0 else [0], queue_name=name)
        if _secret_source is None:
            host, port = (store.host, store.port) if isinstance(store, dist.TCPStore) else (None, 0)
            _secret_source, self._key_file = secret_plan(
                rank, host, port, name, secret, check_bool(insecure, "insecure"))
        if self._key_file is not None:
            weakref.finalize(self, remove_quietly, self._key_file)
        self._sealer: Sealer | None = None
        self._agreement: SessionAgreement | None = None
        if _secret_source is None:
            self._sealer = Sealer(name)
        else:
            self._agreement = SessionAgreement(
                name, rank, world_size, self._store_port(),
                label=f"stateless group {name!r} (rank {rank}/{world_size})",
                call=self._weak_call())
            self._agreement.join(_secret_source, self.timeout)

    @classmethod
    def create(cls, host: str, port: int, rank: int, world_size: int,
               timeout: float = _DEFAULT_TIMEOUT, name: str = "stateless", *,
               secret: bytes | None = None, insecure: bool = False,
               allow_pickle: bool = False, store_timeout: float | None = None,
               data_expiration_seconds: int | None = None,
               listen_socket: socket.socket | None = None) -> StatelessProcessGroup:
        """Create a group: rank 0 listens on ``host:port`` (that address only), others connect.

        Args:
            host: Address of rank 0's store; rank 0 binds exactly this address
                (an IPv6 address may be bracketed: ``[::1]``).
            port: Port of the store (rank 0 binds it).
            rank: This process's rank.
            world_size: Number of processes.
            timeout: Default seconds for blocking operations.
            name: Key prefix (groups sharing a store need distinct names).
            secret: Shared secret of the group (>= 16 bytes, the same on every
                rank); None reads :data:`SECRET_ENV`, else (loopback ``host``
                only) rank 0 makes one and shares it through a private file.
            insecure: Run without authentication (explicit opt-out).
            allow_pickle: See the class docstring.
            store_timeout: vLLM's name for ``timeout``; when given, it wins.
            data_expiration_seconds: vLLM's bound on how long a value stays in
                the store: accepted for its callers (an int > 0); every value
                here is deleted once read, so nothing accumulates.
            listen_socket: Rank 0: a socket already listening on ``host:port``
                for the store (vLLM's keyword; the store uses a duplicate of it,
                the caller keeps and closes its own). Other ranks ignore it.

        Raises:
            TypeError: An argument has the wrong type.
            ValueError: Bad rank/world_size/port/host, no secret for a
                non-loopback ``host`` without ``insecure``, or (rank 0) a
                ``listen_socket`` that is not a TCP socket bound to ``port``.
            AuthenticationError: The session could not be authenticated in time
                (the message says why: no record, a bad one, or rank 0's store
                did not answer).
            StoreConnectionError: Rank 0 cannot listen on ``host:port`` (in
                use, or not an address of this host).
            CommTimeout: (Not rank 0) rank 0's store did not answer within
                ``timeout`` plus a grace: nothing listened there (rank 0 not
                started or gone), or its process accepted the connection and
                stayed silent (stopped). It names the group, op ``create`` and
                rank 0 (``peers == (0,)``).
            StoreConnectionError: The connection to rank 0's store was lost
                while the session was set up (rank 0 exited).
        """
        rank, world_size = _check_rank_world(rank, world_size)
        port = check_int(port, "port", minimum=1, maximum=65535)
        if not isinstance(host, str):
            raise TypeError(f"host must be a str, got {type(host).__name__} ({host!r:.60})")
        if not host or host != host.strip() or any(c in host for c in "\x00\t\r\n "):
            raise ValueError(f"host must be a non-empty str without whitespace or NUL, got "
                             f"{host!r:.60}")
        host = unbracket_host(host)  # "[::1]" is "::1" for the stores and the secret alike
        t: float = check_timeout(timeout if store_timeout is None else store_timeout,  # type: ignore[assignment]
                                 "store_timeout" if store_timeout is not None else "timeout",
                                 positive=True)
        if data_expiration_seconds is not None:
            data_expiration_seconds = check_int(data_expiration_seconds,
                                                "data_expiration_seconds", minimum=1)
        if listen_socket is not None and not isinstance(listen_socket, socket.socket):
            raise TypeError(f"listen_socket must be a socket.socket, got "
                            f"{type(listen_socket).__name__}")
        _check_name(name)
        check_bool(allow_pickle, "allow_pickle")
        check_bool(insecure, "insecure")
        local = uses_key_file(host, secret, insecure)  # then every rank is on this host
        # Rank 0 binds its port before it writes the key file: a second rank 0 on a
        # live group's port fails there, and leaves that group's key file alone.
        store = (_open_store(host, port, rank, world_size, t, name, listen_socket, local)
                 if rank == 0 else None)
        key_file = None
        try:
            source, key_file = secret_plan(rank, host, port, name, secret, insecure)
            if store is None:
                store = _open_store(host, port, rank, world_size, t, name, listen_socket)
            group = cls(rank, world_size, store, name=name, timeout=t, insecure=source is None,
                        allow_pickle=allow_pickle, _secret_source=source)
        except BaseException:
            store = None  # rank 0's server stops with its last reference
            if key_file is not None:
                remove_quietly(key_file)
            raise
        if key_file is not None:
            group._key_file = key_file
            weakref.finalize(group, remove_quietly, key_file)
        return group

    @staticmethod
    def generate_secret() -> bytes:
        """A fresh random secret (32 bytes) for a launcher to hand to every rank."""
        return secrets.token_bytes(32)

    # ------------------------------------------------------------------ p2p
    def send_obj(self, obj: Any, dst: int) -> None:
        """Send ``obj`` to rank ``dst`` (returns once the store confirmed it; does not
        wait for dst).

        The rank's first call that sends or receives agrees on the session first,
        within the group's timeout: it waits until every rank has been constructed
        and, on a rank other than 0, until rank 0 made its own first such call.

        Raises:
            TypeError: ``obj`` cannot be sent without pickle (``dst`` then
                raises ``CollectiveMismatch`` instead of waiting).
            StoreConnectionError: The store's host (rank 0) is gone. The value
                may or may not have reached the store before it went.
            CommTimeout: (First call) the session was not agreed within the
                group's timeout: the message names the ranks not constructed
                yet, or rank 0; nothing was sent and no sequence number taken,
                so the call may be repeated. Or the store did not confirm the
                value within the timeout (rank 0 stopped or overloaded): the
                value went out before the confirmation was awaited and may have
                been delivered (once rank 0 runs again), and its sequence number
                is taken. Do not repeat the call: ``dst`` could receive the
                value twice; treat the pairing with ``dst`` as unknown.
            AuthenticationError: (First call) the session could not be agreed:
                a session record was refused, or replayed from an earlier
                incarnation of the group (the message names it).
        """
        dst = self._check_peer(dst, "dst")
        if self._sealer is None:
            self._agreed_sealer(None, "send_obj")
        key = self._key(f"p2p/{self.rank}->{dst}/{self._send_seq[dst]}")
        self._send_seq[dst] += 1
        self._put_obj(key, obj, "send_obj")

    def recv_obj(self, src: int, timeout: float | None = None) -> Any:
        """Receive the next object sent by rank ``src``.

        Raises:
            CommTimeout: Nothing arrived within ``timeout``.
            AuthenticationError: Only unauthentic values arrived within ``timeout``.
            CollectiveMismatch: ``src`` could not encode its object, or sent
                one this rank refuses (pickle without ``allow_pickle``).
        """
        src = self._check_peer(src, "src")
        deadline = self._deadline(timeout)  # checked before the call takes its number
        if self._sealer is None:
            self._agreed_sealer(deadline, "recv_obj")
        key = self._key(f"p2p/{src}->{self.rank}/{self._recv_seq[src]}")
        self._recv_seq[src] += 1
        data = self._get(key, deadline, "recv_obj", [src])
        self._delete([key], "recv_obj")
        return self._decode(data, src)

    # ------------------------------------------------------------------ collectives
    def broadcast_obj(self, obj: Any | None, src: int, timeout: float | None = None) -> Any:
        """Broadcast ``obj`` from rank ``src``; every rank returns it.

        Every rank states the source it named, so the call returns once every
        rank has called it (the source too). Ranks that named different
        sources all raise ``CollectiveMismatch``; the next broadcast still
        pairs every rank with the same call.

        The rank's first call that sends or receives agrees on the session first,
        within ``timeout`` (see :meth:`send_obj`); if that fails, the call takes no
        sequence number and may be repeated.

        Raises:
            TypeError: (On ``src``) ``obj`` cannot be sent without pickle (the
                other ranks raise ``CollectiveMismatch``).
            CollectiveMismatch: (On every rank) the ranks named different
                sources (the message lists each rank's); or, on the others, the
                source could not encode its object or sent one this rank refuses.
            CommTimeout: Some rank did not call within ``timeout``.
        """
        src = check_rank(src, self.world_size, "src")
        deadline = self._deadline(timeout)  # checked (on every rank) before numbering
        if self._sealer is None:
            self._agreed_sealer(deadline, "broadcast_obj")
        if self.world_size == 1:
            encode_object(obj, allow_pickle=self.allow_pickle)  # same TypeError as with peers
            return obj
        seq = self._bcast_seq
        self._bcast_seq += 1
        # Each rank's record: [the source it named, the object (the source's only)].
        records = self._exchange(self._key(f"bcast/{seq}"),
                                 [src, obj if self.rank == src else None], "broadcast_obj",
                                 deadline)
        named = [_field(rec, 0, r, "broadcast_obj", self.name) for r, rec in enumerate(records)]
        if any(s != src for s in named):
            raise CollectiveMismatch(
                f"stateless group {self.name!r} (rank {self.rank}/{self.world_size}), op "
                f"broadcast_obj: the ranks named different sources (src by rank: "
                f"{dict(enumerate(named))})", queue=self.name,
                side=f"rank {self.rank}/{self.world_size}",
                peers=[r for r, s in enumerate(named) if s != src])
        return obj if self.rank == src else _field(records[src], 1, src, "broadcast_obj",
                                                   self.name)

    def all_gather_obj(self, obj: Any, timeout: float | None = None) -> list[Any]:
        """Gather one object from every rank; returns the list ordered by rank."""
        deadline = self._deadline(timeout)
        if self._sealer is None:
            self._agreed_sealer(deadline, "all_gather_obj")
        seq = self._gather_seq
        self._gather_seq += 1
        return self._exchange(self._key(f"gather/{seq}"), obj, "all_gather_obj", deadline)

    def _exchange(self, base: str, obj: Any, op: str,
                  deadline: tuple[float, float]) -> list[Any]:
        """Put ``obj`` under ``base/<rank>``, read every other rank's; the last reader
        deletes them. Returns the objects ordered by rank (this rank's is ``obj``)."""
        keys = [f"{base}/{r}" for r in range(self.world_size)]
        try:
            self._put_obj(f"{base}/{self.rank}", obj, op, deadline)
        except (TypeError, ValueError):  # its failure record is stored: count this rank
            self._ack_and_clean(f"{base}/done", self.world_size, keys, op, deadline)
            raise
        self._wait(keys, deadline, op)
        raw = {r: self._get(k, deadline, op, [r])
               for r, k in enumerate(keys) if r != self.rank}
        self._ack_and_clean(f"{base}/done", self.world_size, keys, op, deadline)
        return [obj if r == self.rank else self._decode(raw[r], r) for r in range(self.world_size)]

    # ------------------------------------------------------------------ tensors
    # vLLM's tensor calls of its stateless group, carried as objects: CPU copies
    # of the tensors travel through the store in the codec's format (no pickle),
    # so these suit the small tensors of control traffic, not bulk data.

    def broadcast(self, tensor: Any, src: int, timeout: float | None = None) -> Any:
        """``src``'s ``tensor`` on every rank: the source returns its own, the others a
        new tensor (on their ``tensor``'s device). Other ranks may pass None; a
        tensor they pass says what they expect (its shape and dtype) and is not
        written.

        Raises:
            TypeError: On ``src``: ``tensor`` is not a tensor (the others raise
                :class:`~coordinator.errors.PeerRejectedError` naming it).
            CollectiveMismatch: On the others: the source sent something other
                than a tensor, or one of another shape or dtype than the
                receiver's ``tensor``.
            CommTimeout: As :meth:`broadcast_obj`.
        """
        src = check_rank(src, self.world_size, "src")
        if self.rank == src:
            try:
                mine = _cpu_copy(tensor, "tensor")
            except TypeError as e:  # the receivers are told, not left to time out
                self.broadcast_obj([_REJECTED, str(e)[:_REASON_MAX]], src, timeout)
                raise
            self.broadcast_obj(mine, src, timeout)
            return tensor
        got = self.broadcast_obj(None, src, timeout)
        if type(got) is list and len(got) == 2 and got[0] == _REJECTED:
            raise PeerRejectedError(self.name, "broadcast", src,
                                    got[1] if isinstance(got[1], str) else "")
        given = tensor if isinstance(tensor, torch.Tensor) else None
        _expect_tensor(got, src, "broadcast", self.name, like=given)
        return got if given is None else got.to(given.device)

    def send(self, tensor: Any, dst: int) -> None:
        """Send ``tensor`` to rank ``dst`` (a CPU copy, through the store).

        Raises:
            TypeError: ``tensor`` is not a tensor.
        """
        dst = self._check_peer(dst, "dst")
        self.send_obj(_cpu_copy(tensor, "tensor"), dst)

    def recv(self, tensor: Any, src: int, timeout: float | None = None) -> Any:
        """Receive rank ``src``'s next :meth:`send` into ``tensor`` and return it.

        Raises:
            TypeError: ``tensor`` is not a tensor.
            ValueError: ``tensor`` cannot be written in place (a leaf that
                requires grad while grad mode is on, an inference tensor outside
                inference mode, or a view whose elements share memory, such as
                an ``expand``); nothing is taken from the store.
            CollectiveMismatch: ``src`` sent something other than a tensor of
                ``tensor``'s shape and dtype (``tensor`` is left as it was).
            CommTimeout: As :meth:`recv_obj`.
        """
        _cpu_copy(tensor, "tensor")  # checked before anything is taken from the store
        _check_writable(tensor, "tensor")  # likewise: a failed copy_ would lose the message
        src = self._check_peer(src, "src")
        got = self.recv_obj(src, timeout)
        _expect_tensor(got, src, "recv", self.name, like=tensor)
        tensor.copy_(got)
        return tensor

    def all_reduce(self, tensor: Any, op: Any = dist.ReduceOp.SUM,
                   timeout: float | None = None) -> Any:
        """Reduce ``tensor`` across the ranks; a new tensor on ``tensor``'s device.

        Every rank reduces the same tensors in rank order, so all get the same
        bits. ``op``: a :class:`device_comms.ReduceOp`, its name, or a
        ``torch.distributed.ReduceOp``, under the rules of every other
        reduction (:func:`device_comms.reduce_op.check_reduce_op`: ``AVG``
        needs a floating dtype, the bitwise ops an integer one).

        Raises:
            TypeError: ``tensor`` is not a tensor, or ``op`` not a reduce op
                (or not one for its dtype); the peers raise
                :class:`~coordinator.errors.PeerRejectedError` naming this rank.
            CollectiveMismatch: (On every rank) the ranks asked for different
                reduce ops (the message lists each rank's), their tensors differ
                in shape or dtype, or a rank sent no tensor.
            CommTimeout: As :meth:`all_gather_obj`.
        """
        try:
            mine = _cpu_copy(tensor, "tensor")
            rop = check_reduce_op(op, mine.dtype)
        except (TypeError, ValueError) as e:  # the peers are told, not left to time out
            self.all_gather_obj([_REJECTED, str(e)[:_REASON_MAX]], timeout)
            raise
        reduce = _REDUCTIONS[rop]
        # Each rank's record: [its reduce op's name, its tensor], or [_REJECTED, why].
        records = self.all_gather_obj([rop.name, mine], timeout)
        ops = [_field(rec, 0, r, "all_reduce", self.name) for r, rec in enumerate(records)]
        for r, o in enumerate(ops):
            if o == _REJECTED:
                why = _field(records[r], 1, r, "all_reduce", self.name)
                raise PeerRejectedError(self.name, "all_reduce", r,
                                        why if isinstance(why, str) else "")
        if any(o != rop.name for o in ops):
            raise CollectiveMismatch(
                f"stateless group {self.name!r} (rank {self.rank}/{self.world_size}), op "
                f"all_reduce: the ranks asked for different reduce ops (op by rank: "
                f"{dict(enumerate(ops))})", queue=self.name,
                side=f"rank {self.rank}/{self.world_size}",
                peers=[r for r, o in enumerate(ops) if o != rop.name])
        parts = [_field(rec, 1, r, "all_reduce", self.name) for r, rec in enumerate(records)]
        for r, part in enumerate(parts):
            _expect_tensor(part, r, "all_reduce", self.name, like=mine)
        result = parts[0].clone()
        for part in parts[1:]:
            result = reduce(result, part)
        if rop is ReduceOp.AVG:
            result = result / self.world_size
        return result.to(tensor.device)

    def barrier(self, timeout: float | None = None) -> None:
        """Block until every rank has entered the barrier.

        Every rank may exit right after a final barrier: rank 0, which hosts
        the store, returns only after every other rank's wait has returned
        (each confirms with an authenticated ``left`` record). Rank 0 deletes
        each barrier's keys during the next one, and its key file (the
        loopback default) during the first (every rank has read it by then).

        Raises:
            CommTimeout: Some rank did not arrive within ``timeout`` seconds
                (the message lists which).
            AuthenticationError: A rank's arrival record was not authentic.
        """
        deadline = self._deadline(timeout)
        if self._sealer is None:
            self._agreed_sealer(deadline, "barrier")
        seq = self._barrier_seq
        self._barrier_seq += 1
        arrive = [self._key(f"barrier/{seq}/{r}") for r in range(self.world_size)]
        self._put(arrive[self.rank], b"", "barrier", deadline)
        self._wait(arrive, deadline, "barrier")
        for r, k in enumerate(arrive):
            if r != self.rank:
                self._get(k, deadline, "barrier", [r])
        left = [self._key(f"barrier/{seq}/left/{r}") for r in range(self.world_size)]
        if self.rank != 0:
            # Tell the store's host that our wait has returned. Best effort: the
            # barrier is complete for us, and the host may leave once it sees us.
            with contextlib.suppress(*_BEST_EFFORT):
                self._put(left[self.rank], b"", "barrier", deadline)
            return
        # The host stays until every other rank's wait has returned, so its exit
        # (or close()) cannot cut off a rank that arrived last and is still waiting.
        for r in range(1, self.world_size):
            self._get(left[r], deadline, "barrier (leaving)", [r])
        self._delete(left[1:], "barrier")
        if seq > 0:  # everyone has left barrier seq-1
            self._delete([self._key(f"barrier/{seq - 1}/{r}") for r in range(self.world_size)],
                         "barrier")
        elif self._key_file is not None:  # every rank has joined: the key file is done
            remove_quietly(self._key_file)
            self._key_file = None

    def close(self) -> None:
        """Drop the store connection (rank 0 stops serving the others, removes its key file)."""
        self.store = None  # type: ignore[assignment]
        self._calls.close()
        if self._key_file is not None:
            remove_quietly(self._key_file)
            self._key_file = None

    def __repr__(self) -> str:
        return (f"StatelessProcessGroup({self.name!r}, rank={self.rank}, "
                f"world_size={self.world_size})")

    @property
    def rejected_values(self) -> int:
        """Values and session records ignored so far because they failed authentication."""
        return self._rejected + (self._agreement.rejected if self._agreement is not None else 0)

    # ------------------------------------------------------------------ sealing
    def _agreed_sealer(self, deadline: tuple[float, float] | None, op: str) -> Sealer:
        """The session's sealer, agreed now (the rank's first call that seals or opens,
        before it takes a sequence number).

        Raises:
            CommTimeout: Some rank has not joined (or rank 0 confirmed nothing) by the
                deadline.
            AuthenticationError: Some session record was refused until the deadline, or
                was replayed from an earlier incarnation.
        """
        agreement = self._agreement
        assert agreement is not None  # no sealer yet only while a session is to be agreed
        sealer = agreement.agree(self._deadline(None) if deadline is None else deadline, op)
        self._sealer = sealer
        return sealer

    def _store_port(self) -> int:
        """The store's port (0: not a TCP store)."""
        return self.store.port if isinstance(self.store, dist.TCPStore) else 0

    def _put(self, key: str, plain: bytes, op: str,
             deadline: tuple[float, float] | None = None) -> None:
        """Store a sealed value and confirm the store got it.

        A TCPStore ``set`` has no answer: one sent after the store's host died
        fails silently. The ``check`` after it is a round trip on the same
        connection, so it fails instead (``StoreConnectionError``); what it
        finds does not matter (a reader may already have taken the value).
        """
        sealer = self._sealer or self._agreed_sealer(deadline, op)
        self._call("set", key, sealer.seal(key, plain), op=op, deadline=deadline)
        self._call("check", [key], op=op, deadline=deadline)

    def _put_obj(self, key: str, obj: Any, op: str,
                 deadline: tuple[float, float] | None = None) -> None:
        """Store ``obj``; if it cannot be encoded, store a failure record and raise."""
        try:
            plain = encode_object(obj, allow_pickle=self.allow_pickle)
        except (TypeError, ValueError) as e:
            self._put(key, encode_failure(f"rank {self.rank}: {type(e).__name__}: {e}"), op,
                      deadline)
            raise
        self._put(key, plain, op, deadline)

    def _decode(self, plain: bytes, src: int) -> Any:
        return decode_object(plain, allow_pickle=self.allow_pickle,
                             source=f"rank {src} of stateless group {self.name!r}")

    # ------------------------------------------------------------------ store access
    def _seconds(self, timeout: Any) -> float:
        """A call's timeout: its own (0 polls once) or the group's."""
        return check_timeout(timeout, default=self.timeout)  # type: ignore[return-value]

    def _deadline(self, timeout: Any) -> tuple[float, float]:
        """``(monotonic deadline, seconds)`` of a call."""
        t = self._seconds(timeout)
        return time.monotonic() + t, t

    def _key(self, suffix: str) -> str:
        return f"{self.name}/{suffix}"

    def _weak_call(self) -> Callable[..., Any]:
        """:meth:`_call` without a reference to this group, for the session agreement
        it owns: a bound method would make a cycle that keeps a dropped group (rank 0:
        its store server and worker thread) alive until the cyclic GC runs."""
        method = weakref.WeakMethod(self._call)
        name = self.name

        def call(*args: Any, **kwargs: Any) -> Any:
            bound = method()
            if bound is None:  # only the agreement is left: its group was dropped
                raise ClosedError(f"stateless group {name!r} is gone (op {kwargs.get('op')})",
                                  queue=name)
            return bound(*args, **kwargs)

        return call

    def _call(self, method: str, *args: Any, op: str,
              deadline: tuple[float, float] | None = None) -> Any:
        """Run ``store.<method>(*args)``, bounded.

        Args:
            method: Store method name.
            *args: Its arguments.
            op: The group operation it serves, for messages.
            deadline: The operation's ``(monotonic deadline, seconds)``; None
                allows the group's timeout.

        Raises:
            ClosedError: The group was closed.
            CommTimeout: The store did not answer by the deadline plus
                ``_ANSWER_GRACE_S``.
        """
        if self.store is None:
            raise ClosedError(f"stateless group {self.name!r} is closed (op {op})",
                              queue=self.name)
        left = self.timeout if deadline is None else max(deadline[0] - time.monotonic(), 0.0)
        try:
            return self._calls.call(method, *args, limit=left + _ANSWER_GRACE_S, op=op,
                                    side=f"rank {self.rank}/{self.world_size}")
        except dist.DistNetworkError as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            who = ("rank 0 has probably exited or closed the group" if self.rank else
                   "this rank's own store server closed it")
            raise StoreConnectionError(
                f"stateless group {self.name!r} (rank {self.rank}/{self.world_size}), op {op}: "
                f"lost the connection to the store on rank 0; {who}, or the store dropped it "
                f"(it does when a value under a counter key is not an integer: see "
                f"docs/security-stateless.md) ({why})",
                queue=self.name, peers=[0] if self.rank else []) from e
        except MemoryError as e:  # torch's client allocates the length the server claims
            raise StoreConnectionError(
                f"stateless group {self.name!r} (rank {self.rank}/{self.world_size}), op {op}: "
                f"the store at the group's address answered a {method} with a length no "
                f"process can hold; it is not rank 0's store (a process that took the port?)",
                queue=self.name, peers=[0] if self.rank else []) from e

    def _check_peer(self, r: Any, arg: str) -> int:
        peer = check_rank(r, self.world_size, arg)
        if peer == self.rank:
            raise ValueError(f"{arg}={peer} is this rank; point-to-point needs another rank")
        return peer

    def _wait(self, keys: list[str], deadline: tuple[float, float], op: str,
              peers: list[int] | None = None, ranks: list[int] | None = None) -> None:
        """Wait until ``keys`` exist.

        Raises:
            CommTimeout: Not by the deadline; it names ``peers``, else the ranks
                (``ranks[i]``, by default ``i``) whose ``keys[i]`` is missing.
        """
        left = deadline[0] - time.monotonic()
        try:
            # The store's wait times out at once below ~1 ms even when the keys
            # exist, so a (nearly) spent deadline checks them instead.
            if left < 0.05 and self._call("check", keys, op=op, deadline=deadline):
                return
            self._call("wait", keys, datetime.timedelta(seconds=max(left, 0.001)), op=op,
                       deadline=deadline)
        except ClosedError:
            raise  # a RuntimeError, but not a peer that failed to answer
        except (RuntimeError, dist.DistError) as e:
            owners = ranks if ranks is not None else list(range(len(keys)))
            missing = peers if peers is not None else [
                owners[i] for i, k in enumerate(keys) if not self._exists(k, op)]
            raise CommTimeout(
                f"stateless group {self.name!r} (rank {self.rank}/{self.world_size}), op {op}: "
                f"rank(s) {missing} did not answer within {deadline[1]:.1f}s. Check that they "
                f"are alive and call the matching operation.", queue=self.name, peers=missing,
            ) from e

    def _get(self, key: str, deadline: tuple[float, float], op: str, peers: list[int]) -> bytes:
        """The authentic value under ``key``; others are refused until ``deadline``."""
        sealer = self._sealer or self._agreed_sealer(deadline, op)
        self._wait([key], deadline, op, peers)
        data = self._call("get", key, op=op, deadline=deadline)
        try:
            return sealer.open(key, data)
        except AuthenticationError as e:
            return self._get_after_refusal(sealer, key, data, str(e), deadline, op, peers)

    def _get_after_refusal(self, sealer: Sealer, key: str, refused: bytes, why: str,
                           deadline: tuple[float, float], op: str, peers: list[int]) -> bytes:
        """Wait for an authentic value under ``key``, whose value ``refused`` failed
        (``refused`` empty: the key held the empty marker, or was deleted after the wait).

        A refused value is replaced by the empty marker, atomically and only if it is
        still there (``compare_set``: a value a writer put there meanwhile comes back
        instead, and is opened). Every later look at the key comes after the next
        :class:`RetryDelay` (whose deadline ends the wait) and makes at most one fetch
        (``wait`` and ``get``, only when no refused value is known to be there) and one
        ``compare_set`` (of the value refused last). A value is fetched again only once
        it changed.
        """
        rejected = 0
        delay = RetryDelay(deadline[0])
        if refused == _REFUSED:
            why = _EMPTY_LOOK
            pending: bytes | None = None  # a refused value that may still be under the key
        else:
            rejected, pending = 1, refused
            self._rejected += 1
        while True:
            if pending is not None:
                # The marker; or what a writer put there since (`pending`: key deleted).
                now = self._call("compare_set", key, pending, _REFUSED, op=op, deadline=deadline)
                last, pending = pending, None
                if now not in (last, _REFUSED):
                    try:
                        return sealer.open(key, now)
                    except AuthenticationError as e:  # replaced by the marker at the next look
                        why, pending = str(e), now
                        rejected += 1
                        self._rejected += 1
            if not delay.sleep():
                raise self._refused_until_deadline(key, rejected, why, deadline, op, peers)
            if pending is None:
                self._wait([key], deadline, op, peers)  # an outsider may have deleted it
                value = self._call("get", key, op=op, deadline=deadline)
                if value == _REFUSED:
                    if not rejected:
                        why = _EMPTY_LOOK
                    continue
                try:
                    return sealer.open(key, value)
                except AuthenticationError as e:
                    why, pending = str(e), value
                    rejected += 1
                    self._rejected += 1

    def _refused_until_deadline(self, key: str, rejected: int, why: str,
                                deadline: tuple[float, float], op: str,
                                peers: list[int]) -> AuthenticationError:
        """The error of a reader that found no authentic value under ``key`` in time."""
        head = f"stateless group {self.name!r} (rank {self.rank}/{self.world_size}), op {op}: "
        if rejected:
            what = (f"{rejected} value(s) under {key!r} failed authentication and no "
                    f"authentic one arrived within {deadline[1]:.1f}s; none was decoded "
                    f"(last: {why})")
        else:
            what = (f"no value under {key!r} could be read within {deadline[1]:.1f}s and none "
                    f"failed authentication here: {why}")
        return AuthenticationError(head + what, rejected=rejected, queue=self.name, peers=peers)

    def _ack_and_clean(self, counter: str, readers: int, keys: list[str], op: str,
                       deadline: tuple[float, float]) -> None:
        """Count this reader; the last one deletes ``keys``. Best effort: the store's
        host may already have left after its own last use of the group."""
        try:
            if self._call("add", counter, 1, op=op, deadline=deadline) == readers:
                self._delete(keys + [counter], op)
        except _BEST_EFFORT:
            pass

    def _delete(self, keys: list[str], op: str) -> None:
        """Delete ``keys``; best effort, each answer awaited for a grace period at most."""
        for k in keys:
            try:
                self._call("delete_key", k, op=op, deadline=(time.monotonic(), 0.0))
            except _BEST_EFFORT:
                return

    def _exists(self, key: str, op: str) -> bool:
        try:
            return bool(self._call("check", [key], op=op, deadline=(time.monotonic(), 0.0)))
        except _BEST_EFFORT:
            return False


# ---------------------------------------------------------------------- store and checks
def _describe(store: dist.Store, rank: int) -> str:
    """Where the group's store is, for messages."""
    where = f" ({store.host}:{store.port})" if isinstance(store, dist.TCPStore) else ""
    return f"this rank's store{where}" if rank == 0 else f"the store on rank 0{where}"


def _open_store(host: str, port: int, rank: int, world_size: int, timeout: float,
                name: str, listen_socket: socket.socket | None = None,
                loopback_only: bool = False) -> dist.Store:
    """Rank 0: a TCPStore listening on ``host:port`` only (or on the caller's
    ``listen_socket``; ``loopback_only``: a name that resolves to loopback listens
    there); others: a client of it.

    Raises:
        CommTimeout: (Not rank 0) rank 0's store did not answer within ``timeout``
            (plus the connect grace): nothing listened (torch's DistNetworkError),
            or its process accepted the connection and stayed silent.
        StoreConnectionError: (Rank 0) ``host:port`` cannot be bound.
    """
    td = datetime.timedelta(seconds=timeout)
    if rank != 0:
        return rank0_store_client(host, port, world_size, td, op="create", queue=name,
                                  who=f"stateless group {name!r} (rank {rank}/{world_size})",
                                  side=f"rank {rank}/{world_size}")
    try:
        return master_store(host, port, world_size, td, listen_socket=listen_socket,
                            loopback_only=loopback_only)
    except OSError as e:
        raise StoreConnectionError(
            f"rank 0 cannot listen on {host}:{port} for its stateless group's store: "
            f"{e.strerror or e} (errno {e.errno}); pick a free port or an address of this host"
        ) from e


def _check_name(name: Any) -> None:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__} ({name!r:.60})")
    if not name or "/" in name:
        raise ValueError(f"name must be a non-empty str without '/', got {name!r}")


#: The op field of a rank's all_reduce record when that rank refused its own arguments
#: (no reduce op has this name), and the longest reason it sends.
_REJECTED = "!rejected"
_REASON_MAX = 500


def _cpu_copy(tensor: Any, arg: str) -> Any:
    """``tensor`` as a CPU tensor to send (itself when it is one already).

    Raises:
        TypeError: ``tensor`` is not a tensor.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(tensor).__name__}")
    return tensor.detach().cpu()


def _check_writable(tensor: torch.Tensor, arg: str) -> None:
    """Raise ValueError unless ``copy_`` can write into ``tensor`` in place.

    The cases are those where torch's ``copy_`` refuses the destination itself:
    a tensor requiring grad (grad mode on: a leaf or a view of one; a result of
    autograd is refused too, which nobody receives into), an inference tensor (outside inference
    mode), and elements sharing memory (a stride of 0 over more than one element,
    what torch's own overlap check reports as certain overlap).
    """
    if tensor.requires_grad and torch.is_grad_enabled():  # a leaf, or a view of one
        raise ValueError(f"{arg} must be writable in place: got a tensor that requires grad "
                         f"(pass one without requires_grad, or call under torch.no_grad())")
    if tensor.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(f"{arg} must be writable in place: got an inference tensor outside "
                         f"inference mode (pass a normal tensor)")
    if tensor.layout != torch.strided:
        raise ValueError(f"{arg} must be a dense (strided) tensor to receive into, got layout "
                         f"{tensor.layout}")
    if any(st == 0 and n > 1 for st, n in zip(tensor.stride(), tensor.shape, strict=True)):
        raise ValueError(f"{arg} must be writable in place: got a tensor whose elements share "
                         f"memory (stride {tuple(tensor.stride())} for shape "
                         f"{tuple(tensor.shape)}, e.g. an expand()); pass a contiguous one")


def _expect_tensor(got: Any, rank: int, op: str, group: str, like: Any = None) -> None:
    """Raise CollectiveMismatch unless ``got``, from ``rank``, is a tensor (of ``like``'s
    shape and dtype, when given)."""
    if not isinstance(got, torch.Tensor):
        raise CollectiveMismatch(
            f"stateless group {group!r}, op {op}: rank {rank} sent a "
            f"{type(got).__name__}, not a tensor", queue=group, peers=[rank])
    if like is not None and (got.shape != like.shape or got.dtype != like.dtype):
        raise CollectiveMismatch(
            f"stateless group {group!r}, op {op}: rank {rank} sent a {got.dtype} tensor of "
            f"shape {tuple(got.shape)}, this rank's is {like.dtype} {tuple(like.shape)}",
            queue=group, peers=[rank])


def _field(record: Any, i: int, rank: int, op: str, group: str) -> Any:
    """Item ``i`` of ``record``, the two-item list that ``rank`` sent in ``op``.

    Raises:
        CollectiveMismatch: ``record`` is not such a list (``rank`` made another call).
    """
    if not isinstance(record, (list, tuple)) or len(record) != 2:
        raise CollectiveMismatch(
            f"stateless group {group!r}, op {op}: rank {rank} sent a "
            f"{type(record).__name__}, not this call's record (did it make another call?)",
            queue=group, peers=[rank])
    return record[i]


#: How two tensors combine under each reduce op (AVG: summed, then divided).
_REDUCTIONS: dict[ReduceOp, Callable[[Any, Any], Any]] = {
    ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum,
    ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or,
    ReduceOp.BXOR: torch.bitwise_xor,
}


def _check_rank_world(rank: Any, world_size: Any) -> tuple[int, int]:
    """``(rank, world_size)`` as ints, checked."""
    size = check_int(world_size, "world_size", minimum=1)
    return check_rank(rank, size, "rank"), size

"""An object-level process group over a TCPStore, outside torch.distributed's global state.

:class:`StatelessProcessGroup` lets one process join several independent groups
(say an engine's data-parallel coordinator group and a KV-transfer group)
without ``torch.distributed.init_process_group``. It moves plain Python
objects (see :func:`shm_broadcast.group_adapter.encode_object`: ``None``,
numbers, str, bytes and lists/tuples/dicts/sets of them); it is meant for
setup handshakes and control messages.

Security (see ``docs/security-stateless.md``):

* **The store binds the address it was given.** Rank 0 binds a listening
  socket to ``host:port`` itself and hands it to the TCPStore
  (``master_listen_fd``); ``127.0.0.1`` is reachable from this host only.
* **Every value is sealed.** Each value is encrypted (SHAKE-256 key stream,
  a fresh 16-byte nonce per value) and authenticated with HMAC-SHA256 over
  the group name, the key and the ciphertext, under keys derived from the
  group's secret and a per-session nonce that rank 0 publishes (itself
  authenticated). A value that fails authentication is never decoded: the
  reader ignores it and waits for an authentic one until its timeout, then
  raises :class:`~coordinator.errors.AuthenticationError`.
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

    session            rank 0 sets it (nonce + HMAC); others verify it
    send_obj(dst)      set  p2p/<src>-><dst>/<seq>             recv_obj deletes it
    broadcast_obj(src) set  bcast/<src>/<seq>                  each reader adds 1 to
                                                               .../acks; the last
                                                               reader deletes both
    all_gather_obj     set  gather/<seq>/<rank>, read all;    last reader cleans up
    barrier            set  barrier/<seq>/<rank>, wait all;   others set
                            barrier/<seq>/left/<rank>;         rank 0 deletes them in
                                                               barrier seq+1

Sequence numbers are per peer (p2p) or per source (broadcast), so the store
holds only messages not yet read. The ``acks``/``done`` counters decide only
when keys are deleted, never what is read. Blocking calls take a timeout and
raise :class:`~coordinator.errors.CommTimeout` naming the group, the operation
and the peer(s) that did not answer.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import secrets
import struct
import time
import weakref
from collections import defaultdict
from typing import Any, Callable

import torch.distributed as dist

from coordinator.errors import AuthenticationError, CommTimeout, StoreConnectionError
from shm_broadcast.checks import check_int, check_rank, check_timeout
from shm_broadcast.group_adapter import (
    MAX_OBJECT_BYTES,
    decode_object,
    encode_failure,
    encode_object,
)

__all__ = ["SECRET_ENV", "StatelessProcessGroup"]

_DEFAULT_TIMEOUT = 300.0
#: Environment variable holding the group secret as hex (at least 32 hex digits).
SECRET_ENV = "GROUPCOORD_GROUP_SECRET"
_MIN_SECRET = 16
_MAGIC = b"GCS1"
_SEALED, _PLAIN = 1, 0
_NONCE = 16
_TAG = 32
_RETRY_S = 0.005


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
        rejected_values: Values ignored so far because they failed authentication.

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: No secret is given or in the environment, the store is not
            a loopback ``TCPStore`` and ``insecure`` is false; or the secret
            is malformed.
        AuthenticationError: No authentic session record from rank 0 arrived
            within ``timeout``.
    """

    def __init__(self, rank: int, world_size: int, store: dist.Store, name: str = "stateless",
                 timeout: float = _DEFAULT_TIMEOUT, *, secret: bytes | None = None,
                 insecure: bool = False, allow_pickle: bool = False,
                 _secret_source: Callable[[], bytes | None] | None = None) -> None:
        _check_rank_world(rank, world_size)
        _check_name(name)
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.name = name
        self.timeout: float = check_timeout(timeout, positive=True)  # type: ignore[assignment]
        self.allow_pickle = _check_bool(allow_pickle, "allow_pickle")
        self.rejected_values = 0
        self._send_seq: dict[int, int] = defaultdict(int)
        self._recv_seq: dict[int, int] = defaultdict(int)
        self._bcast_seq: dict[int, int] = defaultdict(int)
        self._gather_seq = 0
        self._barrier_seq = 0
        self._key_file: str | None = None
        if _secret_source is None:
            host, port = (store.host, store.port) if isinstance(store, dist.TCPStore) else (None, 0)
            _secret_source, self._key_file = _secret_plan(
                rank, host, port, name, secret, _check_bool(insecure, "insecure"))
        if self._key_file is not None:
            weakref.finalize(self, _remove_quietly, self._key_file)
        self._sealer = _Sealer(name) if _secret_source is None else self._establish(_secret_source)

    @classmethod
    def create(cls, host: str, port: int, rank: int, world_size: int,
               timeout: float = _DEFAULT_TIMEOUT, name: str = "stateless", *,
               secret: bytes | None = None, insecure: bool = False,
               allow_pickle: bool = False) -> "StatelessProcessGroup":
        """Create a group: rank 0 listens on ``host:port`` (that address only), others connect.

        Args:
            host: Address of rank 0's store; rank 0 binds exactly this address.
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

        Raises:
            TypeError: An argument has the wrong type.
            ValueError: Bad rank/world_size/port/host, or no secret for a
                non-loopback ``host`` without ``insecure``.
            AuthenticationError: The session could not be authenticated in time.
            StoreConnectionError: Rank 0 cannot listen on ``host:port`` (in
                use, or not an address of this host).
        """
        _check_rank_world(rank, world_size)
        check_int(port, "port", minimum=1, maximum=65535)
        if not isinstance(host, str):
            raise TypeError(f"host must be a str, got {type(host).__name__} ({host!r:.60})")
        if not host:
            raise ValueError("host must be a non-empty str, got ''")
        t: float = check_timeout(timeout, positive=True)  # type: ignore[assignment]
        _check_name(name)
        _check_bool(allow_pickle, "allow_pickle")
        source, key_file = _secret_plan(rank, host, port, name, secret,
                                        _check_bool(insecure, "insecure"))
        try:
            store = _open_store(host, port, rank, world_size, t)
            group = cls(rank, world_size, store, name=name, timeout=t, insecure=source is None,
                        allow_pickle=allow_pickle, _secret_source=source)
        except BaseException:
            if key_file is not None:
                _remove_quietly(key_file)
            raise
        if key_file is not None:
            group._key_file = key_file
            weakref.finalize(group, _remove_quietly, key_file)
        return group

    @staticmethod
    def generate_secret() -> bytes:
        """A fresh random secret (32 bytes) for a launcher to hand to every rank."""
        return secrets.token_bytes(32)

    # ------------------------------------------------------------------ p2p
    def send_obj(self, obj: Any, dst: int) -> None:
        """Send ``obj`` to rank ``dst`` (returns once stored; does not wait for dst).

        Raises:
            TypeError: ``obj`` cannot be sent without pickle (``dst`` then
                raises ``CollectiveMismatch`` instead of waiting).
        """
        self._check_peer(dst, "dst")
        key = self._key(f"p2p/{self.rank}->{dst}/{self._send_seq[dst]}")
        self._send_seq[dst] += 1
        self._put_obj(key, obj)

    def recv_obj(self, src: int, timeout: float | None = None) -> Any:
        """Receive the next object sent by rank ``src``.

        Raises:
            CommTimeout: Nothing arrived within ``timeout``.
            AuthenticationError: Only unauthentic values arrived within ``timeout``.
            CollectiveMismatch: ``src`` could not encode its object, or sent
                one this rank refuses (pickle without ``allow_pickle``).
        """
        self._check_peer(src, "src")
        key = self._key(f"p2p/{src}->{self.rank}/{self._recv_seq[src]}")
        self._recv_seq[src] += 1
        data = self._get(key, self._deadline(timeout), "recv_obj", [src])
        self._delete([key])
        return self._decode(data, src)

    # ------------------------------------------------------------------ collectives
    def broadcast_obj(self, obj: Any | None, src: int, timeout: float | None = None) -> Any:
        """Broadcast ``obj`` from rank ``src``; every rank returns it."""
        _check_in_range(src, self.world_size, "src")
        seq = self._bcast_seq[src]
        self._bcast_seq[src] += 1
        key = self._key(f"bcast/{src}/{seq}")
        if self.rank == src:
            if self.world_size > 1:
                self._put_obj(key, obj)
            else:
                encode_object(obj, allow_pickle=self.allow_pickle)  # same TypeError as with peers
            return obj
        data = self._get(key, self._deadline(timeout), "broadcast_obj", [src])
        self._ack_and_clean(key + "/acks", self.world_size - 1, [key])
        return self._decode(data, src)

    def all_gather_obj(self, obj: Any, timeout: float | None = None) -> list[Any]:
        """Gather one object from every rank; returns the list ordered by rank."""
        deadline = self._deadline(timeout)
        seq = self._gather_seq
        self._gather_seq += 1
        base = self._key(f"gather/{seq}")
        self._put_obj(f"{base}/{self.rank}", obj)
        keys = [f"{base}/{r}" for r in range(self.world_size)]
        self._wait(keys, deadline, "all_gather_obj")
        raw = {r: self._get(k, deadline, "all_gather_obj", [r])
               for r, k in enumerate(keys) if r != self.rank}
        self._ack_and_clean(f"{base}/done", self.world_size, keys)
        return [obj if r == self.rank else self._decode(raw[r], r) for r in range(self.world_size)]

    def barrier(self, timeout: float | None = None) -> None:
        """Block until every rank has entered the barrier.

        Every rank may exit right after a final barrier: rank 0, which hosts
        the store, returns only after every other rank's wait has returned
        (each confirms with an authenticated ``left`` record). Rank 0 deletes
        each barrier's keys during the next one, and the session record
        during the first (every rank has verified it by then).

        Raises:
            CommTimeout: Some rank did not arrive within ``timeout`` seconds
                (the message lists which).
            AuthenticationError: A rank's arrival record was not authentic.
        """
        deadline = self._deadline(timeout)
        seq = self._barrier_seq
        self._barrier_seq += 1
        arrive = [self._key(f"barrier/{seq}/{r}") for r in range(self.world_size)]
        self._put(arrive[self.rank], b"")
        self._wait(arrive, deadline, "barrier")
        for r, k in enumerate(arrive):
            if r != self.rank:
                self._get(k, deadline, "barrier", [r])
        left = [self._key(f"barrier/{seq}/left/{r}") for r in range(self.world_size)]
        if self.rank != 0:
            # Tell the store's host that our wait has returned. Best effort: the
            # barrier is complete for us, and the host may leave once it sees us.
            try:
                self._put(left[self.rank], b"")
            except (RuntimeError, dist.DistError):
                pass
            return
        # The host stays until every other rank's wait has returned, so its exit
        # (or close()) cannot cut off a rank that arrived last and is still waiting.
        for r in range(1, self.world_size):
            self._get(left[r], deadline, "barrier (leaving)", [r])
        self._delete(left[1:])
        if seq > 0:  # everyone has left barrier seq-1
            self._delete([self._key(f"barrier/{seq - 1}/{r}") for r in range(self.world_size)])
        else:  # every rank has verified the session: its record and key file are done
            self._delete([self._key("session")])
            if self._key_file is not None:
                _remove_quietly(self._key_file)
                self._key_file = None

    def close(self) -> None:
        """Drop the store connection (rank 0 stops serving the others, removes its key file)."""
        self.store = None  # type: ignore[assignment]
        if self._key_file is not None:
            _remove_quietly(self._key_file)
            self._key_file = None

    def __repr__(self) -> str:
        return f"StatelessProcessGroup({self.name!r}, rank={self.rank}, world_size={self.world_size})"

    # ------------------------------------------------------------------ sealing
    def _establish(self, source: Callable[[], bytes | None]) -> "_Sealer":
        """Agree on the session: rank 0 publishes an authenticated nonce, others verify it."""
        key = self._key("session")
        if self.rank == 0:
            secret = source()
            if secret is None:
                raise AuthenticationError(f"stateless group {self.name!r}: rank 0 has no secret")
            session = secrets.token_bytes(_NONCE)
            self.store.set(key, session + _session_tag(secret, self.name, key, session))
            return _Sealer(self.name, secret, session)
        deadline = time.monotonic() + self.timeout
        why = "no session record from rank 0"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AuthenticationError(
                    f"stateless group {self.name!r} (rank {self.rank}/{self.world_size}): could "
                    f"not authenticate rank 0's session within {self.timeout:.1f}s ({why}). Every "
                    f"rank needs the same secret (argument, or {SECRET_ENV}).",
                    rejected=self.rejected_values, queue=self.name, peers=[0])
            secret, record = source(), self._try_get(key, left)
            if secret is None:
                why = "the key file of rank 0 is missing or not private"
            elif record is not None:
                session, tag = record[:_NONCE], record[_NONCE:]
                if hmac.compare_digest(tag, _session_tag(secret, self.name, key, session)):
                    return _Sealer(self.name, secret, session)
                self.rejected_values += 1
                why = "the session record failed authentication"
            time.sleep(_RETRY_S)

    def _put(self, key: str, plain: bytes) -> None:
        self._store().set(key, self._sealer.seal(key, plain))

    def _put_obj(self, key: str, obj: Any) -> None:
        """Store ``obj``; if it cannot be encoded, store a failure record and raise."""
        try:
            plain = encode_object(obj, allow_pickle=self.allow_pickle)
        except (TypeError, ValueError) as e:
            self._put(key, encode_failure(f"rank {self.rank}: {type(e).__name__}: {e}"))
            raise
        self._put(key, plain)

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

    def _store(self) -> dist.Store:
        if self.store is None:
            raise RuntimeError(f"stateless group {self.name!r} is closed")
        return self.store

    def _check_peer(self, r: Any, arg: str) -> None:
        _check_in_range(r, self.world_size, arg)
        if r == self.rank:
            raise ValueError(f"{arg}={r} is this rank; point-to-point needs another rank")

    def _wait(self, keys: list[str], deadline: tuple[float, float], op: str,
              peers: list[int] | None = None) -> None:
        store = self._store()
        left = deadline[0] - time.monotonic()
        try:
            # The store's wait times out at once below ~1 ms even when the keys
            # exist, so a (nearly) spent deadline checks them instead.
            if left < 0.05 and store.check(keys):
                return
            store.wait(keys, datetime.timedelta(seconds=max(left, 0.001)))
        except dist.DistNetworkError as e:
            raise StoreConnectionError(
                f"stateless group {self.name!r} (rank {self.rank}/{self.world_size}), op {op}: "
                f"lost the connection to the store on rank 0; rank 0 has probably exited or "
                f"closed the group ({str(e).splitlines()[0]})"
            ) from e
        except (RuntimeError, dist.DistError) as e:
            missing = peers if peers is not None else [
                i for i, k in enumerate(keys) if not self._exists(k)]
            raise CommTimeout(
                f"stateless group {self.name!r} (rank {self.rank}/{self.world_size}), op {op}: "
                f"rank(s) {missing} did not answer within {deadline[1]:.1f}s. Check that they "
                f"are alive and call the matching operation.", queue=self.name, peers=missing,
            ) from e

    def _get(self, key: str, deadline: tuple[float, float], op: str, peers: list[int]) -> bytes:
        """The authentic value under ``key``; unauthentic ones are skipped until ``deadline``."""
        rejected, why = 0, ""
        while True:
            self._wait([key], deadline, op, peers)
            try:
                return self._sealer.open(key, self._store().get(key))
            except AuthenticationError as e:
                rejected += 1
                self.rejected_values += 1
                why = str(e)
            if time.monotonic() >= deadline[0]:
                raise AuthenticationError(
                    f"stateless group {self.name!r} (rank {self.rank}/{self.world_size}), op "
                    f"{op}: {rejected} value(s) under {key!r} failed authentication and no "
                    f"authentic one arrived within {deadline[1]:.1f}s; none was decoded ({why})",
                    rejected=rejected, queue=self.name, peers=peers)
            time.sleep(_RETRY_S)

    def _try_get(self, key: str, timeout: float) -> bytes | None:
        try:
            self._store().wait([key], datetime.timedelta(seconds=min(timeout, 0.5)))
            return bytes(self._store().get(key))
        except (RuntimeError, dist.DistError):
            return None

    def _ack_and_clean(self, counter: str, readers: int, keys: list[str]) -> None:
        """Count this reader; the last one deletes ``keys``. Best effort: the store's
        host may already have left after its own last use of the group."""
        try:
            if self._store().add(counter, 1) == readers:
                self._delete(keys + [counter])
        except (RuntimeError, dist.DistError):
            pass

    def _delete(self, keys: list[str]) -> None:
        for k in keys:
            try:
                self._store().delete_key(k)
            except (RuntimeError, dist.DistError):
                return

    def _exists(self, key: str) -> bool:
        try:
            return bool(self._store().check([key]))
        except (RuntimeError, dist.DistError):
            return False


class _Sealer:
    """Seals values (encrypt-then-MAC) for one group and session, or frames them in clear.

    Layout of a sealed value: ``GCS1 | 0x01 | nonce(16) | ciphertext | tag(32)``,
    ``tag = HMAC-SHA256(mac_key, len|name | len|key | header | ciphertext)``. The
    ciphertext is the plaintext XOR ``SHAKE-256(enc_key | nonce)``. Both keys
    are HMAC-SHA256(secret, label | session).
    """

    def __init__(self, name: str, secret: bytes | None = None, session: bytes = b"") -> None:
        self._name = name.encode()
        self._mac_key = self._enc_key = b""
        if secret is not None:
            self._mac_key = hmac.new(secret, b"groupcoord-stateless-mac\0" + session,
                                     hashlib.sha256).digest()
            self._enc_key = hmac.new(secret, b"groupcoord-stateless-enc\0" + session,
                                     hashlib.sha256).digest()

    def seal(self, key: str, plain: bytes) -> bytes:
        if not self._mac_key:
            return _MAGIC + bytes([_PLAIN]) + plain
        nonce = secrets.token_bytes(_NONCE)
        head = _MAGIC + bytes([_SEALED]) + nonce
        body = _xor(plain, hashlib.shake_256(self._enc_key + nonce).digest(len(plain)))
        return head + body + self._tag(key, head, body)

    def open(self, key: str, data: bytes) -> bytes:
        """The plaintext of ``data`` read under ``key``.

        Raises:
            AuthenticationError: Wrong size, framing, mode or tag (nothing decoded).
        """
        n = len(data)
        mode = data[len(_MAGIC)] if n > len(_MAGIC) and data[: len(_MAGIC)] == _MAGIC else -1
        if not self._mac_key:
            if mode != _PLAIN or n > MAX_OBJECT_BYTES + 5:
                raise AuthenticationError(f"value of {n} bytes is not a plain groupcoord value")
            return data[len(_MAGIC) + 1:]
        head_len = len(_MAGIC) + 1 + _NONCE
        if mode != _SEALED or not head_len + _TAG <= n <= head_len + _TAG + MAX_OBJECT_BYTES:
            raise AuthenticationError(
                f"value of {n} bytes is not sealed with this group's secret (wrong framing)")
        head, body, tag = data[:head_len], data[head_len:n - _TAG], data[n - _TAG:]
        if not hmac.compare_digest(tag, self._tag(key, head, body)):
            raise AuthenticationError("value has a wrong HMAC (forged, altered or moved)")
        return _xor(body, hashlib.shake_256(self._enc_key + head[-_NONCE:]).digest(len(body)))

    def _tag(self, key: str, head: bytes, body: bytes) -> bytes:
        k = key.encode()
        mac = hmac.new(self._mac_key, struct.pack("<I", len(self._name)) + self._name,
                       hashlib.sha256)
        mac.update(struct.pack("<I", len(k)) + k)
        mac.update(head)
        mac.update(body)
        return mac.digest()


def _xor(a: bytes, b: bytes) -> bytes:
    n = len(a)
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(n, "little")


def _session_tag(secret: bytes, name: str, key: str, session: bytes) -> bytes:
    nb, kb = name.encode(), key.encode()
    msg = b"groupcoord-stateless-session\0" + struct.pack("<II", len(nb), len(kb)) + nb + kb
    return hmac.new(secret, msg + session, hashlib.sha256).digest()


# ---------------------------------------------------------------------- secrets and store
_AUTO = b"<auto>"


def _resolve_secret(secret: Any, insecure: bool, auto_ok: bool = False) -> bytes | None:
    """The group secret from the argument or :data:`SECRET_ENV`; None if insecure.

    Returns :data:`_AUTO` when neither is set and ``auto_ok`` (loopback key file).
    """
    if secret is not None:
        if not isinstance(secret, (bytes, bytearray)):
            raise TypeError(f"secret must be bytes, got {type(secret).__name__}")
        if len(secret) < _MIN_SECRET:
            raise ValueError(f"secret must hold >= {_MIN_SECRET} bytes, got {len(secret)}")
        if insecure:
            raise ValueError("secret and insecure=True contradict each other; pass one")
        return bytes(secret)
    env = os.environ.get(SECRET_ENV, "")
    if env and not insecure:
        try:
            value = bytes.fromhex(env.strip())
        except ValueError:
            raise ValueError(f"{SECRET_ENV} must be hex digits, got {len(env)} characters "
                             "that are not all hex (value not shown)") from None
        if len(value) < _MIN_SECRET:
            raise ValueError(
                f"{SECRET_ENV} must hold >= {2 * _MIN_SECRET} hex digits, got {len(env)}")
        return value
    if insecure:
        return None
    if auto_ok:
        return _AUTO
    raise ValueError(
        f"a StatelessProcessGroup needs a shared secret: pass secret=<bytes> or set {SECRET_ENV} "
        f"(hex) on every rank, or pass insecure=True")


def _secret_plan(rank: int, host: str | None, port: int, name: str, secret: Any,
                 insecure: bool) -> tuple[Callable[[], bytes | None] | None, str | None]:
    """``(secret source or None if insecure, key file this rank writes or None)``.

    Raises:
        ValueError: No secret, and the store is not on a loopback address.
    """
    fixed = _resolve_secret(secret, insecure, auto_ok=host is not None)
    if fixed is None:
        return None, None
    if fixed is not _AUTO:
        return (lambda: fixed), None
    host = str(host)  # set: _AUTO comes only with a host
    if not _is_loopback(host):
        raise ValueError(
            f"a stateless group on non-loopback host {host!r} needs a shared secret: pass "
            f"secret=<the same >= {_MIN_SECRET} random bytes on every rank>, or set "
            f"{SECRET_ENV}=<hex> in every rank's environment (e.g. from secrets.token_hex(32) "
            f"in the launcher), or pass insecure=True")
    path = _key_file_path(host, port, name)
    if rank == 0:
        return _write_key_file(path), path
    return (lambda: _read_key_file(path)), None


def _is_loopback(host: str) -> bool:
    import ipaddress
    import socket

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def _open_store(host: str, port: int, rank: int, world_size: int, timeout: float) -> dist.Store:
    """Rank 0: a TCPStore listening on ``host:port`` only; others: a client of it."""
    td = datetime.timedelta(seconds=timeout)
    if rank != 0:
        return dist.TCPStore(host_name=host, port=port, world_size=world_size, is_master=False,
                             timeout=td, wait_for_workers=False)
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((host, port), family=family, backlog=512)
    except OSError as e:
        raise StoreConnectionError(
            f"rank 0 cannot listen on {host}:{port} for its stateless group's store: "
            f"{e.strerror or e} (errno {e.errno}); pick a free port or an address of this host"
        ) from e
    fd = sock.detach()  # the store owns (and closes) the listening socket from here
    try:
        return dist.TCPStore(host_name=host, port=port, world_size=world_size, is_master=True,
                             timeout=td, wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        try:
            os.close(fd)
        except OSError:
            pass
        raise


def _key_dir() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else __import__("tempfile").gettempdir()
    return os.path.join(base, f"groupcoord-{os.geteuid()}")


def _key_file_path(host: str, port: int, name: str) -> str:
    tag = hashlib.sha256(f"{host}\0{port}\0{name}".encode()).hexdigest()[:16]
    return os.path.join(_key_dir(), f"stateless-{port}-{tag}.key")


def _private_dir(path: str) -> None:
    """Make sure ``path`` is a directory of ours that nobody else can enter."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    import stat

    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise AuthenticationError(
            f"refusing key directory {path!r}: it must be a directory owned by uid "
            f"{os.geteuid()} with mode 0700 (found uid {st.st_uid}, mode {oct(st.st_mode)})")


def _write_key_file(path: str) -> Callable[[], bytes]:
    """Write a fresh secret to ``path`` (0600, atomically); returns its source."""
    _private_dir(os.path.dirname(path))
    _prune_key_files(os.path.dirname(path))
    secret = secrets.token_bytes(32)
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, secret)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return lambda: secret


def _prune_key_files(directory: str, max_age_s: float = 86400.0) -> None:
    """Remove key files left by ranks that died during setup (older than a day)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    now = time.time()
    for n in names:
        path = os.path.join(directory, n)
        try:
            if n.startswith("stateless-") and now - os.lstat(path).st_mtime > max_age_s:
                os.unlink(path)
        except OSError:
            pass


def _read_key_file(path: str) -> bytes | None:
    """The secret in ``path`` if it is a private regular file of ours, else None."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        d = os.lstat(os.path.dirname(path))
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077
                or d.st_uid != os.geteuid() or d.st_mode & 0o077 or st.st_size != 32):
            return None
        return os.read(fd, 32)
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _check_name(name: Any) -> None:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__} ({name!r:.60})")
    if not name or "/" in name:
        raise ValueError(f"name must be a non-empty str without '/', got {name!r}")


def _check_bool(value: Any, arg: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{arg} must be a bool, got {type(value).__name__} ({value!r:.60})")
    return value


def _check_in_range(r: Any, world_size: int, arg: str) -> None:
    check_rank(r, world_size, arg)


def _check_rank_world(rank: Any, world_size: Any) -> None:
    check_int(world_size, "world_size", minimum=1)
    check_rank(rank, world_size, "rank")

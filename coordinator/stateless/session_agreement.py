"""A stateless group's session: every rank contributes a fresh nonce; the session hashes them all.

Records under the group's name (``<name>/``), each authenticated by its tag,
:func:`~coordinator.stateless.store_sealing.session_tag` (HMAC-SHA256 under a key
derived from the secret, binding the group's name, the record's key, the store
port, the world size and the payload)::

    session         rank 0:      N_0 | tag          written when rank 0 joins
    session/<t>     rank t > 0:  N_t | N_0 | tag    written when rank t joins, after it verified
                                                    ``session``: it answers that N_0
    session/writes  counter: every record writer adds 1 after its ``set``; a reader that
                    refused a record fetches it again only once the counter moved
    session/done    counter: every rank adds 1 once it agreed; the rank that brings it to
                    the world size deletes all of these keys

``N_r`` is :data:`~coordinator.stateless.store_sealing.SESSION_BYTES` random
bytes drawn when rank ``r`` joins. The session is :func:`session_of` the list
``N_0 .. N_{n-1}`` (SHA-256 with a domain tag and the count), and the key of
every value is derived from it (:class:`~coordinator.stateless.store_sealing.Sealer`).

**Joining** (:meth:`SessionAgreement.join`, in the constructor; it never waits
for the other ranks): rank 0 writes ``session``; every other rank reads
``session`` until it verifies (a wrong secret shows here, as
``AuthenticationError`` at the end of the timeout) and writes its answer.

**Agreeing** (:meth:`SessionAgreement.agree`, in the rank's first call that seals
or opens a value, within that call's timeout): the rank reads the records of
every rank but rank 0 and itself once they all exist, and accepts the record
of rank ``s`` only if its tag verifies and it answers the ``N_0`` this rank
holds (rank 0: its own; another rank: the one it verified when joining)::

    joined --first seal/open--> reading --every record accepted--> agreed (+1 to session/done)
                                 |   ^
                  a record       |   | session/writes moved, no sooner than the back-off
                  refused        v   | (re-read only the refused records)
                                waiting --deadline--> AuthenticationError naming each refused
                                                      record and why
    (records still missing at the deadline: CommTimeout naming the ranks that never joined)

**No replay is ever accepted** (a group re-created with the same secret, name,
size and port, in this job or a later one): every rank's session hashes its
own nonce, drawn fresh when it joined, so the key it seals and opens values
with differs from every key of an earlier incarnation, whatever records an
attacker planted. A replay can keep ranks from agreeing, never make a rank
accept a value sealed in another session.

**Ranks agree when nobody replaced rank 0's record before they read it, even
when a record of an earlier incarnation was planted under a rank's key before
that rank wrote its own**: a record answers one ``N_0``, and only a rank of
this incarnation (it holds the secret and has seen rank 0's fresh nonce) can
write one that answers this incarnation's; each writes one. A planted record
answers an earlier ``N_0``: readers refuse it and wait, and the rank's own
``set`` replaces it (its ``add`` to ``session/writes`` makes them look again).
So every rank that verified the genuine ``session`` accepts the same list.

**What still fails, and says so**: a rank that verified a *replayed*
``session`` (written over rank 0's record before that rank read it) answers
the old ``N_0``; rank 0 and every rank that verified the genuine record refuse
its answer and raise ``AuthenticationError`` naming it, and it refuses theirs.
An attacker who can write the store can always keep a group from working (it
can delete keys), never make it accept what it did not seal.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import secrets
import struct
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed as dist

from coordinator.errors import AuthenticationError, CommTimeout
from coordinator.stateless.group_secret import SECRET_ENV
from coordinator.stateless.retry_delay import RetryDelay
from coordinator.stateless.store_sealing import SESSION_BYTES, Sealer, session_tag

__all__ = ["SESSION_DOMAIN", "SessionAgreement", "session_of"]

#: Domain tag of :func:`session_of` (the session protocol's version).
SESSION_DOMAIN = b"groupcoord stateless-group session v2"

_TAG_BYTES = 32  # HMAC-SHA256
_RANK0_RECORD = SESSION_BYTES + _TAG_BYTES
_ANSWER_RECORD = 2 * SESSION_BYTES + _TAG_BYTES
_JOIN_SLICE_S = 0.5  # the longest single wait for rank 0's record while joining


class StoreCall(Protocol):
    """Runs ``store.<method>(*args)`` for operation ``op``, bounded by ``deadline``."""

    def __call__(self, method: str, *args: Any, op: str,
                 deadline: tuple[float, float] | None = None) -> Any: ...


class StoreWait(Protocol):
    """Waits for ``keys``; else ``CommTimeout`` naming ``ranks[i]`` for each missing ``keys[i]``."""

    def __call__(self, keys: list[str], deadline: tuple[float, float], op: str,
                 peers: list[int] | None = None, ranks: list[int] | None = None) -> None: ...


def session_of(nonces: list[bytes]) -> bytes:
    """The session of the ranks' nonces ``nonces[r]`` (32 bytes): SHA-256 of
    :data:`SESSION_DOMAIN`, the count (u32, little-endian) and the nonces in rank order."""
    return hashlib.sha256(SESSION_DOMAIN + struct.pack("<I", len(nonces))
                          + b"".join(nonces)).digest()


class SessionAgreement:
    """One rank's part in agreeing on its group's session (see the module docstring).

    Args:
        name: The group's name (the key prefix).
        rank: This rank.
        world_size: The group's size.
        port: The store's port (0: not a TCP store); bound into every tag.
        label: The group and rank for messages (``"stateless group 'g' (rank 1/2)"``).
        call: Runs a store call (the group's bounded call).
        wait: Waits for keys (the group's bounded wait).

    Attributes:
        rejected: Records refused so far (failed authentication, or answered
            another session's rank-0 nonce).
    """

    def __init__(self, name: str, rank: int, world_size: int, port: int, *, label: str,
                 call: StoreCall, wait: StoreWait) -> None:
        self._name, self._rank, self._world_size, self._port = name, rank, world_size, port
        self._label = label
        self._call, self._wait = call, wait
        self._nonce = secrets.token_bytes(SESSION_BYTES)
        self._rank0_nonce = self._nonce if rank == 0 else b""
        self._secret = b""
        self._own_record = b""
        self.rejected = 0

    # ------------------------------------------------------------------ keys
    def record_key(self, rank: int) -> str:
        """The key of rank ``rank``'s record."""
        return f"{self._name}/session" if rank == 0 else f"{self._name}/session/{rank}"

    @property
    def writes_key(self) -> str:
        """The counter every record writer adds 1 to."""
        return f"{self._name}/session/writes"

    @property
    def done_key(self) -> str:
        """The counter every rank adds 1 to once it agreed."""
        return f"{self._name}/session/done"

    def keys_to_clean(self) -> list[str]:
        """Every session key but :attr:`done_key`: the rank that brings ``done`` to
        the world size deletes them (and ``done``)."""
        return [self.record_key(r) for r in range(self._world_size)] + [self.writes_key]

    # ------------------------------------------------------------------ joining
    def join(self, source: Callable[[], bytes | None], timeout: float) -> None:
        """Join: rank 0 writes its record; another rank verifies rank 0's record (retrying
        until ``timeout``) and writes its answer. Never waits for the other ranks.

        Raises:
            AuthenticationError: Rank 0 has no secret; or (other ranks) no record of
                rank 0 verified within ``timeout`` (the message says why: none, a bad
                one, no key file, or rank 0's store did not answer).
            CommTimeout: The store stopped answering.
            StoreConnectionError: The connection to the store was lost.
        """
        deadline = (time.monotonic() + timeout, timeout)
        if self._rank == 0:
            secret = source()
            if secret is None:
                raise AuthenticationError(f"stateless group {self._name!r}: rank 0 has no secret")
            self._secret = secret
            if self._world_size > 1:
                self._publish(0, self._nonce, deadline)
            return
        self._secret, self._rank0_nonce = self._verify_rank0(source, deadline)
        self._publish(self._rank, self._nonce + self._rank0_nonce, deadline)

    def _publish(self, rank: int, payload: bytes, deadline: tuple[float, float]) -> None:
        """Write rank ``rank``'s record; the ``add`` confirms the store got the ``set``."""
        key = self.record_key(rank)
        self._own_record = payload + self._tag(self._secret, key, payload)
        self._call("set", key, self._own_record, op="create", deadline=deadline)
        self._call("add", self.writes_key, 1, op="create", deadline=deadline)

    def _verify_rank0(self, source: Callable[[], bytes | None],
                      deadline: tuple[float, float]) -> tuple[bytes, bytes]:
        """``(secret, N_0)`` once rank 0's record verifies under the secret ``source()``
        gives (re-read each round: a key file may be replaced by rank 0's)."""
        key = self.record_key(0)
        delay = RetryDelay(deadline[0])
        why = "no session record from rank 0"
        record: bytes | None = None
        counted = fetch = True
        seen: int | None = None  # session/writes when the refused record was fetched
        while True:
            if fetch:
                got = self._try_get(key, deadline)
                if isinstance(got, CommTimeout):
                    why, got = "rank 0's store did not answer (is its process stopped?)", None
                record, counted = got, False
            secret = source()
            if secret is None:
                why = "the key file of rank 0 is missing or not private"
            elif record is not None:
                if self._rank0_record_ok(secret, key, record):
                    return secret, record[:SESSION_BYTES]
                if not counted:
                    self.rejected += 1
                    counted = True
                why = ("the session record failed authentication: another secret, world size "
                       "or name than rank 0's, or the store reached via a port mapping")
            if time.monotonic() >= deadline[0]:
                raise AuthenticationError(
                    f"{self._label}: could not authenticate rank 0's session within "
                    f"{deadline[1]:.1f}s ({why}). Every rank needs the same secret (argument, "
                    f"or {SECRET_ENV}).", rejected=self.rejected, queue=self._name, peers=[0])
            if record is None:  # _try_get waited for it (up to _JOIN_SLICE_S)
                fetch = True
            elif seen is None:  # refused: it may have been replaced since we fetched it
                seen, fetch = self._writes(deadline), True
            else:  # fetch again only once a writer added to the counter
                delay.sleep()
                now = self._writes(deadline)
                fetch, seen = now != seen, now

    def _try_get(self, key: str, deadline: tuple[float, float]) -> bytes | CommTimeout | None:
        """The value under ``key`` if it arrives within ``_JOIN_SLICE_S`` (or what is left);
        the error if the store did not answer; else None."""
        left = max(deadline[0] - time.monotonic(), 0.001)
        try:
            self._call("wait", [key], datetime.timedelta(seconds=min(left, _JOIN_SLICE_S)),
                       op="create", deadline=deadline)
            return bytes(self._call("get", key, op="create", deadline=deadline))
        except CommTimeout as e:
            return e
        except (RuntimeError, dist.DistError):
            return None

    def _writes(self, deadline: tuple[float, float], op: str = "create") -> int:
        """The ``session/writes`` counter (creating it at 0 if no record was written yet)."""
        return int(self._call("add", self.writes_key, 0, op=op, deadline=deadline))

    # ------------------------------------------------------------------ agreeing
    def agree(self, deadline: tuple[float, float], op: str) -> Sealer:
        """The sealer of the session, once every other rank's record is accepted.

        Args:
            deadline: The calling operation's ``(monotonic deadline, seconds)``.
            op: The calling operation, for messages.

        Raises:
            CommTimeout: Some rank's record did not appear by the deadline (that rank
                has not joined); the message names them.
            AuthenticationError: Some record was still refused at the deadline; the
                message names each and why (replayed from an earlier incarnation,
                or forged).
        """
        nonces = {self._rank: self._nonce, 0: self._rank0_nonce}
        others = [s for s in range(1, self._world_size) if s != self._rank]
        if others:
            nonces.update(self._read_answers(others, deadline, f"{op} (session set-up)"))
        session = session_of([nonces[r] for r in range(self._world_size)])
        return Sealer(self._name, self._secret, session, port=self._port,
                      world_size=self._world_size)

    def _read_answers(self, ranks: list[int], deadline: tuple[float, float],
                      op: str) -> dict[int, bytes]:
        """``{rank: N_rank}`` from the records of ``ranks`` that answer this rank's N_0."""
        keys = {s: self.record_key(s) for s in ranks}
        self._wait(list(keys.values()), deadline, op, ranks=ranks)
        accepted: dict[int, bytes] = {}
        refused: dict[int, str] = {}

        def read(which: list[int]) -> None:
            values = self._call("multi_get", [keys[s] for s in which], op=op, deadline=deadline)
            for s, value in zip(which, values, strict=True):
                why = self._answer_problem(s, bytes(value))
                if why is None:
                    accepted[s] = bytes(value[:SESSION_BYTES])
                    refused.pop(s, None)
                else:
                    self.rejected += 1
                    refused[s] = why

        read(ranks)
        if not refused:
            return accepted
        seen = self._writes(deadline, op)
        read(list(refused))  # a refused record may have been replaced before the snapshot
        delay = RetryDelay(deadline[0])
        while refused:
            if not delay.sleep():
                raise self._refusal(refused, deadline, op)
            now = self._writes(deadline, op)
            if now != seen:
                seen = now
                self._wait([keys[s] for s in refused], deadline, op, ranks=list(refused))
                read(list(refused))
        return accepted

    def _refusal(self, refused: dict[int, str], deadline: tuple[float, float],
                 op: str) -> AuthenticationError:
        by_reason: dict[str, list[int]] = {}
        for s, why in sorted(refused.items()):
            by_reason.setdefault(why, []).append(s)
        what = "; ".join(
            f"{', '.join(repr(self.record_key(s)) for s in ranks)} (the record of rank(s) "
            f"{ranks}) {why}" for why, ranks in by_reason.items())
        return AuthenticationError(
            f"{self._label}, op {op}: refused {len(refused)} session record(s) for "
            f"{deadline[1]:.1f}s: {what}.{self._own_record_note(op)} No value sealed in "
            f"another session is ever accepted; start the group again (a fresh secret per "
            f"job keeps an earlier job's records useless), and keep others from writing "
            f"its store.",
            rejected=self.rejected, queue=self._name, peers=sorted(refused))

    def _own_record_note(self, op: str) -> str:
        """A sentence saying that this rank's own record was replaced or deleted, if it
        was (best effort: a store that does not answer at once says nothing)."""
        key = self.record_key(self._rank)
        grace = (time.monotonic(), 0.0)
        try:
            if not self._call("check", [key], op=op, deadline=grace):
                return f" This rank's own record {key!r} is no longer in the store (deleted)."
            if bytes(self._call("get", key, op=op, deadline=grace)) != self._own_record:
                return (f" This rank's own record {key!r} was replaced by one it did not "
                        f"write (a replay).")
        except (RuntimeError, dist.DistError, ConnectionError, TimeoutError):
            pass
        return ""

    # ------------------------------------------------------------------ checks
    def _tag(self, secret: bytes, key: str, payload: bytes) -> bytes:
        return session_tag(secret, self._name, key, payload, self._port, self._world_size)

    def _rank0_record_ok(self, secret: bytes, key: str, record: bytes) -> bool:
        payload, tag = record[:SESSION_BYTES], record[SESSION_BYTES:]
        return len(record) == _RANK0_RECORD and hmac.compare_digest(
            tag, self._tag(secret, key, payload))

    def _answer_problem(self, rank: int, record: bytes) -> str | None:
        """None if ``record`` is rank ``rank``'s answer to this rank's N_0; else why not."""
        key = self.record_key(rank)
        payload, tag = record[:2 * SESSION_BYTES], record[2 * SESSION_BYTES:]
        if len(record) != _ANSWER_RECORD or not hmac.compare_digest(
                tag, self._tag(self._secret, key, payload)):
            return ("failed authentication: forged, or written for another secret, name, "
                    "size or store port")
        if payload[SESSION_BYTES:] != self._rank0_nonce:
            if self._rank == 0:
                return (f"answer(s) a nonce of rank 0 that is not this rank's: a record of an "
                        f"earlier incarnation of this group (the same secret, name, size and "
                        f"port) replayed under that key, or that rank verified a replayed "
                        f"{self.record_key(0)!r} (written over this rank's) when it joined")
            return (f"answer(s) another nonce of rank 0 than the one this rank verified when it "
                    f"joined: a record of an earlier incarnation of this group (the same "
                    f"secret, name, size and port) replayed under that key, or one of the two "
                    f"ranks verified a replayed {self.record_key(0)!r} when it joined")
        return None

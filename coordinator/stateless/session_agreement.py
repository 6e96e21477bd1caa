"""A stateless group's session: every rank contributes a fresh nonce, and rank 0 confirms the list.

Records under the group's name, each authenticated by its tag,
:func:`~coordinator.stateless.store_sealing.session_tag` (HMAC-SHA256 under a key
derived from the secret, binding the group's name, the record's key, the store
port, the world size and the payload). ``P = <name>/session`` is the only record
key every incarnation of the group shares; the others lie under ``I =
<name>/session/<N_0 in hex>``, so each incarnation (each rank-0 nonce) has its
own set::

    P           rank 0:  N_0 | tag                   written when rank 0 joins; written again
                                                     when rank 0 finds another value there
    P/writes    counter: rank 0 adds 1 after each write of P; a joining rank that refused
                what it found under P fetches P again only once this moved
    I/<t>       rank t > 0:  N_t | N_0 | tag         its answer, written when it joins, after
                                                     it verified P
    I/writes    counter: every rank t adds 1 after writing I/<t>; rank 0 fetches a refused
                answer again only once this moved
    I/confirm   rank 0:  0x01 | N_0 | N_1 .. N_{n-1} | tag    the confirmation, once it
                                                              accepted every answer;
                or       0x00 | N_0 | tag                     a refusal (see below)
    I/done      counter: rank 0 adds 1 after writing its confirmation, every other rank
                once it accepted it; the rank that brings it to the world size (or past
                it) deletes I/*, P/writes, and P if it still holds this incarnation's record

``N_r`` is :data:`~coordinator.stateless.store_sealing.SESSION_BYTES` random
bytes drawn when rank ``r`` is constructed. The session is :func:`session_of`
the list ``N_0 .. N_{n-1}`` (SHA-256 with a domain tag and the count), and the
key of every value is derived from it
(:class:`~coordinator.stateless.store_sealing.Sealer`).

**Joining** (:meth:`SessionAgreement.join`, in the constructor). Rank 0 writes
``P`` with ``compare_set`` (so it learns what was there) and does not wait for
any rank; an authentic record of another rank 0 that it finds there (left by an
earlier incarnation, or replayed) gets a refusal under that record's
``I/confirm``. A rank ``t > 0`` waits for ``P`` (up to the group's timeout: rank 0
must be constructed by then) and reads it until it verifies (a wrong secret
shows here, as ``AuthenticationError`` at the end of the timeout), then writes
its answer ``I/<t>``.

**Agreeing** (:meth:`SessionAgreement.agree`, in the rank's first call that
sends or receives a value, within that call's timeout)::

    rank 0   waiting --every I/<t> exists--> reading --all accepted--> confirm, +1 done: agreed
              |   ^                            |   ^
     a wait   |   | P holds this rank's        |   | I/writes moved, no sooner than the back-off
     slice    v   | record (written again)     v   |
     ended   checking P                      refused --deadline--> AuthenticationError naming each
              |  another authentic rank-0 record there: a refusal under its I/confirm;
              |  some rank answered such a record (its answer exists there): a refusal under
              |  this rank's I/confirm, and AuthenticationError (in every later call too)
              +--deadline--> the same if some rank answered such a record, else CommTimeout
                             naming the ranks whose answer is missing

    rank t   waiting for I/confirm --exists--> reading --it lists N_0 and N_t--> +1 done: agreed
              |                                  |--a refusal, or a confirmation listing another
              |                                  |  N_t: AuthenticationError (every later call too)
              |                                  |--fails authentication: refused, read again once
              |                                     I/done moved; AuthenticationError at deadline
              +--deadline--> AuthenticationError if P holds another authentic rank-0 record than
                             the one this rank verified; else CommTimeout naming the ranks whose
                             answer is missing, else rank 0

Rank 0's wait slices start at :data:`WATCH_FIRST_S` and double up to
:data:`~coordinator.stateless.retry_delay.MOST_S`; within a slice it looks for
the answers with the store's ``check`` every 1-20 ms (``_keys_exist``), so a
slice ends soon after the answers are there.

**No replay is ever accepted** (a group re-created with the same secret, name,
size and port, in this job or a later one): every rank's session hashes its own
nonce, drawn fresh when it joined, so the key it seals and opens values with
differs from every key of an earlier incarnation, whatever records an attacker
planted. A replay can keep ranks from agreeing, never make a rank accept a value
sealed in another session.

**Ranks that agree hold the same list.** Rank ``t`` accepts only a confirmation
tagged under ``I/confirm`` (for the ``N_0`` it verified) that lists that ``N_0``
and its own fresh ``N_t``. ``I`` is derived from rank 0's fresh nonce, so no
earlier incarnation wrote under it; within this incarnation only rank 0 writes an
authentic record there: one confirmation, after it accepted an authentic answer
under ``I/<s>`` for every ``s`` (only rank ``s`` of this incarnation writes one,
with its own nonce), or a refusal. So every rank that agrees holds rank 0's list,
and the list holds each rank's own nonce. A rank that verified an earlier
incarnation's ``P`` waits under that incarnation's ``I``, where an authentic
record is that incarnation's confirmation (it lists another ``N_t``) or a refusal
of a later rank 0: it never agrees. Records of earlier incarnations lie under
other ``I``: nobody reads them, and their leftover counters cannot make a rank
delete this incarnation's keys.

**What fails, and says so.** A rank that verified an earlier record of rank 0
(replayed over rank 0's before that rank read it, or left in a shared store by
an incarnation whose set-up never completed, read before rank 0 wrote its own)
raises ``AuthenticationError`` naming it: as soon as it finds the earlier
confirmation or rank 0's refusal under that record's ``I/confirm`` (rank 0 writes
the refusal when it finds the record: when it joins, and at the end of each wait
slice of its first call in which an answer is missing), or at its deadline when
``P`` holds another authentic record. Rank 0 then raises ``AuthenticationError``
(it finds that rank's answer under the earlier ``I``), and writes a refusal under
its own ``I/confirm``, so that the ranks that verified its genuine record raise it
too instead of waiting. A rank whose first call ends before rank 0's first call
has started cannot tell a slow rank 0 from a replayed record: it raises
``CommTimeout`` naming rank 0 and saying so, and its next call raises the
``AuthenticationError``. An attacker who can write the store can always keep a
group from working (it can delete keys), never make it accept what it did not
seal.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import struct
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed as dist

from coordinator.errors import AuthenticationError, ClosedError, CommTimeout, StoreConnectionError
from coordinator.stateless.group_secret import SECRET_ENV
from coordinator.stateless.retry_delay import MOST_S, RetryDelay
from coordinator.stateless.store_sealing import SESSION_BYTES, Sealer, session_tag

__all__ = ["SESSION_DOMAIN", "WATCH_FIRST_S", "SessionAgreement", "session_of"]

#: Domain tag of :func:`session_of` (the session protocol's version).
SESSION_DOMAIN = b"groupcoord stateless-group session v2"
#: Rank 0's first wait slice (seconds) before it checks its own record while it waits for
#: the answers; later slices double up to ``MOST_S``.
WATCH_FIRST_S = 0.05

_TAG_BYTES = 32  # HMAC-SHA256
_RANK0_RECORD = SESSION_BYTES + _TAG_BYTES
_ANSWER_RECORD = 2 * SESSION_BYTES + _TAG_BYTES
_JOIN_SLICE_S = 0.5  # the longest single wait for rank 0's record while joining
_CONFIRMED = b"\x01"  # first byte of a confirmation
_REFUSAL = b"\x00"  # first byte of a refusal
_REFUSAL_RECORD = 1 + SESSION_BYTES + _TAG_BYTES
#: How long :meth:`SessionAgreement._keys_exist` first sleeps between two looks at the
#: store (seconds); later pauses double up to ``_LOOK_MOST_S``.
_LOOK_FIRST_S = 0.001
_LOOK_MOST_S = 0.02
# What a best-effort store call (the done count, deleting keys) may meet when the
# store's host has left or stopped; the call is then skipped.
_BEST_EFFORT = (RuntimeError, dist.DistError, CommTimeout, StoreConnectionError)


class StoreCall(Protocol):
    """Runs ``store.<method>(*args)`` for operation ``op``, bounded by ``deadline``."""

    def __call__(self, method: str, *args: Any, op: str,
                 deadline: tuple[float, float] | None = None) -> Any: ...


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

    Attributes:
        rejected: Records refused so far (failed authentication, or answered
            another session's rank-0 nonce).
    """

    def __init__(self, name: str, rank: int, world_size: int, port: int, *, label: str,
                 call: StoreCall) -> None:
        self._name, self._rank, self._world_size, self._port = name, rank, world_size, port
        self._label = label
        self._call = call
        self._nonce = secrets.token_bytes(SESSION_BYTES)
        self._rank0_nonce = self._nonce if rank == 0 else b""
        self._rank0_record = b""  # rank 0's record: rank 0's own, or the one this rank verified
        self._secret = b""
        # Rank 0: the nonces of authentic records of another rank 0 found over its own.
        self._displaced_by: dict[bytes, None] = {}
        # Why the set-up cannot succeed, and whom it names (raised again by every call).
        self._failure: tuple[str, list[int]] | None = None
        self.rejected = 0

    # ------------------------------------------------------------------ keys
    @property
    def rank0_key(self) -> str:
        """``P``: the key of rank 0's record (shared by every incarnation)."""
        return f"{self._name}/session"

    @property
    def rank0_writes_key(self) -> str:
        """``P/writes``: the counter rank 0 adds 1 to after each write of its record."""
        return f"{self._name}/session/writes"

    def incarnation(self, rank0_nonce: bytes | None = None) -> str:
        """``I``: the prefix of the keys of the incarnation whose rank 0 drew
        ``rank0_nonce`` (by default the one this rank holds; another rank knows it
        once it joined)."""
        nonce = self._rank0_nonce if rank0_nonce is None else rank0_nonce
        return f"{self._name}/session/{nonce.hex()}"

    def record_key(self, rank: int, rank0_nonce: bytes | None = None) -> str:
        """The key of rank ``rank``'s record: ``P`` for rank 0, else ``I/<rank>``."""
        return self.rank0_key if rank == 0 else f"{self.incarnation(rank0_nonce)}/{rank}"

    def confirm_key(self, rank0_nonce: bytes | None = None) -> str:
        """``I/confirm``: rank 0's confirmation (or refusal)."""
        return f"{self.incarnation(rank0_nonce)}/confirm"

    @property
    def writes_key(self) -> str:
        """``I/writes``: the counter every answer writer adds 1 to."""
        return f"{self.incarnation()}/writes"

    @property
    def done_key(self) -> str:
        """``I/done``: the counter of the ranks that agreed."""
        return f"{self.incarnation()}/done"

    # ------------------------------------------------------------------ joining
    def join(self, source: Callable[[], bytes | None], timeout: float) -> None:
        """Join: rank 0 writes its record (never waiting for another rank); another rank
        waits for rank 0's record and verifies it (retrying until ``timeout``), then
        writes its answer.

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
                key = self.rank0_key
                self._rank0_record = self._nonce + self._tag(key, self._nonce)
                self._claim_rank0_key(deadline, "create")
            return
        self._secret, self._rank0_record = self._verify_rank0(source, deadline)
        self._rank0_nonce = self._rank0_record[:SESSION_BYTES]
        key = self.record_key(self._rank)
        payload = self._nonce + self._rank0_nonce
        self._call("set", key, payload + self._tag(key, payload), op="create", deadline=deadline)
        # The add confirms the store got the set, and wakes rank 0 if it refused a record there.
        self._call("add", self.writes_key, 1, op="create", deadline=deadline)

    def _verify_rank0(self, source: Callable[[], bytes | None],
                      deadline: tuple[float, float]) -> tuple[bytes, bytes]:
        """``(secret, record)`` once rank 0's record verifies under the secret ``source()``
        gives (re-read each round: a key file may be replaced by rank 0's)."""
        key = self.rank0_key
        delay = RetryDelay(deadline[0])
        why = "no session record from rank 0"
        record: bytes | None = None
        counted = fetch = True
        seen: int | None = None  # P/writes when the refused record was fetched
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
                if self._rank0_record_ok(record, secret):
                    return secret, record
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
                seen, fetch = self._counter(self.rank0_writes_key, deadline, "create"), True
            else:  # fetch again only once rank 0 added to the counter
                delay.sleep()
                now = self._counter(self.rank0_writes_key, deadline, "create")
                fetch, seen = now != seen, now

    def _try_get(self, key: str, deadline: tuple[float, float]) -> bytes | CommTimeout | None:
        """The value under ``key`` if it arrives within ``_JOIN_SLICE_S`` (or what is left);
        the error if the store did not answer; else None."""
        left = max(deadline[0] - time.monotonic(), 0.001)
        try:
            if not self._keys_exist([key], min(left, _JOIN_SLICE_S), deadline, "create"):
                return None
            return bytes(self._call("get", key, op="create", deadline=deadline))
        except CommTimeout as e:
            return e
        except ClosedError:
            raise
        except (RuntimeError, dist.DistError):
            return None

    # ------------------------------------------------------------------ rank 0's record
    def _claim_rank0_key(self, deadline: tuple[float, float], op: str) -> None:
        """Make ``P`` hold rank 0's record: create it if absent (or empty), write it again
        over another value. An authentic record of another rank 0 found there gets a
        refusal under its ``I/confirm`` (the ranks that verified it wait there)."""
        key = self.rank0_key
        found = bytes(self._call("compare_set", key, b"", self._rank0_record, op=op,
                                 deadline=deadline))
        if found != self._rank0_record:
            if self._rank0_record_ok(found, self._secret):
                other = found[:SESSION_BYTES]
                self._displaced_by[other] = None
                self._put_refusal(self.confirm_key(other), op, deadline)
            else:
                self.rejected += 1
            self._call("set", key, self._rank0_record, op=op, deadline=deadline)
        # A joining rank that refused what it found under P fetches P again once this moved.
        self._call("add", self.rank0_writes_key, 1, op=op, deadline=deadline)

    def _put_refusal(self, key: str, op: str, deadline: tuple[float, float]) -> None:
        """Write rank 0's refusal under ``key`` (an ``I/confirm``); the ranks waiting there
        raise ``AuthenticationError``."""
        payload = _REFUSAL + self._nonce
        self._call("set", key, payload + self._tag(key, payload), op=op, deadline=deadline)

    # ------------------------------------------------------------------ agreeing
    def agree(self, deadline: tuple[float, float], op: str) -> Sealer:
        """The sealer of the session, once rank 0 accepted every rank's answer (rank 0)
        or this rank accepted rank 0's confirmation (another rank).

        Args:
            deadline: The calling operation's ``(monotonic deadline, seconds)``.
            op: The calling operation, for messages.

        Raises:
            CommTimeout: Not agreed by the deadline, and nothing says that a record was
                replayed: the message names the ranks whose answer is missing (they
                have not been constructed), else rank 0 (it has not made its first
                call that sends or receives).
            AuthenticationError: A record of rank 0 of an earlier incarnation was
                verified by some rank, or a record was still refused at the deadline;
                the message names them and why. Once a rank learnt that its group
                cannot agree, every later call raises this again.
        """
        if self._failure is not None:
            raise self._fail(*self._failure)
        step = f"{op} (session set-up)"
        if self._world_size == 1:  # no store access at all
            return Sealer(self._name, self._secret, session_of([self._nonce]), port=self._port,
                          world_size=1)
        if self._rank == 0:
            nonces = self._confirm(deadline, step)
        else:
            nonces = self._confirmed(deadline, step)
        self._count_done(deadline)
        return Sealer(self._name, self._secret, session_of(nonces), port=self._port,
                      world_size=self._world_size)

    def _confirm(self, deadline: tuple[float, float], op: str) -> list[bytes]:
        """Rank 0: accept every answer, then write the confirmation listing the nonces."""
        keys = {s: self.record_key(s) for s in range(1, self._world_size)}
        self._await_answers(keys, deadline, op)
        answers = self._read_records(keys, self._answer_problem, self.writes_key, "answer",
                                     deadline, op)
        nonces = [self._nonce] + [answers[s][:SESSION_BYTES] for s in sorted(answers)]
        key = self.confirm_key()
        payload = _CONFIRMED + b"".join(nonces)
        # Not answered; the add to I/done that follows on this connection confirms it.
        self._call("set", key, payload + self._tag(key, payload), op=op, deadline=deadline)
        return nonces

    def _await_answers(self, keys: dict[int, str], deadline: tuple[float, float],
                       op: str) -> None:
        """Rank 0: wait until every answer exists, checking ``P`` after each wait slice.

        Raises:
            AuthenticationError: Some rank answered an authentic record of another
                rank 0 found over this rank's (now, or at the deadline).
            CommTimeout: Answers still missing at the deadline.
        """
        slices = RetryDelay(deadline[0], first=WATCH_FIRST_S, most=MOST_S)
        missing = list(keys)
        while True:
            step = slices.next()
            if step is None:
                break
            if self._keys_exist([keys[s] for s in missing], step, deadline, op):
                return
            self._claim_rank0_key(deadline, op)
            if self._displaced_by:  # some rank may have answered the record found there
                missing = [s for s in missing if not self._exists(keys[s], op, deadline)]
                elsewhere = self._answered_elsewhere(missing, op, deadline)
                if elsewhere:
                    raise self._give_up(elsewhere, deadline, op)
        grace = (time.monotonic(), 0.0)
        missing = [s for s in missing if not self._exists(keys[s], op, grace)]
        if not missing:
            return
        elsewhere = self._answered_elsewhere(missing, op, grace)
        if elsewhere:
            raise self._give_up(elsewhere, deadline, op)
        note = (" This rank's own record was replaced by an earlier incarnation's meanwhile "
                "(it wrote its own back; a rank that verified that one raises "
                "AuthenticationError)." if self._displaced_by else "")
        raise CommTimeout(
            f"{self._label}, op {op}: rank(s) {missing} did not answer within "
            f"{deadline[1]:.1f}s: their session records are missing (those ranks have not "
            f"been constructed).{note} Check that they are alive and call the matching "
            f"operation.", queue=self._name, peers=missing)

    def _answered_elsewhere(self, ranks: list[int], op: str,
                            deadline: tuple[float, float]) -> list[int]:
        """Rank 0: those of ``ranks`` that answered an authentic record of another rank 0
        found over this rank's (their answer exists under that record's ``I``)."""
        return [s for s in ranks if any(self._exists(self.record_key(s, other), op, deadline)
                                        for other in self._displaced_by)]

    def _give_up(self, elsewhere: list[int], deadline: tuple[float, float],
                 op: str) -> AuthenticationError:
        """Rank 0: ranks ``elsewhere`` answered an earlier record of rank 0, so the set-up
        cannot succeed. Write a refusal under this incarnation's ``I/confirm`` (the ranks
        waiting there raise too); the error to raise now and in every later call."""
        with contextlib.suppress(*_BEST_EFFORT):
            self._put_refusal(self.confirm_key(), op, deadline)
            self._call("check", [self.confirm_key()], op=op, deadline=(time.monotonic(), 0.0))
        olds = ", ".join(n.hex()[:8] + "..." for n in self._displaced_by)
        return self._fail(
            f"{self._label}, op {op}: this rank's own record {self.rank0_key!r} was replaced "
            f"by the record of rank 0 of an earlier incarnation of this group (the same "
            f"secret, name, size and port; rank-0 nonce(s) {olds}): a replay, or a record left "
            f"in a shared store by an incarnation whose set-up never completed. This rank "
            f"wrote its own back, but rank(s) {elsewhere} had verified the replayed record and "
            f"answered it (they raise AuthenticationError too), so the group cannot agree on "
            f"a session. No value sealed in another session is ever accepted; start the group "
            f"again (a fresh secret per job keeps an earlier job's records useless), and keep "
            f"others from writing its store.", elsewhere)

    def _confirmed(self, deadline: tuple[float, float], op: str) -> list[bytes]:
        """Another rank: rank 0's confirmation, checked against this rank's view."""
        key = self.confirm_key()
        if not self._keys_exist([key], deadline[0] - time.monotonic(), deadline, op):
            raise self._no_confirmation(deadline, op)
        record = self._read_records({0: key}, self._confirmation_problem, self.done_key,
                                    "confirmation", deadline, op)[0]
        return _split_nonces(record[1:-_TAG_BYTES])

    def _no_confirmation(self, deadline: tuple[float, float],
                         op: str) -> AuthenticationError | CommTimeout:
        """Another rank, at its deadline without rank 0's confirmation: the error that
        says the most that is known."""
        key, verified = self.rank0_key, self._rank0_record
        grace = (time.monotonic(), 0.0)
        with contextlib.suppress(*_BEST_EFFORT):
            # The record there if it changed (this rank's own copy if it did not, or is gone).
            now = bytes(self._call("compare_set", key, verified, verified, op=op,
                                   deadline=grace))
            if now != verified and self._rank0_record_ok(now, self._secret):
                return self._fail(
                    f"{self._label}, op {op}: rank 0 did not confirm the session within "
                    f"{deadline[1]:.1f}s, and {key!r} now holds another authentic record of "
                    f"rank 0 than the one this rank verified when it joined (rank-0 nonce "
                    f"{self._rank0_nonce.hex()[:8]}...): that one was left in the store by an "
                    f"earlier incarnation of this group (the same secret, name, size and port) "
                    f"or replayed from one (or rank 0 has started again). Start the group "
                    f"again (a fresh secret per job keeps an earlier job's records useless).",
                    [0])
        missing = [s for s in range(1, self._world_size)
                   if s != self._rank and not self._exists(self.record_key(s), op, grace)]
        if missing:
            return CommTimeout(
                f"{self._label}, op {op}: rank(s) {missing} did not answer within "
                f"{deadline[1]:.1f}s: their session records are missing (those ranks have not "
                f"been constructed). Check that they are alive and call the matching "
                f"operation.", queue=self._name, peers=missing)
        return CommTimeout(
            f"{self._label}, op {op}: rank 0 did not confirm the session within "
            f"{deadline[1]:.1f}s: it has made no call that sends or receives on this group yet "
            f"(every other rank's first such call waits for rank 0's), or the record of rank 0 "
            f"this rank verified when it joined was replayed from an earlier incarnation "
            f"(rank 0 says so in its first call, and this rank's next call raises "
            f"AuthenticationError then). Check that rank 0 is alive and calls the matching "
            f"operation.", queue=self._name, peers=[0])

    def _count_done(self, deadline: tuple[float, float]) -> None:
        """Add 1 to ``I/done``; the rank that brings it to the world size (or past it)
        deletes this incarnation's keys, and ``P`` if it still holds this incarnation's
        record. Best effort: the store's host may leave right after its own first call."""
        grace = (time.monotonic(), 0.0)
        with contextlib.suppress(*_BEST_EFFORT):
            if int(self._call("add", self.done_key, 1, op="session set-up",
                              deadline=deadline)) < self._world_size:
                return
            for key in ([self.record_key(s) for s in range(1, self._world_size)]
                        + [self.writes_key, self.confirm_key(), self.done_key,
                           self.rank0_writes_key]):
                self._call("delete_key", key, op="session set-up", deadline=grace)
            # Only this incarnation's record: a later rank 0's stays.
            key, ours = self.rank0_key, self._rank0_record
            if self._call("compare_set", key, ours, b"", op="session set-up",
                          deadline=grace) == b"":
                self._call("delete_key", key, op="session set-up", deadline=grace)

    # ------------------------------------------------------------------ reading records
    def _read_records(self, keys: dict[int, str], problem: Callable[[int, bytes], str | None],
                      counter: str, noun: str, deadline: tuple[float, float],
                      op: str) -> dict[int, bytes]:
        """``{s: record under keys[s]}`` once each is accepted (``problem`` gives None). A
        refused one is fetched again only once ``counter`` moved, checked no more often
        than the back-off allows; ``problem`` may raise instead (a fatal record)."""
        accepted: dict[int, bytes] = {}
        refused: dict[int, str] = {}

        def read(which: list[int]) -> None:
            values = self._call("multi_get", [keys[s] for s in which], op=op, deadline=deadline)
            for s, value in zip(which, values, strict=True):
                why = problem(s, bytes(value))
                if why is None:
                    accepted[s] = bytes(value)
                    refused.pop(s, None)
                else:
                    self.rejected += 1
                    refused[s] = why

        read(list(keys))
        if not refused:
            return accepted
        seen = self._counter(counter, deadline, op)
        read(list(refused))  # a refused record may have been replaced before the snapshot
        delay = RetryDelay(deadline[0])
        while refused:
            if not delay.sleep():
                raise self._refusal(refused, keys, noun, deadline, op)
            now = self._counter(counter, deadline, op)
            if now != seen:
                seen = now
                # An outsider may have deleted it: a multi_get would then wait server-side.
                if not self._keys_exist([keys[s] for s in refused],
                                        deadline[0] - time.monotonic(), deadline, op):
                    raise self._refusal(refused, keys, noun, deadline, op)
                read(list(refused))
        return accepted

    def _refusal(self, refused: dict[int, str], keys: dict[int, str], noun: str,
                 deadline: tuple[float, float], op: str) -> AuthenticationError:
        by_reason: dict[str, list[int]] = {}
        for s, why in sorted(refused.items()):
            by_reason.setdefault(why, []).append(s)
        what = "; ".join(
            f"{', '.join(repr(keys[s]) for s in ranks)} (the {noun} of rank(s) {ranks}) {why}"
            for why, ranks in by_reason.items())
        return AuthenticationError(
            f"{self._label}, op {op}: refused {len(refused)} session record(s) for "
            f"{deadline[1]:.1f}s: {what}. No value sealed in another session is ever accepted; "
            f"start the group again (a fresh secret per job keeps an earlier job's records "
            f"useless), and keep others from writing its store.",
            rejected=self.rejected, queue=self._name, peers=sorted(refused))

    # ------------------------------------------------------------------ checks
    def _tag(self, key: str, payload: bytes, secret: bytes | None = None) -> bytes:
        return session_tag(self._secret if secret is None else secret, self._name, key,
                           payload, self._port, self._world_size)

    def _tag_ok(self, key: str, record: bytes, size: int, secret: bytes | None = None) -> bool:
        """``record`` is ``size`` bytes: a payload and its tag under ``key``."""
        payload, tag = record[:-_TAG_BYTES], record[-_TAG_BYTES:]
        return len(record) == size and hmac.compare_digest(tag, self._tag(key, payload, secret))

    def _rank0_record_ok(self, record: bytes, secret: bytes) -> bool:
        """``record`` is an authentic record of rank 0 (of any incarnation)."""
        return self._tag_ok(self.rank0_key, record, _RANK0_RECORD, secret)

    def _answer_problem(self, rank: int, record: bytes) -> str | None:
        """Rank 0: None if ``record`` is rank ``rank``'s answer to its N_0; else why not."""
        if not self._tag_ok(self.record_key(rank), record, _ANSWER_RECORD):
            return ("failed authentication: forged, or written for another secret, name, "
                    "size or store port")
        if record[SESSION_BYTES:2 * SESSION_BYTES] != self._nonce:
            return ("answer(s) a nonce of rank 0 that is not this rank's: written by a holder "
                    "of the secret for another session")
        return None

    def _confirmation_problem(self, _: int, record: bytes) -> str | None:
        """Another rank: None if ``record`` is rank 0's confirmation listing the N_0 this
        rank verified and its own N_t; raises on an authentic refusal or a confirmation of
        another session (this rank verified an earlier record of rank 0); else why not."""
        key = self.confirm_key()
        if record[:1] == _REFUSAL and self._tag_ok(key, record, _REFUSAL_RECORD):
            rank0 = record[1:1 + SESSION_BYTES].hex()[:8]
            raise self._verified_a_replay(
                f"rank 0 (rank-0 nonce {rank0}...) found it over its own record and refused "
                f"it under {key!r}", key)
        size = 1 + SESSION_BYTES * self._world_size + _TAG_BYTES
        if record[:1] != _CONFIRMED or not self._tag_ok(key, record, size):
            return ("failed authentication: forged, or written for another secret, name, "
                    "size or store port")
        nonces = _split_nonces(record[1:-_TAG_BYTES])
        if nonces[0] != self._rank0_nonce or nonces[self._rank] != self._nonce:
            raise self._verified_a_replay(
                f"the confirmation under {key!r} lists another nonce of this rank: it is "
                f"that incarnation's", key)
        return None

    def _verified_a_replay(self, evidence: str, key: str) -> AuthenticationError:
        self.rejected += 1
        return self._fail(
            f"{self._label}: the record of rank 0 this rank verified when it joined "
            f"({self.rank0_key!r}, rank-0 nonce {self._rank0_nonce.hex()[:8]}...) is the "
            f"record of an earlier incarnation of this group (the same secret, name, size and "
            f"port): replayed over rank 0's, or left in a shared store by an incarnation whose "
            f"set-up never completed and read before rank 0 wrote its own. Evidence: "
            f"{evidence}. This rank cannot agree with rank 0; start the group again (a fresh "
            f"secret per job keeps an earlier job's records useless).", [0])

    # ------------------------------------------------------------------ store helpers
    def _counter(self, key: str, deadline: tuple[float, float], op: str) -> int:
        """The counter under ``key`` (creating it at 0 if nobody added to it yet)."""
        return int(self._call("add", key, 0, op=op, deadline=deadline))

    def _keys_exist(self, keys: list[str], seconds: float, deadline: tuple[float, float],
                    op: str) -> bool:
        """True once every key of ``keys`` exists, looking for at most ``seconds`` (never
        past the deadline); False if they do not by then.

        Looks with the store's ``check`` at growing intervals (:data:`_LOOK_FIRST_S` up
        to :data:`_LOOK_MOST_S`), not with its timed ``wait``: a wait that runs out
        makes torch's client log two warnings, and rank 0 waits for the answers in
        slices that run out until the last rank has come.
        """
        end = min(time.monotonic() + seconds, deadline[0])
        pause = _LOOK_FIRST_S
        try:
            while True:
                if self._call("check", keys, op=op, deadline=deadline):
                    return True
                left = end - time.monotonic()
                if left <= 0:
                    return False
                time.sleep(min(pause, left))
                pause = min(2 * pause, _LOOK_MOST_S)
        except ClosedError:
            raise
        except (RuntimeError, dist.DistError):
            return False

    def _exists(self, key: str, op: str, deadline: tuple[float, float]) -> bool:
        return bool(self._call("check", [key], op=op, deadline=deadline))

    def _fail(self, message: str, peers: list[int]) -> AuthenticationError:
        """The error saying that the set-up cannot succeed; every later call raises it too."""
        self._failure = (message, peers)
        return AuthenticationError(message, rejected=self.rejected, queue=self._name,
                                   peers=peers)


def _split_nonces(data: bytes) -> list[bytes]:
    return [data[i:i + SESSION_BYTES] for i in range(0, len(data), SESSION_BYTES)]


"""Lock-free step synchronisation of the shared-memory collective engine.

Every collective is a sequence of *steps*. In step ``s`` (1, 2, ...) each
local rank writes only its own slot of buffer parity ``s % 2``, publishes
``s`` in its generation word, waits until every peer's generation is ``>= s``
and then may read any slot of parity ``s % 2``. Generations only grow and every
op of the communicator shares them, so there is no reset step and different
ops interleave freely.

Protocol for one step, seen from writer ``r`` and any reader ``q``::

    rank r                                    rank q (waiting at step s)
    ------                                    --------------------------
    write own slot of parity s%2
    write sig[s%2] = (op,dtype,root | size)
    FENCE  (orders the data before the flag)
    gen_r := s  -----------------------------> sees gen_r >= s
                                               FENCE (flag before data)
                                               compare sig[s%2] of r with its own
                                               read r's slot of parity s%2
                                               ... finishes reading, later
                                               publishes gen_q := s+1

Generation of a peer ``q`` as seen by rank ``r`` waiting at step ``s``::

        gen_q < s        gen_q == s              gen_q == s+1
     +-----------+   +------------------+   +----------------------+
     |  behind:  |-->| step s published |-->| done with step s;     |
     |  wait     |   | (data + sig)     |   | its step-s data stays |
     +-----------+   +------------------+   | intact (see below)    |
                                            +----------------------+
    gen_q >= s+2 cannot happen: q writes step s+2 only after seeing every
    generation >= s+1, and ours is still s.

Why buffers are never overwritten while read (double buffering): rank ``r``
writes parity ``s%2`` again only at step ``s+2``. Before that it completed step
``s+1``, i.e. saw every ``gen_q >= s+1``; a peer publishes ``s+1`` only after it
finished reading step ``s``. The same argument protects the signature words,
which are checked before a rank publishes its next step.

Writing a peer's slot. With two local ranks the engine's all_reduce lets the
peer ``q`` *modify* ``r``'s slot of parity ``s%2`` after step ``s``
(the two-rank one-step scheme of :mod:`device_comms.cpu_shm.small`), while ``r``
no longer reads it. The argument above covers it unchanged: ``q`` publishes
``s+1`` only after it finished with step ``s``'s slots, so ``r``'s rewrite at
step ``s+2`` cannot overlap ``q``'s writes, and ``q``'s writes before its
``FENCE`` + publish are visible to ``r`` when ``r`` sees ``gen_q >= s+1``.

Rejected calls. A rank whose own arguments fail validation still takes
part in the collective's *first* step, so every generation stays in step::

    all ranks at gen G; rank r rejects, peers q call the op validly

    rank r (rejecting)                     rank q (valid call)
    ------------------                     -------------------
    write reason text into own slot G+1    write own data into slot G+1
    sig[(G+1)%2] := (REJECTED, len)        sig[(G+1)%2] := (op, size key)
    FENCE; gen_r := G+1                    FENCE; gen_q := G+1
    wait every gen >= G+1                  wait every gen >= G+1
    own sig is REJECTED: no checks         sees r's sig REJECTED: reads r's
    return -> raise ValueError/TypeError   reason, raise PeerRejectedError
    --------------- every rank at gen G+1, nothing else written ---------------

A rejected call is thus an ordinary step (a complete one: the rejecting rank
also waits for its peers), so the double-buffering argument above holds
unchanged and the next collective of every rank is step G+2. The REJECTED
signature's kind byte (0xFF) never occurs in a real signature. When several
ranks reject, each raises its own error; a valid rank names the lowest
rejecting rank. A multi-step op checks signatures in its first step, so its
valid ranks leave before any further step. A ``barrier`` (no signature)
passes a rejected step silently: ranks calling different things at the same
point is the caller's bug, as with any other mismatch.

Call numbers. A call's first step also carries the owning group's call number
(``StepSync.number``, from ``DeviceCommunicator.number_calls``; else 0) beside
its signature. Different numbers mean the ranks are out of step (one rank's
earlier call never reached this engine): every rank raises
``CollectiveMismatch`` rather than combine one rank's call ``#n`` with
another's ``#n+1``, and nothing realigns them (no rank knows whose sequence is right).

Relayed errors. A step whose signature is :data:`FAILED` (kind 0xFE) carries
an error found elsewhere -- a hierarchical communicator's node leader passing
on another node's rejection or mismatch (:meth:`StepSync.relay`) -- as
msgpack ``(kind, culprit rank, message)`` in the relaying rank's slot; its
local peers raise the same class naming the same culprit. Like a rejected
step it is a complete step, so generations stay in step.

Memory ordering. On x86-64 (TSO) stores are not reordered with older stores
and loads not with older loads, so "data, then flag" / "flag, then data" in
program order would already suffice for ordinary stores; but torch's copy
kernels may use non-temporal or fast-string stores, which are weakly ordered.
``FENCE`` is an uncontended ``threading.Lock`` acquire + release: a locked
read-modify-write on x86 (a full barrier that also drains write-combining
buffers), and on ARMv8 a release followed by an acquire (ordered, RCsc), which
acts as a full barrier too. A step whose caller wrote its data from this
thread with ordinary stores (``StepSync.step(plain_stores=True)``: glibc's
``memmove``, which ends its own non-temporal loop with ``sfence``, and numpy's
copy and ufunc loops) skips the two ordering fences on x86: there program
order is memory order for store-store and load-load pairs, and stores that
other threads made before this one saw them (an OpenMP team's, joined at its
barrier) are seen by every CPU in the same order (x86 stores are
multi-copy atomic). The Dekker fence below (a store, then a load) stays on
every machine. The flag is one aligned 8-byte store/load through a
``memoryview`` (a single instruction on x86-64 and ARM64), so it never tears.
Rank ``r`` writes only its own 128-byte header line, so flags do not falsely
share cache lines.

Giving up on a step. A rank whose timeout runs out at step ``g`` (or whose
call is interrupted there: :meth:`StepSync.abandon`) must not let a late peer
complete the step (it would return a result while this one
raised): it first *withdraws* its publication, and a step passes only on a
second sweep of the peers' generations after one that saw them all::

    rank t (timeout at step g, or it      rank p (late, or waiting)
    saw a peer behind with CLOSED < 0)    -------------------------
    ------------------------------------  gen_p := g
    CLOSED_t := -g; gen_t := g-1          FENCE
    FENCE                                 sweep 1: wait until each gen_q >= g
    load every gen_q                      sweep 2: every gen_q >= g again?
      some gen_q < g: it stands,            yes: the step passes
        raise CollectiveTimeout             no: wait again (health checks: a
      all >= g: gen_t := g, CLOSED_t := 0,      peer behind with CLOSED < 0
        wake the parked, wait on                makes p give up as t did)

Why no rank passes a step that ``t`` gave up for good (it saw ``gen_y < g``
after its FENCE): a passing ``p``'s first sweep saw ``gen_y >= g``, i.e. read
after ``y``'s publish, which follows ``t``'s load, which follows ``t``'s
withdrawal; its second sweep reads ``gen_t`` later still (loads keep their
order), sees ``g-1`` for good, and does not pass. When ``y`` is ``p``, ``p``'s
own FENCE after publishing gives the same order. When ``t`` finds everyone
arrived, the step stands: peers that saw ``g-1`` wait until ``t`` restores
``g``, and one that saw ``CLOSED_t < 0`` withdraws by the same rule (it raises
only if its sweep finds a rank behind, and then nobody passes). Generations
are read before ``CLOSED`` words, written after them: a withdrawal is seen
with its mark. A withdrawn rank's communicator is broken for good.

Waiting for a peer's generation to reach ``s``::

      +------+   _SPIN_S s   +-------+  _PARK_AFTER s  +---------------------+
      | POLL | ------------> | YIELD | --------------> | PARK: parked := 1,  |
      +------+               +-------+                 | FENCE, re-read gen, |
         |                      |                      | FUTEX_WAIT(gen, old)|
         |  gen >= s            |                      | parked := 0         |
         +----------------------+--------------------> +---------------------+
                                  done   <-- gen >= s ----+   | woken/timeout:
                                                              v  health check,
                                                              PARK again

Waiting: a few polls of the flag, then polls with ``sched_yield`` in between
(no spinning at all when the node's ranks outnumber its CPUs; at the first
yield a rank that shares its CPU with a peer moves to another,
:mod:`device_comms.cpu_shm.placement`), and after
:data:`_PARK_AFTER` the waiter *parks*: it sets ``parked`` in its own line and
sleeps in ``FUTEX_WAIT`` on the generation word it waits for
(:mod:`device_comms.cpu_shm.futex`). A rank that publishes a generation then checks the
peers' ``parked`` words and, if one is set, issues ``FUTEX_WAKE`` on its own
generation word. The two sides are a Dekker pair (each stores, then loads what
the other stored), so both use ``FENCE`` between their store and their load:
at least one sees the other, i.e. either the waiter sees the new generation and
does not sleep, or the publisher sees ``parked`` and wakes it; and
``FUTEX_WAIT`` itself re-checks the word atomically in the kernel. On a busy
machine parking matters: a waiter that keeps polling burns the CPU share its
peer needs, and a woken sleeper is scheduled promptly. Sleeps are bounded
(:data:`_PARK_MAX`), and every 0.2 s the waiter checks that the ranks it waits
for are alive (``psutil``; a zombie counts as dead) and have not closed the
workspace, and applies the optional timeout.
"""

from __future__ import annotations

import contextlib
import os
import platform
import threading
import time
from collections.abc import Callable, Sequence

import msgspec
import psutil
import torch

from device_comms.cpu_shm import futex, step_errors
from device_comms.cpu_shm.placement import CpuSpread
from device_comms.cpu_shm.workspace import CALL, CLOSED, GEN, PARKED, PLACED, SIG, ShmWorkspace
from device_comms.errors import (  # BrokenCommunicator re-exported for older imports
    BrokenCommunicator,
    CollectiveMismatch,
    CollectiveTimeout,
    DeviceCommError,
    GroupCoordError,
    PeerDiedError,
    PeerRejectedError,
)
from device_comms.signatures.step_signature import (  # re-exported: the step's signature words
    FAILED,
    KIND_NAMES,
    REJECTED,
    dtype_code,
    dtype_of,
    op_of,
    shape_key,
    shape_of_key,
    signature,
)

__all__ = [
    "StepSync", "signature", "shape_key", "shape_of_key", "dtype_code", "dtype_of", "op_of",
    "KIND_NAMES",
    "BrokenCommunicator", "REJECTED", "FAILED",
]

_FENCE = threading.Lock()
_acquire, _release = _FENCE.acquire, _FENCE.release
# Total store order: stores are not reordered with older stores, loads not with
# older loads (only a store followed by a load needs a fence; see "Memory ordering").
_TSO = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_HEALTH_EVERY = 0.2  # seconds between liveness/timeout checks
_NAP_AFTER = 0.002  # seconds of waiting after which we sleep instead of yielding
_NAP = 50e-6
# Seconds of pure polling before the first sched_yield: none. When the peer
# shares this CPU, every moment spent spinning is a moment the peer cannot run
# to publish what we wait for; on an idle machine a yield returns at once.
_SPIN_S = 0.0
_PARK_AFTER = 100e-6  # seconds of polling before sleeping on a futex
_PARK_MAX = 0.05  # longest single futex sleep (health checks run in between)
_REASON_MAX = 4096  # bytes of the rejection reason passed to the peers


class StepSync:
    """Generation counters of one local rank over a :class:`ShmWorkspace`.

    Args:
        ws: The workspace.
        name: The group's unique name (for errors).
        group_ranks: Group rank of every local rank (for errors).
        pids: Pid of every local rank.
        timeout: Seconds a step may wait before :class:`CollectiveTimeout` (None: forever).
        spread: Whether a waiting rank moves off a CPU its peers wait on
            (:mod:`device_comms.cpu_shm.placement`); None reads ``GROUPCOORD_CPU_SPREAD``.

    Attributes:
        gen: Last step this rank published.
    """

    def __init__(
        self,
        ws: ShmWorkspace,
        name: str,
        group_ranks: Sequence[int],
        pids: Sequence[int],
        timeout: float | None,
        spread: bool | None = None,
    ) -> None:
        self.ws = ws
        self.hdr = ws.hdr
        self.name = name
        self.me = ws.local_rank
        self.size = ws.local_size
        self.group_ranks = list(group_ranks)
        self.pids = list(pids)
        self.timeout = timeout
        self.gen = 0
        self._waiting = 0  # the step a slow wait is at (0: none; see abandon)
        self.broken: str | None = None
        #: The owning group's call counter (see "Call numbers"); None: every call is 0.
        self.number: Callable[[], int] | None = None
        self._my_line = ws.line(self.me)
        self._peers = [peer for peer in range(self.size) if peer != self.me]
        self._peer_gen = [ws.line(peer) + GEN for peer in self._peers]
        self._my_gen = self._my_line + GEN
        self._my_sig = (self._my_line + SIG[0], self._my_line + SIG[1])
        #: Per parity: (peer, its signature's first word) for every peer.
        self._peer_sig = tuple([(peer, ws.line(peer) + SIG[parity]) for peer in self._peers]
                               for parity in (0, 1))
        self._peer_parked = [ws.line(peer) + PARKED for peer in self._peers]
        #: (word index, address) of every peer's generation word.
        self._peer_gen_addr = [(word, ws.hdr_address + 8 * word) for word in self._peer_gen]
        self._my_parked = self._my_line + PARKED
        self._my_gen_addr = ws.hdr_address + 8 * (self._my_line + GEN)
        self._parking = futex.AVAILABLE
        # Seconds of waiting after which a rank sleeps in the kernel (None: never).
        self.park_after: float | None = _PARK_AFTER if futex.AVAILABLE else None
        self._procs = {peer: _process(self.pids[peer]) for peer in self._peers}
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # pragma: no cover - non-Linux
            cpus = os.cpu_count() or 1
        # Seconds of pure polling before yielding (never when oversubscribed).
        self.spin_s = _SPIN_S if self.size <= cpus else 0.0
        #: Moves this rank off a CPU a peer waits on (device_comms.cpu_shm.placement).
        self.spread = CpuSpread(self.hdr, self._my_line + PLACED,
                                [(peer, ws.line(peer) + PLACED) for peer in self._peers],
                                self.me, self.size, spread)

    @property
    def next_parity(self) -> int:
        """Buffer parity of the next step."""
        return (self.gen + 1) & 1

    def step(
        self, op: str, sig_a: int = 0, sig_b: int = 0, check: bool = False,
        plain_stores: bool = False,
    ) -> int:
        """Publish the next step and wait for every peer to publish it.

        Call after writing this rank's slot of :attr:`next_parity`.

        Args:
            op: Operation name (for errors).
            sig_a: Packed signature (from :func:`signature`), when ``check``.
            sig_b: Size key, when ``check``.
            check: Compare signatures with every peer's.
            plain_stores: This thread wrote the step's data with ordinary
                stores (glibc ``memmove``, numpy; the reads after the step
                are loads), so on a TSO machine program order is memory
                order and the two ordering fences are skipped.

        Returns:
            The parity of the step just completed.

        Raises:
            CollectiveMismatch: Peers called a different collective (every rank raises).
            PeerDiedError: A peer exited or closed the workspace while we waited.
            CollectiveTimeout: The timeout elapsed.
        """
        if self.broken is not None:
            raise BrokenCommunicator(self.broken)
        gen = self.gen + 1  # the step this call publishes
        hdr = self.hdr
        if check:
            word = self._my_sig[gen & 1]
            hdr[word] = sig_a
            hdr[word + 1] = sig_b
            number = self.number
            call = hdr[word + CALL] = 0 if number is None else number()
        fenced = not (plain_stores and _TSO)
        if fenced:
            _acquire()  # FENCE: data and signature before the generation
            _release()
        hdr[self._my_gen] = gen
        self.gen = gen
        _acquire()  # FENCE: store the generation before loading "parked" and the
        _release()  # peers' generations (both Dekker pairs)
        if self._parking:
            for word in self._peer_parked:
                if hdr[word]:
                    futex.futex_wake(self._my_gen_addr)
                    break
        peers = self._peer_gen
        for word in peers:
            if hdr[word] < gen:
                self._wait_slow(gen, op)
                break
        else:  # a second sweep confirms (see "Giving up on a step")
            for word in peers:
                if hdr[word] < gen:
                    self._wait_slow(gen, op)
                    break
        if fenced:
            _acquire()  # FENCE: generations before the data
            _release()
        if check:
            for _peer, word in self._peer_sig[gen & 1]:
                if hdr[word] != sig_a or hdr[word + 1] != sig_b or hdr[word + CALL] != call:
                    self._disagree(op, gen, sig_a, sig_b)
                    self._out_of_step(op, gen, sig_a, call)
                    break
        return gen & 1

    def reject(self, op: str, reason: str) -> None:
        """Take part in ``op``'s first step as a rank that rejected its arguments.

        Writes ``reason`` (truncated UTF-8) into this rank's slot, publishes the
        step with the :data:`REJECTED` signature and waits for the peers like
        any step; peers in the step raise :class:`PeerRejectedError`. Returns
        normally (the caller raises its own validation error).
        """
        data = reason.encode("utf-8", "replace")[: min(_REASON_MAX, self.ws.slot_bytes)]
        if data:
            slot = self.ws.slot(self.next_parity, self.me, torch.uint8)
            slot[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.step(op, REJECTED, len(data), True)

    def relay(self, op: str, error: GroupCoordError) -> None:
        """Take part in a step as a rank that passes on an error found elsewhere.

        A node leader uses this when other nodes' ranks rejected or mismatched
        a call its own ranks agreed on, or its exchange with the other leaders
        failed: it writes ``error`` (kind, culprits, message; msgpack) into its
        slot under the :data:`FAILED` signature, and its local peers raise the
        same kind of error naming the same ranks (:func:`step_errors.relayed`).
        Returns normally (the caller raises ``error`` itself).
        """
        peers = [peer for peer in error.peers
                 if isinstance(peer, int) and not isinstance(peer, bool)]
        culprit = peers[0] if peers else -1
        if isinstance(error, PeerRejectedError):
            kind, text = "rejected", error.reason
        elif isinstance(error, CollectiveMismatch):
            kind, text = "mismatch", str(error)
        elif isinstance(error, PeerDiedError):
            kind, text = "closed", str(error)
        else:
            kind, text = "timeout", str(error)
        data = msgspec.msgpack.encode((kind, culprit, text[:_REASON_MAX], peers[:64]))
        data = data[: self.ws.slot_bytes]
        slot = self.ws.slot(self.next_parity, self.me, torch.uint8)
        slot[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.step(op, FAILED, len(data), True)

    def abandon(self, op: str, why: str) -> None:
        """This rank left ``op`` partway (``why``), on the thread that made it: break
        and tell the peers.

        A step this rank was interrupted waiting at (in its slow wait, where
        peers were missing) is withdrawn as after a timeout ("Giving up on a
        step"): a peer that had not arrived at it yet then raises instead of
        passing it alone (the step stands where every peer had arrived). A
        step this rank had passed is left alone: peers may still be
        confirming it. Peers waiting for this rank's next step find
        ``CLOSED < 0`` and raise (as for a rank that gave up after its
        timeout), instead of taking its next call's steps for the rest of
        this one."""
        if self._waiting and self._waiting == self.gen:  # interrupted waiting for peers
            self._waiting = 0
            with contextlib.suppress(ValueError, TypeError):  # already released
                self._give_up(self.gen)
        self._break_off(f"an earlier call ({op}) was interrupted partway ({why}); this "
                        f"communicator cannot be used any more")

    def abort(self, why: str) -> None:
        """The communicator was aborted (``why``), maybe from another thread: break
        and tell the peers as :meth:`abandon` does; a wait in progress raises
        :class:`BrokenCommunicator` at its next health check."""
        self._break_off(f"the communicator was aborted: {why}")

    def _break_off(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
        with contextlib.suppress(ValueError, TypeError):  # already released
            self.hdr[self._my_line + CLOSED] = -(self.gen + 1)

    def leave(self, why: str) -> None:
        """This rank's communicator is going away (``why``), maybe from another thread: a
        wait in progress here raises :class:`BrokenCommunicator` at its next health
        check, and peers learn that this rank left, as after :meth:`close`."""
        if self.broken is None:
            self.broken = f"the communicator was closed: {why}"
        self.close()

    def close(self) -> None:
        """Tell peers this rank left (they stop waiting on it with an error).

        A rank that gave up on a step keeps that record (a negative ``CLOSED``
        word), so peers arriving later still learn the cause: a timeout."""
        with contextlib.suppress(ValueError, TypeError):  # already released
            if self.hdr[self._my_line + CLOSED] >= 0:
                self.hdr[self._my_line + CLOSED] = 1

    # ------------------------------------------------------------------ slow path
    def _wait_slow(self, gen: int, op: str) -> None:
        """Wait until every peer published step ``gen``, confirmed by one more sweep."""
        start = time.perf_counter()
        next_health = start + _HEALTH_EVERY
        hdr, peers = self.hdr, self._peer_gen
        self._waiting = gen  # an interrupt from here on withdraws the step (abandon)
        while True:
            next_health = self._wait_each(gen, op, start, next_health)
            for word in peers:  # a sweep after every peer was seen: see "Giving up on a step"
                if hdr[word] < gen:
                    break
            else:
                self._waiting = 0
                return

    def _wait_each(self, gen: int, op: str, start: float, next_health: float) -> float:
        """Wait until each peer in turn is seen at generation ``gen`` or later.

        Returns:
            When the next health check is due.
        """
        hdr, spin_s, park_after = self.hdr, self.spin_s, self.park_after
        clock = time.perf_counter
        polls = 0
        placed = False  # whether this wait recorded its CPU (at its first yield)
        for word, address in self._peer_gen_addr:
            while hdr[word] < gen:
                polls += 1
                if polls & 15:  # read the clock every 16 polls only
                    continue
                now = clock()
                waited = now - start
                if waited < spin_s:
                    continue
                if now >= next_health:
                    next_health = now + _HEALTH_EVERY
                    self._check_health(gen, op, waited)
                if park_after is not None and waited >= park_after:
                    self._park(word, address, gen, next_health - now)
                elif park_after is None and waited > _NAP_AFTER:
                    time.sleep(_NAP)
                else:
                    if not placed:
                        placed = True
                        self.spread.waiting(gen)
                    os.sched_yield()
        return next_health

    def _park(self, word: int, address: int, gen: int, limit: float) -> None:
        """Sleep on a peer's generation word (index ``word``, at ``address``) until it
        moves from below ``gen`` (or ``limit`` seconds)."""
        hdr = self.hdr
        hdr[self._my_parked] = 1
        _FENCE.acquire()  # store "parked" before loading the generation (Dekker)
        _FENCE.release()
        seen = hdr[word]
        if seen < gen:
            futex.futex_wait(address, seen, max(1e-4, min(_PARK_MAX, limit)))
        hdr[self._my_parked] = 0

    def _behind(self, gen: int) -> list[int]:
        """The local ranks whose generation is below ``gen``."""
        return [peer for peer in self._peers if self.hdr[self.ws.line(peer) + GEN] < gen]

    def _check_health(self, gen: int, op: str, waited: float) -> None:
        if self.broken is not None:  # another thread broke the engine (an abort)
            # again, in case this wait's give-up (below, last time) reset the mark
            self.hdr[self._my_line + CLOSED] = -(self.gen + 1)
            raise BrokenCommunicator(self.broken)
        behind = self._behind(gen)
        line = self.ws.line
        for peer in behind:
            rank, pid = self.group_ranks[peer], self.pids[peer]
            if self.hdr[line(peer) + CLOSED] > 0:
                self._fail(PeerDiedError(
                    f"group {self.name!r}, op {op}: peer rank {rank} (pid {pid}) destroyed its "
                    f"communicator while this rank (rank {self.group_ranks[self.me]}) waited "
                    f"for it; every rank must call the same collectives before destroy()",
                    queue=self.name, peers=(rank,),
                ))
            if not _alive(self._procs.get(peer)):
                self._fail(PeerDiedError(
                    f"group {self.name!r}, op {op}: peer rank {rank} (pid {pid}) died while "
                    f"this rank (rank {self.group_ranks[self.me]}) waited for it in the "
                    f"shared-memory engine; the communicator cannot be used any more",
                    queue=self.name, peers=(rank,),
                ))
        gave_up = any(self.hdr[line(peer) + CLOSED] < 0 for peer in behind)
        if gave_up or (self.timeout is not None and waited > self.timeout):
            behind = self._give_up(gen)
            if behind:
                self._fail(self._timeout_error(op, gen, behind))
            # else every peer arrived at the deadline: the step stands, the wait goes on

    def _give_up(self, gen: int) -> list[int]:
        """Withdraw this rank's step ``gen`` (see "Giving up on a step").

        Returns:
            The local ranks still behind after the withdrawal: then it stands.
            Empty: every peer had arrived, the step is published again and the
            wait goes on.
        """
        hdr, closed = self.hdr, self._my_line + CLOSED
        hdr[closed] = -gen  # before the withdrawal: who sees the one sees the other
        hdr[self._my_gen] = gen - 1
        _acquire()  # FENCE: the withdrawal before loading the peers' generations (Dekker)
        _release()
        behind = self._behind(gen)
        if behind:
            self.gen = gen - 1
            return behind
        hdr[self._my_gen] = gen
        hdr[closed] = 0
        if self._parking:
            futex.futex_wake(self._my_gen_addr)
        return []

    def _timeout_error(self, op: str, gen: int, behind: list[int]) -> CollectiveTimeout:
        """This rank gives up on step ``gen``: the ranks that never came, and those that
        gave up before it (their timeout ran out, or their call was interrupted)."""
        line, hdr, ranks = self.ws.line, self.hdr, self.group_ranks
        return step_errors.timeout(
            self.name, op, gen, ranks[self.me], self.timeout,
            missing=[ranks[peer] for peer in behind if hdr[line(peer) + CLOSED] >= 0],
            quit_=[ranks[peer] for peer in behind if hdr[line(peer) + CLOSED] < 0])

    def _fail(self, error: DeviceCommError) -> None:
        self.broken = f"an earlier error left this communicator unusable: {error}"
        try:
            raise error
        finally:
            del error  # a frame holding the error its traceback holds is a cycle

    def _disagree(self, op: str, gen: int, sig_a: int, sig_b: int) -> None:
        """Some peer's signature of step ``gen`` differs from ours (``sig_a``, ``sig_b``):
        raise, or not if we rejected."""
        if sig_a in (REJECTED, FAILED):
            return  # this rank raises its own error
        hdr, parity = self.hdr, gen & 1
        for peer, word in self._peer_sig[parity]:  # in rank order: name the lowest rejecter
            if hdr[word] in (REJECTED, FAILED):
                length = max(0, min(int(hdr[word + 1]), _REASON_MAX + 64, self.ws.slot_bytes))
                raw = self.ws.slot(parity, peer, torch.uint8)[:length].numpy().tobytes()
                if hdr[word] == FAILED:
                    raise self._relayed(op, peer, raw)
                raise PeerRejectedError(
                    self.name, op, self.group_ranks[peer], raw.decode("utf-8", "replace")
                )
        for peer, word in self._peer_sig[parity]:
            if hdr[word] != sig_a or hdr[word + 1] != sig_b:
                self._mismatch(op, peer, (sig_a, sig_b), (hdr[word], hdr[word + 1]),
                               self._calls(parity, sig_a, sig_b))

    def _out_of_step(self, op: str, gen: int, sig_a: int, call: int) -> None:
        """Same call, but some peer made it as another of the group's calls: raise."""
        if sig_a in (REJECTED, FAILED):
            return  # this rank raises its own error
        hdr, parity = self.hdr, gen & 1
        others = sorted({(int(hdr[word + CALL]), self.group_ranks[peer])
                         for peer, word in self._peer_sig[parity] if hdr[word + CALL] != call})
        raise step_errors.out_of_step(self.name, op, self.group_ranks[self.me], call, others)

    def _calls(self, parity: int, sig_a: int, sig_b: int) -> list[tuple[int, int, list[int]]]:
        """Every local rank's signature of the step of ``parity``, as ``(sig_a, sig_b,
        group ranks that signed it)``; this rank signed ``(sig_a, sig_b)``."""
        classes: dict[tuple[int, int], list[int]] = {(sig_a, sig_b): [self.group_ranks[self.me]]}
        for peer, word in self._peer_sig[parity]:
            key = (int(self.hdr[word]), int(self.hdr[word + 1]))
            classes.setdefault(key, []).append(self.group_ranks[peer])
        return [(words[0], words[1], ranks) for words, ranks in classes.items()]

    def _relayed(self, op: str, peer: int, raw: bytes) -> GroupCoordError:
        """The error local rank ``peer`` relayed with :meth:`relay`, to raise here."""
        return step_errors.relayed(self.name, op, self.group_ranks[peer], raw)

    def _mismatch(self, op: str, peer: int, ours: tuple[int, int], theirs: tuple[int, int],
                  calls: list[tuple[int, int, list[int]]]) -> None:
        """Raise the mismatch with local rank ``peer`` (signatures ``ours`` and ``theirs``);
        ``calls`` (every local rank's call) goes with it as ``error.calls``, for a node
        leader to pass on."""
        raise step_errors.mismatch(self.name, op, self.group_ranks[self.me],
                                   self.group_ranks[peer], ours, theirs, calls)


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except (psutil.Error, ValueError):
        return None  # not visible (other pid namespace): rely on the timeout


def _alive(proc: psutil.Process | None) -> bool:
    try:
        return proc is None or (proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True

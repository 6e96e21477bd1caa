"""What a GroupCoordinator says when one of its calls cannot complete.

Every public call of a :class:`~coordinator.group.group_coordinator.GroupCoordinator`
gets a sequence number: 1, 2, ... per group and rank. Ranks that make the same
calls in the same order (the contract of every group) agree on it, so "call
#17" on one rank is call #17 on the others, and two ranks that report
different ops for the same number have diverged there.

A wait that runs out raises :class:`~coordinator.errors.CommTimeout` whose
message names the group, this rank, the op, the call number, the timeout and
the ranks that did not arrive, with what is known about each one's process;
``peers`` holds those ranks (group ranks). Where the ranks come from:

* shared-memory collectives: the step's generation words say exactly which
  ranks are behind;
* message-queue broadcasts: the writer knows which readers lag, a reader waits
  for the writer;
* point-to-point calls: the peer is the call's ``src`` / ``dst``;
* gloo collectives (barriers, objects over the CPU group, every collective of
  a group without shared memory): gloo's error names nobody. A side check
  then looks at the peers' processes, which costs no communication: each
  rank's identity (pid, start time, boot id, pid namespace) is gathered once
  when the group is built, and a peer on this host is reported ``exited``,
  ``stopped`` (``SIGSTOP``, a debugger) or ``running``. Ranks found stopped or
  exited are the suspects; when every peer runs, the message says that gloo
  cannot tell which one is missing and names them all. Peers on other hosts
  cannot be checked, which the message says too.

Gloo also reports "connection closed by peer" when a *live* peer gave up
(after its own timeout or error, gloo closes its connections). That becomes
:class:`~coordinator.errors.PeerDiedError` only on evidence: a peer on this
host whose process is gone (within a grace of :data:`_EXIT_GRACE_S`: an
exiting process closes its sockets first) is named as dead; a stopped one is
the rank that did not arrive (:class:`~coordinator.errors.CommTimeout`). When
the call had lasted most of the timeout (:data:`_GAVE_UP_FRACTION`) and no
peer is gone or stopped at once (no grace then), a peer gave up at its own
timeout while this rank waited too: that is this rank's timeout as well
(``CommTimeout``, naming every candidate, as gloo names nobody). Earlier, a peer gave up on an error
of its own or destroyed the group: when every peer is provably alive it is
:class:`~coordinator.errors.ClosedError` ("a peer closed its connections"),
because nobody died. A node leader of the hierarchical path passes a closed
connection between leaders on to its node's ranks as a ``PeerDiedError``
marked ``suspected``; it is explained the same way, among the other nodes' ranks.

Any other error of the family raised inside a call names the group's op too:
when a lower layer raised it for a call of its own (the shared-memory engine
seeing a peer die during the header broadcast of ``broadcast_object``, a
signed call finding a mismatch in the tensors of a tensor dict), it is
raised again, same class and ``peers``, its message prefixed with the group,
the op and the call number.
"""

from __future__ import annotations

import copy
import os
import re
import socket
import time
from collections.abc import Sequence
from typing import Any

import psutil

from coordinator.errors import NotInitializedError
from device_comms.errors import translate_backend_error
from shm_broadcast.errors import (
    ClosedError,
    CollectiveMismatch,
    CommTimeout,
    GroupCoordError,
    PeerDiedError,
)
from shm_broadcast.lifecycle.segment import OwnerIdentity
from shm_broadcast.ranks.group_adapter import object_group
from shm_broadcast.waiting.peer_watch import PeerWatch

__all__ = ["CallErrors", "WAIT_ERRORS", "own_identity"]

#: Seconds to keep looking at peers' processes before reporting a closed
#: connection from a live peer: an exiting process closes its sockets before it
#: is gone, and an interpreter that exits on an uncaught exception takes a few
#: hundred milliseconds more to finish (atexit handlers, finalisation), a
#: second or more on a loaded host. Never past the call's own timeout.
_EXIT_GRACE_S = 2.0
_EXIT_POLL_S = 0.02
#: A live peer that closed its connections after the call had lasted this share
#: of the timeout gave up at its own timeout: the call is reported as timed out.
_GAVE_UP_FRACTION = 0.8

#: What a call may raise when a wait fails or its ranks disagree: our timeouts,
#: RuntimeError (PeerDiedError, BrokenCommunicator, or an untranslated backend
#: error) and CollectiveMismatch; and ValueError, which is what torch and
#: Python raise when the group is destroyed under a running call (its process
#: group unregistered, its shared memory released). :meth:`CallErrors.explain`
#: re-raises anything else it does not recognise unchanged (argument errors).
WAIT_ERRORS = (CommTimeout, RuntimeError, CollectiveMismatch, ValueError)

_WHY = {
    "exited": "gone",
    "stopped": "stopped: SIGSTOP, job control or a debugger",
    "running": "alive",
    "unknown": "not checkable from here",
}


def own_identity() -> list[Any]:
    """This process's ``[host, pid, start time, boot id, pid namespace]``, msgpack-able."""
    me = OwnerIdentity.of_self()
    try:
        ctime = psutil.Process().create_time()
    except psutil.Error:
        ctime = 0.0
    return [socket.gethostname(), os.getpid(), ctime, me.boot_id, me.pidns]


#: What gloo reports for a call on a group whose connections an earlier timeout closed.
_PAIRS_CLOSED = "Application timeout caused pair closure"

class CallErrors:
    """Explains failed waits of one group's calls (see the module docstring).

    Args:
        name: The group's unique name.
        rank: This process's group rank.
        world_size: The group's size.
        timeout: The group's timeout in seconds (None: unknown; a closed
            connection from a live peer is then never read as a timeout).

    Attributes:
        watches: Per group rank, a :class:`PeerWatch` of its process when it
            can be checked from here (same boot and pid namespace), else None.
        hosts: Per group rank, its host name (empty until :meth:`learn_peers`).
    """

    def __init__(self, name: str, rank: int, world_size: int,
                 timeout: float | None = None) -> None:
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.watches: list[PeerWatch | None] = [None] * world_size
        self.hosts: list[str] = [""] * world_size
        self.pids: list[int] = [0] * world_size
        #: Set when the group is destroyed (:meth:`CallBook.close
        #: <coordinator.calls.call_book.CallBook.close>`): a call that fails
        #: from then on failed because its group went away under it.
        self.destroyed = False

    def learn_peers(self, cpu_group: Any) -> None:
        """Gather every rank's process identity (collective over ``cpu_group``)."""
        mine = own_identity()
        idents = object_group(cpu_group).all_gather(mine)
        _, _, _, boot, pidns = mine
        for r, ident in enumerate(idents):
            try:
                host, pid, ctime, peer_boot, peer_ns = ident
                pid = int(pid)
            except (TypeError, ValueError):
                continue  # a malformed identity only loses the side check
            self.hosts[r], self.pids[r] = str(host), pid
            if boot and pidns and peer_boot == boot and peer_ns == pidns:
                self.watches[r] = PeerWatch(pid, float(ctime) or None)  # 0: start unknown

    # ------------------------------------------------------------------ entry
    def explain(self, op: str, seq: int, e: BaseException, partner: int | None = None,
                writer: int | None = None, started: float | None = None) -> None:
        """Raise the error call ``seq`` (``op``) should raise for ``e``, or return
        to let the caller re-raise ``e`` unchanged.

        Args:
            op: The public method that failed.
            seq: Its sequence number in this group.
            e: What the call raised.
            partner: The peer of a point-to-point call (group rank).
            writer: The group rank of the message queue's writer, for a
                reader's timeout (its ``peers`` say ``"writer"``).
            started: When the call began (``time.monotonic()``), if known.
        """
        error = self._explained(op, seq, e, partner, writer, started)
        if error is None:
            return
        # Dropped from this frame on the way out: the error's traceback holds the
        # frame, and a frame that held the error would make a cycle keeping the
        # frames' objects (the group's communicator and process groups, whose
        # sockets and threads destroy() ends) alive until the garbage collector ran.
        try:
            raise error from e
        finally:
            del error

    def _explained(self, op: str, seq: int, e: BaseException, partner: int | None,
                   writer: int | None, started: float | None) -> BaseException | None:
        """:meth:`explain`'s error for ``e``, or None where ``e`` is raised as it is."""
        if self.destroyed and not isinstance(e, (ClosedError, NotInitializedError)):
            # (NotInitializedError: the call began after destroy, and says so.)
            # What ended the wait is chained (raise ... from e), not quoted: destroy()
            # ends gloo waits by closing their connections, and gloo then reports a
            # timeout that never ran out.
            err = ClosedError(f"{self._where(op, seq)}: the group was destroyed while this "
                              f"call was running (its wait ended with {type(e).__name__})")
            err.call = seq  # type: ignore[attr-defined]
            err.op = op  # type: ignore[attr-defined]
            return err
        cause = e
        raw = e.__cause__ if isinstance(e, GroupCoordError) else e
        if not isinstance(e, GroupCoordError):
            e = translate_backend_error(e, self._where(op, seq))
            if e is cause:
                return None  # not a failed wait: the caller re-raises it as it is
        if isinstance(e, CommTimeout):
            if getattr(e, "call", None) is not None:
                return None  # already explained by the group whose call it was
            detail = f"gloo: {_first_line(raw)}" if _is_backend_error(raw) else _first_line(e)
            return self._timeout(op, seq, e, partner, writer, detail)
        if isinstance(e, PeerDiedError) and _is_backend_error(raw):
            return self._closed_by_peer(op, seq, _first_line(raw), partner, started)
        if isinstance(e, PeerDiedError) and getattr(e, "suspected", False):
            ranks = [p for p in e.peers if isinstance(p, int) and not isinstance(p, bool)]
            return self._closed_by_peer(op, seq, _first_line(e), partner, started,
                                        ranks or None)
        if e is not cause or not isinstance(e, GroupCoordError):
            return e
        # Raised by a lower layer for a call of its own (the header broadcast of
        # broadcast_object, the tensors of a tensor dict): say which call of this
        # group it served; a queue names its writer "writer": give its rank.
        names_op = re.search(rf"\bop {re.escape(op)}\b", str(e)) is not None
        if writer is None:  # a point-to-point link's writer is the call's partner
            writer = partner
        writer_named = writer is not None and "writer" in e.peers
        if not names_op or writer_named:
            peers = [writer if p == "writer" else p for p in e.peers]
            return _in_call(e, None if names_op else self._where(op, seq), peers)
        return None

    def dead_partner(self, op: str, seq: int, partner: int) -> PeerDiedError | None:
        """The error of call ``seq`` when its ``partner``'s process is provably gone
        (checked on this host: pid and start time), else None.

        For waits that cannot count on the backend to notice: a gloo receive
        posted while its peer dies may wait for the whole timeout.
        """
        if self._state(partner) != "exited":
            return None
        return PeerDiedError(
            f"{self._where(op, seq)}: rank {partner} died while this call waited for it "
            f"({self._states([partner])})",
            queue=self.name, side=f"rank {self.rank}", peers=[partner])

    # ------------------------------------------------------------------ timeouts
    def _timeout(self, op: str, seq: int, e: CommTimeout, partner: int | None,
                 writer: int | None, detail: str) -> GroupCoordError:
        """The timeout naming the ranks that did not arrive; a
        :class:`PeerDiedError` naming them when some of them are gone (the side
        check is evidence: the wait ran out because they died)."""
        known = [p for p in e.peers if isinstance(p, int) and not isinstance(p, bool)]
        if writer is not None and "writer" in e.peers:
            known.append(writer)
        if partner is not None and not known:
            known = [partner]
        if known:
            missing = sorted(set(known))
            head = f"timed out waiting for rank(s) {missing} ({self._states(missing)})"
            stuck = [r for r in missing if self._state(r) in ("stopped", "exited")]
            if stuck and stuck != missing:
                # The running ones are most likely waiting for these, as this rank is.
                missing = stuck
                head += f"; stopped or gone among them: rank(s) {stuck}"
        else:
            missing, head = self._suspects()
        if _PAIRS_CLOSED in detail:
            head = ("could not run: an earlier timeout closed this group's connections (gloo "
                    "closes all of a group's connections when one of its waits times out), so "
                    "the group cannot be used any more; destroy it and create it again")
        gone = [r for r in missing if self._state(r) == "exited"]
        if gone:
            err: GroupCoordError = PeerDiedError(
                f"{self._where(op, seq)}: rank(s) {gone} died; this rank {head}. "
                f"Detail: {detail}", queue=self.name, side=f"rank {self.rank}", peers=gone)
        else:
            err = CommTimeout(
                f"{self._where(op, seq)}: {head}. Every rank of the group must make the same "
                f"calls in the same order. Detail: {detail}",
                queue=self.name, side=f"rank {self.rank}", peers=missing)
        err.call = seq  # type: ignore[attr-defined]
        err.op = op  # type: ignore[attr-defined]
        return err

    def _suspects(self) -> tuple[list[int], str]:
        """Gloo named nobody: the peers whose process is stopped or gone, else all."""
        others = [r for r in range(self.world_size) if r != self.rank]
        states = {r: self._state(r) for r in others}
        bad = [r for r in others if states[r] in ("stopped", "exited")]
        listing = self._states(others, states)
        if bad:
            return bad, (f"timed out; gloo does not say which rank is missing, suspected: "
                         f"rank(s) {bad} (side check of the peers' processes: {listing})")
        return others, (f"timed out; gloo does not say which rank is missing and no peer "
                        f"process is stopped or gone, so any of rank(s) {others} may be "
                        f"elsewhere ({listing})")

    # ------------------------------------------------------------------ closed connections
    def _closed_by_peer(self, op: str, seq: int, backend_text: str, partner: int | None,
                        started: float | None = None,
                        among: Sequence[int] | None = None) -> GroupCoordError:
        """The error for a connection a peer closed (see the module docstring):
        the candidates are ``among``, else the partner, else every other rank."""
        if among is not None:
            candidates = list(among)
        elif partner is not None:
            candidates = [partner]
        else:
            candidates = [r for r in range(self.world_size) if r != self.rank]
        states = {r: self._state(r) for r in candidates}
        late = self._gave_up_at_timeout(started)
        # A close this late is most likely a peer's timeout: no grace (a killed
        # process is gone before its sockets close; a slowly exiting one is then
        # reported as the timeout it caused, not as dead).
        deadline = time.monotonic() + (0.0 if late else _EXIT_GRACE_S)
        if started is not None and self.timeout is not None:
            deadline = min(deadline, started + self.timeout)
        while (not {"exited", "stopped"} & set(states.values())
               and time.monotonic() < deadline):
            # An exiting process closes its sockets before it is gone: keep
            # looking before calling every peer alive (a stopped one explains
            # the wait at once).
            time.sleep(_EXIT_POLL_S)
            states = {r: self._state(r) for r in candidates}
        gone = [r for r in candidates if states[r] == "exited"]
        stopped = [r for r in candidates if states[r] == "stopped"]
        listing = self._states(candidates, states)
        first = backend_text
        where = self._where(op, seq)
        if stopped and not gone:
            # This rank waited for a stopped rank; a peer that waited too gave up
            # first and closed its connections: the stopped rank is the one missing.
            err = CommTimeout(
                f"{where}: rank(s) {stopped} did not arrive ({listing}); a peer gave up "
                f"waiting first and closed its connections. Every rank of the group must "
                f"make the same calls in the same order. Detail: gloo: {first}",
                queue=self.name, side=f"rank {self.rank}", peers=stopped)
            err.call = seq  # type: ignore[attr-defined]
            err.op = op  # type: ignore[attr-defined]
            return err
        if gone:
            return PeerDiedError(
                f"{where}: rank(s) {gone} died ({listing}); gloo reported: {first}",
                queue=self.name, side=f"rank {self.rank}", peers=gone)
        if late:  # nobody gone or stopped: live peers gave up
            return self._given_up(where, seq, op, candidates, listing, first)
        if all(states[r] != "unknown" for r in candidates):
            return ClosedError(
                f"{where}: a peer closed its connections of this group although its process "
                f"is alive ({listing}): it gave up on a call (its own timeout or error) or "
                f"destroyed the group. Look for the first error in the other ranks' logs; "
                f"gloo reported: {first}",
                queue=self.name, side=f"rank {self.rank}", peers=candidates)
        return PeerDiedError(
            f"{where}: a peer closed its connection: it exited, or gave up on the call "
            f"({listing}); gloo reported: {first}",
            queue=self.name, side=f"rank {self.rank}", peers=candidates)

    def _gave_up_at_timeout(self, started: float | None) -> bool:
        """Whether the call had lasted most of the timeout (a peer closing now gave up
        at its own timeout while this rank waited too)."""
        return (started is not None and self.timeout is not None
                and time.monotonic() - started >= _GAVE_UP_FRACTION * self.timeout)

    def _given_up(self, where: str, seq: int, op: str, candidates: list[int], listing: str,
                  first: str) -> CommTimeout:
        """The timeout of a call whose live peers gave up waiting first."""
        err = CommTimeout(
            f"{where}: timed out: after {self.timeout:g}s a live peer gave up waiting and closed "
            f"its connections, so this call cannot complete either; gloo does not say which "
            f"rank is missing, any of rank(s) {candidates} may be elsewhere ({listing}). Every "
            f"rank of the group must make the same calls in the same order. Detail: gloo: "
            f"{first}", queue=self.name, side=f"rank {self.rank}", peers=candidates)
        err.call = seq  # type: ignore[attr-defined]
        err.op = op  # type: ignore[attr-defined]
        return err

    def await_exit(self, ranks: Sequence[int]) -> None:
        """Wait (at most the exit grace) until one of ``ranks`` is gone, for a
        failure that came before its timeout: a peer whose connections broke
        is usually exiting, and is reported dead once its process is gone."""
        deadline = time.monotonic() + _EXIT_GRACE_S
        while time.monotonic() < deadline:
            if any(self._state(r) in ("exited", "stopped", "unknown") for r in ranks):
                return
            time.sleep(_EXIT_POLL_S)

    # ------------------------------------------------------------------ helpers
    def _where(self, op: str, seq: int) -> str:
        return (f"group {self.name!r} (rank {self.rank} of {self.world_size}), op {op}, "
                f"call #{seq}")

    def _state(self, r: int) -> str:
        if not 0 <= r < self.world_size:
            return "unknown"
        w = self.watches[r]
        return w.state() if w is not None else "unknown"

    def _states(self, ranks: Sequence[int], states: dict[int, str] | None = None) -> str:
        parts = []
        for r in ranks:
            st = states[r] if states is not None else self._state(r)
            pid = self.pids[r] if 0 <= r < self.world_size else 0
            who = f"pid {pid}" if pid else "pid unknown"
            if st == "unknown" and 0 <= r < self.world_size and self.hosts[r]:
                who += f" on {self.hosts[r]}"
            parts.append(f"rank {r}, {who}: {_WHY[st]}")
        return "; ".join(parts)


def _in_call(e: GroupCoordError, where: str | None, peers: Sequence[object]) -> GroupCoordError:
    """A copy of ``e`` (same class) naming ``peers``, its message prefixed with ``where``."""
    new = copy.copy(e)
    new.__dict__.update(e.__dict__)
    new.peers = tuple(peers)
    if where is not None:
        new.args = (f"{where}: {e}",)
    return new


def _first_line(e: BaseException | None) -> str:
    """The first line of an error's text (gloo appends long notes), at most 400 characters."""
    return str(e).strip().split("\n", 1)[0][:400]


def _is_backend_error(e: BaseException | None) -> bool:
    """Whether ``e`` is a backend's own error (gloo's RuntimeError), not one of ours."""
    return isinstance(e, RuntimeError) and not isinstance(e, GroupCoordError)


"""The bookkeeping of a group's calls: their numbers, the group's closed state, and
the explanation of a call whose wait failed.

Every public call of a group gets a number, 1, 2, ... per group and rank. The
book counts the two kinds of calls apart: collective calls (``collectives``;
the same count on every rank of a correct program, so it stamps the
message-queue broadcasts, :mod:`coordinator.group.broadcast_stamps`, and
numbers the communicator's calls) and point-to-point calls (``p2p_calls``;
which ranks make them differs). A call's number is their sum when it begins
(``calls``). A call whose wait fails is explained by
the book's :class:`~coordinator.calls.call_errors.CallErrors` (group, op, call
number, the ranks that did not arrive). Once the group is closed, a call that
begins raises :class:`~coordinator.errors.NotInitializedError` and one still
running fails with :class:`~coordinator.errors.ClosedError`.

The book also writes the group's calls into the flight recorder
(:mod:`coordinator.trace.recorder`) through its ``trace`` (None when the
recorder is off): each call begins an entry once numbered, with the
collective and point-to-point counts as they then are and its input's
shapes; completes it with its output's shapes when they differ; and on an
exception marks it failed with the error the call raises, explained, which
for a timeout, a dead peer, a mismatch or a broken communicator also writes
this process's dump (:mod:`coordinator.trace.auto_dump`).

The busiest calls (``all_reduce`` and friends) number and record themselves
inline with the statements :meth:`CallBook.run` runs, so that they pay no
function layer for it::

    n = book.begin(op)                        # the group's token, then the number
    try:                                      # (a point-to-point call: p2p_calls += 1,
        seq = n + book.p2p_calls              #  no token; seq = n + book.collectives)
        trace, mark = self._trace, self._marks  # the group's GroupTrace; marks
        if trace is None and mark is None:    # a failure: book.explain(op, seq, e,
            started = monotonic()             #   started=started)
            ...
        entry = None if trace is None else trace.begin_tensor(op, n, book.p2p_calls, input_)
        marks = None if mark is None else mark()
        ...                                   # a failure: book.failed(op, seq, e,
        book.finished(entry, marks)           #   entry, marks)
    finally:
        book.end()                            # the token back

A group whose device calls are marked while the recorder is off gives those
calls a :class:`~coordinator.trace.recorder.StartOnly` as ``trace``: its
entries are in no ring and keep the call's start, which :meth:`CallBook.failed`
reads to tell a peer that gave up at its timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from time import monotonic, monotonic_ns
from typing import Any, TypeVar

import torch

from coordinator.calls.call_errors import WAIT_ERRORS, CallErrors
from coordinator.custom_ops import untraced
from coordinator.errors import NotInitializedError, PeerDiedError
from coordinator.trace import auto_dump
from coordinator.trace.recorder import (
    CREATED,
    DEVICE,
    DIM,
    DONE,
    OUT_DTYPES,
    OUT_SIZES,
    REDUCE_OP,
    ROOT,
    TRANSPORT,
    GroupTrace,
    shapes_of,
)
from device_comms.cpu.one_call import OneCall

__all__ = ["CallBook", "destroyed_msg"]

_R = TypeVar("_R")  # what a numbered call returns


def destroyed_msg(name: str, op: str) -> str:
    """The error message for using a destroyed group."""
    return f"GroupCoordinator {name!r} was destroyed; {op} needs a live group (create a new one)"


class CallBook:
    """The numbers, closed state and failed-wait explanation of one group's calls.

    Args:
        name: The group's unique name.
        rank: This process's group rank.
        world_size: The group's size.
        timeout: The group's timeout in seconds.

        trace: The group's flight-recorder writer; None: calls are not recorded.

    Attributes:
        collectives: Collective calls made so far on this rank.
        p2p_calls: Point-to-point calls made so far on this rank.
        errors: Explains failed waits; learns the peers' processes at
            :meth:`learn_peers`.
        trace: The group's flight-recorder writer, or None.
        marks: Takes the marks of a device collective (the group's watchdog
            follows them; :mod:`coordinator.trace.watchdog`), or None.
    """

    def __init__(self, name: str, rank: int, world_size: int, timeout: float,
                 trace: GroupTrace | None = None) -> None:
        self.name = name
        self.collectives = 0
        self.p2p_calls = 0
        #: Held by the thread in one of the group's collectives (see :meth:`begin`).
        self.one_call = OneCall(f"group {name!r} (rank {rank}/{world_size})")
        #: ``end()`` ends the collective :meth:`begin` began on this thread, whatever
        #: it raised: the token's own ``leave``, so that it costs no Python frame.
        self.end: Callable[[], None] = self.one_call.leave
        self.errors = CallErrors(name, rank, world_size, timeout)
        self.trace = trace
        self.marks: Callable[[], Any] | None = None

    @property
    def calls(self) -> int:
        """Calls made so far on this rank; the next is number ``calls + 1``."""
        return self.collectives + self.p2p_calls

    @property
    def closed(self) -> bool:
        """Whether the group was closed (:meth:`close`)."""
        return self.errors.destroyed

    def learn_peers(self, cpu_group: Any) -> None:
        """Gather every rank's process identity for the explanations (collective)."""
        self.errors.learn_peers(cpu_group)

    def check_live(self, op: str) -> None:
        """Refuse to begin ``op`` on a closed group.

        Raises:
            NotInitializedError: The group was closed.
        """
        if self.errors.destroyed:
            raise NotInitializedError(destroyed_msg(self.name, op))

    def begin(self, op: str) -> int:
        """Begin collective ``op`` on this thread: take the group's token, then number
        the call; :attr:`end` after it, whatever it raised.

        The token comes first so that a call refused takes no number: the
        numbers are what the ranks compare to pair their calls, and the
        communicator reads them while the call runs, so a number taken by a
        refused call (or by another thread's call meanwhile) would leave this
        rank one call ahead of its peers for good.

        Returns:
            The call's collective number.

        Raises:
            ConcurrentCallError: Another thread of this rank is in a collective
                of the group; nothing was numbered or sent.
        """
        one_call = self.one_call
        if not one_call.take(False):
            one_call.refuse(op)
        self.collectives = n = self.collectives + 1
        return n

    def run(self, op: str, fn: Callable[..., _R], *args: Any, partner: int | None = None,
            p2p: bool = False, data: Any = None, transport: str | None = None,
            dim: Any = None, root: Any = None, reduce_op: Any = None) -> _R:
        """Run ``fn(*args)`` as call ``op``: numbered (a collective call unless
        ``p2p``), recorded (``data``: the input whose shapes the entry keeps;
        ``transport``: see :meth:`record`; ``dim``: the call's dimension, along
        which a variable-size call's rows differ between ranks and an
        all-gather's or gather's output grows, None for 0, and an all-to-all's
        ``(scatter_dim, gather_dim)``; ``root``: a rooted
        call's ``src``/``dst``; ``reduce_op``: a reducing call's op) and a
        failed wait explained (``partner``: the peer of a point-to-point call).

        While torch.compile traces, the call runs eagerly, outside the graph
        (:data:`run_eagerly`): the tracer must not follow it into the waits and
        address arithmetic of :meth:`run_now`, which fake tensors of dynamic
        shapes cannot take."""
        if torch.compiler.is_compiling():
            eager: _R = run_eagerly(self, op, fn, *args, partner=partner, p2p=p2p, data=data,
                                    transport=transport, dim=dim, root=root,
                                    reduce_op=reduce_op)
            return eager
        return self.run_now(op, fn, *args, partner=partner, p2p=p2p, data=data,
                            transport=transport, dim=dim, root=root, reduce_op=reduce_op)

    def run_now(self, op: str, fn: Callable[..., _R], *args: Any, partner: int | None = None,
                p2p: bool = False, data: Any = None, transport: str | None = None,
                dim: Any = None, root: Any = None, reduce_op: Any = None) -> _R:
        """:meth:`run` without asking whether torch.compile traces: the body that
        :data:`run_eagerly` runs. It must not ask: torch's flag is process-wide, so
        while another thread compiles it is set here too, and asking again would
        send the call back to :data:`run_eagerly` without end."""
        if p2p:
            self.p2p_calls = n = self.p2p_calls + 1
            return self._run(op, fn, args, n + self.collectives, partner, p2p, data,
                             transport, dim, root, reduce_op)
        n = self.begin(op)
        try:
            return self._run(op, fn, args, n + self.p2p_calls, partner, p2p, data,
                             transport, dim, root, reduce_op)
        finally:
            self.end()

    def _run(self, op: str, fn: Callable[..., _R], args: tuple[Any, ...], seq: int,
             partner: int | None, p2p: bool, data: Any, transport: str | None,
             dim: Any, root: Any, reduce_op: Any) -> _R:
        """:meth:`run`'s call, numbered ``seq``."""
        entry = self.record(op, data, -1 if partner is None else partner, transport)
        if entry is not None:
            entry[DIM] = dim  # as given (a bad one: the call raises, the dump ignores it)
            entry[ROOT] = root  # as given: the dump keeps only an int
            entry[REDUCE_OP] = reduce_op
        marks = None if p2p or self.marks is None else self.marks()
        started = monotonic()
        try:
            result = fn(*args)
        except BaseException as e:
            self.failed(op, seq, e, entry, marks, partner=partner, started=started)
            raise
        if marks is not None:
            self.finished(None, marks)
        self.completed(entry, result, data, marks)
        return result

    def record(self, op: str, data: Any = None, peer: int = -1,
               transport: str | None = None,
               shapes: tuple[Any, Any] | None = None, root: Any = None) -> list[Any] | None:
        """Begin the recorder's entry of call ``op``, numbered just now: the
        counts as they are, ``data``'s shapes (or ``shapes``, ``(sizes,
        dtypes)``, for a call that has no tensor yet: a receive), ``peer`` (a
        point-to-point call's group rank), ``transport`` when the call names its
        own, ``root``: a rooted call's ``src``/``dst`` as given. None when the
        recorder is off."""
        trace = self.trace
        if trace is None:
            return None
        sizes, dtypes = shapes_of(data) if shapes is None else shapes
        entry = trace.begin(op, self.collectives, self.p2p_calls, sizes, dtypes, peer)
        if transport is not None:
            entry[TRANSPORT] = transport
        entry[ROOT] = root
        return entry

    @staticmethod
    def completed(entry: list[Any] | None, result: Any = None, data: Any = None,
                  marks: Any = None) -> None:
        """Mark ``entry`` (if any) completed; ``result``'s shapes are kept when they
        differ from ``data``'s (the input's); ``marks``, the device call's marks
        (finished by the caller), go with it."""
        if entry is None:
            return
        if result is not None:
            out = shapes_of(result)
            if out[0] is not None and out != shapes_of(data):
                entry[OUT_SIZES], entry[OUT_DTYPES] = out
        if marks is not None:
            entry[DEVICE] = marks
        entry[DONE] = monotonic_ns()

    @staticmethod
    def finished(entry: list[Any] | None, marks: Any) -> None:
        """A call returned: its device marks (if any) end after the work it queued,
        and go with ``entry`` (if any), which completes now. The hot calls' form."""
        if marks is not None:
            marks.finish()
            if entry is not None:
                entry[DEVICE] = marks
        if entry is not None:
            entry[DONE] = monotonic_ns()

    def failed(self, op: str, seq: int, e: BaseException, entry: list[Any] | None,
               marks: Any = None, *, partner: int | None = None, writer: int | None = None,
               started: float | None = None, group_timeout: bool = True) -> None:
        """Call ``seq`` (``op``) raised ``e``: raise the error it should raise
        (:meth:`explain`), or return to let the caller re-raise ``e``; either way
        the error is first recorded in ``entry`` (if any) and, when it is worth
        a post-mortem, this process's dump written (once per error).

        Args:
            started: When the call began (``time.monotonic()``); None: the
                entry's creation (a call without an entry passes it: with the
                recorder off, a peer that gave up at its timeout is told from
                one that failed early only by it).
            group_timeout: Whether the call waited with the group's timeout
                (else how long it lasted says nothing of a peer's timeout,
                and is not given to the explanation).
        """
        if marks is not None:  # the work queued before the failure ends the marks
            marks.finish()
            if entry is not None:
                entry[DEVICE] = marks
        if not group_timeout:
            started = None
        elif started is None and entry is not None:
            started = entry[CREATED] / 1e9  # the same clock as time.monotonic()
        try:
            if isinstance(e, WAIT_ERRORS):
                self.errors.explain(op, seq, e, partner=partner, writer=writer,
                                    started=started)
        except BaseException as explained:
            self.note_failure(op, seq, explained, entry)
            raise
        self.note_failure(op, seq, e, entry)

    def note_failure(self, op: str, seq: int, error: BaseException,
                     entry: list[Any] | None) -> None:
        """Record that call ``seq`` (``op``) fails with ``error`` (already the error it
        raises), and write the dump it deserves (never raises)."""
        trace = self.trace
        if entry is None or trace is None:
            return
        GroupTrace.fail(entry, error)
        auto_dump.dump_for_error(trace, op, seq, error)

    def number_p2p(self) -> int:
        """Number a point-to-point call made outside :meth:`run`; returns its number."""
        self.p2p_calls = n = self.p2p_calls + 1
        return n + self.collectives

    def explain(self, op: str, seq: int, e: BaseException, partner: int | None = None,
                writer: int | None = None, started: float | None = None) -> None:
        """Raise the error call ``seq`` (``op``) should raise for ``e``, or return to
        let the caller re-raise ``e`` (see :meth:`CallErrors.explain
        <coordinator.calls.call_errors.CallErrors.explain>`)."""
        self.errors.explain(op, seq, e, partner=partner, writer=writer, started=started)

    def dead_partner(self, op: str, partner: int) -> PeerDiedError | None:
        """The error of the current call ``op`` when ``partner``'s process is provably
        gone, else None."""
        return self.errors.dead_partner(op, self.calls, partner)

    def close(self) -> None:
        """Mark the group closed: calls that begin from now on raise
        ``NotInitializedError``, calls still running that fail raise ``ClosedError``."""
        self.errors.destroyed = True


#: :meth:`CallBook.run_now` outside torch.compile's graph: called from a traced
#: function it is a graph break, and the call runs as in eager mode.
run_eagerly: Callable[..., Any] = untraced(CallBook.run_now)

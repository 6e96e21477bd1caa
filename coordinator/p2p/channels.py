"""Worker threads that run a group's point-to-point calls in issue order.

A :class:`Channel` is one direction with one peer ("sends to rank 2",
"receives from rank 0") of one group. It holds a FIFO of :class:`Work` items
and one daemon thread, started at the first item, that runs them one after the
other; a blocking call of the same direction runs on its caller's thread in
the channel's *turn* (:meth:`Channel.turn`: after every earlier item finished,
before any later one starts). :class:`Channels` keeps a group's channels and
closes them.

Synchronisation (one ``threading.Condition`` per channel guards its queue,
its running item and the inline flag):

* the worker takes the head item only while no inline call holds the turn,
  and marks it running until it finished;
* :meth:`Channel.turn` waits until the queue is empty, nothing runs and no
  other inline call holds the turn, then holds it until its block ends;
* so at most one call of a direction runs at any time, in the order the
  calls were issued (submission order, or turn order for inline calls), which
  is what pairs a rank's ``n``-th send to ``p`` with ``p``'s ``n``-th receive.

Closing (:meth:`Channels.close`): queued items fail with
:class:`~coordinator.errors.ClosedError` at once; running ones get a grace
period to finish. An item still running after it waits in gloo for a peer
that will not come, and gloo cannot cancel a wait, so :meth:`Channels.close`
then calls ``break_group``, which closes the group's connections (every
pending gloo operation of the group fails at once); those items fail with
``ClosedError`` too, and every thread is joined.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from coordinator.calls.call_errors import WAIT_ERRORS, CallErrors
from coordinator.errors import ClosedError, CommTimeout

__all__ = ["Work", "Channel", "Channels", "SEND", "RECV", "LIVENESS_S"]

SEND, RECV = "send", "recv"
_JOIN_S = 10.0  # after breaking the connections, every wait ends within milliseconds
#: Seconds between checks that a waited-for peer's process still exists.
LIVENESS_S = 0.25


class Work:
    """One point-to-point call: what to run, and its outcome once it ran.

    Args:
        op: The public method (``"isend"``, ``"irecv_tensor_dict"``, ...).
        peer: The other group rank.
        call: The call's number in its group.
        fn: What runs it (a blocking call); its return value is the result.
        args: Arguments of ``fn``.
        errors: The group's :class:`~coordinator.calls.call_errors.CallErrors`, which
            turns a failed wait into the error the call raises and tells
            whether the peer's process is gone.
        quiet: Nobody waits for this item (it only tells the peer that this
            rank rejected its arguments): its failure is expected and not reported.
        self_ending: Says whether the call's transport ends it by itself when the
            peer dies (a shared-memory link: its reader first takes what the
            dead writer published, then raises; its writer raises when the
            reader it waits for is gone). Such a call is never declared failed
            from outside (:meth:`dead_peer`): what the peer sent before dying
            still arrives. None: the transport may miss a death (gloo).
    """

    __slots__ = ("op", "peer", "call", "_fn", "_args", "errors", "quiet", "result", "error",
                 "observed", "dropped", "cancel", "_done", "_settle", "_self_ending")

    def __init__(self, op: str, peer: int, call: int, fn: Callable[..., Any],
                 args: tuple[Any, ...], errors: CallErrors, quiet: bool = False,
                 self_ending: Callable[[], bool] | None = None) -> None:
        self.op, self.peer, self.call = op, peer, call
        self._fn: Callable[..., Any] | None = fn
        self._args: tuple[Any, ...] | None = args
        self.errors = errors
        self.quiet = quiet
        self._self_ending = self_ending
        self.result: Any = None
        self.error: BaseException | None = None
        self.observed = False  # a wait() or is_completed() saw the outcome
        self.dropped = False  # the handle was garbage-collected before the outcome
        self.cancel: BaseException | None = None  # set by close() before breaking connections
        self._done = threading.Event()
        self._settle = threading.Lock()  # the outcome is set once (worker or declare())

    def done(self) -> bool:
        """Whether the call finished (successfully or not)."""
        return self._done.is_set()

    def block(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the call to finish; whether it did."""
        return self._done.wait(timeout)

    def run(self) -> None:
        """Run the call (once) and record its result or error."""
        fn, args = self._fn, self._args
        self._fn = self._args = None  # the item no longer keeps the tensors alive
        try:
            if fn is None:
                raise RuntimeError("internal: a point-to-point work item ran twice")
            result = fn(*args)  # type: ignore[misc]
        except Exception as e:
            self._finish(None, self.cancel or self._explained(e))
        else:
            self._finish(result, None)

    def fail(self, error: BaseException) -> None:
        """Finish without running (the channel closed before the call started)."""
        self._fn = self._args = None
        self._finish(None, error)

    def declare(self, error: BaseException) -> None:
        """Finish with ``error`` now, though the worker may still be inside the call
        (its peer is gone); whatever the worker ends with later is dropped."""
        self._finish(None, error)

    def dead_peer(self) -> BaseException | None:
        """The error of this call when the peer's process is provably gone and its
        transport would not end the call by itself, else None (a call on a link
        may still complete from what the peer published before it died)."""
        ending = self._self_ending
        if ending is not None and ending():
            return None
        return self.errors.dead_partner(self.op, self.call, self.peer)

    def describe(self) -> str:
        """``"isend to rank 1 (call #5)"``."""
        where = "to" if "send" in self.op else "from"
        return f"{self.op} {where} rank {self.peer} (call #{self.call})"

    def _explained(self, e: Exception) -> BaseException:
        if not isinstance(e, WAIT_ERRORS):
            return e
        try:
            self.errors.explain(self.op, self.call, e, partner=self.peer)
        except Exception as translated:
            return translated
        return e

    def _finish(self, result: Any, error: BaseException | None) -> None:
        with self._settle:
            if self._done.is_set():
                return  # declared failed earlier: the first outcome stands
            self.result, self.error = result, error
            self._done.set()
        if self.dropped and error is not None and not self.quiet:
            warn_unobserved(self)


def warn_unobserved(work: Work) -> None:
    """Report the failure of a call whose handle was dropped without a wait()."""
    warnings.warn(
        f"{work.describe()} failed and its handle was dropped without wait(): "
        f"{type(work.error).__name__}: {work.error}",
        RuntimeWarning, stacklevel=2,
    )


class Channel:
    """The calls of one direction with one peer, run in issue order (module docstring).

    Args:
        label: Thread name suffix (``"pp:0 send->1"``).
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self._cond = threading.Condition()
        self._queue: collections.deque[Work] = collections.deque()
        self._running: Work | None = None
        self._inline = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, work: Work) -> None:
        """Queue ``work`` behind every earlier call of this direction.

        Raises:
            ClosedError: The channel is closed (its group was destroyed).
        """
        with self._cond:
            if self._closed:
                raise ClosedError(f"{self.label}: the group was destroyed")
            self._queue.append(work)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"gc-p2p {self.label}",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

    @contextlib.contextmanager
    def turn(self, timeout: float, describe: Callable[[], str],
             check: Callable[[], None]) -> Iterator[None]:
        """Hold this direction for an inline (blocking) call, after every earlier one.

        Args:
            timeout: Seconds to wait for the earlier calls.
            describe: The waiting call, for the timeout's message.
            check: Called every :data:`LIVENESS_S` while waiting; raises to stop
                (the peer died).

        Raises:
            CommTimeout: The earlier calls did not finish within ``timeout``
                (``peers`` empty: the caller's error translation names the peer).
            ClosedError: The channel closed meanwhile.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                free = self._cond.wait_for(
                    lambda: self._closed or not (self._queue or self._running or self._inline),
                    max(0.0, min(LIVENESS_S, deadline - time.monotonic())))
                if free or time.monotonic() >= deadline:
                    break
                check()
            if self._closed:
                raise ClosedError(f"{self.label}: the group was destroyed")
            if not free:
                raise CommTimeout(
                    f"{describe()} waited {timeout:g}s for earlier asynchronous calls of the "
                    f"same direction ({len(self._queue) + 1} outstanding) to finish")
            self._inline = True
        try:
            yield
        finally:
            with self._cond:
                self._inline = False
                self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._queue or self._inline):
                    self._cond.wait()
                if not self._queue:
                    return  # closed: close() failed whatever was queued
                work = self._running = self._queue.popleft()
            try:
                work.run()
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()

    # ------------------------------------------------------------------ closing
    def shut(self, reason: Callable[[Work], BaseException]) -> None:
        """Refuse new calls and fail the queued ones with ``reason(work)``."""
        with self._cond:
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for w in queued:
            w.fail(reason(w))

    def running(self) -> Work | None:
        """The call running on the worker now, if any."""
        return self._running

    def busy(self) -> bool:
        """Whether a call of this direction runs now: on the worker, or a blocking
        call on its caller's thread (:meth:`turn`)."""
        return self._running is not None or self._inline

    def join(self, deadline: float) -> bool:
        """Wait until the worker thread ended (until ``deadline``); whether it did."""
        t = self._thread
        if t is None:
            return True
        t.join(max(0.0, deadline - time.monotonic()))
        return not t.is_alive()


class Channels:
    """A group's channels, by ``(direction, peer)``.

    Args:
        name: The group's unique name.
        break_group: Closes the group's connections (see the module docstring).
    """

    def __init__(self, name: str, break_group: Callable[[], None]) -> None:
        self.name = name
        self._break_group = break_group
        self._lock = threading.Lock()
        self._channels: dict[tuple[str, int], Channel] = {}
        self._closed = False

    def get(self, direction: str, peer: int) -> Channel:
        """The channel of ``direction`` with ``peer`` (created at first use)."""
        ch = self._channels.get((direction, peer))
        if ch is None:
            with self._lock:
                if self._closed:
                    raise ClosedError(f"group {self.name!r} was destroyed")
                ch = self._channels.setdefault(
                    (direction, peer),
                    Channel(f"{self.name} {direction}{'->' if direction == SEND else '<-'}{peer}"))
        return ch

    def find(self, direction: str, peer: Any) -> Channel | None:
        """The channel of ``direction`` with ``peer`` if one was created, else None."""
        return self._channels.get((direction, peer))

    def close(self, grace: float) -> None:
        """Fail queued calls, give running ones ``grace`` seconds, then end them; join threads."""
        with self._lock:
            self._closed = True
            channels = list(self._channels.values())
        for ch in channels:
            ch.shut(lambda w: ClosedError(
                f"group {self.name!r} was destroyed before {w.describe()} started",
                queue=self.name, peers=(w.peer,)))
        deadline = time.monotonic() + grace
        while any(ch.busy() for ch in channels) and time.monotonic() < deadline:
            time.sleep(0.01)
        stuck = [w for w in (ch.running() for ch in channels) if w is not None]
        for w in stuck:
            w.cancel = ClosedError(
                f"group {self.name!r} was destroyed while {w.describe()} was still waiting "
                f"for its peer ({grace:g}s after destroy() began)",
                queue=self.name, peers=(w.peer,))
        if any(ch.busy() for ch in channels):  # blocking calls too: gloo waits end at once
            self._break_group()
        end = time.monotonic() + _JOIN_S
        alive = [ch.label for ch in channels if not ch.join(end)]
        if alive:
            warnings.warn(f"point-to-point threads of group {self.name!r} did not end: {alive}",
                          RuntimeWarning, stacklevel=2)

"""The handle of an asynchronous point-to-point call.

``isend``, ``irecv``, ``isend_tensor_dict`` and ``irecv_tensor_dict`` each
make a :class:`P2PHandle` at once (the dict calls return it in vLLM's forms:
:mod:`coordinator.p2p.dict_handles`): :meth:`P2PHandle.is_completed` polls,
:meth:`P2PHandle.wait` blocks until the call finished and returns its result
(the received tensor or dict; None for sends) or raises its error: a dead
peer (``PeerDiedError``), a mismatch or a peer's rejection
(``CollectiveMismatch`` / ``PeerRejectedError``), malformed bytes
(``DecodeError``), a timeout (``CommTimeout`` naming the group, the op, the
call number and the peer). Argument errors (``TypeError``/``ValueError``
naming the argument) raise at the call itself, as in the blocking calls.

A receive may end with a step that must run on the waiting thread: on a
CUDA group, an ``irecv_tensor_dict`` with an ``all_gather_group`` rebuilds
its sliced tensors with all-gathers over that group, collectives the group's
ranks must call in the same order as their others (vLLM's ``postprocess``).
Such a handle's first ``wait()`` that finds the transfer done runs the step
(``finish``, which waits with that group's timeout, not the wait's) and
keeps what it returned or raised, so every later ``wait()`` returns or
raises the same; ``is_completed()`` says whether the transfer finished.

A ``wait(timeout)`` that runs out leaves the call running: wait again, or
destroy the group. A handle dropped without ``wait()`` does not stop its
call, which keeps its place in the order; if the call fails, a
``RuntimeWarning`` says so (never silently).

How the calls run, in which order, and how destroying the group ends them:
:mod:`coordinator.p2p.point_to_point`.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

from coordinator.errors import CommTimeout
from coordinator.p2p.channels import LIVENESS_S, warn_unobserved
from shm_broadcast.checks import check_timeout

__all__ = ["P2PHandle"]


class P2PHandle:
    """An asynchronous point-to-point call, returned by ``GroupCoordinator.isend`` and
    friends (see the module docstring for ordering, errors and closing).

    Args:
        work: The call's state (a :class:`~coordinator.p2p.channels.Work`, or a
            CUDA event's :class:`~coordinator.p2p.cuda_p2p.EventWork`).
        timeout: The group's timeout, the default of :meth:`wait`.
        finish: Run once, by the first :meth:`wait` that sees the call
            succeed, on the call's result; what it returns is the handle's
            result (see the module docstring).
    """

    __slots__ = ("_work", "_timeout", "_next_check", "_finish", "_finished")

    def __init__(self, work: Any, timeout: float,
                 finish: Callable[[Any], Any] | None = None) -> None:
        self._work = work
        self._timeout = timeout
        self._next_check = time.monotonic() + LIVENESS_S
        # (the step, and the lock under which the first wait runs it), only with a step
        self._finish = None if finish is None else (finish, threading.Lock())
        self._finished: tuple[Any, Exception | None] | None = None

    @property
    def op(self) -> str:
        """The call: ``"isend"``, ``"irecv"``, ``"isend_tensor_dict"`` or
        ``"irecv_tensor_dict"``."""
        op: str = self._work.op
        return op

    @property
    def peer(self) -> int:
        """The other group rank."""
        peer: int = self._work.peer
        return peer

    @property
    def call(self) -> int:
        """The call's number in its group (errors name it)."""
        call: int = self._work.call
        return call

    def is_completed(self) -> bool:
        """Whether the call finished, successfully or not (``wait()`` then returns at once).

        A call whose peer's process is gone counts as finished (with
        ``PeerDiedError``); that is checked at most every :data:`LIVENESS_S`.
        A call on a shared-memory link is left to the link, which first
        delivers what the peer published before it died, then raises.
        """
        w = self._work
        if w.done():
            return True
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + LIVENESS_S
            self._check_peer()
        done: bool = w.done()
        return done

    def wait(self, timeout: float | datetime.timedelta | None = None) -> Any:
        """Wait for the call; return its result (a receive's tensor or dict, None for sends).

        Args:
            timeout: Seconds (or a timedelta) ``>= 0``; ``0`` polls once;
                None: the group's timeout.

        Raises:
            CommTimeout: Not finished within ``timeout``; names the group, the
                op, the call number and the peer. The call goes on.
            Exception: The call's own error (``PeerDiedError``,
                ``CollectiveMismatch``, ``PeerRejectedError``, ``DecodeError``,
                ``ClosedError`` after ``destroy()``, ...), at every wait.
            TypeError, ValueError: ``timeout`` is not a valid timeout.
        """
        got = check_timeout(timeout, default=self._timeout)
        wait_s = self._timeout if got is None else got
        w = self._work
        deadline = time.monotonic() + wait_s
        # Gloo may not notice a peer that died while a receive was posted; the
        # peer's process is checked between slices of the wait.
        while not w.block(max(0.0, min(LIVENESS_S, deadline - time.monotonic()))):
            self._check_peer()
            if w.done():
                break
            if time.monotonic() >= deadline:
                raise self._timed_out(wait_s)
        w.observed = True
        if w.error is not None:
            raise w.error
        step = self._finish
        if step is None:
            return w.result
        return self._finished_result(*step, w.result)

    def _finished_result(self, finish: Callable[[Any], Any], lock: threading.Lock,
                         result: Any) -> Any:
        """``finish(result)``, run once; later calls return or raise what it did. An
        interrupt (not an ``Exception``) is not kept: the next wait runs it again."""
        with lock:
            done = self._finished
            if done is None:
                try:
                    done = (finish(result), None)
                except Exception as e:
                    done = (None, e)
                self._finished = done
        value, error = done
        if error is not None:
            raise error
        return value

    def _check_peer(self) -> None:
        w = self._work
        dead = w.dead_peer()
        if dead is not None:
            w.declare(dead)

    def _timed_out(self, wait_s: float) -> BaseException:
        w = self._work
        e = CommTimeout(f"{w.describe()} did not complete within {wait_s:g}s (it goes on: "
                        f"wait again, or destroy the group to cancel it)", peers=(w.peer,))
        try:
            w.errors.explain(w.op, w.call, e, partner=w.peer)
        except CommTimeout as err:
            return err
        return e

    def __del__(self) -> None:
        try:
            w = self._work
        except AttributeError:
            return
        if w.observed:
            return
        w.dropped = True
        if w.done() and w.error is not None and not w.quiet:
            warn_unobserved(w)

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "pending"
        return f"P2PHandle({self._work.describe()}, {state})"

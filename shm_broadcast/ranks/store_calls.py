"""Calls of a ``torch.distributed`` store, each bounded by the caller's deadline.

A TCPStore client waits without limit for the answer to a request once the
request is sent: the store's own timeout bounds only how long the *server*
lets a ``wait``/``get`` sit, and a server process that is stopped (SIGSTOP,
a debugger, a frozen container) or whose host stopped answering without
closing the connection never answers. A ``wait`` on such a store overruns
its timeout and then hangs for good in the request that cancels it.

:class:`StoreCalls` runs every call on one worker thread per store (the
client serialises its requests anyway) and waits for the answer until the
call's limit. What happens to a call whose caller gave up::

    queued --(worker takes it)--> running --(store answers)--> done
      |                              |
      | caller's limit passes        | caller's limit passes: CommTimeout;
      v                              v the worker finishes it whenever the
    abandoned: never sent            store answers, and drops the answer

Both transitions out of ``queued`` happen under one lock, so a call is
either sent or abandoned, never both: a call that raised ``CommTimeout``
before it started has no effect on the store. One that was already running
may still take effect (a ``set`` lands when the store wakes up). Later calls
queue behind a running one and are bounded by their own limits, so once the
store answers again (SIGCONT) the calls go on in order.

The store's C++ calls release the GIL, so the worker never holds up the
caller. The worker is a daemon thread: one stuck in a call cannot keep the
interpreter from exiting; the exit waits a little for a call given up on
while running (:mod:`shm_broadcast.ranks.native_calls`), since its return
into a finalised interpreter would abort the process. The worker keeps the
store alive while a call runs, so an abandoned call never runs on a
destroyed client. After ``os.fork`` the child
starts a worker of its own (threads do not survive a fork).
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from shm_broadcast.errors import ClosedError, CommTimeout
from shm_broadcast.ranks.native_calls import wait_at_exit

__all__ = ["StoreCalls"]

_STOP = object()  # tells the worker to exit


class _Call:
    """One store request: what to run and, once done, its answer or error."""

    __slots__ = ("method", "fn", "args", "done", "value", "error", "state")

    def __init__(self, method: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.method, self.fn, self.args = method, fn, args
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.state = "queued"  # -> "running" | "abandoned" (under StoreCalls' lock)


class StoreCalls:
    """Runs one store's calls on a worker thread, each bounded by a limit.

    Args:
        store: The store (any ``torch.distributed.Store``).
        label: Who owns it, first in error messages (``"stateless group 'dp'"``).
        describe: Where the store is, for error messages (``"the store on
            rank 0 (127.0.0.1:29500)"``).
        peers: The ranks whose process serves the store (``peers`` of the
            raised :class:`CommTimeout`).
        queue_name: ``queue`` attribute of the errors raised.
    """

    # The worker's side (set by _fresh_worker_state, again in a forked child).
    _pid: int
    _requests: queue.SimpleQueue[Any]
    _running: list[_Call | None]  # the call the worker is in
    _worker: threading.Thread | None

    def __init__(self, store: Any, label: str, describe: str, peers: list[int],
                 queue_name: str | None = None) -> None:
        self.store: Any = store
        self._label, self._describe, self._peers = label, describe, list(peers)
        self._queue_name = queue_name
        self._lock = threading.Lock()
        self._fresh_worker_state()

    def call(self, method: str, *args: Any, limit: float, op: str, side: str) -> Any:
        """``store.<method>(*args)``, waiting at most ``limit`` seconds for its answer.

        Args:
            method: Store method (``"get"``, ``"set"``, ``"wait"``...).
            *args: Its arguments.
            limit: Seconds to wait for the answer (> 0).
            op: The operation of the caller, for the message.
            side: Who calls (``"rank 1/4"``), for the message.

        Raises:
            ValueError: ``limit`` is not a positive number.
            ClosedError: :meth:`close` was called.
            CommTimeout: No answer within ``limit``. A call that had not
                started is dropped; one that had goes on in the background
                and ends when the store answers.
            Exception: What the store call raised.
        """
        if not isinstance(limit, (int, float)) or not limit > 0:
            raise ValueError(f"limit must be a positive number of seconds, got {limit!r}")
        req = self._submit(method, args, op)
        if not req.done.wait(limit):
            raise self._timeout(req, limit, op, side)
        if req.error is not None:
            raise req.error
        return req.value

    def close(self) -> None:
        """Drop the store and let the worker exit once the call it runs has returned.

        A store call still running keeps its store until it returns; the
        store is released then (rank 0's server stops listening).
        """
        with self._lock:
            self.store = None
            if self._worker is not None and self._pid == os.getpid():
                self._requests.put(_STOP)
            self._worker = None

    # ------------------------------------------------------------------ helpers
    def _fresh_worker_state(self) -> None:
        """A queue and no worker yet (at creation, and in a forked child)."""
        self._pid = os.getpid()
        self._requests = queue.SimpleQueue()
        self._running = [None]
        self._worker = None
        # A StoreCalls dropped without close() still lets its worker go.
        weakref.finalize(self, self._requests.put, _STOP)

    def _submit(self, method: str, args: tuple[Any, ...], op: str) -> _Call:
        with self._lock:
            if self.store is None:
                raise ClosedError(f"{self._label} is closed (op {op})", queue=self._queue_name)
            if self._pid != os.getpid():  # forked: the parent's worker is not here
                self._fresh_worker_state()
            req = _Call(method, getattr(self.store, method), args)
            if self._worker is None:
                worker = threading.Thread(
                    target=_serve, args=(self._requests, self._running, self._lock),
                    name=f"store-calls {self._label}", daemon=True)
                self._worker = worker
                worker.start()
            self._requests.put(req)
        return req

    def _timeout(self, req: _Call, limit: float, op: str, side: str) -> CommTimeout:
        """Abandon ``req`` if it has not started; the error that says so."""
        with self._lock:
            if req.state == "queued":
                req.state = "abandoned"
            running = self._running[0]
        if req.state == "running":
            wait_at_exit(req.done)  # its answer must not come while the interpreter ends
        if req.state == "abandoned":
            why = (f" (never sent: queued behind an earlier {running.method} it has not "
                   f"answered)" if running is not None else " (never sent)")
        else:
            why = ""
        return CommTimeout(
            f"{self._label} ({side}), op {op}: {self._describe} did not answer a "
            f"{req.method} within {limit:.1f}s{why}; its process may be stopped (SIGSTOP, "
            f"a debugger), overloaded, or cut off without closing the connection",
            queue=self._queue_name, side=side, peers=self._peers)


def _serve(requests: queue.SimpleQueue[Any], running: list[_Call | None],
           lock: threading.Lock) -> None:
    """The worker: run calls in order, skipping abandoned ones, until told to stop."""
    while True:
        req = requests.get()
        if req is _STOP:
            return
        with lock:
            if req.state == "abandoned":
                req = None
                continue
            req.state = "running"
            running[0] = req
        try:
            req.value = req.fn(*req.args)
        except BaseException as e:  # handed to the caller, which re-raises it
            req.error = e
        finally:
            with lock:
                running[0] = None
            req.done.set()
            req = None  # an idle worker holds no answer and no store

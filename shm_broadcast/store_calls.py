"""Calls of a ``torch.distributed`` store, each bounded by the caller's deadline.

A TCPStore client waits without limit for the answer to a request once the
request is sent: the store's own timeout bounds only how long the *server*
lets a ``wait``/``get`` sit, and a server process that is stopped (SIGSTOP,
a debugger, a frozen container) or whose host stopped answering without
closing the connection never answers. A ``wait`` on such a store overruns
its timeout and then hangs for good in the request that cancels it.

:class:`StoreCalls` runs every call on one worker thread per store (the
client serialises its requests anyway) and waits for the answer until the
call's limit. A call still running at its limit is abandoned: the caller
gets :class:`~shm_broadcast.errors.CommTimeout` naming what did not answer,
and the worker finishes it whenever the store answers. A later call queues
behind it and is bounded by its own limit, so once the store answers again
(SIGCONT) the calls go on where they were; nothing is retried or reordered.

The store's C++ calls release the GIL, so the worker never holds up the
caller. The worker is a daemon thread: one stuck in a call cannot keep the
interpreter from exiting. It keeps the store alive while a call runs, so an
abandoned call never runs on a destroyed client.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Any, Callable

from shm_broadcast.errors import CommTimeout

__all__ = ["StoreCalls"]

_STOP = object()  # tells the worker to exit


class _Call:
    __slots__ = ("method", "fn", "args", "done", "value", "error")

    def __init__(self, method: str, fn: Callable[..., Any], args: tuple) -> None:
        self.method, self.fn, self.args = method, fn, args
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class StoreCalls:
    """Runs one store's calls on a worker thread, each bounded by a limit.

    Args:
        store: The store (any ``torch.distributed.Store``).
        name: Group or queue name used in error messages.
        describe: Says where the store is, for error messages (say ``"the
            store on rank 0 (127.0.0.1:29500)"``).
        peers: The ranks whose process serves the store (``peers`` of the
            raised :class:`CommTimeout`).
    """

    def __init__(self, store: Any, name: str, describe: str, peers: list[int]) -> None:
        self.store = store
        self._name, self._describe, self._peers = name, describe, list(peers)
        self._requests: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._running: list[_Call | None] = [None]  # the call the worker is in
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()
        # A group dropped without close() still lets its worker go.
        weakref.finalize(self, self._requests.put, _STOP)

    def call(self, method: str, *args: Any, limit: float, op: str, side: str) -> Any:
        """``store.<method>(*args)``, waiting at most ``limit`` seconds for its answer.

        Args:
            method: Store method (``"get"``, ``"set"``, ``"wait"``...).
            *args: Its arguments.
            limit: Seconds to wait for the answer (> 0).
            op: The operation of the caller, for the message.
            side: Who calls (``"rank 1/4"``), for the message.

        Raises:
            CommTimeout: No answer within ``limit`` (the call goes on in the
                background and ends when the store answers).
            Exception: What the store call raised.
        """
        req = _Call(method, getattr(self.store, method), args)
        self._start()
        self._requests.put(req)
        if not req.done.wait(limit):
            running = self._running[0]
            behind = (f" (queued behind an earlier {running.method} it has not answered "
                      f"either)" if running is not None and running is not req else "")
            raise CommTimeout(
                f"stateless group {self._name!r} ({side}), op {op}: {self._describe} did not "
                f"answer a {method} within {limit:.1f}s{behind}; its process may be stopped "
                f"(SIGSTOP, a debugger), overloaded, or cut off without closing the "
                f"connection", queue=self._name, side=side, peers=self._peers)
        if req.error is not None:
            raise req.error
        return req.value

    def close(self) -> None:
        """Let the worker exit once the calls queued so far have returned."""
        with self._lock:
            if self._worker is not None:
                self._requests.put(_STOP)
                self._worker = None

    def _start(self) -> None:
        with self._lock:
            if self._worker is None:
                self._worker = threading.Thread(target=_serve,
                                                args=(self._requests, self._running),
                                                name=f"store-calls-{self._name}", daemon=True)
                self._worker.start()


def _serve(requests: "queue.SimpleQueue[Any]", running: list[_Call | None]) -> None:
    """The worker: run calls in order until told to stop."""
    while True:
        req = requests.get()
        if req is _STOP:
            return
        running[0] = req
        try:
            req.value = req.fn(*req.args)
        except BaseException as e:  # handed to the caller, which re-raises it
            req.error = e
        finally:
            running[0] = None
            req.done.set()

"""``GroupcoordWork``: the ``torch.distributed.Work`` our process group returns.

Collectives of the groupcoord backend run to completion on the calling
thread, so their works are born complete (or failed). Point-to-point calls
go to gloo, whose works complete later; a work then holds gloo's and waits
on it. Every work offers what torch's callers use:

* ``wait(timeout)``: bounded by ``timeout`` or, when none is given (torch
  passes 0 for "none"), by the group's timeout; gloo's timeout error becomes
  :class:`~shm_broadcast.errors.CommTimeout` (final: gloo closes the
  connection of the two ranks when a wait times out), a dead peer
  :class:`~shm_broadcast.errors.PeerDiedError`; a failed work raises its
  error on every ``wait`` (from any thread);
* ``is_completed()``, ``is_success()``, ``exception()``, ``result()``;
* ``get_future()``: a ``torch.futures.Future`` whose value is the call's
  output tensors (DDP's communication hooks read ``fut.value()[0]``), or
  which raises the call's error; for a call still in flight a daemon thread
  waits for it (gloo's point-to-point works have no future);
* ``_source_rank()`` for ``recv`` from any source.

Lifetime: when C++ (DDP's reducer, functional collectives) receives this
Python object through torch's ``PyProcessGroup`` trampoline, torch wraps it
in a ``PyWorkHolder`` that owns a reference to the Python object, so the
Python side may drop its own reference early.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from device_comms.errors import translate_backend_error

__all__ = ["GroupcoordWork"]


class GroupcoordWork(dist.Work):
    """A finished call, or a gloo point-to-point call in flight.

    Args:
        result: The call's output tensors (the future's value).
        error: The call's error (a failed work).
        pending: A gloo work still in flight (point-to-point).
        finish: Run once ``pending`` completed (copies a received tensor into a
            non-contiguous destination).
        timeout: Seconds ``wait()`` without a timeout may last.
        where: The group, rank and op, for error messages.
    """

    def __init__(
        self,
        result: Sequence[torch.Tensor] = (),
        *,
        error: BaseException | None = None,
        pending: dist.Work | None = None,
        finish: Callable[[], object] | None = None,
        timeout: float = 1800.0,
        where: str = "",
    ) -> None:
        super().__init__()
        self._result = list(result)
        self._error = error
        self._gloo = pending  # kept after completion: recv_anysource asks it for the source
        self._done = pending is None
        self._finish = finish
        self._timeout = timeout
        self._where = where
        #: guards the end of a gloo work (a finished collective has nothing to guard)
        self._lock: contextlib.AbstractContextManager[Any] = (
            threading.Lock() if pending is not None else contextlib.nullcontext())

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Wait until the call completed; raise its error if it failed.

        Safe from any thread, and more than once.

        Args:
            timeout: The longest wait (None or zero: the group's timeout).

        Raises:
            CommTimeout: The call did not complete in time.
            Exception: The call's own error (every ``wait`` raises it again).
        """
        if not self._done and self._gloo is not None:
            seconds = timeout.total_seconds() if timeout else 0.0
            limit = datetime.timedelta(seconds=seconds if seconds > 0 else self._timeout)
            try:
                self._gloo.wait(limit)
            except RuntimeError as e:
                err = translate_backend_error(e, self._where)
                self._settle_once(err)
                if err is e:
                    raise
                raise err from e
            self._settle_once(None)
        if self._error is not None:
            raise self._error
        return True

    def _settle_once(self, error: BaseException | None) -> None:
        """Record the gloo work's end and run ``finish`` (once, on the first thread)."""
        with self._lock:
            if self._done:
                return
            self._done = True
            finish, self._finish = self._finish, None
            if error is not None:
                self._error = error
                return
        if finish is not None:
            try:
                finish()
            except BaseException as e:
                self._error = e
                raise

    def is_completed(self) -> bool:
        """Whether the call finished (successfully or not)."""
        if not self._done and self._gloo is not None and self._gloo.is_completed():
            with contextlib.suppress(Exception):  # kept on the work: wait() raises it
                self.wait()
        return self._done

    def is_success(self) -> bool:
        """Whether the call finished without error."""
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        """The call's error, or None."""
        return self._error

    def result(self) -> list[torch.Tensor]:
        """The call's output tensors (after waiting for it)."""
        self.wait()
        return self._result

    def get_future(self) -> Future[list[torch.Tensor]]:
        """A future completed with the output tensors, or with the call's error."""
        fut: Future[list[torch.Tensor]] = Future()
        if self._done or self._gloo is None:
            self._fill(fut)
            return fut

        def settle() -> None:
            with contextlib.suppress(BaseException):  # handed to the future below
                self.wait()
            self._fill(fut)

        # gloo's point-to-point works have no future of their own: a thread waits
        # (bounded by the group's timeout) and settles this one
        threading.Thread(target=settle, name="groupcoord-work-future", daemon=True).start()
        return fut

    def _fill(self, fut: Future[list[torch.Tensor]]) -> None:
        if self._error is not None:
            fut.set_exception(self._error)  # type: ignore[arg-type]  # torch's stub: the value's type
        else:
            fut.set_result(self._result)

    def _source_rank(self) -> int:
        """The group rank a ``recv`` from any source received from (after waiting)."""
        self.wait()
        if self._gloo is None:
            raise ValueError("this work is not a receive from any source")
        return int(self._gloo._source_rank())  # noqa: SLF001 - torch's own name for it

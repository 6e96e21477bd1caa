"""What ``isend_tensor_dict`` and ``irecv_tensor_dict`` return: one call's
:class:`~coordinator.p2p.handle.P2PHandle` in the forms vLLM's pipeline code
takes apart.

groupcoord moves a tensor dict as one ordered call with one handle. vLLM's
calls return pieces instead, and its workers use them as such (vLLM 0.33,
``v1/worker/gpu_worker.py``)::

    handles = pp.isend_tensor_dict(tensors, all_gather_group=tp)
    pending = handles[1:]          # waited before the next step reuses buffers
    tensor_dict, handles, postprocess = pp.irecv_tensor_dict(all_gather_group=tp)
    ...                            # later, before the dict is read:
    for h in handles: h.wait()
    for fn in postprocess: fn()

So that code written for either runs unchanged:

* :class:`DictSend` is a list of two entries, both the call's handle (vLLM's
  first handle is the metadata's, the others the tensors'; here one handle
  finishes with the whole send, so ``handles[1:]`` waits for all of it), and
  has the handle's own ``wait()`` and ``is_completed()``.
* :class:`DictReceive` is the triple ``(tensor_dict, [handle], [fill])``: the
  dict is empty until ``fill()`` (which waits for the call) puts the received
  items into it, as vLLM's is complete only after its postprocess steps; and
  the triple has ``wait()``, which fills the same dict and returns it, and
  ``is_completed()``. In a group of one rank, as vLLM's, the dict is None
  (nothing is received) and ``wait()`` returns None.

``wait()`` raises the call's error each time it is asked (as the handle does);
a failed ``fill()`` leaves the dict empty.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any

from coordinator.p2p.handle import P2PHandle

__all__ = ["DictReceive", "DictSend"]


class DictSend(list[P2PHandle]):
    """What ``isend_tensor_dict`` returns (see the module docstring).

    Args:
        handle: The send's handle.
    """

    def __init__(self, handle: P2PHandle) -> None:
        super().__init__((handle, handle))
        self._handle = handle

    @property
    def handle(self) -> P2PHandle:
        """The send's handle (its ``op``, ``peer`` and ``call``)."""
        return self._handle

    def wait(self, timeout: float | datetime.timedelta | None = None) -> None:
        """Wait for the send (:meth:`P2PHandle.wait`)."""
        self._handle.wait(timeout)

    def is_completed(self) -> bool:
        """Whether the send finished, successfully or not (:meth:`P2PHandle.is_completed`)."""
        return self._handle.is_completed()


class DictReceive(tuple[dict[Any, Any] | None, list[P2PHandle], list[Callable[[], None]]]):
    """What ``irecv_tensor_dict`` returns (see the module docstring).

    Args:
        handle: The receive's handle; its ``wait()`` returns the dict received.
        alone: The group has one rank: nothing arrives, the dict is None.
    """

    _handle: P2PHandle
    _filled: bool
    _lock: threading.Lock

    def __new__(cls, handle: P2PHandle, alone: bool = False) -> DictReceive:
        received: dict[Any, Any] | None = None if alone else {}
        self = super().__new__(cls, (received, [handle], []))
        self._handle = handle
        self._filled = False
        self._lock = threading.Lock()
        self[2].append(self._fill)
        return self

    @property
    def handle(self) -> P2PHandle:
        """The receive's handle (its ``op``, ``peer`` and ``call``)."""
        return self._handle

    def wait(self, timeout: float | datetime.timedelta | None = None) -> dict[Any, Any] | None:
        """Wait for the dict and return it (the triple's first item, now filled).

        Raises:
            The call's error (see :meth:`P2PHandle.wait`).
        """
        self._fill(timeout)
        return self[0]

    def is_completed(self) -> bool:
        """Whether the receive finished, successfully or not (:meth:`P2PHandle.is_completed`)."""
        return self._handle.is_completed()

    def _fill(self, timeout: float | datetime.timedelta | None = None) -> None:
        """Wait for the call and put what arrived into the triple's dict, once."""
        got = self._handle.wait(timeout)
        with self._lock:
            if self._filled:
                return
            received = self[0]
            if received is not None and got is not None:
                received.update(got)
            self._filled = True

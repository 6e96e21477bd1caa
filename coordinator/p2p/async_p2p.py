"""Asynchronous point-to-point calls: ``isend``, ``irecv``, ``isend_tensor_dict``, ``irecv_tensor_dict``.

Each returns a :class:`P2PHandle` at once: :meth:`P2PHandle.is_completed`
polls, :meth:`P2PHandle.wait` blocks until the call finished and returns its
result (the received tensor or dict; None for sends) or raises its error: a
dead peer (``PeerDiedError``), a mismatch or a peer's rejection
(``CollectiveMismatch`` / ``PeerRejectedError``), malformed bytes
(``DecodeError``), a timeout (``CommTimeout`` naming the group, the op, the
call number and the peer). Argument errors (``TypeError``/``ValueError``
naming the argument) raise at the call itself, as in the blocking calls.

Design (CPU groups, gloo). One worker thread per peer and direction of the
group (:mod:`coordinator.p2p.channels`), started at the first asynchronous
call in that direction, runs the group's *blocking* calls
(``comm.send``/``comm.recv``, :func:`coordinator.p2p.tensor_dict.send_tensor_dict`
/ ``recv_tensor_dict``) in issue order, and the handle waits for it. Why
threads rather than torch's gloo ``isend``/``irecv`` works: every CPU call is
signed. A send and its receive first exchange headers (in both directions),
the payload follows only after both agreed, and a tensor dict's metadata must
be received and checked before its tensors' buffers can be posted; those are
chains of dependent steps, which a thread runs with exactly the code of the
blocking calls (same checks, same error translation, same wire format: an
``isend`` pairs with a blocking ``recv`` and the other way round), waiting in
gloo with the GIL released. One thread per *direction*, not one per group:
each rank of a pair (or a ring) must have a send to and a receive from its
peers in flight at once, which a single queue per group would deadlock; the
signed send/recv gives each direction its own tags
(:mod:`device_comms.signatures.p2p_envelopes`), so the two directions never mix. Cost:
one thread hand-off per call and at most ``2 * (world_size - 1)`` threads per
group.

Ordering rule. Calls of one direction with one peer run in the order they
were issued, asynchronous or blocking alike: a blocking send
(``send``, ``send_object``, ``send_tensor_dict``) to rank ``p`` first waits
until every earlier ``isend``/``isend_tensor_dict`` to ``p`` finished (at most
the group's timeout), then runs on the caller's thread before any later one;
receives from ``p`` likewise. The peer must receive them in the same order
with calls of the same kind (a tensor by ``recv``/``irecv``, a dict by
``recv_tensor_dict``/``irecv_tensor_dict``). Calls in the other direction,
with other peers, and collectives are not ordered against outstanding
handles, and may run meanwhile (collectives use other gloo tags).

Buffers. ``isend`` does not copy: do not modify a tensor (or a dict's
tensors) until its handle completed. ``irecv`` into a tensor fills it in
place (the receive lands in a new tensor that is then copied in) and returns
it; ``irecv((shape, dtype))`` returns a new tensor.

Dropped handles and closing. A handle dropped without ``wait()`` does not
stop its call, which keeps its place in the order; if the call fails, a
``RuntimeWarning`` says so (never silently). ``GroupCoordinator.destroy()``
fails queued calls with ``ClosedError``, gives running ones
:data:`CLOSE_GRACE_S` to finish, then closes the group's gloo connections so
that those waiting for a peer end at once (with ``ClosedError``; gloo cannot
cancel one wait, but a wait that times out closes every connection of its
group), and joins the threads. A ``wait(timeout)`` that runs out leaves the
call running: wait again, or destroy the group.

CUDA groups go through :mod:`coordinator.p2p.async_p2p_cuda` (NCCL on a side
stream, imported at the first CUDA call).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from coordinator.errors import CommTimeout
from coordinator.p2p import link_tensors
from coordinator.p2p import tensor_dict as tensor_dict_ops
from coordinator.p2p.channels import LIVENESS_S, RECV, SEND, Channels, Work, warn_unobserved
from device_comms import validation
from shm_broadcast.checks import check_timeout

if TYPE_CHECKING:
    from coordinator.group.group_coordinator import GroupCoordinator

__all__ = ["P2PHandle", "isend", "irecv", "isend_tensor_dict", "irecv_tensor_dict", "ordered",
           "close", "CLOSE_GRACE_S", "SEND", "RECV"]

#: Seconds ``destroy()`` lets running point-to-point calls finish before ending them.
CLOSE_GRACE_S = 1.0
_BREAK_TAG = 0x6770  # never sent: the expired wait on it closes the group's connections


class P2PHandle:
    """An asynchronous point-to-point call, returned by ``GroupCoordinator.isend`` and
    friends (see the module docstring for ordering, errors and closing).

    Args:
        work: The call's state (a :class:`~coordinator.p2p.channels.Work`, or a
            CUDA event's :class:`~coordinator.p2p.async_p2p_cuda.EventWork`).
        timeout: The group's timeout, the default of :meth:`wait`.
    """

    __slots__ = ("_work", "_timeout", "_next_check")

    def __init__(self, work: Any, timeout: float) -> None:
        self._work = work
        self._timeout = timeout
        self._next_check = time.monotonic() + LIVENESS_S

    @property
    def op(self) -> str:
        """The call: ``"isend"``, ``"irecv"``, ``"isend_tensor_dict"`` or ``"irecv_tensor_dict"``."""
        return self._work.op

    @property
    def peer(self) -> int:
        """The other group rank."""
        return self._work.peer

    @property
    def call(self) -> int:
        """The call's number in its group (errors name it)."""
        return self._work.call

    def is_completed(self) -> bool:
        """Whether the call finished, successfully or not (``wait()`` then returns at once).

        A call whose peer's process is gone counts as finished (with
        ``PeerDiedError``); that is checked at most every :data:`LIVENESS_S`.
        """
        w = self._work
        if w.done():
            return True
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + LIVENESS_S
            self._check_peer()
        return w.done()

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
        wait_s = check_timeout(timeout, default=self._timeout)
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
        return w.result

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


# ---------------------------------------------------------------------- the four calls
def isend(coord: GroupCoordinator, tensor: torch.Tensor, dst: int | None) -> P2PHandle:
    """Implementation of :meth:`GroupCoordinator.isend`."""
    dst, seq = _begin(coord, "isend", dst, "dst", +1)
    try:
        t = validation.check_tensor(tensor, "tensor", coord.device)
    except (TypeError, ValueError) as e:
        _tell_peer(coord, SEND, dst, "isend", seq, e)
        raise
    if coord.device.type == "cuda":
        return _cuda(coord).isend(t, dst, seq)
    return _submit(coord, SEND, dst, "isend", seq, link_tensors.send, coord, t, dst)


def irecv(coord: GroupCoordinator, tensor_or_spec: Any, src: int | None) -> P2PHandle:
    """Implementation of :meth:`GroupCoordinator.irecv`."""
    src, seq = _begin(coord, "irecv", src, "src", -1)
    try:
        buf, size, dtype = _recv_target(tensor_or_spec, coord.device)
    except (TypeError, ValueError) as e:
        _tell_peer(coord, RECV, src, "irecv", seq, e)
        raise
    if coord.device.type == "cuda":
        return _cuda(coord).irecv(buf, size, dtype, src, seq)
    return _submit(coord, RECV, src, "irecv", seq, _recv_into, coord, buf, size, dtype, src)


def isend_tensor_dict(coord: GroupCoordinator, tensor_dict: Mapping[Any, Any],
                      dst: int | None) -> P2PHandle:
    """Implementation of :meth:`GroupCoordinator.isend_tensor_dict`."""
    dst, seq = _begin(coord, "isend_tensor_dict", dst, "dst", +1, allow_alone=True)
    try:
        if not isinstance(tensor_dict, Mapping):
            raise TypeError(f"tensor_dict must be a dict, got {type(tensor_dict).__name__}")
        # Same checks as the blocking call (sparse tensors, devices), before anything is queued.
        tensor_dict_ops.flatten_tensor_dict(tensor_dict, device=coord.device)
    except (TypeError, ValueError) as e:
        if coord.world_size > 1 and coord.device.type == "cpu":  # the receiver is told, in order
            submit(coord, SEND, dst, "isend_tensor_dict", seq, tensor_dict_ops.reject_send,
                   coord, dst, e, quiet=True)
        raise
    if coord.world_size == 1:
        return _done(coord, "isend_tensor_dict", dst, seq, None)
    snapshot = dict(tensor_dict)  # later changes to the caller's dict do not travel
    if coord.device.type == "cuda":
        return _cuda(coord).isend_tensor_dict(snapshot, dst, seq)
    return _submit(coord, SEND, dst, "isend_tensor_dict", seq, tensor_dict_ops.send_tensor_dict,
                   coord, snapshot, dst, None, None)


def irecv_tensor_dict(coord: GroupCoordinator, src: int | None) -> P2PHandle:
    """Implementation of :meth:`GroupCoordinator.irecv_tensor_dict`."""
    src, seq = _begin(coord, "irecv_tensor_dict", src, "src", -1, allow_alone=True)
    if coord.world_size == 1:
        return _done(coord, "irecv_tensor_dict", src, seq, None)
    if coord.device.type == "cuda":
        return _cuda(coord).irecv_tensor_dict(src, seq)
    return _submit(coord, RECV, src, "irecv_tensor_dict", seq, tensor_dict_ops.recv_tensor_dict,
                   coord, src, None)


# ---------------------------------------------------------------------- blocking calls, closing
def ordered(coord: GroupCoordinator, direction: str, peer: Any, op: str,
            fn: Callable[..., Any], *args: Any) -> Any:
    """Run blocking call ``fn(*args)`` after this direction's outstanding asynchronous calls.

    Runs on the caller's thread; costs one dictionary lookup when no
    asynchronous call was ever made in that direction.

    Raises:
        CommTimeout: The earlier calls did not finish within the group's timeout.
    """
    chs: Channels | None = getattr(coord, "_p2p_channels", None)
    ch = chs.find(direction, peer) if chs is not None else None
    if ch is None:
        return fn(*args)
    def check() -> None:
        dead = coord._errors.dead_partner(op, coord.calls, peer)
        if dead is not None:
            raise dead

    with ch.turn(coord.timeout, lambda: f"{op} with rank {peer}", check):
        return fn(*args)


def close(coord: GroupCoordinator) -> None:
    """End every asynchronous call of ``coord`` and join its threads (see the module docstring)."""
    chs: Channels | None = getattr(coord, "_p2p_channels", None)
    cuda = getattr(coord, "_p2p_cuda", None)
    coord._p2p_channels = coord._p2p_cuda = None
    if cuda is not None:
        cuda.close(CLOSE_GRACE_S)
    if chs is not None:
        chs.close(CLOSE_GRACE_S)


def submit(coord: GroupCoordinator, direction: str, peer: int, op: str, seq: int,
           fn: Callable[..., Any], *args: Any, quiet: bool = False) -> Work:
    """Queue ``fn(*args)`` as call ``seq`` on the channel of ``direction`` with ``peer``."""
    work = Work(op, peer, seq, fn, args, coord._errors, quiet=quiet)
    _channels(coord).get(direction, peer).submit(work)
    return work


# ---------------------------------------------------------------------- helpers
def _begin(coord: GroupCoordinator, op: str, peer: Any, arg: str, step: int,
           allow_alone: bool = False) -> tuple[int, int]:
    """Check the group and the peer (default: next / previous rank); number the call."""
    coord._check_live(op)
    coord.calls = seq = coord.calls + 1
    if peer is None:
        peer = (coord.rank_in_group + step) % coord.world_size
    if allow_alone and coord.world_size == 1:
        validation.check_rank(peer, 1, arg)
    else:
        coord._check_peer(peer, arg)
    return peer, seq


def _submit(coord: GroupCoordinator, direction: str, peer: int, op: str, seq: int,
            fn: Callable[..., Any], *args: Any) -> P2PHandle:
    return P2PHandle(submit(coord, direction, peer, op, seq, fn, *args), coord.timeout)


def _done(coord: GroupCoordinator, op: str, peer: int, seq: int, result: Any) -> P2PHandle:
    """A handle of a call that needs no communication (a group of one)."""
    work = Work(op, peer, seq, lambda: result, (), coord._errors)
    work.run()
    return P2PHandle(work, coord.timeout)


def _tell_peer(coord: GroupCoordinator, direction: str, peer: int, op: str, seq: int,
               e: BaseException) -> None:
    """In this direction's order, take part in the call as a rank that rejected its
    arguments, so the peer raises ``PeerRejectedError`` instead of waiting
    (:func:`coordinator.p2p.link_tensors.reject`: on the direction's link, or through
    the communicator)."""
    if coord.device.type != "cpu":
        if getattr(coord.comm, "_reject", None) is not None:
            submit(coord, direction, peer, op, seq, coord.comm._reject,
                   "send" if direction == SEND else "recv", e, peer, quiet=True)
        return
    submit(coord, direction, peer, op, seq, link_tensors.reject, coord, direction, peer, e,
           quiet=True)


def _recv_target(x: Any, device: torch.device) -> tuple[torch.Tensor | None, torch.Size,
                                                        torch.dtype]:
    """``(buffer or None, shape, dtype)`` of an irecv's ``tensor_or_spec``."""
    if isinstance(x, torch.Tensor):
        t = validation.check_writable(validation.check_tensor(x, "tensor_or_spec", device),
                                      "tensor_or_spec")
        return t, t.shape, t.dtype
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        raise TypeError(f"tensor_or_spec must be a torch.Tensor to fill or a (shape, dtype) "
                        f"pair, got {type(x).__name__} ({x!r:.80})")
    shape, dtype = x
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"tensor_or_spec[1] (the dtype) must be a torch.dtype, got "
                        f"{type(dtype).__name__} ({dtype!r:.60})")
    if not isinstance(shape, (torch.Size, tuple, list)) or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in shape):
        raise TypeError(f"tensor_or_spec[0] (the shape) must be a sequence of ints, got "
                        f"{shape!r:.80}")
    if any(s < 0 for s in shape):
        raise ValueError(f"tensor_or_spec[0] (the shape) must not have negative entries, got "
                         f"{tuple(shape)}")
    validation.check_fits(shape, dtype, device, "tensor_or_spec")
    return None, torch.Size(shape), dtype


def _recv_into(coord: GroupCoordinator, buf: torch.Tensor | None, size: torch.Size,
               dtype: torch.dtype, src: int) -> torch.Tensor:
    out = link_tensors.recv(coord, size, dtype, src)
    if buf is None:
        return out
    with torch.no_grad():  # a buffer that requires grad is filled as torch.distributed.recv would
        buf.copy_(out)
    return buf


def _channels(coord: GroupCoordinator) -> Channels:
    chs: Channels | None = getattr(coord, "_p2p_channels", None)
    if chs is None:
        group, me, n = coord.cpu_group, coord.rank_in_group, coord.world_size
        chs = coord._p2p_channels = Channels(
            coord.unique_name, lambda: _break_connections(group, (me + 1) % n))
    return chs


def _break_connections(group: Any, peer: int) -> None:
    """Close every gloo connection of ``group``: a wait that expires makes gloo close
    the group's pairs, which ends every pending operation of the group at once."""
    buf = torch.empty(1, dtype=torch.uint8)
    try:
        group.recv([buf], peer, _BREAK_TAG).wait(datetime.timedelta(milliseconds=1))
    except RuntimeError:
        pass


def _cuda(coord: GroupCoordinator) -> Any:
    cuda = getattr(coord, "_p2p_cuda", None)
    if cuda is None:
        from coordinator.p2p.async_p2p_cuda import CudaP2P

        cuda = coord._p2p_cuda = CudaP2P(coord)
    return cuda

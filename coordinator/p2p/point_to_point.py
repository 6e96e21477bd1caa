"""A group's point-to-point calls, blocking and asynchronous, and the order they keep.

:class:`PointToPoint` runs ``send``/``recv`` (tensors), ``send_object`` /
``recv_object`` and ``isend``/``irecv``, and gives every point-to-point call
of the group (tensor dicts too: :mod:`coordinator.group.tensor_dict_calls`) its
place in the order below. It owns what they keep between calls: the group's
shared-memory links (:mod:`coordinator.p2p.shm_links`), the worker threads of
the asynchronous calls (:mod:`coordinator.p2p.channels`) and a CUDA group's
side stream (:mod:`coordinator.p2p.cuda_p2p`).

Asynchronous calls return a :class:`~coordinator.p2p.handle.P2PHandle` at once.

Design (CPU groups, gloo). One worker thread per peer and direction of the
group, started at the first asynchronous call in that direction, runs the
group's *blocking* calls (the link or ``comm.send``/``comm.recv``, a tensor
dict's ``send``/``recv``) in issue order, and the handle waits for it. Why
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
(:mod:`device_comms.signatures.p2p_envelopes`), so the two directions never
mix. Cost: one thread hand-off per call and at most ``2 * (world_size - 1)``
threads per group.

Ordering rule. Calls of one direction with one peer run in the order they
were issued, asynchronous or blocking alike: a blocking send
(``send``, ``send_object``, ``send_tensor_dict``) to rank ``p`` first waits
until every earlier ``isend``/``isend_tensor_dict`` to ``p`` finished (at most
the group's timeout), then runs on the caller's thread before any later one;
receives from ``p`` likewise (:meth:`PointToPoint.ordered`). The peer must
receive them in the same order with calls of the same kind (a tensor by
``recv``/``irecv``, a dict by ``recv_tensor_dict``/``irecv_tensor_dict``).
Calls in the other direction, with other peers, and collectives are not
ordered against outstanding handles, and may run meanwhile (collectives use
other gloo tags).

Buffers. ``isend`` does not copy: do not modify a tensor (or a dict's
tensors) until its handle completed. ``irecv`` into a tensor fills it in
place (the receive lands in a new tensor that is then copied in) and returns
it; ``irecv((shape, dtype))`` returns a new tensor.

Closing (:meth:`PointToPoint.close`, at ``GroupCoordinator.destroy()``):
calls blocked on a link end with ``ClosedError``; queued asynchronous calls
fail with ``ClosedError``, running ones get :data:`CLOSE_GRACE_S` to finish,
then the group's gloo connections are closed so that those waiting for a peer
end at once (with ``ClosedError``; gloo cannot cancel one wait, but a wait
that times out closes every connection of its group); the threads are joined
and the links closed.

CUDA groups go through :mod:`coordinator.p2p.cuda_p2p` (NCCL on a side
stream, imported at the first CUDA call).

Recording (:mod:`coordinator.trace`). Every call enters the group's flight
recorder when it is numbered. A blocking call completes or fails its entry
on the caller's thread, as the collectives do. An asynchronous call on a CPU
group completes its entry on the channel's thread when the call ran, whoever
waits; a failure is recorded there by the class of the error the call
raised, a gloo error by the class it translates to (a timeout, a closed
connection), before the handle's explanation (which, checking the peers'
processes, may name it otherwise: a closed connection from a peer that is
alive is a ``ClosedError``). A CUDA group's ``isend``/``irecv`` entries carry
CUDA-event marks around the transfer on the side stream
(:class:`~coordinator.trace.cuda_marks.CudaMarks`, read when a dump is
written), so a dump shows them started and completed as the device does;
``isend_tensor_dict``/``irecv_tensor_dict`` entries of a CUDA group stay
``started``. A receive records the shape and dtype it receives (a blocking
``recv`` at its start, an ``irecv`` once its target is checked), so that a
receive still waiting compares with its send.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from time import monotonic
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from coordinator.calls.call_book import CallBook, destroyed_msg
from coordinator.calls.gloo_break import break_connections
from coordinator.calls.group_view import GroupView
from coordinator.calls.peers import check_peer, peer_rank
from coordinator.errors import NotInitializedError
from coordinator.p2p import link_tensors
from coordinator.p2p.channels import RECV, SEND, Channels, Work
from coordinator.p2p.handle import P2PHandle
from coordinator.p2p.shm_links import ShmLinks
from coordinator.trace.recorder import IN_DTYPES, IN_SIZES
from coordinator.wire.object_comm import ObjectChannel
from device_comms import validation
from device_comms.errors import translate_backend_error
from shm_broadcast.checks import as_int

if TYPE_CHECKING:
    from coordinator.p2p.cuda_p2p import CudaP2P

__all__ = ["PointToPoint", "CLOSE_GRACE_S"]

#: Seconds ``destroy()`` lets running point-to-point calls finish before ending them.
CLOSE_GRACE_S = 1.0
_R = TypeVar("_R")  # what a blocking call run in its turn returns


class PointToPoint:
    """The point-to-point calls of one group (see the module docstring).

    Args:
        group: The group.
        book: The group's call bookkeeping (numbers, closed state, explanations).
        objects: The group's object calls (objects, link offers, a CUDA dict's metadata).

    Attributes:
        links: The group's shared-memory links.
    """

    def __init__(self, group: GroupView, book: CallBook, objects: ObjectChannel) -> None:
        self._group = group
        self._book = book
        self._objects = objects
        self.links = ShmLinks(group, objects, book)
        self._channels: Channels | None = None  # the asynchronous calls' threads, at first use
        self._cuda: CudaP2P | None = None  # a CUDA group's side stream, at first use
        # Two threads' first calls must build one Channels (one CudaP2P), and none
        # may be built once close() took them.
        self._first_use = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ blocking calls
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """``GroupCoordinator.send``: ``tensor`` to group rank ``dst``, in its turn."""
        dst = _peer(dst)
        book = self._book
        book.p2p_calls = n = book.p2p_calls + 1
        seq = n + book.collectives
        partner = peer_rank(dst)
        entry = book.record("send", tensor, -1 if partner is None else partner)
        started = monotonic()
        try:
            self.ordered(SEND, dst, "send", link_tensors.send, self._group, self.links,
                         tensor, dst)
        except BaseException as e:
            book.failed("send", seq, e, entry, partner=partner, started=started)
            raise
        book.completed(entry)

    def recv(self, size: torch.Size | Sequence[int], dtype: torch.dtype,
             src: int) -> torch.Tensor:
        """``GroupCoordinator.recv``: a tensor from group rank ``src``, in its turn."""
        src = _peer(src)
        book = self._book
        book.p2p_calls = n = book.p2p_calls + 1
        seq = n + book.collectives
        partner = peer_rank(src)
        entry = book.record("recv", None, -1 if partner is None else partner,
                            shapes=_spec_shapes(size, dtype))
        started = monotonic()
        try:
            got = self.ordered(RECV, src, "recv", link_tensors.recv, self._group,
                               self.links, size, dtype, src)
        except BaseException as e:
            book.failed("recv", seq, e, entry, partner=partner, started=started)
            raise
        book.completed(entry, got)
        return got

    def send_object(self, obj: Any, dst: int) -> None:
        """``GroupCoordinator.send_object``: ``obj`` to group rank ``dst``, in its turn."""
        dst = _peer(dst)
        self._book.run("send_object", self.ordered, SEND, dst, "send_object",
                       self._objects.send, obj, dst, partner=peer_rank(dst), p2p=True)

    def recv_object(self, src: int) -> Any:
        """``GroupCoordinator.recv_object``: an object from group rank ``src``, in its turn."""
        src = _peer(src)
        return self._book.run("recv_object", self.ordered, RECV, src, "recv_object",
                              self._objects.recv, src, partner=peer_rank(src), p2p=True)

    def ordered(self, direction: str, peer: Any, op: str, fn: Callable[..., _R],
                *args: Any) -> _R:
        """Run blocking call ``fn(*args)`` after this direction's outstanding calls.

        Runs on the caller's thread, holding the direction's turn: asynchronous
        calls issued meanwhile (by any thread) wait for it, a blocking call of
        another thread too, and ``destroy()`` can tell that it runs (it breaks
        the group's connections to end a wait in gloo).

        Raises:
            CommTimeout: The earlier calls did not finish within the group's timeout.
            ClosedError: The group was destroyed.
        """
        book, chs = self._book, self._channels
        if chs is None:
            chs = self._channels_at_first_use(op)
        ch = chs.get(direction, peer)

        def check() -> None:
            dead = book.dead_partner(op, peer)
            if dead is not None:
                raise dead

        with ch.turn(self._group.timeout, lambda: f"{op} with rank {peer}", check):
            return fn(*args)

    # ------------------------------------------------------------------ asynchronous calls
    def isend(self, tensor: torch.Tensor, dst: int | None) -> P2PHandle:
        """``GroupCoordinator.isend``: start sending ``tensor`` to ``dst`` (default: next rank)."""
        g = self._group
        dst, seq, entry = self.begin("isend", dst, "dst", +1, data=tensor)
        try:
            t = validation.check_tensor(tensor, "tensor", g.device)
        except (TypeError, ValueError) as e:
            self._tell_peer(SEND, dst, "isend", seq, e)
            self._book.note_failure("isend", seq, e, entry)
            raise
        if g.device.type == "cuda":
            return self.cuda().isend(t, dst, seq, entry)
        return self.handle(self.submit(SEND, dst, "isend", seq, link_tensors.send, g,
                                       self.links, t, dst, entry=entry))

    def irecv(self, tensor_or_spec: Any, src: int | None) -> P2PHandle:
        """``GroupCoordinator.irecv``: start receiving from ``src`` (default: previous rank)."""
        g = self._group
        src, seq, entry = self.begin("irecv", src, "src", -1)
        try:
            buf, size, dtype = _recv_target(tensor_or_spec, g.device)
        except (TypeError, ValueError) as e:
            self._tell_peer(RECV, src, "irecv", seq, e)
            self._book.note_failure("irecv", seq, e, entry)
            raise
        if entry is not None:  # what it receives, known now (a send's sizes, as the peer's)
            entry[IN_SIZES], entry[IN_DTYPES] = size, dtype
        if g.device.type == "cuda":
            return self.cuda().irecv(buf, size, dtype, src, seq, entry)
        return self.handle(self.submit(RECV, src, "irecv", seq, self._recv_into, buf, size,
                                       dtype, src, entry=entry))

    def begin(self, op: str, peer: Any, arg: str, step: int, allow_alone: bool = False,
              data: Any = None) -> tuple[int, int, list[Any] | None]:
        """Start asynchronous call ``op``: check the group and the peer (None: the
        next rank for ``step`` +1, the previous for -1); number and record the
        call (``data``: the input whose shapes the entry keeps).

        Returns:
            ``(peer, call number, the recorder's entry or None)``.
        """
        g, book = self._group, self._book
        book.check_live(op)
        seq = book.number_p2p()
        if peer is None:
            peer = (g.rank_in_group + step) % g.world_size
        partner = peer_rank(peer)
        entry = book.record(op, data, -1 if partner is None else partner)
        try:
            if allow_alone and g.world_size == 1:
                peer = validation.check_rank(peer, 1, arg)
            else:
                peer = check_peer(peer, arg, g.world_size, g.rank_in_group)
        except BaseException as e:
            book.note_failure(op, seq, e, entry)
            raise
        return peer, seq, entry

    def submit(self, direction: str, peer: int, op: str, seq: int, fn: Callable[..., Any],
               *args: Any, quiet: bool = False, entry: list[Any] | None = None) -> Work:
        """Queue ``fn(*args)`` as call ``seq`` on the channel of ``direction`` with ``peer``
        (``quiet``: nobody waits for it, its failure is not reported; ``entry``:
        the call's recorder entry, completed or failed when it ran)."""
        if entry is not None:
            fn = _recording(self._book, op, seq, entry, fn)
        work = Work(op, peer, seq, fn, args, self._book.errors, quiet=quiet,
                    self_ending=functools.partial(self.links.on_link, direction, peer))
        self._channels_at_first_use(op).get(direction, peer).submit(work)
        return work

    def handle(self, work: Work, finish: Callable[[Any], Any] | None = None) -> P2PHandle:
        """The handle of a submitted call (``finish``: see :class:`P2PHandle`)."""
        return P2PHandle(work, self._group.timeout, finish)

    def done(self, op: str, peer: int, seq: int, result: Any,
             entry: list[Any] | None = None) -> P2PHandle:
        """A handle of a call that needs no communication (a group of one)."""
        self._book.completed(entry)
        work = Work(op, peer, seq, lambda: result, (), self._book.errors)
        work.run()
        return P2PHandle(work, self._group.timeout)

    def cuda(self) -> CudaP2P:
        """The asynchronous calls of a CUDA group (created, and imported, at first use).

        Raises:
            NotInitializedError: The group was closed.
        """
        cuda = self._cuda
        if cuda is not None:
            return cuda
        with self._first_use:
            if self._cuda is None:
                self._refuse_after_close("isend")
                from coordinator.p2p.cuda_p2p import CudaP2P

                self._cuda = CudaP2P(self._group, self._book.errors, self._objects, self)
            return self._cuda

    def _tell_peer(self, direction: str, peer: int, op: str, seq: int,
                   e: BaseException) -> None:
        """In this direction's order, take part in the call as a rank that rejected its
        arguments, so the peer raises ``PeerRejectedError`` instead of waiting
        (:func:`coordinator.p2p.link_tensors.reject`: on the direction's link, or
        through the communicator)."""
        g = self._group
        if g.device.type != "cpu":
            submit_kind = "send" if direction == SEND else "recv"
            self.submit(direction, peer, op, seq, link_tensors.reject_through_comm, g.comm,
                        submit_kind, e, peer, quiet=True)
            return
        self.submit(direction, peer, op, seq, link_tensors.reject, g, self.links, direction,
                    peer, e, quiet=True)

    def _recv_into(self, buf: torch.Tensor | None, size: torch.Size, dtype: torch.dtype,
                   src: int) -> torch.Tensor:
        out = link_tensors.recv(self._group, self.links, size, dtype, src)
        if buf is None:
            return out
        with torch.no_grad():  # a buffer that requires grad is filled as torch.distributed.recv
            buf.copy_(out)
        return buf

    def _channels_at_first_use(self, op: str) -> Channels:
        """The group's channels, built by the first call (``op``) of any thread.

        Raises:
            NotInitializedError: The group was closed.
        """
        chs = self._channels
        if chs is not None:
            return chs
        with self._first_use:
            if self._channels is None:
                self._refuse_after_close(op)
                g = self._group
                group, peer = g.cpu_group, (g.rank_in_group + 1) % g.world_size
                self._channels = Channels(g.unique_name,
                                          lambda: break_connections(group, peer))
            return self._channels

    def _refuse_after_close(self, op: str) -> None:
        """Raise as a call ``op`` on a closed group does (holding ``_first_use``)."""
        self._book.check_live(op)
        if self._closed:  # closing, before the group counts as destroyed
            raise NotInitializedError(destroyed_msg(self._group.unique_name, op))

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """End every point-to-point call of the group (see the module docstring)."""
        self.links.shutdown()  # calls blocked on a link end with ClosedError
        with self._first_use:
            self._closed = True
            chs, cuda = self._channels, self._cuda
            self._channels = self._cuda = None
        if cuda is not None:
            cuda.close(CLOSE_GRACE_S)
        if chs is not None:
            chs.close(CLOSE_GRACE_S)  # outstanding handles end (ClosedError), threads joined
        self.links.close()


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


def _spec_shapes(size: Any, dtype: Any) -> tuple[torch.Size | None, torch.dtype | None]:
    """``(shape, dtype)`` a receive of ``size`` and ``dtype`` records, as a send of
    that tensor does; ``(None, None)`` where they are not a shape and a dtype
    (the receive's own checks then say what is wrong)."""
    try:
        shape = torch.Size(size)
    except (TypeError, ValueError, RuntimeError):
        return None, None
    if not isinstance(dtype, torch.dtype):
        return None, None
    return shape, dtype


def _recording(book: CallBook, op: str, seq: int, entry: list[Any],
               fn: Callable[..., _R]) -> Callable[..., _R]:
    """``fn`` that completes the recorder's ``entry`` when it returns, or marks it
    failed (and dumps, see :mod:`coordinator.trace.auto_dump`) with what it
    raised, on the channel's thread, when the call finishes, whoever waits."""

    def run(*args: Any) -> _R:
        try:
            result = fn(*args)
        except BaseException as e:  # named by its class (the handle explains it further)
            book.note_failure(op, seq, translate_backend_error(
                e, f"group {book.name!r}, op {op}, call #{seq}"), entry)
            raise
        book.completed(entry, result)
        return result

    return run


def _peer(peer: Any) -> Any:
    """``peer`` as a Python ``int`` when it is an integer of another type (a NumPy
    rank): the link path and the channels take ``int`` peers, and a NumPy peer
    went over gloo while its partner's call used the link. Anything else comes
    back as it is, for the call's own check to refuse by name."""
    got = as_int(peer)
    return peer if got is None else got

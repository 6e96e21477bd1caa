"""Python objects over a CPU (gloo) group, without pickle, and source-failure markers.

An object is encoded with the message queue's codec (:mod:`shm_broadcast.codec.message_codec`:
msgspec msgpack for the structure, tensors and arrays out of band as raw
bytes). What travels is

1. a header, one int64 tensor ``[msg_len, blob_len, kind]``;
2. when non-empty, the payload: the msgpack bytes followed by the arrays' raw
   bytes, as uint8 tensors of at most :data:`PIECE_BYTES` each.

``kind`` says which call sent the object (:data:`OBJECT`: ``send_object``;
:data:`LINK_OFFER`: the first ``send``/``send_tensor_dict`` of a direction,
:mod:`coordinator.p2p.shm_links`; :data:`DICT_META`: a tensor dict's metadata on
the CPU group). A receiver waiting for another kind takes the object (the
stream stays in order) and raises ``CollectiveMismatch`` naming both calls,
so ``send`` paired with ``recv_object`` never hands the offer to the caller.

Point to point, both go as plain gloo sends. Broadcasts go through a
:data:`Broadcast` function: a group's own (CPU) communicator
(:func:`comm_broadcast`), whose calls are signed, so a rank that skipped the
broadcast or made another call there raises ``CollectiveMismatch`` on every
rank instead of pairing its bytes with another call; or plain gloo
broadcasts over a group the caller named (:func:`gloo_broadcast`).

The receiver checks the header (non-negative sizes, at most
:data:`MAX_OBJECT_BYTES` and at most this host's memory and swap) before it
allocates, and allocates a piece only when the piece before it arrived: its
memory grows with the bytes a peer sent, never with what the peer claimed. It
decodes with the same checks every queue reader makes (in time linear in the
bytes: see :mod:`shm_broadcast.codec.hash_flooding`): malformed bytes raise
:class:`~shm_broadcast.errors.DecodeError` naming the sender (``object from
rank N: ...``, ``peers=(N,)``), and nothing received is ever unpickled unless
the group opted in with ``allow_pickle=True``.

A sender that cannot encode its object (a type msgspec cannot carry, say)
must not leave the receivers waiting for bytes that never come. Point to
point, it sends the header ``[len(text), -1, kind]`` and its error text as UTF-8;
in broadcasts the caller sends a :class:`SourceFailure` (its own msgpack ext,
no pickle) in place of the data. The sender raises ``TypeError`` itself, and
every receiver raises :class:`~shm_broadcast.errors.CollectiveMismatch`
naming the sender.

A caller may still plug its own :class:`ObjectCodec` (``dumps``/``loads``)
into ``GroupCoordinator.codec``; its bytes then travel as the msgpack part.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import pickle
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from coordinator.errors import CollectiveMismatch, DecodeError
from shm_broadcast.codec.message_codec import Codec, SourceFailure

if TYPE_CHECKING:
    from device_comms.base import DeviceCommunicator

__all__ = [
    "ObjectChannel",
    "ObjectCodec",
    "PickleCodec",
    "SourceFailure",
    "SERIALIZE_ERRORS",
    "MAX_OBJECT_BYTES",
    "PIECE_BYTES",
    "OBJECT",
    "LINK_OFFER",
    "DICT_META",
    "send_object",
    "send_failure",
    "recv_object",
    "broadcast_object",
    "comm_broadcast",
    "gloo_broadcast",
]

#: Largest object (msgpack plus raw array bytes) a receiver accepts: 1 TiB.
#: The header of a larger claim is refused before anything is allocated.
MAX_OBJECT_BYTES = 1 << 40
#: Largest tensor a payload travels in: a receiver allocates a piece only
#: once the one before it arrived.
PIECE_BYTES = 64 << 20
_MAX_FAILURE_TEXT = 4096

#: Which call sent an object (the header's third word): point to point
#: ``send_object``, a link offer, a tensor dict's metadata; broadcast, the same
#: words for ``broadcast_object`` and ``broadcast_tensor_dict`` and
#: :data:`OBJECT_LIST` for ``broadcast_object_list``.
OBJECT, LINK_OFFER, DICT_META, OBJECT_LIST = 0, 1, 2, 3
_SENT_BY = {OBJECT: "send_object", LINK_OFFER: "send or send_tensor_dict",
            DICT_META: "send_tensor_dict", OBJECT_LIST: "broadcast_object_list"}
_WAITED_BY = {OBJECT: "recv_object", LINK_OFFER: "recv or recv_tensor_dict",
              DICT_META: "recv_tensor_dict"}
#: The kind each broadcasting call sends and expects.
BROADCAST_KINDS = {"broadcast_object": OBJECT, "broadcast_tensor_dict": DICT_META,
                   "broadcast_object_list": OBJECT_LIST}
_BROADCAST_BY = {kind: op for op, kind in BROADCAST_KINDS.items()}

# What serialisers raise for a value they cannot encode (before any byte moves):
# the codec raises TypeError (a type it cannot carry without the pickle
# opt-in, a CUDA or sparse tensor); with the opt-in, pickle raises
# PicklingError, AttributeError ("Can't pickle local object") or TypeError.
SERIALIZE_ERRORS: tuple[type[BaseException], ...] = (
    pickle.PicklingError,
    AttributeError,
    TypeError,
    RecursionError,
)


class ObjectChannel(Protocol):
    """Who carries single objects between two ranks of a group, uncounted (the
    group's object calls): what links and tensor dicts send their offers and
    metadata through. ``kind`` is one of :data:`OBJECT`, :data:`LINK_OFFER`,
    :data:`DICT_META`."""

    def send(self, obj: Any, dst: int, kind: int = OBJECT) -> None: ...

    def recv(self, src: int, kind: int = OBJECT) -> Any: ...


class ObjectCodec(Protocol):
    """Turns objects into bytes and back (kept for callers that bring their own)."""

    def dumps(self, obj: Any) -> bytes: ...

    def loads(self, data: bytes | memoryview) -> Any: ...


class PickleCodec:
    """Pickle with the highest protocol.

    Unsafe on received bytes: ``loads`` runs whatever code the sender chose.
    Nothing in this project uses it; it is kept for callers that exchange
    objects among processes they trust as much as their own.
    """

    def dumps(self, obj: Any) -> bytes:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)

    def loads(self, data: bytes | memoryview) -> Any:
        return pickle.loads(data)


def _pack(obj: Any, codec: Codec | ObjectCodec) -> tuple[tuple[int, int], torch.Tensor]:
    """``((msg_len, blob_len), payload)`` for ``obj``; raises the codec's TypeError first.

    A :class:`Codec` puts msgpack then array bytes in the payload; a
    caller-supplied :class:`ObjectCodec` puts its ``dumps`` bytes (``blob_len`` 0).
    """
    if not isinstance(codec, Codec):
        data = codec.dumps(obj)
        payload = torch.empty(len(data), dtype=torch.uint8, device="cpu")
        if len(data):
            ctypes.memmove(payload.data_ptr(), bytes(data), len(data))
        return (len(data), 0), payload
    enc = codec.encode(obj)
    mlen = len(enc.msg)
    payload = torch.empty(mlen + enc.blob_len, dtype=torch.uint8, device="cpu")
    if payload.numel():
        addr = payload.data_ptr()
        ctypes.memmove(addr, enc.msg, mlen)
        enc.write_blob(addr + mlen)
    return (mlen, enc.blob_len), payload


def _failure_message(e: BaseException | str) -> tuple[tuple[int, int], torch.Tensor]:
    """``((len(text), -1), payload)`` of a failure: then the UTF-8 text."""
    reason = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    text = reason.encode("utf-8", "replace")[:_MAX_FAILURE_TEXT]
    payload = torch.frombuffer(bytearray(text), dtype=torch.uint8) if text else torch.empty(
        0, dtype=torch.uint8)
    return (len(text), -1), payload


@functools.cache
def host_memory() -> int:
    """Bytes of this host's memory and swap: nothing received can be larger."""
    import psutil

    total: int = psutil.virtual_memory().total + psutil.swap_memory().total
    return total


def _checked_header(header: torch.Tensor, peer: int) -> tuple[int, int]:
    """``(msg_len, blob_len)`` of a received header; ``blob_len`` is -1 for a failure text.

    Raises:
        DecodeError: A size is negative (other than a failure's -1), a failure
            text is longer than senders write, the kind is unknown, or the
            total exceeds :data:`MAX_OBJECT_BYTES` or this host's memory.
    """
    mlen, blen, kind = (int(x) for x in header.tolist())
    limit = _MAX_FAILURE_TEXT if blen == -1 else min(MAX_OBJECT_BYTES, host_memory())
    if mlen < 0 or blen < -1 or kind not in _SENT_BY or mlen + max(blen, 0) > limit:
        raise DecodeError(
            f"corrupt object header from rank {peer}: msgpack {mlen} bytes, arrays "
            f"{blen} bytes, kind {kind} (sizes must be >= 0, together at most {limit} "
            f"bytes; kinds {sorted(_SENT_BY)})", peers=(peer,))
    return mlen, blen


def _send_payload(payload: torch.Tensor, move: Callable[[torch.Tensor], Any]) -> None:
    """Hand ``payload`` to ``move`` in pieces of at most :data:`PIECE_BYTES`."""
    for start in range(0, payload.numel(), PIECE_BYTES):
        move(payload[start:start + PIECE_BYTES])


def _receive_payload(nbytes: int, move: Callable[[torch.Tensor], Any]) -> torch.Tensor:
    """The ``nbytes`` payload, received by ``move`` (which fills or returns each
    piece) in the pieces :func:`_send_payload` cuts; a piece is allocated only
    after the one before it arrived. The whole buffer is allocated once every
    piece is here, and each piece is freed as it is copied in, so the pages in
    use peak at the payload plus one piece."""
    pieces: collections.deque[torch.Tensor] = collections.deque()
    for start in range(0, nbytes, PIECE_BYTES):
        piece = torch.empty(min(PIECE_BYTES, nbytes - start), dtype=torch.uint8, device="cpu")
        got = move(piece)
        pieces.append(got if isinstance(got, torch.Tensor) else piece)
    if len(pieces) == 1:
        return pieces[0]
    whole = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
    start = 0
    while pieces:
        # Taking the next piece drops the last one: its pages go back before the
        # next piece's part of ``whole`` is touched.
        piece = pieces.popleft()
        whole[start:start + piece.numel()].copy_(piece)
        start += piece.numel()
    return whole


def _unpack(mlen: int, blen: int, payload: torch.Tensor, codec: Codec | ObjectCodec,
            peer: int) -> Any:
    """The object in ``payload``; a malformed one raises :class:`DecodeError` naming ``peer``."""
    arr = payload.numpy()
    if not isinstance(codec, Codec):
        return codec.loads(arr.tobytes())
    try:
        return codec.decode(arr.data[:mlen], arr, mlen, blen)
    except DecodeError as e:
        raise DecodeError(f"object from rank {peer}: {e}", peers=(peer,)) from None


def _raise_if_failure(got: Any, what: str, peer: int) -> Any:
    if isinstance(got, SourceFailure):
        raise CollectiveMismatch(
            f"{what}: the sender (rank {peer}) could not send its object "
            f"({got.message}); fix the call on that rank", peers=(peer,))
    return got


def send_object(obj: Any, dst_global: int, group: dist.ProcessGroup,
                codec: Codec | ObjectCodec, kind: int = OBJECT) -> None:
    """Send ``obj`` to global rank ``dst_global`` over ``group`` (no pickle by default).

    ``kind``: the call sending it (see the module docstring).

    Raises:
        TypeError: ``obj`` cannot be encoded (the message names the type and the
            pickle opt-in); the receiver is told and raises ``CollectiveMismatch``.
    """
    try:
        sizes, payload = _pack(obj, codec)
    except SERIALIZE_ERRORS as e:
        _send(*_failure_message(e), kind, dst_global, group)
        raise TypeError(
            f"obj of type {type(obj).__name__} cannot be serialised for sending "
            f"({type(e).__name__}: {e})"
        ) from e
    _send(sizes, payload, kind, dst_global, group)


def send_failure(reason: str, dst_global: int, group: dist.ProcessGroup, kind: int) -> None:
    """Send ``reason`` where global rank ``dst_global`` waits for an object of
    ``kind``: its ``recv_object`` raises ``CollectiveMismatch`` quoting it."""
    _send(*_failure_message(reason), kind, dst_global, group)


def _send(sizes: tuple[int, int], payload: torch.Tensor, kind: int, dst: int,
          group: dist.ProcessGroup) -> None:
    dist.send(torch.tensor([*sizes, kind], dtype=torch.int64, device="cpu"), dst=dst, group=group)
    _send_payload(payload, lambda piece: dist.send(piece, dst=dst, group=group))


def recv_object(src_global: int, group: dist.ProcessGroup, codec: Codec | ObjectCodec,
                kind: int = OBJECT, src_rank: int | None = None) -> Any:
    """Receive an object sent by :func:`send_object` from global rank ``src_global``.

    ``kind``: the kind of object this call waits for (see the module docstring);
    ``src_rank``: the sender's rank as errors name it (its group rank; default
    ``src_global``).

    Raises:
        CollectiveMismatch: The sender could not serialise its object, or sent
            another kind (what it sent was taken).
        DecodeError: The bytes received are malformed, or hold a pickled value
            while ``codec`` has ``allow_pickle`` off.
    """
    header = torch.empty(3, dtype=torch.int64, device="cpu")
    who = src_global if src_rank is None else src_rank
    dist.recv(header, src=src_global, group=group)
    mlen, blen = _checked_header(header, who)
    payload = _receive_payload(mlen + max(blen, 0),
                               lambda piece: dist.recv(piece, src=src_global, group=group))
    sent = int(header[2])
    if sent != kind:
        raise CollectiveMismatch(
            f"{_WAITED_BY[kind]}: the sender (rank {who}) called "
            f"{_SENT_BY[sent]} where this rank called {_WAITED_BY[kind]}; make matching "
            f"calls on both ranks (what it sent was taken)", peers=(who,))
    if blen == -1:
        text = payload.numpy().tobytes().decode("utf-8", "replace")
        _raise_if_failure(SourceFailure(text), _WAITED_BY[kind], who)
    return _unpack(mlen, blen, payload, codec, who)


#: Broadcasts a tensor in place from the source (returns the filled tensor).
Broadcast = Callable[[torch.Tensor], torch.Tensor]


def gloo_broadcast(src_global: int, group: dist.ProcessGroup) -> Broadcast:
    """Plain ``torch.distributed`` broadcasts over ``group`` (unsigned)."""
    def bcast(t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=src_global, group=group)
        return t
    return bcast


def comm_broadcast(comm: DeviceCommunicator, src: int) -> Broadcast:
    """Broadcasts through a device communicator serving CPU tensors: signed calls,
    so a rank that called something else makes every rank raise
    ``CollectiveMismatch`` instead of pairing bytes with another call."""
    def bcast(t: torch.Tensor) -> torch.Tensor:
        return comm.broadcast(t, src)
    return bcast


def broadcast_object(obj: Any, src: int, bcast: Broadcast,
                     codec: Codec | ObjectCodec, is_src: bool,
                     op: str = "broadcast_object") -> Any:
    """Broadcast ``obj`` from the source ``bcast`` names; returns it on every rank.

    ``bcast`` moves the header, then the payload (:func:`comm_broadcast` or
    :func:`gloo_broadcast`); ``src`` is the source's rank as errors name it;
    ``op`` the calling collective (a key of :data:`BROADCAST_KINDS`), which the
    header carries and receivers compare with their own.

    No failure handling: on the source, an object that cannot be encoded raises
    ``TypeError`` before anything is sent, and the caller then broadcasts a
    :class:`SourceFailure` in its place. Receivers return what arrived
    (possibly that marker).

    Raises:
        TypeError: On the source, ``obj`` cannot be encoded.
        DecodeError: On a receiver, the bytes received are malformed.
        CollectiveMismatch: On a receiver, the source made another broadcasting
            call (its bytes were taken, so the group stays in step).
    """
    if is_src:
        sizes, payload = _pack(obj, codec)
        bcast(torch.tensor([*sizes, BROADCAST_KINDS[op]], dtype=torch.int64, device="cpu"))
        _send_payload(payload, bcast)
        return obj
    header = bcast(torch.empty(3, dtype=torch.int64, device="cpu"))
    mlen, blen = _checked_header(header, src)
    payload = _receive_payload(mlen + max(blen, 0), bcast)
    if blen == -1:  # senders of broadcasts send SourceFailure objects, never this form
        raise DecodeError(f"corrupt object header from rank {src}", peers=(src,))
    sent = int(header[2])
    if sent != BROADCAST_KINDS[op]:
        raise CollectiveMismatch(
            f"{op}: the source (rank {src}) called {_BROADCAST_BY.get(sent, _SENT_BY[sent])} "
            f"where this rank called {op}; make the same collective calls in the same order "
            f"on every rank (what it sent was taken)", peers=(src,))
    return _unpack(mlen, blen, payload, codec, src)

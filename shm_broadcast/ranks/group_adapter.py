"""A uniform object-collective view over the groups this package accepts, without pickle.

``shm_broadcast`` uses nothing else of this project, yet it must set itself up
over either a ``torch.distributed`` process group (usually the CPU/gloo one) or
a ``coordinator.StatelessProcessGroup``. :func:`object_group` wraps either in
an :class:`ObjectGroup` with ``rank``, ``world_size``, ``broadcast`` and
``all_gather`` of plain Python objects. Stateless groups are recognised by
duck typing (attributes ``rank``, ``world_size`` and methods ``broadcast_obj``,
``all_gather_obj``), so no import of ``coordinator`` is needed.

Nothing received from a peer is unpickled. On a torch group, objects are
encoded with :func:`encode_object` (msgspec msgpack) and moved as ``uint8``
tensors: the sizes first (checked against :data:`MAX_OBJECT_BYTES` before any
buffer is allocated), then the bytes. A stateless group encodes the same way
and authenticates every value (see :mod:`coordinator.stateless.stateless_group`).

What :func:`encode_object` carries, exactly (same type back on every rank):
``None``, ``bool``, ``int`` (64-bit), ``float``, ``str``, ``bytes``, and
``list``, ``tuple``, ``dict``, ``set``, ``frozenset`` of these, nested at most
:data:`MAX_DEPTH` levels. An object that also holds tensors or numpy arrays
travels in the message queue's format (:class:`shm_broadcast.codec.message_codec.Codec`:
msgpack plus the arrays' raw bytes, each size checked before anything is
allocated; the receiver gets private copies). Any other type (subclasses
included: a namedtuple, an enum, a dataclass) raises ``TypeError`` on the
sender naming the type. ``allow_pickle=True`` on both sides opts into pickle for such objects;
it lets any peer that can reach the channel run code in this process, so use
it only between processes that trust each other completely.

Malformed bytes from a peer raise :class:`~shm_broadcast.errors.CollectiveMismatch`
naming it (never ``IndexError``, ``msgspec.DecodeError`` or the like), and so
do sets, frozensets and dicts (keyed ones and msgpack maps) with more than
:data:`~shm_broadcast.codec.hash_flooding.MAX_SHARED_HASH` items on one hash,
which would take time quadratic in their size to build: decoding is linear in
the bytes (:mod:`shm_broadcast.codec.safe_msgpack`). A sender that could not
encode its object sends a failure record instead, so its peers raise
``CollectiveMismatch`` naming it instead of waiting.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any, Protocol, runtime_checkable

import msgspec

from shm_broadcast.checks import check_rank
from shm_broadcast.codec.hash_flooding import (
    CollisionBudget,
    dict_from_pairs,
    frozenset_from,
    set_from,
)
from shm_broadcast.codec.safe_msgpack import SafeDecoder
from shm_broadcast.errors import CollectiveMismatch, CommTimeout, GroupCoordError, PeerDiedError

__all__ = [
    "MAX_DEPTH",
    "MAX_OBJECT_BYTES",
    "ObjectGroup",
    "StatelessLike",
    "decode_object",
    "encode_failure",
    "encode_object",
    "CLOSED_WORDS",
    "TIMEOUT_WORDS",
    "exchange_failed",
    "object_group",
]

#: Largest encoded object accepted from a peer (and sent), in bytes.
MAX_OBJECT_BYTES = 64 << 20
#: Deepest nesting of containers that :func:`encode_object` carries.
MAX_DEPTH = 64

_KIND_MSGPACK = 0x6D  # b"m"
_KIND_PICKLE = 0x70  # b"p"
_KIND_FAILURE = 0x65  # b"e"
_KIND_CODEC = 0x63  # b"c": the message length (uint32), the msgpack, the arrays' bytes
_CODEC_HEADER = struct.Struct("<I")
_EXT_TUPLE, _EXT_SET, _EXT_FROZENSET, _EXT_PAIRS = 1, 2, 3, 4
_CONTAINER_EXT: dict[type, int] = {tuple: _EXT_TUPLE, set: _EXT_SET, frozenset: _EXT_FROZENSET}
_SCALARS = (type(None), bool, int, float, str, bytes)
_MAX_FAILURE_CHARS = 2000


# ---------------------------------------------------------------------- encoding
def encode_object(obj: Any, *, allow_pickle: bool = False) -> bytes:
    """Encode ``obj`` for a peer: msgspec msgpack, or pickle only when allowed.

    Args:
        obj: The object (see the module docstring for the types carried).
        allow_pickle: Pickle objects that msgpack cannot carry exactly; the
            receiver must opt in too.

    Returns:
        One kind byte followed by the payload.

    Raises:
        TypeError: ``obj`` holds a type msgpack cannot carry (named in the
            message) and ``allow_pickle`` is false.
        ValueError: ``obj`` is nested deeper than :data:`MAX_DEPTH` or its
            encoding exceeds :data:`MAX_OBJECT_BYTES`.
    """
    try:
        out = bytes([_KIND_MSGPACK]) + msgspec.msgpack.encode(_prep(obj, 0))
    except TypeError:
        try:
            out = _encode_with_arrays(obj)
        except TypeError:  # it names the type neither format carries, and the opt-in
            if not allow_pickle:
                raise
            out = bytes([_KIND_PICKLE]) + pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if len(out) > MAX_OBJECT_BYTES:
        raise ValueError(
            f"obj encodes to {len(out)} bytes, more than the {MAX_OBJECT_BYTES} bytes an object "
            f"exchange carries; send large data as tensors")
    return out


def _encode_with_arrays(obj: Any) -> bytes:
    """``obj`` (holding tensors or arrays) in the queue codec's format, as one buffer.

    Raises:
        TypeError: ``obj`` holds a type that codec cannot carry either.
    """
    from shm_broadcast.codec.message_codec import Codec

    enc = Codec().encode(obj)
    return (bytes([_KIND_CODEC]) + _CODEC_HEADER.pack(len(enc.msg)) + enc.msg
            + bytes(enc.blob_bytes()))


def _decode_with_arrays(view: memoryview, allow_pickle: bool) -> Any:
    """The object of :func:`_encode_with_arrays` bytes (kind byte stripped)."""
    from shm_broadcast.codec.message_codec import Codec

    if len(view) < _CODEC_HEADER.size:
        raise ValueError(f"{len(view)} bytes, shorter than the header")
    (mlen,) = _CODEC_HEADER.unpack(view[:_CODEC_HEADER.size])
    start = _CODEC_HEADER.size + mlen
    if start > len(view):
        raise ValueError(f"a {mlen}-byte message in {len(view)} bytes")
    return Codec(allow_pickle=allow_pickle).decode(view[_CODEC_HEADER.size:start], view, start,
                                                   len(view) - start)


def encode_failure(reason: str) -> bytes:
    """A record telling the receivers that the sender could not produce its object."""
    return bytes([_KIND_FAILURE]) + str(reason)[:_MAX_FAILURE_CHARS].encode("utf-8", "replace")


def _prep(obj: Any, depth: int) -> Any:
    """``obj`` with tuples, sets and non-str-keyed dicts wrapped as msgpack exts."""
    t = type(obj)
    if t in _SCALARS:
        if t is int and not -(2**63) <= obj < 2**64:
            raise TypeError(
                f"cannot encode an int beyond 64 bits ({obj.bit_length()} bits) without pickle; "
                "send it as a str, or pass allow_pickle=True on every rank")
        return obj
    if depth >= MAX_DEPTH:
        raise ValueError(f"obj is nested more than {MAX_DEPTH} levels deep")
    if t is list:
        return [_prep(v, depth + 1) for v in obj]
    if t is dict:
        if all(type(k) is str for k in obj):
            return {k: _prep(v, depth + 1) for k, v in obj.items()}
        pairs = [[_prep(k, depth + 1), _prep(v, depth + 1)] for k, v in obj.items()]
        return msgspec.msgpack.Ext(_EXT_PAIRS, msgspec.msgpack.encode(pairs))
    code = _CONTAINER_EXT.get(t)
    if code is None:
        raise TypeError(
            f"cannot send an object of type {t.__module__}.{t.__qualname__} without pickle: "
            "only None, bool, int, float, str, bytes and list/tuple/dict/set/frozenset of "
            "them are carried. Convert it (e.g. to a dict), or pass allow_pickle=True on "
            "every rank (this lets any peer run code in the receiver).")
    items = [_prep(v, depth + 1) for v in obj]
    return msgspec.msgpack.Ext(code, msgspec.msgpack.encode(items))


# ---------------------------------------------------------------------- decoding
def decode_object(data: Any, *, allow_pickle: bool = False, source: str = "a peer") -> Any:
    """Decode bytes made by :func:`encode_object` (or :func:`encode_failure`).

    Args:
        data: The received bytes (any buffer).
        allow_pickle: Accept a pickled payload. Off by default: a pickled
            payload is refused without being read.
        source: Who sent it, for error messages (``"rank 2 of group 'tp'"``).

    Returns:
        The object.

    Raises:
        CollectiveMismatch: ``data`` is malformed, larger than
            :data:`MAX_OBJECT_BYTES`, pickled while ``allow_pickle`` is false,
            or a failure record (the message carries the sender's reason).
    """
    view = memoryview(data).cast("B")
    if len(view) > MAX_OBJECT_BYTES or len(view) < 1:
        raise CollectiveMismatch(
            f"object from {source} has {len(view)} bytes, outside [1, {MAX_OBJECT_BYTES}]")
    kind = view[0]
    if kind == _KIND_FAILURE:
        reason = bytes(view[1:]).decode("utf-8", "replace")
        raise CollectiveMismatch(f"{source} could not produce its object: {reason}")
    if kind == _KIND_PICKLE:
        if not allow_pickle:
            raise CollectiveMismatch(
                f"{source} sent a pickled object but this rank does not accept pickle "
                "(allow_pickle=False); it was not unpickled")
        return pickle.loads(view[1:])
    if kind not in (_KIND_MSGPACK, _KIND_CODEC):
        raise CollectiveMismatch(f"object from {source} is malformed: unknown kind byte {kind}")
    try:
        if kind == _KIND_CODEC:
            return _decode_with_arrays(view[1:], allow_pickle)
        return _MsgpackReader().decode(view[1:])
    except (msgspec.MsgspecError, ValueError, TypeError, OverflowError, RecursionError) as e:
        raise CollectiveMismatch(
            f"object from {source} is malformed ({type(e).__name__}: {e})") from None


class _MsgpackReader:
    """A msgspec decoder whose ext hook rebuilds tuples, sets and keyed dicts,
    depth-bounded, in time linear in the bytes (:mod:`shm_broadcast.codec.safe_msgpack`
    reads the maps, :mod:`shm_broadcast.codec.hash_flooding` builds the sets and dicts)."""

    def __init__(self) -> None:
        self._depth = 0
        self._budget = CollisionBudget()  # one reader per message
        self._decoder = SafeDecoder(self._ext)

    def decode(self, data: Any) -> Any:
        return self._decoder.decode(data)

    def _ext(self, code: int, data: memoryview) -> Any:
        if self._depth >= MAX_DEPTH:
            raise ValueError(f"nested more than {MAX_DEPTH} levels deep")
        self._depth += 1
        try:
            items = self._decoder.decode(data)
        finally:
            self._depth -= 1
        if not isinstance(items, list):
            raise ValueError(f"ext {code} does not hold an array")
        if code == _EXT_TUPLE:
            return tuple(items)
        if code == _EXT_SET:
            return set_from(items)
        if code == _EXT_FROZENSET:
            return frozenset_from(items, self._budget)
        if code == _EXT_PAIRS:
            return dict_from_pairs(items)
        raise ValueError(f"unknown ext code {code}")


# ---------------------------------------------------------------------- groups
@runtime_checkable
class StatelessLike(Protocol):
    """What a stateless (TCPStore-based) group must offer."""

    rank: int
    world_size: int

    def broadcast_obj(self, obj: Any | None, src: int) -> Any: ...

    def all_gather_obj(self, obj: Any) -> list[Any]: ...


class ObjectGroup:
    """Object collectives with group-local ranks, whatever the group type.

    Args:
        group: A torch ``ProcessGroup`` or a stateless group.
        allow_pickle: On a torch group, pickle objects msgpack cannot carry
            and accept pickled ones (every rank must agree). A stateless group
            follows its own ``allow_pickle`` setting.
    """

    def __init__(self, group: Any, allow_pickle: bool = False) -> None:
        self._group = group
        self._allow_pickle = bool(allow_pickle)
        self._stateless = isinstance(group, StatelessLike) and not _is_torch_group(group)
        if self._stateless:
            self.rank: int = int(group.rank)
            self.world_size: int = int(group.world_size)
        else:
            import torch.distributed as dist

            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            if self.rank < 0:
                raise ValueError("this process is not a member of the given process group")

    def broadcast(self, obj: Any | None, src: int, op: str = "object broadcast",
                  name: str | None = None) -> Any:
        """Broadcast ``obj`` from group rank ``src``; returns it on every rank.

        Args:
            obj: The object (used on ``src`` only).
            src: Group rank of the source.
            op: The caller's operation, named in errors.
            name: The group's name in errors (default: the torch group's).

        Raises:
            TypeError: On ``src``: ``obj`` cannot be encoded (the others raise
                ``CollectiveMismatch``).
            CollectiveMismatch: The source failed, or sent malformed bytes.
            PeerDiedError: A peer's connection closed during the exchange.
            CommTimeout: The exchange ran out of time waiting for a peer.
        """
        src = check_rank(src, self.world_size, "src")
        if self._stateless:
            return self._group.broadcast_obj(obj, src=src)
        import torch
        import torch.distributed as dist

        gsrc, dev = dist.get_global_rank(self._group, src), _device_of(self._group)
        payload, error = self._encode(obj) if self.rank == src else (b"", None)
        size = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
        self._backend(op, name, dist.broadcast, size, src=gsrc, group=self._group)
        n = self._checked_size(int(size.item()), src)
        buf = (_bytes_tensor(payload).to(dev) if self.rank == src
               else torch.empty(n, dtype=torch.uint8, device=dev))
        self._backend(op, name, dist.broadcast, buf, src=gsrc, group=self._group)
        if error is not None:
            raise error
        if self.rank == src:
            return obj
        return decode_object(buf.cpu().numpy(), allow_pickle=self._allow_pickle,
                             source=f"rank {src}")

    def all_gather(self, obj: Any, op: str = "object all-gather",
                   name: str | None = None) -> list[Any]:
        """Gather ``obj`` from every rank; returns the list ordered by group rank.

        Args:
            obj: This rank's object.
            op: The caller's operation, named in errors.
            name: The group's name in errors (default: the torch group's).

        Raises:
            TypeError: ``obj`` cannot be encoded on this rank (the others raise
                ``CollectiveMismatch`` naming it).
            CollectiveMismatch: A peer failed, or sent malformed bytes.
            PeerDiedError: A peer's connection closed during the exchange.
            CommTimeout: The exchange ran out of time waiting for a peer.
        """
        if self._stateless:
            return list(self._group.all_gather_obj(obj))
        import torch
        import torch.distributed as dist

        payload, error = self._encode(obj)
        dev, n = _device_of(self._group), self.world_size
        sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(n)]
        mine = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
        self._backend(op, name, dist.all_gather, sizes, mine, group=self._group)
        lens = [self._checked_size(int(s.item()), r) for r, s in enumerate(sizes)]
        width = max(lens)
        data = torch.zeros(width, dtype=torch.uint8, device="cpu")
        data[: len(payload)] = _bytes_tensor(payload)
        bufs = [torch.empty(width, dtype=torch.uint8, device=dev) for _ in range(n)]
        self._backend(op, name, dist.all_gather, bufs, data.to(dev), group=self._group)
        if error is not None:
            raise error
        return [obj if r == self.rank else
                decode_object(bufs[r][: lens[r]].cpu().numpy(), allow_pickle=self._allow_pickle,
                              source=f"rank {r}")
                for r in range(n)]

    def _backend(self, op: str, name: str | None, fn: Any, *args: Any, **kwargs: Any) -> None:
        """A torch.distributed call whose backend failure (gloo's ``RuntimeError``)
        becomes ours, naming the group, ``op`` and the peers."""
        try:
            fn(*args, **kwargs)
        except RuntimeError as e:
            if isinstance(e, GroupCoordError):
                raise
            name = name or getattr(self._group, "group_name", "") or "unnamed"
            ours = exchange_failed(name, op, self.rank, self.world_size, e)
            if ours is e:
                raise
            raise ours from e

    def _encode(self, obj: Any) -> tuple[bytes, BaseException | None]:
        """This rank's payload, or a failure record and the error to raise after sending it."""
        try:
            return encode_object(obj, allow_pickle=self._allow_pickle), None
        except (TypeError, ValueError) as e:
            return encode_failure(f"rank {self.rank}: {type(e).__name__}: {e}"), e

    def _checked_size(self, n: int, src: int) -> int:
        if not 1 <= n <= MAX_OBJECT_BYTES:
            raise CollectiveMismatch(
                f"rank {src} announced an object of {n} bytes, outside [1, {MAX_OBJECT_BYTES}]; "
                "nothing was allocated", peers=(src,))
        return n


def _device_of(group: Any) -> Any:
    """Where the group's tensors live: CPU, or the current CUDA device for a NCCL-only group."""
    import torch
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _bytes_tensor(data: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _is_torch_group(group: Any) -> bool:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return False
    return isinstance(group, dist.ProcessGroup)


def object_group(group: Any, *, allow_pickle: bool = False) -> ObjectGroup:
    """Wrap a torch ProcessGroup or a stateless group as an :class:`ObjectGroup`.

    Args:
        group: ``torch.distributed.ProcessGroup`` (CPU-capable, e.g. gloo) or an
            object shaped like ``coordinator.StatelessProcessGroup``.
        allow_pickle: See :class:`ObjectGroup`; off by default.

    Raises:
        TypeError: ``group`` is neither.
    """
    if isinstance(group, ObjectGroup):
        return group
    if _is_torch_group(group) or isinstance(group, StatelessLike):
        return ObjectGroup(group, allow_pickle=allow_pickle)
    raise TypeError(
        "group must be a torch.distributed.ProcessGroup or a StatelessProcessGroup, "
        f"got {type(group).__name__}"
    )


# What gloo says when a peer's connection went away (the peer died or left),
# and when a wait on a peer ran out; matched in lower case.
CLOSED_WORDS = ("connection closed", "connection reset", "broken pipe", "eof",
                 "connection refused")
TIMEOUT_WORDS = ("timed out", "timeout")


def exchange_failed(name: str, op: str, rank: int, world_size: int,
                    e: RuntimeError) -> BaseException:
    """Our error for an object exchange the backend failed: a peer's closed
    connection (it died or left) or a wait that ran out; ``e`` itself for any
    other failure (out of memory, a backend bug), which is re-raised as it is.

    Args:
        name: The group's name.
        op: The operation the exchange served.
        rank: This rank in the group.
        world_size: The group's size.
        e: The backend's error.
    """
    others = [r for r in range(world_size) if r != rank]
    text = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
    low = str(e).lower()
    if any(w in low for w in TIMEOUT_WORDS):
        return CommTimeout(
            f"group {name!r}, op {op}: the object exchange timed out waiting for rank(s) "
            f"{others} (every rank must make this call); backend: {text}",
            queue=name, peers=others)
    if any(w in low for w in CLOSED_WORDS):
        return PeerDiedError(
            f"group {name!r}, op {op}: a peer closed its connection during the object "
            f"exchange (one of rank(s) {others} died or left); backend: {text}",
            queue=name, peers=others)
    return e

"""Point-to-point Python objects over a CPU (gloo) group, and source-failure markers.

An object is serialised to bytes, its length goes first as one int64 tensor,
then the bytes as a uint8 tensor. Serialisation is pluggable
(:class:`ObjectCodec`); the default is pickle, because these calls carry
arbitrary user objects. Hot-path metadata should use the message queue or
``broadcast_tensor_dict``, which never pickle tensors.

A sender that cannot serialise its object must not leave the receiver waiting
for bytes that never come: it sends a *negative* length ``-(n + 1)`` followed
by ``n`` bytes of UTF-8 error text, and the receiver raises ``ValueError``
with that text. Collectives use :class:`SourceFailure` the same way: a source
whose input is unusable broadcasts one in place of the data, so every
receiver raises instead of hanging.
"""

from __future__ import annotations

import pickle
from typing import Any, Protocol

import torch
import torch.distributed as dist

from coordinator.errors import CollectiveMismatch

__all__ = [
    "ObjectCodec",
    "PickleCodec",
    "SourceFailure",
    "SERIALIZE_ERRORS",
    "send_object",
    "recv_object",
]

# What serialisers raise for a value they cannot encode (before any byte moves):
# pickle raises PicklingError, AttributeError ("Can't pickle local object") or
# TypeError ("cannot pickle '_thread.lock' object"); msgspec raises TypeError.
SERIALIZE_ERRORS: tuple[type[BaseException], ...] = (
    pickle.PicklingError,
    AttributeError,
    TypeError,
    RecursionError,
)


class SourceFailure:
    """Sent in place of the data when the source rank rejected its own input.

    Attributes:
        message: Why the source failed (its exception text).
    """

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (SourceFailure, (self.message,))

    def __repr__(self) -> str:
        return f"SourceFailure({self.message!r})"


class ObjectCodec(Protocol):
    """Turns objects into bytes and back."""

    def dumps(self, obj: Any) -> bytes: ...

    def loads(self, data: bytes | memoryview) -> Any: ...


class PickleCodec:
    """Pickle with the highest protocol."""

    def dumps(self, obj: Any) -> bytes:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)

    def loads(self, data: bytes | memoryview) -> Any:
        return pickle.loads(data)


def _as_tensor(data: bytes) -> torch.Tensor:
    if not len(data):
        return torch.empty(0, dtype=torch.uint8)  # frombuffer refuses empty buffers
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def send_object(obj: Any, dst_global: int, group: dist.ProcessGroup, codec: ObjectCodec) -> None:
    """Send ``obj`` to global rank ``dst_global`` over ``group``.

    Raises:
        TypeError: ``obj`` cannot be serialised (the receiver is told, and raises
            ``ValueError``).
    """
    try:
        data = codec.dumps(obj)
    except SERIALIZE_ERRORS as e:
        text = f"{type(e).__name__}: {e}".encode("utf-8", "replace")
        dist.send(torch.tensor([-(len(text) + 1)], dtype=torch.int64), dst=dst_global, group=group)
        if text:
            dist.send(_as_tensor(text), dst=dst_global, group=group)
        raise TypeError(
            f"obj of type {type(obj).__name__} cannot be serialised for sending "
            f"({type(e).__name__}: {e})"
        ) from e
    payload = _as_tensor(data)
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64), dst=dst_global, group=group)
    if payload.numel():
        dist.send(payload, dst=dst_global, group=group)


def recv_object(src_global: int, group: dist.ProcessGroup, codec: ObjectCodec) -> Any:
    """Receive an object sent by :func:`send_object` from global rank ``src_global``.

    Raises:
        ValueError: The sender could not serialise its object.
    """
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=src_global, group=group)
    n = int(size.item())
    failed = n < 0
    buf = torch.empty(-n - 1 if failed else n, dtype=torch.uint8)
    if buf.numel():
        dist.recv(buf, src=src_global, group=group)
    data = buf.numpy().tobytes()
    if failed:
        raise CollectiveMismatch(
            f"the sender (global rank {src_global}) could not serialise the object it was "
            f"sending ({data.decode('utf-8', 'replace')}); fix the call on that rank",
            peers=(src_global,),
        )
    return codec.loads(data)

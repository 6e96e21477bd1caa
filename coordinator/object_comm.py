"""Point-to-point Python objects over a CPU (gloo) group.

An object is serialised to bytes, its length goes first as one int64 tensor,
then the bytes as a uint8 tensor. Serialisation is pluggable
(:class:`ObjectCodec`); the default is pickle, because these calls carry
arbitrary user objects. Hot-path metadata should use the message queue or
``broadcast_tensor_dict``, which never pickle tensors.
"""

from __future__ import annotations

import pickle
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["ObjectCodec", "PickleCodec", "send_object", "recv_object"]


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


def send_object(obj: Any, dst_global: int, group: dist.ProcessGroup, codec: ObjectCodec) -> None:
    """Send ``obj`` to global rank ``dst_global`` over ``group``."""
    data = codec.dumps(obj)
    payload = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if len(data)
        else torch.empty(0, dtype=torch.uint8)  # frombuffer refuses empty buffers
    )
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64), dst=dst_global, group=group)
    if payload.numel():
        dist.send(payload, dst=dst_global, group=group)


def recv_object(src_global: int, group: dist.ProcessGroup, codec: ObjectCodec) -> Any:
    """Receive an object sent by :func:`send_object` from global rank ``src_global``."""
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=src_global, group=group)
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    if buf.numel():
        dist.recv(buf, src=src_global, group=group)
    return codec.loads(buf.numpy().tobytes())

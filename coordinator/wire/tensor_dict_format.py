"""What a dict of tensors and plain values becomes on the wire: metadata and payload.

A tensor dict is flattened into *metadata* (one entry per key, in order) and a
list of *payload* tensors. Metadata is plain data, so the message queue's
msgspec codec carries it without pickling, on every path (queue, CPU group or
shared-memory link)::

    entry = [key, VALUE, value]                       # plain Python value
          | [key, TENSOR, [device_type, dtype, shape, parts]]
          | [key, INLINE, tensor]                     # a CPU tensor inside the message

``parts`` is 0 for a tensor sent whole, or ``n`` when it travels as ``1/n``
slices (the all-gather optimisation of
:mod:`coordinator.group.tensor_dict_calls`); receivers check it against their
own group. Receivers allocate their own tensors (:func:`alloc`).

Received metadata is checked before anything is allocated for it
(:func:`check_metadata`): entries of the right form, a known kind, a known
dtype, a device the group moves, non-negative dimensions whose byte size fits
in 64 bits, slicing that divides the tensor, keys of which at most
:data:`~shm_broadcast.codec.hash_flooding.MAX_SHARED_HASH` share a hash (the
receiver builds a dict of them). Anything else raises
:class:`~shm_broadcast.errors.DecodeError`. Values other than tensors go
through the codec's rules: types msgspec cannot carry are refused on the
source unless the group opted in with ``allow_pickle=True``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from coordinator.errors import DecodeError
from coordinator.wire import object_comm
from shm_broadcast.codec.hash_flooding import check_spread
from shm_broadcast.describe import describe

__all__ = [
    "VALUE",
    "TENSOR",
    "INLINE",
    "DTYPES",
    "dtype_of",
    "flatten_tensor_dict",
    "snapshot",
    "check_metadata",
    "alloc",
    "plain",
    "sent_numels",
    "AllGatherGroup",
    "SlicedDict",
    "rebuild_slices",
    "own_slices",
]

#: The kinds of metadata entries.
VALUE, TENSOR, INLINE = 0, 1, 2


_MAX_NDIM = 64
_MAX_TENSOR_BYTES = 1 << 62


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _known_dtypes() -> dict[str, torch.dtype]:
    """Canonical names of the dtypes a receiver may allocate (no quantized ones)."""
    out: dict[str, torch.dtype] = {}
    for value in vars(torch).values():
        if isinstance(value, torch.dtype) and not _dtype_name(value).startswith("q"):
            try:
                with warnings.catch_warnings():  # complex32 warns that it is experimental
                    warnings.simplefilter("ignore")
                    torch.empty(0, dtype=value, device="cpu")
            except (RuntimeError, TypeError):
                continue
            out[_dtype_name(value)] = value
    return out


#: Canonical names of the dtypes a receiver may allocate.
DTYPES = _known_dtypes()


class AllGatherGroup(Protocol):
    """What a send or receive uses of its ``all_gather_group``."""

    @property
    def world_size(self) -> int: ...
    @property
    def rank_in_group(self) -> int: ...

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor: ...

    def isend(self, tensor: torch.Tensor, dst: int | None = None) -> Any: ...

    def irecv(self, tensor_or_spec: Any, src: int | None = None) -> Any: ...


class SlicedDict(NamedTuple):
    """A received dict whose sliced tensors are not rebuilt yet.

    Attributes:
        out: The dict, in the sender's key order; a sliced key holds this
            rank's slice until :func:`rebuild_slices` replaces it.
        sliced: ``(key, this rank's slice, the whole tensor's shape)`` of every
            sliced tensor, in key order.
    """

    out: dict[Any, Any]
    sliced: list[tuple[Any, torch.Tensor, tuple[int, ...]]]


def own_slices(meta: list[list[Any]], payload: list[torch.Tensor], parts: int,
               rank: int) -> list[torch.Tensor]:
    """``payload`` as it travels: each tensor that ``meta`` (from
    :func:`flatten_tensor_dict`) marks sliced replaced by slice ``rank`` of ``parts``
    (a view of its flat elements), the others whole."""
    descs = [desc for _, kind, desc in meta if kind == TENSOR]
    return [t.reshape(parts, -1)[rank] if desc[3] else t
            for desc, t in zip(descs, payload, strict=True)]


def rebuild_slices(got: SlicedDict, gather: AllGatherGroup) -> dict[Any, Any]:
    """Rebuild every sliced tensor of ``got`` with one all-gather over ``gather`` each
    (a collective of that group: each of its ranks calls this for the same dict).

    Returns:
        ``got.out``, its sliced keys now holding the whole tensors.
    """
    out = got.out
    for key, piece, shape in got.sliced:
        out[key] = gather.all_gather(piece, dim=0).reshape(shape)
    return out


def dtype_of(name: str) -> torch.dtype:
    """The dtype a metadata entry names.

    Raises:
        DecodeError: Not the name of a dtype a receiver allocates.
    """
    dt = DTYPES.get(name) if type(name) is str else None
    if dt is None:
        raise DecodeError(f"unknown dtype {describe(name, 60)} in tensor-dict metadata")
    return dt


#: Values :func:`snapshot` keeps as they are: none of them can change.
_SCALARS = frozenset({int, float, bool, str, bytes, type(None), complex})
#: Levels of nested containers :func:`snapshot` copies; below them values are kept by
#: reference (the codec refuses nesting that deep anyway).
_SNAPSHOT_DEPTH = 100


def snapshot(tensor_dict: Mapping[Any, Any]) -> dict[Any, Any]:
    """The dict as it is now, for a send that encodes it later: a copy of
    ``tensor_dict`` and of the mutable containers in its values (plain dicts,
    lists, tuples holding them, sets, bytearrays, numpy arrays), so that what
    the caller changes after the call does not travel. Tensors and other
    objects (subclasses of those containers included, which travel only with
    ``allow_pickle``) are kept by reference (a tensor is the caller's until the
    send completes, as with ``isend``)."""
    return {key: _copied(value, _SNAPSHOT_DEPTH) for key, value in tensor_dict.items()}


def _copied(value: Any, depth: int) -> Any:
    """``value`` with its mutable containers copied, ``depth`` levels down."""
    t = type(value)
    if depth <= 0:
        return value
    if t is list:
        if _SCALARS.issuperset(map(type, value)):  # token ids, positions: one C-level pass
            return value.copy()
        return [_copied(v, depth - 1) for v in value]
    if t is dict:
        return {k: _copied(v, depth - 1) for k, v in value.items()}
    if t is tuple:
        return tuple(_copied(v, depth - 1) for v in value)
    if t is set:  # its items are hashable, so none is a list, dict or set
        return set(value)
    if t is bytearray:
        return bytearray(value)
    if t is np.ndarray:
        return value.copy()
    return value


def flatten_tensor_dict(
    tensor_dict: Mapping[Any, Any],
    inline_cpu: bool = False,
    slicing: Mapping[Any, bool] | None = None,
    parts: int = 1,
    device: torch.device | None = None,
) -> tuple[list[list[Any]], list[torch.Tensor]]:
    """Split a dict into metadata entries and payload tensors.

    Args:
        tensor_dict: Mapping of keys to tensors, None or plain data.
        inline_cpu: Keep CPU tensors inside the metadata (for the message queue,
            which encodes them out of band).
        slicing: Keys whose tensors are sent as slices (see module docstring).
        parts: Number of slices of a sliced tensor (the all-gather group size).
        device: The group's device; when given, every tensor must be on the CPU
            or on a device of that type.

    Raises:
        TypeError: ``tensor_dict`` is not a mapping, or holds a sparse or
            quantized tensor.
        ValueError: A tensor is on a device the group cannot move.
    """
    if not isinstance(tensor_dict, Mapping):
        raise TypeError(f"tensor_dict must be a dict, got {type(tensor_dict).__name__}")
    meta: list[list[Any]] = []
    payload: list[torch.Tensor] = []
    for key, value in tensor_dict.items():
        if isinstance(value, torch.Tensor):
            _check_sendable(key, value)
            if device is not None and value.device.type not in ("cpu", device.type):
                where = "cpu" if device.type == "cpu" else f"cpu or {device.type}"
                raise ValueError(
                    f"tensor_dict[{key!r}] is on {value.device}, but this group moves tensors "
                    f"on {where}; move it with .to({str(device)!r})"
                )
            if inline_cpu and value.device.type == "cpu":
                meta.append([key, INLINE, plain(value)])
                continue
            n = parts if slicing and slicing.get(key, False) else 0
            meta.append(
                [key, TENSOR, [value.device.type, _dtype_name(value.dtype), list(value.shape), n]]
            )
            payload.append(value)
        else:
            meta.append([key, VALUE, value])
    return meta, payload


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor outside autograd: receivers get new tensors, neither
    Parameters nor tensors that require grad, whichever transport carried them
    (the message queue's codec would keep both)."""
    if type(t) is not torch.Tensor or t.requires_grad:
        return t.detach()
    return t


def _check_sendable(key: Any, value: torch.Tensor) -> None:
    """Refuse, before anything is sent, a tensor no receiver could rebuild.

    Raises:
        TypeError: ``value`` is not dense (strided), or its dtype is one a
            receiver does not allocate (quantized dtypes).
        ValueError: ``value`` has more dimensions than a receiver accepts.
    """
    if value.dim() > _MAX_NDIM:
        raise ValueError(
            f"tensor_dict[{key!r}] has {value.dim()} dimensions; at most {_MAX_NDIM} travel "
            f"(a receiver refuses more): reshape it and send its shape alongside")
    if value.layout != torch.strided or value.is_nested:
        kind = "nested" if value.is_nested else str(value.layout)
        raise TypeError(
            f"tensor_dict[{key!r}] is a {kind} tensor; only dense (strided) "
            f"tensors can be sent (.to_dense(), or .unbind() a nested one)"
        )
    if _dtype_name(value.dtype) not in DTYPES:
        raise TypeError(
            f"tensor_dict[{key!r}] has dtype {value.dtype}, which cannot be sent "
            f"(quantized tensors do not travel); send .int_repr() with its scale and "
            f"zero point, or .dequantize()"
        )


def alloc(desc: list[Any], device: torch.device, numel_div: int = 1) -> torch.Tensor:
    """A tensor for a descriptor :func:`check_metadata` accepted."""
    dev_type, dtype_name, shape, _ = desc
    dev = torch.device("cpu") if dev_type == "cpu" else device
    if numel_div == 1:
        return torch.empty(shape, dtype=dtype_of(dtype_name), device=dev)
    numel = 1
    for s in shape:
        numel *= s
    return torch.empty(numel // numel_div, dtype=dtype_of(dtype_name), device=dev)


def check_metadata(meta: Any, device_type: str, source: int | None = None) -> list[list[Any]]:
    """Check received tensor-dict metadata before anything is allocated for it.

    Args:
        meta: What the codec decoded (a list of ``[key, kind, value]``).
        device_type: The receiving group's device type (``"cpu"``, ``"cuda"``).
        source: The sending rank, named by the error (``from rank N``, ``peers=(N,)``).

    Returns:
        ``meta`` itself, every entry known to be well formed: keys hashable,
        kinds known, tensor descriptors ``[device, dtype, shape, parts]`` with a
        device of ``"cpu"`` or ``device_type``, a known dtype, at most 64
        non-negative dimensions whose byte size fits in 62 bits, and ``parts``
        (``0`` or a slice count) dividing the element count; the CPU tensors
        together no larger than this host's memory and swap (the receiver
        must hold them all, so a larger claim is a lie); at most
        :data:`~shm_broadcast.codec.hash_flooding.MAX_SHARED_HASH` keys on one hash
        (the receiver builds a dict of them, which would take time quadratic in
        the number of keys sharing a hash).

    Raises:
        DecodeError: Any entry is malformed, or too many keys share a hash.
    """
    try:
        return _checked(meta, device_type)
    except DecodeError as e:
        if source is None:
            raise
        raise DecodeError(f"from rank {source}: {e}", peers=(source,)) from None


def _checked(meta: Any, device_type: str) -> list[list[Any]]:
    """:func:`check_metadata` without the sender's name."""
    if type(meta) is not list:
        raise DecodeError(f"tensor-dict metadata must be a list, got {type(meta).__name__}")
    cpu_bytes = 0
    for i, entry in enumerate(meta):
        if (type(entry) is not list or len(entry) != 3 or type(entry[1]) is not int
                or entry[1] not in (VALUE, TENSOR, INLINE)):
            raise DecodeError(f"tensor-dict metadata entry {i} is malformed: "
                              f"{describe(entry, 200)}")
        try:
            hash(entry[0])
        except TypeError:
            raise DecodeError(f"tensor-dict metadata entry {i} has an unhashable key") from None
        if entry[1] == TENSOR:
            nbytes = _check_desc(entry[2], device_type, i)
            if entry[2][0] == "cpu":
                cpu_bytes += nbytes
        elif entry[1] == INLINE and not isinstance(entry[2], torch.Tensor):
            raise DecodeError(f"tensor-dict metadata entry {i} is an inline tensor without one")
    _check_host_bytes(cpu_bytes)
    check_spread((entry[0] for entry in meta), len(meta), "tensor-dict metadata")
    return meta


def _check_desc(desc: Any, device_type: str, i: int) -> int:
    """Check one tensor descriptor; returns the bytes of its whole tensor."""
    if type(desc) is not list or len(desc) != 4:
        raise DecodeError(f"tensor-dict metadata entry {i}: bad tensor descriptor "
                          f"{describe(desc, 200)}")
    dev_type, dtype_name, shape, parts = desc
    if type(dev_type) is not str or dev_type not in ("cpu", device_type):
        raise DecodeError(f"tensor-dict metadata entry {i}: device {describe(dev_type, 40)} is not "
                          f"'cpu' or this group's {device_type!r}")
    itemsize = dtype_of(dtype_name).itemsize
    if (type(shape) is not list or len(shape) > _MAX_NDIM
            or not all(type(n) is int and n >= 0 for n in shape)):
        raise DecodeError(f"tensor-dict metadata entry {i}: bad shape {describe(shape, 200)}")
    numel, span = 1, 1
    for n in shape:
        numel *= n
        span *= max(n, 1)  # an empty tensor's strides still multiply its other sizes
    if span * itemsize > _MAX_TENSOR_BYTES:
        raise DecodeError(f"tensor-dict metadata entry {i}: shape {describe(shape, 200)} is too "
                          f"large")
    if type(parts) is not int or parts < 0 or (parts and numel % parts):
        raise DecodeError(f"tensor-dict metadata entry {i}: bad slice count {describe(parts, 40)} "
                          f"for {numel} elements")
    return numel * itemsize


def _check_host_bytes(nbytes: int) -> None:
    """Refuse metadata whose CPU tensors could not fit in this host's memory."""
    if nbytes > object_comm.host_memory():
        raise DecodeError(f"tensor-dict metadata describes {nbytes} bytes of CPU tensors, more "
                          f"than this host's memory and swap ({object_comm.host_memory()} bytes)")


def sent_numels(meta: list[list[Any]]) -> list[tuple[int, list[Any]]]:
    """``(elements sent, descriptor)`` of every tensor entry of checked metadata (a
    sliced tensor sends ``1/parts`` of its elements)."""
    return [(math.prod(v[2]) // (v[3] or 1), v) for _, kind, v in meta if kind == TENSOR]

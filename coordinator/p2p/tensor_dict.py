"""Moving dicts of tensors and plain values between ranks.

A tensor dict is flattened into *metadata* (one entry per key, in order) and a
list of *payload* tensors. Metadata is plain data, so the message queue's
msgspec codec carries it without pickling, on every path (queue or CPU
group)::

    entry = [key, VALUE, value]                       # plain Python value
          | [key, TENSOR, [device_type, dtype, shape, parts]]

``parts`` is 0 for a tensor sent whole, or ``n`` when it travels as ``1/n``
slices (see below); receivers check it against their own group.

Payload routing:

* the message queue (when the group has one and ``src`` is its writer) carries
  the metadata, and CPU tensors travel inside the same message, out of band;
* ``send_tensor_dict`` between two ranks of a host on a CPU group: the
  direction's shared-memory link carries metadata and tensors as one message
  (:mod:`coordinator.p2p.shm_links`, :mod:`coordinator.p2p.link_messages`);
* otherwise metadata travels once over the CPU group, and each non-empty
  tensor follows: tensors on the group's device through the device
  communicator, CPU tensors (on a GPU group) over the CPU group.

Receivers allocate their own tensors. Empty tensors send no payload.

Received metadata is checked before anything is allocated for it
(:func:`check_metadata`): entries of the right form, a known kind, a known
dtype, a device the group moves, non-negative dimensions whose byte size fits
in 64 bits, slicing that divides the tensor. Anything else raises
:class:`~shm_broadcast.errors.DecodeError`. Values other than tensors go
through the codec's rules: types msgspec cannot carry are refused on the
source unless the group opted in with ``allow_pickle=True``.

Pipeline sends can use the all-gather optimisation: when the tensor is
replicated across an ``all_gather_group`` (say the TP group) of ``n`` ranks, each
sender sends only its ``1/n`` slice and the receiving TP ranks rebuild the
whole tensor with one all-gather among themselves.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from coordinator.errors import CollectiveMismatch, DecodeError, GroupCoordError
from coordinator.group import object_comm
from coordinator.group.object_comm import SERIALIZE_ERRORS, SourceFailure
from coordinator.p2p import link_messages
from coordinator.p2p.channels import RECV as RECV_SIDE
from coordinator.p2p.channels import SEND as SEND_SIDE
from device_comms.torch_dist.torch_communicator import wire_view
from device_comms.validation import dense

if TYPE_CHECKING:
    from coordinator.group.group_coordinator import GroupCoordinator

__all__ = [
    "broadcast_tensor_dict",
    "abort_broadcast",
    "send_tensor_dict",
    "recv_tensor_dict",
    "flatten_tensor_dict",
    "check_metadata",
]

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
                    torch.empty(0, dtype=value)
            except (RuntimeError, TypeError):
                continue
            out[_dtype_name(value)] = value
    return out


_DTYPES = _known_dtypes()


def _dtype(name: str) -> torch.dtype:
    dt = _DTYPES.get(name) if type(name) is str else None
    if dt is None:
        raise DecodeError(f"unknown dtype {name!r} in tensor-dict metadata")
    return dt


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
                meta.append([key, INLINE, value])
                continue
            n = parts if slicing and slicing.get(key, False) else 0
            meta.append(
                [key, TENSOR, [value.device.type, _dtype_name(value.dtype), list(value.shape), n]]
            )
            payload.append(value)
        else:
            meta.append([key, VALUE, value])
    return meta, payload


def _check_sendable(key: Any, value: torch.Tensor) -> None:
    """Refuse, before anything is sent, a tensor no receiver could rebuild.

    Raises:
        TypeError: ``value`` is not dense (strided), or its dtype is one a
            receiver does not allocate (quantized dtypes).
    """
    if value.layout != torch.strided or value.is_nested:
        kind = "nested" if value.is_nested else str(value.layout)
        raise TypeError(
            f"tensor_dict[{key!r}] is a {kind} tensor; only dense (strided) "
            f"tensors can be sent (.to_dense(), or .unbind() a nested one)"
        )
    if _dtype_name(value.dtype) not in _DTYPES:
        raise TypeError(
            f"tensor_dict[{key!r}] has dtype {value.dtype}, which cannot be sent "
            f"(quantized tensors do not travel); send .int_repr() with its scale and "
            f"zero point, or .dequantize()"
        )


def _alloc(desc: list[Any], device: torch.device, numel_div: int = 1) -> torch.Tensor:
    """A tensor for a descriptor :func:`check_metadata` accepted."""
    dev_type, dtype_name, shape, _ = desc
    dev = torch.device("cpu") if dev_type == "cpu" else device
    if numel_div == 1:
        return torch.empty(shape, dtype=_dtype(dtype_name), device=dev)
    numel = 1
    for s in shape:
        numel *= s
    return torch.empty(numel // numel_div, dtype=_dtype(dtype_name), device=dev)


def check_metadata(meta: Any, device_type: str) -> list[list[Any]]:
    """Check received tensor-dict metadata before anything is allocated for it.

    Args:
        meta: What the codec decoded (a list of ``[key, kind, value]``).
        device_type: The receiving group's device type (``"cpu"``, ``"cuda"``).

    Returns:
        ``meta`` itself, every entry known to be well formed: keys hashable,
        kinds known, tensor descriptors ``[device, dtype, shape, parts]`` with a
        device of ``"cpu"`` or ``device_type``, a known dtype, at most 64
        non-negative dimensions whose byte size fits in 62 bits, and ``parts``
        (``0`` or a slice count) dividing the element count; the CPU tensors
        together no larger than this host's memory and swap (the receiver
        must hold them all, so a larger claim is a lie).

    Raises:
        DecodeError: Any entry is malformed.
    """
    if type(meta) is not list:
        raise DecodeError(f"tensor-dict metadata must be a list, got {type(meta).__name__}")
    cpu_bytes = 0
    for i, entry in enumerate(meta):
        if type(entry) is not list or len(entry) != 3 or entry[1] not in (VALUE, TENSOR, INLINE):
            raise DecodeError(f"tensor-dict metadata entry {i} is malformed: {entry!r:.200}")
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
    return meta


def _check_desc(desc: Any, device_type: str, i: int) -> int:
    """Check one tensor descriptor; returns the bytes of its whole tensor."""
    if type(desc) is not list or len(desc) != 4:
        raise DecodeError(f"tensor-dict metadata entry {i}: bad tensor descriptor {desc!r:.200}")
    dev_type, dtype_name, shape, parts = desc
    if dev_type not in ("cpu", device_type):
        raise DecodeError(f"tensor-dict metadata entry {i}: device {dev_type!r:.40} is not "
                          f"'cpu' or this group's {device_type!r}")
    itemsize = _dtype(dtype_name).itemsize
    if (type(shape) is not list or len(shape) > _MAX_NDIM
            or not all(type(n) is int and n >= 0 for n in shape)):
        raise DecodeError(f"tensor-dict metadata entry {i}: bad shape {shape!r:.200}")
    numel, span = 1, 1
    for n in shape:
        numel *= n
        span *= max(n, 1)  # an empty tensor's strides still multiply its other sizes
    if span * itemsize > _MAX_TENSOR_BYTES:
        raise DecodeError(f"tensor-dict metadata entry {i}: shape {shape} is too large")
    if type(parts) is not int or parts < 0 or (parts and numel % parts):
        raise DecodeError(f"tensor-dict metadata entry {i}: bad slice count {parts!r:.40} "
                          f"for {numel} elements")
    return numel * itemsize


def _check_host_bytes(nbytes: int) -> None:
    """Refuse metadata whose CPU tensors could not fit in this host's memory."""
    if nbytes > object_comm.host_memory():
        raise DecodeError(f"tensor-dict metadata describes {nbytes} bytes of CPU tensors, more "
                          f"than this host's memory and swap ({object_comm.host_memory()} bytes)")


# ---------------------------------------------------------------------- broadcast
def broadcast_tensor_dict(
    coord: GroupCoordinator,
    tensor_dict: Mapping[Any, Any] | None,
    src: int,
    group: dist.ProcessGroup | None,
    metadata_group: dist.ProcessGroup | None,
) -> dict[Any, Any] | None:
    """Implementation of :meth:`GroupCoordinator.broadcast_tensor_dict`."""
    overrides = group is not None or metadata_group is not None
    use_mq = not overrides and coord.mq_broadcaster is not None and src == coord.mq_writer_rank
    is_src = coord.rank_in_group == src
    if is_src:
        try:
            meta, payload = flatten_tensor_dict(  # type: ignore[arg-type]
                tensor_dict, inline_cpu=use_mq, device=coord.device
            )
        except (TypeError, ValueError) as e:
            abort_broadcast(coord, src, group, metadata_group, str(e))
            raise
        try:
            _bcast_meta(coord, meta, src, group, metadata_group)
        except SERIALIZE_ERRORS as e:
            abort_broadcast(coord, src, group, metadata_group, f"{type(e).__name__}: {e}")
            raise TypeError(
                f"broadcast_tensor_dict on group {coord.unique_name!r}: tensor_dict holds a value "
                f"that cannot be serialised ({type(e).__name__}: {e})"
            ) from e
        for t in payload:
            if t.numel():
                _bcast_tensor(coord, dense(t), src, group, metadata_group)
        return dict(tensor_dict)  # type: ignore[arg-type]
    meta = _bcast_meta(coord, None, src, group, metadata_group)
    if isinstance(meta, SourceFailure):
        raise CollectiveMismatch(
            f"broadcast_tensor_dict on group {coord.unique_name!r}: the source rank {src} "
            f"rejected its input ({meta.message}); fix the call on rank {src}",
            queue=coord.unique_name, peers=(src,),
        )
    check_metadata(meta, coord.device.type)
    out: dict[Any, Any] = {}
    for key, kind, value in meta:
        if kind == TENSOR:
            t = _alloc(value, coord.device)
            if t.numel():
                _bcast_tensor(coord, t, src, group, metadata_group)
            out[key] = t
        else:
            out[key] = value
    return out


def abort_broadcast(
    coord: GroupCoordinator,
    src: int,
    group: dist.ProcessGroup | None,
    metadata_group: dist.ProcessGroup | None,
    message: str,
) -> None:
    """On ``src``: send an error marker where receivers expect metadata, so they
    raise instead of waiting for a broadcast that will never come."""
    _bcast_meta(coord, SourceFailure(message), src, group, metadata_group)


def _bcast_meta(
    coord: GroupCoordinator,
    obj: Any,
    src: int,
    group: dist.ProcessGroup | None,
    metadata_group: dist.ProcessGroup | None,
) -> Any:
    """Broadcast the metadata object (no failure checks; callers do them).

    Through the group's message queue or as codec bytes over the CPU group
    (``metadata_group`` when given); never pickled unless the group opted in.
    """
    if group is not None or metadata_group is not None:
        return coord._broadcast_raw(obj, src, metadata_group or coord.cpu_group,
                                    op="broadcast_tensor_dict")
    return coord._broadcast_raw(obj, src, op="broadcast_tensor_dict")


def _bcast_tensor(
    coord: GroupCoordinator,
    t: torch.Tensor,
    src: int,
    group: dist.ProcessGroup | None,
    metadata_group: dist.ProcessGroup | None,
) -> None:
    on_cpu = t.device.type == "cpu"
    if group is not None or metadata_group is not None:
        pg = (metadata_group or coord.cpu_group) if on_cpu else (group or coord.device_group)
        dist.broadcast(wire_view(t), src=coord.ranks[src], group=pg)
    elif t.device.type == coord.device.type:
        coord.comm.broadcast(t, src=src)
    else:  # CPU tensor in a GPU group: over the CPU group
        dist.broadcast(wire_view(t), src=coord.ranks[src], group=coord.cpu_group)


# ---------------------------------------------------------------------- point to point
def check_all_gather_group(group: Any) -> GroupCoordinator | None:
    """``all_gather_group``: None or a GroupCoordinator."""
    from coordinator.group.group_coordinator import GroupCoordinator

    if group is None or isinstance(group, GroupCoordinator):
        return group
    raise TypeError(f"all_gather_group must be a GroupCoordinator, got {type(group).__name__}")


def send_tensor_dict(
    coord: GroupCoordinator,
    tensor_dict: Mapping[Any, Any],
    dst: int,
    all_gather_group: GroupCoordinator | None,
    all_gather_tensors: Mapping[Any, bool] | None,
) -> None:
    """Implementation of :meth:`GroupCoordinator.send_tensor_dict`.

    A ``tensor_dict`` this rank cannot send (not a mapping, a meta or sparse
    tensor, a value the codec refuses) is reported to the receiver in place of
    the dict, as ``send`` reports its bad arguments: it raises instead of
    waiting for its timeout.
    """
    try:
        if not isinstance(tensor_dict, Mapping):
            raise TypeError(f"tensor_dict must be a dict, got {type(tensor_dict).__name__}")
        all_gather_group = check_all_gather_group(all_gather_group)
        n = all_gather_group.world_size if all_gather_group is not None else 1
        slicing = _slicing_plan(tensor_dict, n, all_gather_tensors)
        meta, payload = flatten_tensor_dict(tensor_dict, slicing=slicing, parts=n,
                                            device=coord.device)
    except (TypeError, ValueError) as e:
        reject_send(coord, dst, e)
        raise
    if all_gather_group is not None:  # sliced: send only this rank's 1/n
        payload = [t.reshape(n, -1)[all_gather_group.rank_in_group] if desc[3] else t
                   for (_, _, desc), t in zip((m for m in meta if m[1] == TENSOR), payload)]
    link = coord._links.sender(dst)
    if link is not None:
        _send_on_link(coord, link, meta, payload, dst)
        return
    try:
        coord._send_object(meta, dst, object_comm.DICT_META)
    except TypeError as e:  # the receiver was told by send_object
        raise TypeError(
            f"send_tensor_dict on group {coord.unique_name!r}: tensor_dict holds a value that "
            f"cannot be serialised ({e.__cause__ or e})"
        ) from e
    for t in payload:
        if t.numel():
            _send(coord, dense(t), dst)


def reject_send(coord: GroupCoordinator, dst: int, e: BaseException) -> None:
    """Send, in place of the dict ``dst`` waits for, why this rank's call failed:
    on the direction's link (settling it if this is its first call) the
    receiver raises ``PeerRejectedError``; on the CPU group, ``CollectiveMismatch``
    naming this rank. Failing to tell is noted on ``e``."""
    reason = f"{type(e).__name__}: {e}"
    try:
        link = coord._links.sender(dst)
        if link is not None:
            link.enqueue(link_messages.rejection(reason))
        else:
            coord._cpu_call("send_tensor_dict", object_comm.send_failure, reason,
                            coord.ranks[dst], coord.cpu_group, object_comm.DICT_META)
    except (GroupCoordError, RuntimeError) as notify:
        e.add_note(f"telling rank {dst} of group {coord.unique_name!r} failed: {notify}")


def _send_on_link(coord: GroupCoordinator, link: Any, meta: list[list[Any]],
                  payload: list[torch.Tensor], dst: int) -> None:
    """The dict on its link; a value the codec refuses is reported to the receiver."""
    try:
        refusal = link_messages.send(link, meta, payload,
                                     lambda e: coord._links.break_direction(SEND_SIDE, dst, e))
    except SERIALIZE_ERRORS as e:  # encoding comes first: nothing was published
        link.enqueue(link_messages.failure(f"{type(e).__name__}: {e}"))
        raise TypeError(
            f"send_tensor_dict on group {coord.unique_name!r}: tensor_dict holds a value that "
            f"cannot be serialised ({type(e).__name__}: {e})"
        ) from e
    if refusal is not None:
        raise link_messages.refused(coord.unique_name, "send_tensor_dict", refusal, dst)


def recv_tensor_dict(
    coord: GroupCoordinator,
    src: int,
    all_gather_group: GroupCoordinator | None,
) -> dict[Any, Any]:
    """Implementation of :meth:`GroupCoordinator.recv_tensor_dict`.

    A bad ``all_gather_group`` (not a group, or not the sender's kind) is
    raised after the dict has been received, so the sender's call completes
    and the direction stays in step.
    """
    try:
        all_gather_group = check_all_gather_group(all_gather_group)
        bad_group: TypeError | None = None
    except TypeError as e:
        all_gather_group, bad_group = None, e
    link = coord._links.receiver(src)
    if link is None:
        meta = check_metadata(coord._recv_object(src, object_comm.DICT_META), coord.device.type)
        def fill(desc: list[Any], parts: int, key: Any) -> torch.Tensor:
            return _recv_into(coord, _alloc(desc, coord.device, parts or 1), src)
    else:
        pieces = link_messages.receive(
            link, src, lambda e: coord._links.break_direction(RECV_SIDE, src, e),
            link_messages.DICT, coord.unique_name, coord.device.type)
        meta = pieces.meta
        def fill(desc: list[Any], parts: int, key: Any) -> torch.Tensor:
            numel = math.prod(desc[2]) // (parts or 1)
            flat = pieces.take(_dtype(desc[1]), numel, key)
            return flat if parts else flat.reshape(desc[2])
    out: dict[Any, Any] = {}
    problem = ""
    have = all_gather_group.world_size if all_gather_group is not None else None
    for key, kind, value in meta:
        if kind != TENSOR:
            out[key] = value
            continue
        parts = int(value[3])
        if not parts:
            out[key] = fill(value, 0, key)
            continue
        piece = fill(value, parts, key)
        if all_gather_group is None or have != parts:
            # Keep receiving (the sender is blocked on its sends), report at the end.
            problem = problem or (
                f"the sender sliced tensor {key!r} into {parts} parts for an all-gather, but "
                f"recv_tensor_dict was called with "
                f"{'no all_gather_group' if have is None else f'an all_gather_group of size {have}'}"
                f"; pass the same kind of all_gather_group on both sides"
            )
            continue
        full = all_gather_group.all_gather(piece, dim=0)
        out[key] = full.reshape(value[2])
    if bad_group is not None:
        raise bad_group
    if problem:
        raise ValueError(problem)
    return out


def _numels(meta: list[list[Any]]) -> list[tuple[int, list[Any]]]:
    """``(elements sent, descriptor)`` of every tensor entry of checked metadata."""
    return [(math.prod(v[2]) // (v[3] or 1), v) for _, kind, v in meta if kind == TENSOR]


def _slicing_plan(
    tensor_dict: Mapping[Any, Any], n: int, overrides: Mapping[Any, bool] | None
) -> dict[Any, bool]:
    if overrides is not None and not isinstance(overrides, Mapping):
        raise TypeError(
            f"all_gather_tensors must be a dict of key -> bool, got {type(overrides).__name__}"
        )
    plan: dict[Any, bool] = {}
    for key, t in tensor_dict.items():
        if not isinstance(t, torch.Tensor):
            continue
        divisible = n > 1 and t.numel() > 0 and t.numel() % n == 0
        want = overrides.get(key, divisible) if overrides else divisible
        if want and n == 1:
            raise ValueError(
                f"all_gather_tensors[{key!r}] is True but no all_gather_group of more than "
                f"one rank was given; pass all_gather_group to slice tensors"
            )
        if want and not divisible:
            raise ValueError(
                f"all_gather_tensors[{key!r}] is True but tensor {key!r} has {t.numel()} "
                f"elements, not divisible by the all_gather_group size {n}"
            )
        plan[key] = bool(want)
    return plan


def _send(coord: GroupCoordinator, t: torch.Tensor, dst: int) -> None:
    if t.device.type == coord.device.type:
        coord.comm.send(t, dst=dst)
    else:  # CPU tensor in a GPU group: over the CPU group
        dist.send(wire_view(t), dst=coord.ranks[dst], group=coord.cpu_group)


def _recv_into(coord: GroupCoordinator, buf: torch.Tensor, src: int) -> torch.Tensor:
    """Receive into a tensor shaped like ``buf`` (returns the filled tensor)."""
    if not buf.numel():
        return buf
    if buf.device.type == coord.device.type:
        return coord.comm.recv(buf.shape, buf.dtype, src=src)
    dist.recv(wire_view(buf), src=coord.ranks[src], group=coord.cpu_group)
    return buf

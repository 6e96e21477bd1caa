"""Argument checks shared by every communicator (user input never hits ``assert``)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import torch

from shm_broadcast import checks
from shm_broadcast.codec.tensor_layout import contiguous
from shm_broadcast.codec.tensor_storage import check_storage, storage_covers

__all__ = [
    "check_device", "check_group", "check_writable", "check_fits", "gather_dim", "check_tensor",
    "NOT_COPYABLE",
    "check_storage", "storage_covers", "resolved", "dense", "check_out",
    "check_gather_out",
    "check_out_meta",
    "norm_dim", "check_rank", "check_spec", "check_sizes", "check_divisible",
]


def check_device(device: Any, arg: str = "device") -> torch.device:
    """``device`` as a :class:`torch.device` (a device, a string such as ``"cuda:1"``,
    or a CUDA index).

    Raises:
        TypeError: ``device`` is none of those.
        ValueError: A string torch cannot parse as a device, or a negative index.
    """
    if isinstance(device, torch.device):
        return device
    if isinstance(device, bool) or not isinstance(device, (str, int)):
        raise TypeError(f"{arg} must be a torch.device, a device string or an index, "
                        f"got {type(device).__name__} ({device!r:.60})")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{arg} must name a device (e.g. 'cpu' or 'cuda:0'), "
                         f"got {device!r:.60} ({e})") from None


def check_group(group: Any, arg: str, allow_none: bool = False) -> Any:
    """``group`` if it is a :class:`torch.distributed.ProcessGroup` this process
    belongs to (or None, with ``allow_none``).

    Raises:
        TypeError: ``group`` is not a ProcessGroup.
        ValueError: This process is not a member of it.
    """
    import torch.distributed as dist

    if group is None and allow_none:
        return None
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{arg} must be a torch.distributed.ProcessGroup"
                        f"{' or None' if allow_none else ''}, got {type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError(f"{arg}: this process (rank {dist.get_rank()}) is not a member")
    return group


#: Dtypes torch stores one element per byte but cannot copy (no copy kernel).
NOT_COPYABLE = frozenset(
    dt for dt in (getattr(torch, f"{kind}{bits}", None) for kind in ("uint", "int")
                  for bits in range(1, 8))
    if isinstance(dt, torch.dtype)
)


def check_tensor(t: Any, arg: str, device: torch.device | None = None,
                 copied: bool = False) -> torch.Tensor:
    """Return ``t`` if it is a dense tensor with data (on ``device``'s type when given).

    Layout and storage are checked here, before any communication: a sparse or
    meta tensor that got further would fail mid-collective on one rank only.
    With ``copied`` (a collective, whose transports copy tensors with torch) a
    dtype torch cannot copy (:data:`NOT_COPYABLE`) is refused too.

    Raises:
        TypeError: ``t`` is not a tensor, or is sparse / quantised / nested, or
            (``copied``) of a dtype in :data:`NOT_COPYABLE`.
        ValueError: ``t`` is a meta tensor, on another device type, or its
            storage no longer holds its elements (:func:`check_storage`).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided or t.is_quantized or t.is_nested:
        kind = "quantised" if t.is_quantized else "nested" if t.is_nested else str(t.layout)
        raise TypeError(
            f"{arg} must be a dense (torch.strided) tensor, got a {kind} tensor; "
            f"convert it first (e.g. .to_dense())"
        )
    if copied and t.dtype in NOT_COPYABLE:
        raise TypeError(
            f"{arg} has dtype {t.dtype}, which torch cannot copy (it has no copy kernel "
            f"for it), and collectives copy their tensors; send its bytes and view them "
            f"back: {arg}.view(torch.uint8), then .view({t.dtype}) on the result"
        )
    if t.is_meta:
        where = f" on a {device.type} device" if device is not None else ""
        raise ValueError(f"{arg} is a meta tensor (it has no data); materialise it{where} first")
    if device is not None and t.device.type != device.type:
        raise ValueError(
            f"{arg} must be on a {device.type} device for this communicator, "
            f"got a tensor on {t.device}; move it with .to({str(device)!r})"
        )
    check_storage(t, arg)
    return t


def check_writable(t: torch.Tensor, arg: str) -> torch.Tensor:
    """Return ``t`` if data can be received into it: no two of its elements share
    memory (an ``expand``-ed or stride-0 view cannot hold distinct values), and
    torch allows writing into it here (:func:`check_receivable`).

    Raises:
        ValueError: ``t`` has a dimension of size above 1 with stride 0, or is
            an inference tensor outside ``torch.inference_mode()``.
    """
    check_receivable(t, arg)
    shared = [d for d, (n, s) in enumerate(zip(t.shape, t.stride(), strict=True))
              if s == 0 and n > 1]
    if shared:
        raise ValueError(
            f"{arg} cannot receive data: it is an expanded view whose elements share memory "
            f"(stride 0 in dim {shared[0]} of shape {tuple(t.shape)}); receive into a tensor "
            f"that owns its elements, e.g. {arg}.clone()"
        )
    return t


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t``, or its values materialised when it is a lazy conjugate or negative view.

    Transports move raw elements: a view whose bytes are not its values (the
    imaginary part of a conjugate, ``z.conj().imag``, is a negative view) must
    not be sent as it is, nor a zero tensor without storage (autograd's
    efficient zeros).
    """
    if t.is_conj() or t.is_neg():
        return t.resolve_conj().resolve_neg()
    # autograd's storage-less zeros: data_ptr() is 0 (torch has no public test for them)
    if t._is_zerotensor():  # noqa: SLF001 - torch's own API
        return torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    return t


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` as contiguous raw elements that are its values (see :func:`resolved`),
    flattening to a stride-1 view (``t.reshape(-1).view(torch.uint8)`` works).

    torch calls a tensor of at most one element contiguous whatever its strides
    (``x[3:4:2]``), and its flat view keeps the odd stride; such a tensor is
    copied into fresh storage (a few bytes).
    """
    t = contiguous(resolved(t))  # sub-byte dtypes too, which torch cannot copy
    if t.numel() <= 1 and t.dim() and t.stride(-1) != 1:
        t = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
    return t


def check_receivable(t: torch.Tensor, arg: str) -> torch.Tensor:
    """Return ``t`` if a call may write into it here: not an inference tensor
    outside ``torch.inference_mode()`` (torch refuses every in-place write into
    one there, and a write refused after the call's step would fail this rank
    alone).

    Raises:
        ValueError: ``t`` is such an inference tensor.
    """
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(
            f"{arg} is an inference tensor (made under torch.inference_mode()), which "
            f"cannot be written outside inference mode; make the call inside "
            f"torch.inference_mode() or pass a tensor made outside it")
    return t


def check_out(out: Any, like: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """Return ``out`` if it can take a result shaped like ``like``, written element-wise.

    It must be a dense, contiguous tensor with ``like``'s dtype and shape (not a
    lazy conjugate or negative view), and either be ``like`` itself (same
    memory, in place) or share no memory with it.

    Raises:
        TypeError: ``out`` is not a dense tensor, or its dtype differs.
        ValueError: ``out``'s device type, shape or layout is wrong, it is a
            storage-less zero tensor, or it partly overlaps ``like``.
    """
    check_tensor(out, "out", device)
    check_out_meta(out, like)
    check_receivable(out, "out")
    # data_ptr() is 0: there is nowhere to write (torch has no public test for it)
    if out._is_zerotensor():  # noqa: SLF001 - torch's own API
        raise ValueError(
            "out must have memory to write into, got a storage-less zero tensor "
            "(autograd's efficient zeros); pass torch.zeros_like(out)"
        )
    if out.device != like.device:
        raise ValueError(f"out must be on {like.device} (input_'s device), got {out.device}")
    if out.is_conj() or out.is_neg():
        raise ValueError(
            f"out must not be a lazy view (is_conj()={out.is_conj()}, is_neg()={out.is_neg()}): "
            "results are written as raw elements; pass out.resolve_conj().resolve_neg()"
        )
    if _overlap(out, like) and not (out.data_ptr() == like.data_ptr() and like.is_contiguous()):
        raise ValueError(
            f"out overlaps input_ without being the same memory (out's bytes start at "
            f"{out.data_ptr():#x}, input_'s at {like.data_ptr():#x}); pass input_ itself "
            "(in place) or a separate tensor"
        )
    checked: torch.Tensor = out  # a tensor since check_tensor(out) returned
    return checked


def check_gather_out(out: Any, like: torch.Tensor, dim: int, world_size: int,
                     device: torch.device | None = None) -> torch.Tensor:
    """Return ``out`` if it can take the all-gather of ``like`` along ``dim`` over
    ``world_size`` ranks: a dense, contiguous tensor of ``like``'s dtype and
    device with ``like``'s shape but ``world_size`` times as long along ``dim``,
    not a lazy conjugate or negative view, sharing no memory with ``like``.

    Raises:
        TypeError: ``out`` is not a dense tensor, or its dtype differs.
        ValueError: its device, shape or layout is wrong, it is a storage-less
            zero tensor, or it overlaps ``like``.
    """
    check_tensor(out, "out", device)
    check_receivable(out, "out")
    if out.dtype != like.dtype:
        raise TypeError(f"out must have dtype {like.dtype} (input_'s), got {out.dtype}")
    want = like.shape[:dim] + (like.shape[dim] * world_size,) + like.shape[dim + 1:]
    if out.shape != want:
        raise ValueError(f"out must have shape {tuple(want)} (input_'s, {world_size} times "
                         f"as long along dim {dim}), got {tuple(out.shape)}")
    if not out.is_contiguous():
        raise ValueError(
            f"out must be contiguous, got strides {out.stride()} for shape {tuple(out.shape)}")
    if out.device != like.device:
        raise ValueError(f"out must be on {like.device} (input_'s device), got {out.device}")
    if out.is_conj() or out.is_neg():
        raise ValueError(
            f"out must not be a lazy view (is_conj()={out.is_conj()}, is_neg()={out.is_neg()}): "
            "results are written as raw elements; pass out.resolve_conj().resolve_neg()")
    if out._is_zerotensor():  # noqa: SLF001 - torch's own API
        raise ValueError("out must have memory to write into, got a storage-less zero tensor")
    if _overlap(out, like):
        raise ValueError("out must not share memory with input_ (the gathered result is "
                         "written while input_ may still be read); pass a separate tensor")
    checked: torch.Tensor = out
    return checked


def check_out_meta(out: Any, like: torch.Tensor) -> torch.Tensor:
    """The checks of :func:`check_out` that need only metadata (what a traced call can do)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != like.dtype:
        raise TypeError(f"out must have dtype {like.dtype} (input_'s), got {out.dtype}")
    if out.shape != like.shape:
        raise ValueError(
            f"out must have shape {tuple(like.shape)} (input_'s), got {tuple(out.shape)}")
    if not out.is_contiguous():
        raise ValueError(
            f"out must be contiguous, got strides {out.stride()} for shape {tuple(out.shape)}")
    return out


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges spanned by ``a`` and ``b`` intersect."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True) if st > 0)
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def norm_dim(dim: Any, ndim: int, arg: str = "dim") -> int:
    """Return ``dim`` as a non-negative index into a tensor of ``ndim`` dims."""
    d = checks.as_int(dim)
    if d is None:
        raise TypeError(f"{arg} must be an int, got {type(dim).__name__}")
    if ndim == 0:
        raise ValueError(f"{arg}={d} is invalid for a 0-dim tensor; reshape it to 1-D first")
    if not -ndim <= d < ndim:
        raise ValueError(f"{arg} must be in [{-ndim}, {ndim}) for a {ndim}-D tensor, got {d}")
    return d % ndim


_INT64_MAX = (1 << 63) - 1


def _host_memory() -> int:
    """Bytes of physical memory on this host (0: unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def check_fits(shape: Sequence[int], dtype: torch.dtype, device: torch.device | None,
               arg: str) -> None:
    """A tensor of ``shape`` and ``dtype`` that a call would allocate can exist: its
    element count fits an int64 and, in host memory, its bytes fit this host's
    memory. Checked before the call, so an impossible size is refused (and the
    peers told) instead of failing the allocation partway.

    Raises:
        ValueError: The tensor is larger than that, naming ``arg``.
    """
    numel = math.prod(int(s) for s in shape)
    nbytes = numel * (dtype.itemsize if hasattr(dtype, "itemsize") else 1)
    limit = _host_memory() if device is None or device.type == "cpu" else 0
    too_long = max(shape, default=0) > _INT64_MAX or numel > _INT64_MAX or nbytes > _INT64_MAX
    if too_long or (limit and nbytes > limit):
        where = "int64" if too_long else f"this host's memory ({limit} bytes)"
        raise ValueError(
            f"{arg}: the result would be a {dtype} tensor of shape {tuple(shape)} "
            f"({numel} elements, {nbytes} bytes), more than {where} can hold"
        )


def gather_dim(t: torch.Tensor, dim: Any, world_size: int, arg: str = "input_") -> int:
    """``dim`` normalised for ``t`` (:func:`norm_dim`), once the gathered result of
    ``world_size`` such tensors along it can exist (:func:`check_fits`)."""
    d = norm_dim(dim, t.dim())
    shape = list(t.shape)
    shape[d] *= world_size
    check_fits(shape, t.dtype, t.device, arg)
    return d


def check_spec(size: Any, dtype: Any, device: torch.device | None = None) -> torch.Size:
    """The shape of a ``recv(size, dtype)`` call (a shape, or an int for a 1-D
    tensor), checked with its dtype.

    Raises:
        TypeError: ``dtype`` is not a ``torch.dtype`` or ``size`` not a sequence of ints.
        ValueError: ``size`` has a negative entry.
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    if checks.as_int(size) is not None:
        size = (size,)  # a length, as torch.empty(n) takes it (vLLM's callers pass one)
    dims = [checks.as_int(s) for s in size] if isinstance(size, (torch.Size, list, tuple)) else None
    if dims is None or None in dims:
        raise TypeError(f"size must be a shape (a sequence of ints), got {size!r}")
    size = dims
    if any(s < 0 for s in size):
        raise ValueError(f"size must not have negative entries, got {tuple(size)}")
    check_fits(size, dtype, device, "size")
    return torch.Size(size)


def check_rank(r: Any, world_size: int, arg: str) -> int:
    """Return ``r`` if it is a valid group rank, else raise TypeError/ValueError."""
    return checks.check_rank(r, world_size, arg)


def check_sizes(
    sizes: Any, world_size: int, arg: str = "sizes", total: int | None = None
) -> list[int]:
    """Validate a per-rank size list (non-negative ints, one per rank, optional sum)."""
    if not isinstance(sizes, (list, tuple)):
        raise TypeError(f"{arg} must be a list of ints (one per rank), got {type(sizes).__name__}")
    if len(sizes) != world_size:
        raise ValueError(f"{arg} must have {world_size} entries (one per rank), got {len(sizes)}")
    out = []
    for i, s in enumerate(sizes):
        out.append(checks.check_int(s, f"{arg}[{i}]", minimum=0))
    if total is not None and sum(out) != total:
        raise ValueError(
            f"{arg} must sum to the size of the scattered dimension ({total}), "
            f"got sum({out}) = {sum(out)}"
        )
    return out


def check_divisible(n: int, world_size: int, what: str) -> None:
    """Raise ValueError unless ``n`` splits evenly across ``world_size`` ranks."""
    if n % world_size:
        raise ValueError(
            f"{what} ({n}) must be divisible by the group's world size ({world_size}); "
            f"use the 'v' variant with explicit sizes for uneven splits"
        )


def same_shapes(tensors: Sequence[torch.Tensor]) -> bool:
    """True when all tensors share one shape."""
    return all(t.shape == tensors[0].shape for t in tensors)

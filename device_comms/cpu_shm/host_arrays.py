"""numpy arrays over a CPU tensor's bytes that leave the tensor untouched.

``Tensor.numpy()`` marks the tensor's storage as not resizable for the rest of
its life (numpy holds a pointer into it), so a caller's ``x.resize_(n)`` or
``x.untyped_storage().resize_(0)`` would fail after a collective touched
``x``. The engine therefore never calls it on a caller's tensor: it maps the
bytes by address instead, which is no dearer (a few Python-level calls either
way). The array owns
nothing; it is valid while the tensor it was made for occupies those bytes, so
callers use it within the call that made it, or -- like
:class:`~device_comms.cpu_shm.address_views.AddressViews` -- only for a live
tensor that starts at the same address and spans the same bytes.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

__all__ = ["bytes_at", "array_of", "numpy_dtype", "mark_written"]

_NUMPY_DTYPES: dict[torch.dtype, Any] = {}


def bytes_at(addr: int, nbytes: int) -> Any:
    """The ``nbytes`` bytes at ``addr`` as a writable uint8 array (owning nothing)."""
    if nbytes <= 0 or not addr:
        return np.empty(0, dtype=np.uint8)
    raw = (ctypes.c_uint8 * nbytes).from_address(addr)
    return np.frombuffer(raw, dtype=np.uint8)  # type: ignore[call-overload]  # ctypes: a buffer


def numpy_dtype(dtype: torch.dtype) -> Any:
    """numpy's dtype for a torch dtype numpy has (TypeError for bfloat16 and the like)."""
    got = _NUMPY_DTYPES.get(dtype)
    if got is None:
        got = _NUMPY_DTYPES[dtype] = torch.empty(0, dtype=dtype, device="cpu").numpy().dtype
    return got


def array_of(tensor: torch.Tensor) -> Any:
    """Contiguous CPU ``tensor``'s elements as a numpy array of its shape (no copy)."""
    flat = bytes_at(tensor.data_ptr(), tensor.nbytes).view(numpy_dtype(tensor.dtype))
    return flat.reshape(tuple(tensor.shape))


def _version_bumper() -> Any:
    """torch's C entry that counts an in-place write into each tensor of a tuple, else
    the public wrapper around it (a Python function around the same entry)."""
    # torch's own private API: the C entry and the version counter have no public names
    bump = getattr(torch._C, "_increment_version", None)  # noqa: SLF001 - torch's own
    if bump is None:
        return torch.autograd.graph.increment_version
    probe = torch.empty(0, device="cpu")
    try:
        before = probe._version  # noqa: SLF001 - torch's own
        bump((probe,))
        if probe._version == before + 1:  # noqa: SLF001 - torch's own
            return bump
    except (TypeError, RuntimeError):
        pass
    return torch.autograd.graph.increment_version


_bump_versions = _version_bumper()


def mark_written(tensor: torch.Tensor) -> None:
    """Count a write into ``tensor`` that torch did not see (ctypes, numpy), as an in-place
    op does, so autograd refuses a tensor it saved for backward instead of using new values."""
    _bump_versions((tensor,))

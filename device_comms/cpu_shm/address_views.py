"""numpy views of caller memory, by address, for tensors of one shape and dtype.

The one-step all_reduce (:mod:`device_comms.cpu_shm.small`) copies its input
into its slot, and writes an in-place result, through numpy views of the
caller's bytes: a copy through a view is cheaper than a ``ctypes.memmove``
call, and the views are kept from call to call, keyed by the address they
map. :class:`AddressViews` is that cache; its docstring states when a view is
right and its code is the only way in.
"""

from __future__ import annotations

from typing import Any

import torch

from device_comms.cpu_shm.host_arrays import bytes_at
from device_comms.cpu_shm.seen_once import SeenOnce

__all__ = ["AddressViews", "NULL_PAGE"]

#: No mapping starts in the first page: an address below it is ``data_ptr()`` of a
#: tensor without memory (autograd's zeros: 0; a view of a storage resized to 0: its
#: offset).
NULL_PAGE = 4096


class AddressViews:
    """numpy views of the bytes at an address, for live contiguous tensors of one shape and dtype.

    **Invariant.** :meth:`get` is asked only for ``t.data_ptr()`` of a live
    contiguous tensor ``t`` of :attr:`shape` and :attr:`dtype`, during a call
    that holds ``t``. Then the ``nbytes`` bytes at that address are exactly
    ``t``'s bytes, whichever allocation they belong to now, and they stay
    mapped while ``t`` lives; so a view made at that address for an earlier
    tensor (since freed: allocators hand freed blocks back) serves ``t`` just
    as well. That is why a view may own nothing, and must not: owning the
    earlier tensor's memory would keep it from being freed or resized.

    What the code enforces, so that the invariant is all a caller must keep:

    * every view spans exactly :attr:`nbytes` bytes and owns nothing (it is
      made from the address, never from a tensor's storage);
    * a view is made only for a tensor of this shape and dtype that is
      contiguous, starts at the address and has memory there (not below
      :data:`NULL_PAGE`), and only when the address comes back
      (:meth:`sight`): making views costs more than one copy through them saves;
    * at most ``limit`` addresses have views, and at most ``limit`` are
      remembered as seen once (either set is dropped whole when full).

    Args:
        like: A tensor of the shape and dtype (only those are kept).
        numpy_dtype: numpy's dtype for ``dtype`` when a typed view is wanted too
            (the one-step sum runs in numpy), else None.
        limit: Most addresses with views (and most remembered as seen once).

    Attributes:
        get: ``get(address)``: the ``(bytes, typed)`` views at ``address``, or None.
            ``bytes`` is a uint8 array of :attr:`nbytes`; ``typed`` the same bytes as
            an array of :attr:`shape` (None without ``numpy_dtype``). A plain dict
            lookup: it runs on every call.
        shape: The tensors' shape.
        dtype: Their dtype.
        nbytes: Bytes of one tensor.
    """

    __slots__ = ("get", "shape", "dtype", "nbytes", "_numpy_dtype", "_limit", "_views", "_seen")

    def __init__(self, like: torch.Tensor, numpy_dtype: Any = None, limit: int = 16) -> None:
        self.shape = like.shape
        self.dtype = like.dtype
        self.nbytes = like.nbytes
        self._numpy_dtype = numpy_dtype
        self._limit = limit
        self._views: dict[int, tuple[Any, Any]] = {}
        self._seen = SeenOnce(limit)
        self.get = self._views.get

    def __len__(self) -> int:
        """Addresses with views."""
        return len(self._views)

    def sight(self, tensor: torch.Tensor, address: int) -> tuple[Any, Any] | None:
        """Note a call on ``tensor`` at ``address`` (its ``data_ptr()``) that :meth:`get` missed.

        Returns:
            The new views of ``tensor``'s bytes when ``address`` was seen before
            (the tensor checked against this cache's shape and dtype first), else
            None: the first time an address is seen, or when ``tensor`` cannot
            have views (then the caller copies by other means).
        """
        if address < NULL_PAGE or not self.nbytes:
            return None
        if not self._seen.again(address):
            return None
        if (
            tensor.data_ptr() != address
            or tensor.dtype != self.dtype
            or tensor.shape != self.shape
            or not tensor.is_contiguous()
        ):
            return None
        raw = bytes_at(address, self.nbytes)
        typed = None
        if self._numpy_dtype is not None:
            typed = raw.view(self._numpy_dtype).reshape(tuple(self.shape))
        if len(self._views) >= self._limit:
            self._views.clear()
        views = self._views[address] = (raw, typed)
        return views

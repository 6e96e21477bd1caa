"""Whether a tensor's storage still holds every element its shape and strides reach.

``x.untyped_storage().resize_(0)`` keeps ``x``'s shape but frees its bytes
(``data_ptr()`` becomes 0, or a tiny offset); a shrinking ``resize_`` leaves
some of them outside. Anything that copies a tensor by address (the codec,
the shared-memory engine, links) checks this first, or it would crash on the
freed address or send whatever the allocator put after the shrunk storage.
Used from every layer, so it lives in the bottom package and needs nothing
but the tensor's own methods (no torch import).
"""

from __future__ import annotations

from typing import Any

__all__ = ["storage_covers", "check_storage"]


def _extent_bytes(t: Any) -> int:
    """Bytes of ``t``'s storage that its elements reach (from the storage's start)."""
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    extent: int = (t.storage_offset() + last + 1) * t.element_size()
    return extent


def storage_covers(t: Any) -> bool:
    """Whether every element of ``t`` lies in its storage (true for storage-less zeros,
    which :func:`device_comms.validation.resolved` replaces, and for empty tensors)."""
    nbytes = t.nbytes
    if nbytes == 0:
        return True
    try:
        have: int = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # a wrapper without a storage of its own
        return True
    # Contiguous (the common case): the elements end at offset + nbytes.
    if t.is_contiguous() and have >= t.storage_offset() * t.element_size() + nbytes:
        return True
    # torch's own test for its storage-less zero tensors (no public equivalent)
    return have >= _extent_bytes(t) or t._is_zerotensor()  # noqa: SLF001 - torch's API


def check_storage(t: Any, arg: str) -> None:
    """Raise ValueError when ``t``'s storage was freed or shrunk under it.

    ``x.untyped_storage().resize_(0)`` keeps ``x``'s shape but frees its bytes
    (``data_ptr()`` becomes 0, or a tiny offset): transports that copy by
    address would read zeros, garbage, or crash.
    """
    if not storage_covers(t):
        raise ValueError(
            f"{arg}'s storage holds {t.untyped_storage().nbytes()} bytes but its "
            f"{tuple(t.shape)} elements need {_extent_bytes(t)} (the storage was freed "
            f"or shrunk, e.g. by untyped_storage().resize_(0)); give it memory again "
            f"(untyped_storage().resize_(...)) or pass another tensor"
        )



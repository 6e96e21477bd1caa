"""Contiguous copies of any tensor, including those of dtypes torch cannot copy.

torch keeps its sub-byte dtypes (``torch.uint1``-``uint7``, ``int1``-``int7``)
one element per byte but has no copy kernel for them: ``contiguous()`` of a
non-contiguous one raises ``NotImplementedError``. Anything that moves raw
elements (the codec, the collectives) needs the contiguous bytes only, so such
a tensor is copied as ``uint8`` of the same strides and viewed back. Used from
every layer, so it lives in the bottom package and imports no torch at load.
"""

from __future__ import annotations

from typing import Any

__all__ = ["contiguous", "clone"]


def contiguous(t: Any) -> Any:
    """``t.contiguous()``, through its bytes when torch has no copy kernel for its dtype.

    Args:
        t: A tensor (any device, strided).

    Returns:
        ``t`` itself when contiguous, else a contiguous copy of the same dtype,
        shape and element bytes.
    """
    try:
        return t.contiguous()
    except NotImplementedError as e:
        return _copy_bytes(t, e)


def clone(t: Any) -> Any:
    """``t.clone()``, through its bytes when torch has no copy kernel for its dtype
    (then contiguous)."""
    try:
        return t.clone()
    except NotImplementedError as e:
        return _copy_bytes(t, e)


def _copy_bytes(t: Any, error: NotImplementedError) -> Any:
    """A contiguous copy of ``t`` made as ``uint8`` of the same strides, viewed back;
    ``error`` (torch's, for want of a copy kernel) again unless ``t`` holds one
    element per byte."""
    if t.element_size() != 1:
        raise error
    import torch

    return t.view(torch.uint8).clone(memory_format=torch.contiguous_format).view(t.dtype)

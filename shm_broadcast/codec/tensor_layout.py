"""A contiguous copy of any tensor, including those of dtypes torch cannot copy.

torch keeps its sub-byte dtypes (``torch.uint1``-``uint7``, ``int1``-``int7``)
one element per byte but has no copy kernel for them: ``contiguous()`` of a
non-contiguous one raises ``NotImplementedError``. Anything that moves raw
elements (the codec, the collectives) needs the contiguous bytes only, so such
a tensor is copied as ``uint8`` of the same strides and viewed back. Used from
every layer, so it lives in the bottom package and imports no torch at load.
"""

from __future__ import annotations

from typing import Any

__all__ = ["contiguous"]


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
    except NotImplementedError:  # no copy kernel for the dtype: copy one byte an element
        if t.element_size() != 1:
            raise
        import torch

        return t.view(torch.uint8).contiguous().view(t.dtype)

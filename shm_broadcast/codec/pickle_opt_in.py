"""The pickle opt-in: pickle protocol 5 with tensors and ndarrays out of band.

Reachable only with ``allow_pickle=True``: :class:`~shm_broadcast.codec.message_codec.Codec`
calls :func:`pickle_oob` for a value no ext holds and :func:`unpickle_oob` for
a received ``EXT_PICKLE`` only after checking its side opted in; without the
opt-in it raises (``TypeError`` sending, ``DecodeError`` receiving) and never
comes here. Unpickling runs whatever code the sender chose: only for peers
trusted as much as this process.

Inside a pickled value, plain tensors and non-object ndarrays are not pickled
but written as the codec's array descriptors (pickle ``persistent_id``), so
their bytes still travel raw in the message's blob. The codec passes the
functions that write and read those descriptors, which keeps this module free
of the codec's state.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

from shm_broadcast.codec.wire_format import (
    EXT_NDARRAY,
    EXT_TENSOR,
    TORCH,
    memoryview_state,
    rebuild_memoryview,
)
from shm_broadcast.errors import DecodeError

__all__ = ["OobPickler", "OobUnpickler", "pickle_oob", "unpickle_oob"]


class OobPickler(pickle.Pickler):
    """Pickler that sends plain tensors and ndarrays out-of-band (``allow_pickle`` only).

    Args:
        file: Where the pickle goes.
        tensor_desc: Writes a tensor's descriptor (reserving its bytes in the blob).
        array_desc: Likewise for an ndarray.
    """

    def __init__(self, file: io.BytesIO, tensor_desc: Callable[[Any], bytes],
                 array_desc: Callable[[np.ndarray], bytes]) -> None:
        super().__init__(file, protocol=5)
        self._tensor_desc = tensor_desc
        self._array_desc = array_desc

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is memoryview:  # not picklable by itself
            return rebuild_memoryview, memoryview_state(obj)
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        t = type(obj)
        if t is TORCH.tensor:  # None until torch is loaded
            return (EXT_TENSOR, self._tensor_desc(obj))
        if t is np.ndarray and not obj.dtype.hasobject and obj.dtype.itemsize:
            return (EXT_NDARRAY, self._array_desc(obj))
        return None


class OobUnpickler(pickle.Unpickler):
    """Unpickler resolving :class:`OobPickler`'s out-of-band arrays (``allow_pickle`` only).

    Args:
        file: The pickle.
        tensor_from: Reads a tensor from its descriptor (checked against the blob).
        array_from: Likewise for an ndarray.
    """

    def __init__(self, file: io.BytesIO, tensor_from: Callable[[Any], Any],
                 array_from: Callable[[Any], np.ndarray]) -> None:
        super().__init__(file)
        self._tensor_from = tensor_from
        self._array_from = array_from

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is not tuple or len(pid) != 2:
            raise DecodeError(f"corrupt message: bad persistent id {pid!r}")
        code, desc = pid
        if code == EXT_TENSOR:
            return self._tensor_from(desc)
        if code == EXT_NDARRAY:
            return self._array_from(desc)
        raise DecodeError(f"corrupt message: unknown persistent id code {code!r}")


def pickle_oob(obj: Any, tensor_desc: Callable[[Any], bytes],
               array_desc: Callable[[np.ndarray], bytes]) -> bytes:
    """Pickle ``obj`` with its plain tensors/ndarrays out of band (see :class:`OobPickler`)."""
    out = io.BytesIO()
    OobPickler(out, tensor_desc, array_desc).dump(obj)
    return out.getvalue()


def unpickle_oob(data: Any, tensor_from: Callable[[Any], Any],
                 array_from: Callable[[Any], np.ndarray]) -> Any:
    """Unpickle what :func:`pickle_oob` wrote; runs code the sender chose."""
    return OobUnpickler(io.BytesIO(data), tensor_from, array_from).load()

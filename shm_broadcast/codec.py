"""Message encoding: msgspec msgpack for the structure, raw bytes for arrays.

A message is two parts:

* ``msg``: msgpack bytes of the Python structure (msgspec), in which every
  ``torch.Tensor`` and ``numpy.ndarray`` is replaced by a small msgpack *ext*
  descriptor (dtype, shape, offset, size);
* ``blob``: the arrays' raw bytes, each at a 64-byte aligned offset. The
  writer ``memmove``\\ s them from the tensors' memory straight into the ring
  chunk (or one buffer for zmq); nothing is pickled.

Decoding copies every array out into fresh memory (``numpy.frombuffer(...)
.copy()``), so a returned tensor never aliases a chunk the writer will reuse.

What round-trips, exactly (``exact=True``, the default):

=========================================  ===================================
value                                      encoded as
=========================================  ===================================
None, bool, int (64-bit), float, str,      msgpack natives
bytes, list, dict with str/int keys
tuple, set, frozenset, dict with other     msgpack ext wrapping their items
keys (e.g. tuple keys)                     (so a tuple comes back a tuple)
memoryview                                 ext: bytes, format, shape (comes
                                           back as a memoryview over a copy)
``torch.Tensor`` (CPU, strided, any dtype  ext descriptor + raw bytes
incl. bfloat16/float8/complex, 0-dim,      (non-contiguous ones are made
empty, non-contiguous, conj/neg views)     contiguous first; requires_grad kept)
``numpy.ndarray`` (non-object dtype,       ext descriptor + raw bytes
structured dtypes included)
anything else (dataclasses, enums,         **pickle fallback**: protocol 5,
namedtuples, msgspec Structs, datetime,    with any tensor/ndarray inside
Parameter, subclasses of the above, ints   still sent out-of-band as raw
beyond 64 bits, object arrays...)          bytes (pickle ``persistent_id``)
=========================================  ===================================

Nesting is bounded by the interpreter's recursion limit (roughly a thousand
levels of lists/dicts, a few hundred of tuples/sets); deeper messages raise
:class:`ValueError` before anything is sent.

The pickle fallback is explicit: it can be switched off
(``allow_pickle=False``), after which such values raise :class:`TypeError`
naming their type. With ``exact=False`` the structure is handed to msgspec
as is, which is faster for huge lists (no per-element type scan, ~13 ns per
element) but lossy where msgpack is: tuples and sets come back as lists,
dataclasses/Structs as dicts, enums as their values.
"""

from __future__ import annotations

import ctypes
import io
import pickle
import struct
import sys
from typing import Any

import msgspec
import numpy as np

__all__ = ["Codec", "Encoded"]

_EXT_TENSOR = 1
_EXT_NDARRAY = 2
_EXT_TUPLE = 3
_EXT_SET = 4
_EXT_FROZENSET = 5
_EXT_DICT_PAIRS = 6
_EXT_PICKLE = 7
_EXT_MEMORYVIEW = 8

_ALIGN = 64
_TENSOR_HEAD = struct.Struct("<QQBBB")  # offset, nbytes, dtype code, flags, ndim
_ARRAY_HEAD = struct.Struct("<QQBH")  # offset, nbytes, ndim, len(dtype descr)
# Shape structs by ndim; numpy 2 and torch allow up to 64 dimensions.
_SHAPES = [struct.Struct(f"<{n}q") for n in range(65)]
#: Depth hint for the error raised on messages nested too deeply.
_DEPTH_HINT = "a few hundred levels of tuples/sets, about a thousand of lists/dicts"
_FLAG_REQUIRES_GRAD = 1

# Stable dtype codes: index in this tuple (names missing in this torch are skipped).
_TORCH_DTYPE_NAMES = (
    "float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64",
    "uint8", "bool", "complex64", "complex128", "complex32", "uint16", "uint32",
    "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e8m0fnu", "float4_e2m1fn_x2", "bits8", "bits16",
)
_UINT_BY_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64, 16: np.complex128}
_NONE_TYPE = type(None)
_PLAIN_KEYS = frozenset({str, int})
# Types encoded natively and exactly, plus the array types the hook handles.
# torch is not imported by this package: until the process imports it, no
# value can be a tensor; _load_torch() extends the tables once it is there.
_PASS = frozenset({str, int, float, bool, _NONE_TYPE, bytes, np.ndarray})
_TENSOR: Any = None  # torch.Tensor once loaded
_TORCH: Any = None  # the torch module once loaded
_DTYPE_TO_CODE: dict[Any, int] = {}
_CODE_TO_DTYPE: dict[int, tuple[Any, np.dtype, bool]] = {}


def _load_torch() -> Any:
    """Import torch (if needed) and build the dtype tables. Returns the module."""
    global _PASS, _TENSOR, _TORCH
    if _TORCH is not None:
        return _TORCH
    import torch

    same = {
        torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
        torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
        torch.int64: np.int64, torch.uint8: np.uint8, torch.bool: np.bool_,
        torch.complex64: np.complex64, torch.complex128: np.complex128,
    }
    for code, name in enumerate(_TORCH_DTYPE_NAMES):
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype) and dt not in _DTYPE_TO_CODE:
            _DTYPE_TO_CODE[dt] = code
            np_same = same.get(dt)
            np_dt = np.dtype(np_same) if np_same is not None else np.dtype(_UINT_BY_SIZE[dt.itemsize])
            _CODE_TO_DTYPE[code] = (dt, np_dt, np_same is None)
    _TENSOR = torch.Tensor
    _PASS = _PASS | {torch.Tensor}
    _TORCH = torch
    return torch


class _Box:
    """Wraps a value the encoder hook must turn into an ext (tuple, set, opaque)."""

    __slots__ = ("code", "value")

    def __init__(self, code: int, value: Any) -> None:
        self.code = code
        self.value = value


class Encoded:
    """One encoded message, ready to be written.

    Attributes:
        msg: msgpack bytes of the structure.
        blob_len: Size of the raw-array area in bytes.
        copies: ``(source address, nbytes, offset in blob)`` per array.
        keep: The arrays/tensors the addresses point into (kept alive).
    """

    __slots__ = ("msg", "blob_len", "copies", "keep")

    def __init__(self, msg: bytes, blob_len: int, copies: list, keep: list) -> None:
        self.msg = msg
        self.blob_len = blob_len
        self.copies = copies
        self.keep = keep

    def write_blob(self, dst_addr: int) -> None:
        """Copy every array's bytes to ``dst_addr + offset`` (caller ensures room)."""
        memmove = ctypes.memmove
        for src, nbytes, off in self.copies:
            memmove(dst_addr + off, src, nbytes)

    def blob_bytes(self) -> bytearray:
        """Return the blob as one new buffer (for zmq transport)."""
        out = bytearray(self.blob_len)
        if self.blob_len:
            self.write_blob(ctypes.addressof(ctypes.c_char.from_buffer(out)))
        return out


class Codec:
    """Encoder/decoder pair. One per queue side; not thread-safe.

    Args:
        allow_pickle: Fall back to pickle for values msgspec cannot carry
            exactly (encode) and accept such values (decode).
        exact: Preserve tuples/sets/non-str keys and route msgspec-lossy types
            (dataclasses, enums...) through the pickle fallback. See the
            module docstring.
    """

    def __init__(self, allow_pickle: bool = True, exact: bool = True) -> None:
        self.allow_pickle = allow_pickle
        self.exact = exact
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoder = msgspec.msgpack.Decoder(ext_hook=self._ext_hook)
        self._copies: list[tuple[int, int, int]] = []
        self._keep: list[Any] = []
        self._cursor = 0
        self._src: Any = b""
        self._src_start = 0
        self._src_len = 0

    # ---------------------------------------------------------------- encode
    def encode(self, obj: Any) -> Encoded:
        """Encode ``obj``; arrays are referenced, not copied (see :class:`Encoded`).

        Raises:
            TypeError: A value cannot be encoded (CUDA tensor, sparse tensor,
                or an opaque type with ``allow_pickle=False``).
        """
        if _TORCH is None and "torch" in sys.modules:
            _load_torch()
        self._copies = []
        self._keep = []
        self._cursor = 0
        try:
            msg = self._encoder.encode(_prep(obj) if self.exact else obj)
        except (OverflowError, UnicodeEncodeError):
            # An int beyond 64 bits or a lone surrogate somewhere: pickle it all.
            self._copies, self._keep, self._cursor = [], [], 0
            try:
                msg = self._encoder.encode(_Box(_EXT_PICKLE, obj))
            except RecursionError:
                raise _too_deep("encode") from None
        except RecursionError:
            raise _too_deep("encode") from None
        return Encoded(msg, self._cursor, self._copies, self._keep)

    def _reserve(self, nbytes: int, src_addr: int, keep: Any) -> int:
        off = self._cursor
        if nbytes:
            self._copies.append((src_addr, nbytes, off))
            self._keep.append(keep)
        self._cursor = off + (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        return off

    def _tensor_desc(self, t: Any) -> bytes:
        if not t.is_cpu:
            raise TypeError(
                f"MessageQueue carries CPU tensors only, got a tensor on {t.device}; "
                "move it with .cpu() or use a device communicator"
            )
        if t.layout is not _TORCH.strided:
            raise TypeError(f"MessageQueue carries strided tensors only, got layout {t.layout}")
        code = _DTYPE_TO_CODE.get(t.dtype)
        if code is None:
            raise TypeError(f"tensor dtype {t.dtype} is not supported by MessageQueue")
        flags = 0
        if t.requires_grad:
            flags = _FLAG_REQUIRES_GRAD
            t = t.detach()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        if not t.is_contiguous():
            t = t.contiguous()
        nbytes = t.nbytes
        off = self._reserve(nbytes, t.data_ptr(), t)
        shape = t.shape
        ndim = len(shape)
        return _TENSOR_HEAD.pack(off, nbytes, code, flags, ndim) + _SHAPES[ndim].pack(*shape)

    def _array_desc(self, a: np.ndarray) -> bytes:
        if not a.flags.c_contiguous:
            a = np.ascontiguousarray(a)
        dt = a.dtype
        if dt.fields is None and dt.subdtype is None:
            descr = dt.str.encode()
        else:
            descr = b"\x00" + msgspec.msgpack.encode(np.lib.format.dtype_to_descr(dt))
        nbytes = a.nbytes
        off = self._reserve(nbytes, a.__array_interface__["data"][0] if nbytes else 0, a)
        ndim = a.ndim
        return (
            _ARRAY_HEAD.pack(off, nbytes, ndim, len(descr))
            + _SHAPES[ndim].pack(*a.shape)
            + descr
        )

    def _enc_hook(self, obj: Any) -> msgspec.msgpack.Ext:
        t = type(obj)
        if t is _TENSOR and t is not None:
            return msgspec.msgpack.Ext(_EXT_TENSOR, self._tensor_desc(obj))
        if t is np.ndarray and not obj.dtype.hasobject:
            return msgspec.msgpack.Ext(_EXT_NDARRAY, self._array_desc(obj))
        if t is _Box:
            if obj.code == _EXT_PICKLE:
                return msgspec.msgpack.Ext(_EXT_PICKLE, self._pickle(obj.value))
            return msgspec.msgpack.Ext(obj.code, self._encoder.encode(obj.value))
        # A type msgspec does not know (numpy scalars, custom classes...).
        return msgspec.msgpack.Ext(_EXT_PICKLE, self._pickle(obj))

    def _pickle(self, obj: Any) -> bytes:
        if not self.allow_pickle:
            raise TypeError(
                f"cannot encode a value of type {type(obj).__qualname__} without pickle "
                "(allow_pickle=False); send plain containers, tensors and arrays"
            )
        out = io.BytesIO()
        _OobPickler(out, self).dump(obj)
        return out.getvalue()

    # ---------------------------------------------------------------- decode
    def decode(self, msg: Any, blob: Any, blob_start: int, blob_len: int) -> Any:
        """Decode a message whose arrays live in ``blob[blob_start:blob_start+blob_len]``.

        Args:
            msg: msgpack bytes (any buffer, e.g. a ``memoryview`` into the ring).
            blob: Buffer holding the raw array bytes.
            blob_start: Offset of the blob in ``blob``.
            blob_len: Size of the blob.

        Returns:
            The object; every array in it is a private copy.
        """
        self._src = blob
        self._src_start = blob_start
        self._src_len = blob_len
        try:
            return self._decoder.decode(msg)
        except RecursionError:
            raise _too_deep("decode") from None
        finally:
            self._src = b""

    def _slice(self, off: int, nbytes: int, dtype: np.dtype, shape: tuple) -> np.ndarray:
        if off + nbytes > self._src_len:
            raise ValueError("corrupt message: array extends beyond the message's data area")
        if nbytes == 0:
            return np.empty(shape, dtype)
        # Copy as raw bytes: a structured dtype's copy() skips its padding bytes
        # (left uninitialised), a byte copy is exact and a plain memcpy.
        raw = np.frombuffer(self._src, np.uint8, nbytes, self._src_start + off).copy()
        return raw.view(dtype).reshape(shape)

    def _tensor_from(self, data: Any) -> Any:
        torch = _TORCH if _TORCH is not None else _load_torch()
        off, nbytes, code, flags, ndim = _TENSOR_HEAD.unpack_from(data, 0)
        shape = _SHAPES[ndim].unpack_from(data, _TENSOR_HEAD.size)
        entry = _CODE_TO_DTYPE.get(code)
        if entry is None:
            raise ValueError(f"corrupt or incompatible message: unknown tensor dtype code {code}")
        dtype, np_dtype, needs_view = entry
        t = torch.from_numpy(self._slice(off, nbytes, np_dtype, shape))
        if needs_view:
            t = t.view(dtype)
        if flags & _FLAG_REQUIRES_GRAD:
            t.requires_grad_(True)
        return t

    def _array_from(self, data: Any) -> np.ndarray:
        off, nbytes, ndim, dlen = _ARRAY_HEAD.unpack_from(data, 0)
        pos = _ARRAY_HEAD.size
        shape = _SHAPES[ndim].unpack_from(data, pos)
        pos += 8 * ndim
        descr = bytes(data[pos : pos + dlen])
        if descr[:1] == b"\x00":
            dt = np.lib.format.descr_to_dtype(_tuplify(msgspec.msgpack.decode(descr[1:])))
        else:
            dt = np.dtype(descr.decode())
        return self._slice(off, nbytes, dt, shape)

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == _EXT_TENSOR:
            return self._tensor_from(data)
        if code == _EXT_NDARRAY:
            return self._array_from(data)
        if code == _EXT_TUPLE:
            return tuple(self._decoder.decode(data))
        if code == _EXT_DICT_PAIRS:
            return dict(self._decoder.decode(data))
        if code == _EXT_SET:
            return set(self._decoder.decode(data))
        if code == _EXT_FROZENSET:
            return frozenset(self._decoder.decode(data))
        if code == _EXT_MEMORYVIEW:
            return _rebuild_memoryview(*msgspec.msgpack.decode(data))
        if code == _EXT_PICKLE:
            if not self.allow_pickle:
                raise TypeError("received a pickled value but this queue side has allow_pickle=False")
            return _OobUnpickler(io.BytesIO(data), self).load()
        raise ValueError(f"corrupt or incompatible message: unknown ext code {code}")


def _too_deep(op: str) -> ValueError:
    return ValueError(
        f"cannot {op} the message: it is nested too deeply for the recursion limit "
        f"(sys.getrecursionlimit() = {sys.getrecursionlimit()}; roughly {_DEPTH_HINT} fit)")


def _memoryview_state(mv: memoryview) -> tuple[bytes, str, list[int], bool]:
    """``(C-order bytes, format, shape, readonly)`` of a memoryview (any layout)."""
    return mv.tobytes(), mv.format, list(mv.shape or ()), bool(mv.readonly)


def _rebuild_memoryview(data: bytes, fmt: str, shape: list[int], readonly: bool) -> memoryview:
    """A memoryview equal to the one :func:`_memoryview_state` described, over fresh memory.

    Read-only views come back over ``bytes``, writable ones over a ``bytearray``.
    Formats ``memoryview.cast`` cannot restore (struct strings) come back as bytes ('B').
    """
    mv = memoryview(data if readonly else bytearray(data))
    if fmt == "B" and len(shape) == 1:
        return mv
    try:
        return mv.cast("B").cast(fmt, shape)
    except (TypeError, ValueError):
        return mv


def _tuplify(descr: Any) -> Any:
    """Turn msgpack's lists back into the tuples numpy's descr format uses."""
    if isinstance(descr, list):
        return [tuple(_tuplify(x) for x in field) if isinstance(field, list) else field
                for field in descr]
    return descr


class _OobPickler(pickle.Pickler):
    """Pickler that sends plain tensors and ndarrays out-of-band."""

    def __init__(self, file: io.BytesIO, codec: Codec) -> None:
        super().__init__(file, protocol=5)
        self._codec = codec

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is memoryview:  # not picklable by itself
            return _rebuild_memoryview, _memoryview_state(obj)
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        t = type(obj)
        if t is _TENSOR and t is not None:
            return (_EXT_TENSOR, self._codec._tensor_desc(obj))
        if t is np.ndarray and not obj.dtype.hasobject:
            return (_EXT_NDARRAY, self._codec._array_desc(obj))
        return None


class _OobUnpickler(pickle.Unpickler):
    """Unpickler resolving the out-of-band arrays of :class:`_OobPickler`."""

    def __init__(self, file: io.BytesIO, codec: Codec) -> None:
        super().__init__(file)
        self._codec = codec

    def persistent_load(self, pid: Any) -> Any:
        code, desc = pid
        if code == _EXT_TENSOR:
            return self._codec._tensor_from(desc)
        if code == _EXT_NDARRAY:
            return self._codec._array_from(desc)
        raise pickle.UnpicklingError(f"unknown persistent id code {code!r}")


def _prep(obj: Any) -> Any:
    """Make ``obj`` exact for msgspec: box tuples/sets/odd keys and opaque values.

    Returns ``obj`` itself when nothing needs boxing (the common case costs one
    C-level type scan per container and no copy); containers are copied only
    along the path to a value that changed.
    """
    t = type(obj)
    if t is dict:
        if not _PLAIN_KEYS.issuperset(map(type, obj)):
            return _Box(_EXT_DICT_PAIRS, [[_prep(k), _prep(v)] for k, v in obj.items()])
        if _PASS.issuperset(map(type, obj.values())):
            return obj
        new = None
        for k, v in obj.items():
            if type(v) in _PASS:
                continue
            pv = _prep(v)
            if pv is not v:
                if new is None:
                    new = dict(obj)
                new[k] = pv
        return obj if new is None else new
    if t is list:
        if _PASS.issuperset(map(type, obj)):
            return obj
        new = None
        for i, v in enumerate(obj):
            if type(v) in _PASS:
                continue
            pv = _prep(v)
            if pv is not v:
                if new is None:
                    new = list(obj)
                new[i] = pv
        return obj if new is None else new
    if t in _PASS:
        return obj
    if t is tuple:
        return _Box(_EXT_TUPLE, _prep(list(obj)))
    if t is set:
        return _Box(_EXT_SET, _prep(list(obj)))
    if t is frozenset:
        return _Box(_EXT_FROZENSET, _prep(list(obj)))
    if t is memoryview:  # msgpack would turn it into bytes
        return _Box(_EXT_MEMORYVIEW, _memoryview_state(obj))
    return _Box(_EXT_PICKLE, obj)

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

What round-trips, exactly (``exact=True``, the default), with no pickle:

=========================================  ===================================
value                                      encoded as
=========================================  ===================================
None, bool, int (64-bit), float, str,      msgpack natives
bytes, list, dict with str/int keys
tuple, set, frozenset, dict with other     msgpack ext wrapping their items
keys (e.g. tuple keys)                     (so a tuple comes back a tuple)
ints beyond 64 bits, str with lone         ext: two's-complement bytes /
surrogates                                 UTF-8 with ``surrogatepass``
bytearray                                  ext: its bytes
memoryview                                 ext: bytes, format, shape (comes
                                           back as a memoryview over a copy)
numpy scalars (``np.float32(1)``...,       ext: dtype string + raw bytes
non-object, non-structured)                (same numpy scalar type back)
``torch.Tensor`` and                       ext descriptor + raw bytes
``torch.nn.Parameter`` (CPU, strided,      (non-contiguous ones are made
any dtype incl. bfloat16/float8/complex,   contiguous first; requires_grad
0-dim, empty, non-contiguous, conj/neg)    and the Parameter type kept)
``torch.Size``, ``torch.dtype``,           ext: the dims / the dtype's name
``torch.device``                           (known dtypes only) / the device
                                           string
``numpy.ndarray`` (non-object dtype,       ext descriptor + raw bytes
structured dtypes included)
:class:`SourceFailure`                     ext: its message (a sender's
                                           "I could not send" marker)
anything else (dataclasses, enums,         **refused** with ``TypeError``
namedtuples, msgspec Structs, datetime,    naming the type, unless the side
other subclasses, object arrays...)        opted in with ``allow_pickle=True``
=========================================  ===================================

Nesting is bounded by the interpreter's recursion limit (roughly a thousand
levels of lists/dicts, a few hundred of tuples/sets); deeper messages raise
:class:`ValueError` before anything is sent (and :class:`DecodeError` when
received).

Pickle is an explicit opt-in (``allow_pickle=True``, off by default): then the
values in the last row travel as pickle protocol 5, with any tensor/ndarray
inside still sent out-of-band as raw bytes (pickle ``persistent_id``), and a
receiving side with ``allow_pickle=True`` unpickles them, which runs whatever
code the sender chose: only for peers you trust as much as your own process.
A side without the opt-in refuses a pickled value with :class:`DecodeError`
and never unpickles it. With ``exact=False`` the structure is handed to
msgspec as is, which is faster for huge lists (no per-element type scan, ~13
ns per element) but lossy where msgpack is: tuples and sets come back as
lists, dataclasses/Structs as dicts, enums as their values.

Decoding trusts nothing it receives (see ``docs/security-codec.md``): every
declared size is checked against the bytes present before anything is
allocated (``prod(shape) * itemsize == nbytes`` and ``offset + nbytes`` inside
the data area), shapes must be non-negative with at most 64 dimensions,
dtypes must be known plain (non-object) ones, and any malformed input raises
:class:`~shm_broadcast.errors.DecodeError`, never ``IndexError``,
``struct.error``, ``MemoryError``, ``UnicodeDecodeError`` or msgspec's errors.
"""

from __future__ import annotations

import ctypes
import io
import math
import pickle
import re
import struct
import sys
import warnings
from typing import Any

import msgspec
import numpy as np

from shm_broadcast.errors import DecodeError

__all__ = ["Codec", "Encoded", "SourceFailure", "PICKLE_OPT_IN"]

_EXT_TENSOR = 1
_EXT_NDARRAY = 2
_EXT_TUPLE = 3
_EXT_SET = 4
_EXT_FROZENSET = 5
_EXT_DICT_PAIRS = 6
_EXT_PICKLE = 7
_EXT_MEMORYVIEW = 8
_EXT_NPSCALAR = 9
_EXT_BIGINT = 10
_EXT_SURROGATE_STR = 11
_EXT_FAILURE = 12
_EXT_BYTEARRAY = 13
_EXT_TORCH_SIZE = 14
_EXT_TORCH_DTYPE = 15
_EXT_TORCH_DEVICE = 16

_ALIGN = 64
_MAX_NDIM = 64
_TENSOR_HEAD = struct.Struct("<QQBBB")  # offset, nbytes, dtype code, flags, ndim
_ARRAY_HEAD = struct.Struct("<QQBH")  # offset, nbytes, ndim, len(dtype descr)
# Shape structs by ndim; numpy 2 and torch allow up to 64 dimensions.
_SHAPES = [struct.Struct(f"<{n}q") for n in range(_MAX_NDIM + 1)]
#: Depth hint for the error raised on messages nested too deeply.
_DEPTH_HINT = "a few hundred levels of tuples/sets, about a thousand of lists/dicts"
_FLAG_REQUIRES_GRAD = 1
_FLAG_PARAMETER = 2
#: A plain numpy dtype string: byte order, kind, size, optional datetime unit.
_DTYPE_STR = re.compile(r"[<>|=]?[?a-zA-Z][0-9]{0,9}(\[[0-9]{0,9}[a-zA-Z]{1,3}\])?")
_INT64_MIN, _UINT64_END = -(1 << 63), 1 << 64

#: How an error tells the user to opt in to pickle (one wording everywhere).
PICKLE_OPT_IN = (
    "allow_pickle=True on both sides (MessageQueue / GroupCoordinator / "
    "init_distributed_environment / initialize_model_parallel), which lets the "
    "peer run code in this process: only between processes you trust"
)

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
_PARAMETER: Any = None  # torch.nn.Parameter once loaded
_TORCH: Any = None  # the torch module once loaded
_DTYPE_TO_CODE: dict[Any, int] = {}
_CODE_TO_DTYPE: dict[int, tuple[Any, np.dtype, bool, int]] = {}
_DTYPE_BY_NAME: dict[str, Any] = {}  # "float32" -> torch.float32, known dtypes only
_TORCH_LEAVES: dict[type, int] = {}  # torch.Size/dtype/device -> their ext codes


def _load_torch() -> Any:
    """Import torch (if needed) and build the dtype tables. Returns the module."""
    global _PASS, _TENSOR, _PARAMETER, _TORCH
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
            _CODE_TO_DTYPE[code] = (dt, np_dt, np_same is None, np_dt.itemsize)
    _DTYPE_BY_NAME.update((str(dt).removeprefix("torch."), dt) for dt in _DTYPE_TO_CODE)
    _TORCH_LEAVES.update({torch.Size: _EXT_TORCH_SIZE, torch.dtype: _EXT_TORCH_DTYPE,
                          torch.device: _EXT_TORCH_DEVICE})
    _TENSOR = torch.Tensor
    _PARAMETER = torch.nn.Parameter
    _PASS = _PASS | {torch.Tensor}
    _TORCH = torch
    return torch


class SourceFailure:
    """Sent in place of the data when the sender could not produce it.

    Travels as its own msgpack ext (no pickle); a receiver that gets one
    raises instead of waiting for data that will never come.

    Attributes:
        message: Why the sender failed (its exception text).
    """

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (SourceFailure, (self.message,))

    def __eq__(self, other: object) -> bool:
        return type(other) is SourceFailure and other.message == self.message

    def __hash__(self) -> int:
        return hash(self.message)

    def __repr__(self) -> str:
        return f"SourceFailure({self.message!r})"


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
        allow_pickle: Opt in to pickle: encode values msgspec cannot carry
            exactly with pickle, and unpickle such values when received
            (which runs code the sender chose). Off by default: such values
            raise ``TypeError`` when sent and :class:`DecodeError` when received.
        exact: Preserve tuples/sets/non-str keys and refuse (or, with
            ``allow_pickle``, pickle) msgspec-lossy types (dataclasses,
            enums...). See the module docstring.

    Raises:
        TypeError: ``allow_pickle`` or ``exact`` is not a bool.
    """

    def __init__(self, allow_pickle: bool = False, exact: bool = True) -> None:
        for name, value in (("allow_pickle", allow_pickle), ("exact", exact)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
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
                or a type msgspec cannot carry while ``allow_pickle`` is off;
                the message names the type and the opt-in).
            ValueError: ``obj`` is nested too deeply.
        """
        if _TORCH is None and "torch" in sys.modules:
            _load_torch()
        self._copies = []
        self._keep = []
        self._cursor = 0
        try:
            msg = self._encoder.encode(_prep(obj) if self.exact else obj)
        except (OverflowError, UnicodeEncodeError):
            # An int beyond 64 bits or a lone surrogate somewhere: box those too.
            self._copies, self._keep, self._cursor = [], [], 0
            try:
                msg = self._encoder.encode(_prep_full(obj, self.exact))
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

    def _tensor_desc(self, t: Any, flags: int = 0) -> bytes:
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
        if t.requires_grad:
            flags |= _FLAG_REQUIRES_GRAD
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
            return self._box_ext(obj)
        if t is _PARAMETER and t is not None:
            return msgspec.msgpack.Ext(_EXT_TENSOR, self._tensor_desc(obj, _FLAG_PARAMETER))
        if t is SourceFailure:
            return msgspec.msgpack.Ext(_EXT_FAILURE, _utf8(obj.message))
        if _is_plain_npscalar(obj):  # exact=False reaches here with numpy scalars
            return msgspec.msgpack.Ext(_EXT_NPSCALAR, _npscalar_state(obj))
        if _TORCH is not None and t in _TORCH_LEAVES:  # and with dtypes, devices
            return self._box_ext(_Box(_TORCH_LEAVES[t], obj))
        # A type msgspec does not know (custom classes...).
        return msgspec.msgpack.Ext(_EXT_PICKLE, self._pickle(obj))

    def _box_ext(self, box: _Box) -> msgspec.msgpack.Ext:
        code, value = box.code, box.value
        if code == _EXT_PICKLE:
            return msgspec.msgpack.Ext(_EXT_PICKLE, self._pickle(value))
        if code == _EXT_NPSCALAR:
            return msgspec.msgpack.Ext(_EXT_NPSCALAR, _npscalar_state(value))
        if code == _EXT_BIGINT:
            return msgspec.msgpack.Ext(
                _EXT_BIGINT, value.to_bytes(value.bit_length() // 8 + 1, "little", signed=True))
        if code == _EXT_SURROGATE_STR:
            return msgspec.msgpack.Ext(_EXT_SURROGATE_STR, _utf8(value))
        if code == _EXT_BYTEARRAY:
            return msgspec.msgpack.Ext(_EXT_BYTEARRAY, bytes(value))
        if code == _EXT_TORCH_SIZE:
            return msgspec.msgpack.Ext(code, _SHAPES[len(value)].pack(*value))
        if code in (_EXT_TORCH_DTYPE, _EXT_TORCH_DEVICE):
            return msgspec.msgpack.Ext(code, str(value).removeprefix("torch.").encode())
        return msgspec.msgpack.Ext(code, self._encoder.encode(value))

    def _pickle(self, obj: Any) -> bytes:
        if not self.allow_pickle:
            what = f"{type(obj).__module__}.{type(obj).__qualname__}"
            if isinstance(obj, np.ndarray):
                what += f" of dtype {obj.dtype} (Python objects)"
            raise TypeError(
                f"cannot send a value of type {what} without pickle: msgspec carries "
                "None, bool, int, float, str, bytes, lists, dicts, tuples, sets, numpy "
                "arrays and scalars and CPU tensors; convert it "
                "(dataclasses.asdict(x), an enum's .value...) or opt in with "
                + PICKLE_OPT_IN
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
            blob_len: Size of the blob (checked against ``blob`` before any
                array is read).

        Returns:
            The object; every array in it is a private copy.

        Raises:
            DecodeError: The bytes are malformed (sizes that do not match the
                bytes present, bad shapes, unknown dtypes or codes, bad UTF-8,
                nesting too deep) or hold a pickled value while
                ``allow_pickle`` is off. Nothing is allocated for a claimed
                size before it is checked.
        """
        self._src = blob
        self._src_start = blob_start
        self._src_len = blob_len
        try:
            return self._decoder.decode(msg)
        except DecodeError:
            raise
        except RecursionError:
            raise _too_deep("decode") from None
        except Exception as e:  # any other failure here means the input is malformed
            raise DecodeError(
                f"corrupt or incompatible message: {type(e).__name__}: {e}") from None
        finally:
            self._src = b""

    def _slice(self, off: int, nbytes: int, dtype: np.dtype, itemsize: int,
               shape: tuple) -> np.ndarray:
        # Holds on return: 0 <= dims, prod(shape) * itemsize == nbytes, and the
        # nbytes lie inside both the declared data area and the buffer itself.
        ndim = len(shape)
        if ndim == 1:  # the common case, without the generic calls
            bad = shape[0] < 0 or shape[0] * itemsize != nbytes
        else:
            bad = (ndim and min(shape) < 0) or math.prod(shape) * itemsize != nbytes
        if bad:
            raise DecodeError(
                f"corrupt message: shape {shape} of {dtype} does not match the descriptor's "
                f"{nbytes} bytes (negative, or needs {math.prod(shape) * itemsize})")
        if nbytes == 0:
            return np.empty(shape, dtype)
        if off + nbytes > self._src_len:
            raise DecodeError(
                f"corrupt message: array of {nbytes} bytes at offset {off} extends beyond "
                f"the message's data area ({self._src_len} bytes declared)")
        try:  # frombuffer allocates nothing: it refuses a range the buffer does not hold
            raw = np.frombuffer(self._src, np.uint8, nbytes, self._src_start + off)
        except ValueError:
            raise DecodeError(
                f"corrupt message: array of {nbytes} bytes at offset {off} extends beyond "
                f"the bytes received") from None
        # Copy as raw bytes: a structured dtype's copy() skips its padding bytes
        # (left uninitialised), a byte copy is exact and a plain memcpy.
        return raw.copy().view(dtype).reshape(shape)

    def _tensor_from(self, data: Any) -> Any:
        torch = _TORCH if _TORCH is not None else _load_torch()
        try:  # a short descriptor or ndim > 64 fails here (struct.error / IndexError)
            off, nbytes, code, flags, ndim = _TENSOR_HEAD.unpack_from(data, 0)
            shape = _SHAPES[ndim].unpack_from(data, _TENSOR_HEAD.size)
        except (struct.error, IndexError):
            raise DecodeError(
                f"corrupt message: bad tensor descriptor of {len(data)} bytes") from None
        entry = _CODE_TO_DTYPE.get(code)
        if entry is None:
            raise DecodeError(f"corrupt or incompatible message: unknown tensor dtype code {code}")
        dtype, np_dtype, needs_view, itemsize = entry
        t = torch.from_numpy(self._slice(off, nbytes, np_dtype, itemsize, shape))
        if needs_view:
            t = t.view(dtype)
        if flags:
            if flags & _FLAG_PARAMETER:
                return _PARAMETER(t, requires_grad=bool(flags & _FLAG_REQUIRES_GRAD))
            if flags & _FLAG_REQUIRES_GRAD:
                t.requires_grad_(True)
        return t

    def _array_from(self, data: Any) -> np.ndarray:
        try:  # a short descriptor or ndim > 64 fails here (struct.error / IndexError)
            off, nbytes, ndim, dlen = _ARRAY_HEAD.unpack_from(data, 0)
            pos = _ARRAY_HEAD.size
            shape = _SHAPES[ndim].unpack_from(data, pos)
        except (struct.error, IndexError):
            raise DecodeError(
                f"corrupt message: bad array descriptor of {len(data)} bytes") from None
        pos += 8 * ndim
        if len(data) != pos + dlen:
            raise DecodeError(f"corrupt message: array descriptor of {len(data)} bytes, "
                              f"{pos + dlen} expected")
        dt = _dtype_from(bytes(data[pos:]))
        return self._slice(off, nbytes, dt, dt.itemsize, shape)

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == _EXT_TENSOR:
            return self._tensor_from(data)
        if code == _EXT_NDARRAY:
            return self._array_from(data)
        if code == _EXT_TUPLE:
            return tuple(self._items(data, code))
        if code == _EXT_DICT_PAIRS:
            return _pairs_to_dict(self._items(data, code))
        if code == _EXT_SET:
            return set(self._items(data, code))
        if code == _EXT_FROZENSET:
            return frozenset(self._items(data, code))
        if code == _EXT_MEMORYVIEW:
            return _rebuild_memoryview(*_memoryview_fields(msgspec.msgpack.decode(data)))
        if code == _EXT_NPSCALAR:
            return _npscalar_from(data)
        if code == _EXT_BIGINT:
            return int.from_bytes(data, "little", signed=True)
        if code == _EXT_SURROGATE_STR:
            return bytes(data).decode("utf-8", "surrogatepass")
        if code == _EXT_BYTEARRAY:
            return bytearray(data)
        if code in (_EXT_TORCH_SIZE, _EXT_TORCH_DTYPE, _EXT_TORCH_DEVICE):
            return _torch_leaf_from(code, data)
        if code == _EXT_FAILURE:
            return SourceFailure(bytes(data).decode("utf-8", "surrogatepass"))
        if code == _EXT_PICKLE:
            if not self.allow_pickle:
                raise DecodeError(
                    "received a pickled value, which this side refuses to unpickle "
                    "(allow_pickle is off): the sender must send plain data, or opt in with "
                    + PICKLE_OPT_IN)
            return _OobUnpickler(io.BytesIO(data), self).load()
        raise DecodeError(f"corrupt or incompatible message: unknown ext code {code}")

    def _items(self, data: memoryview, code: int) -> list:
        items = self._decoder.decode(data)
        if type(items) is not list:
            raise DecodeError(
                f"corrupt message: ext {code} must hold a list, got {type(items).__name__}")
        return items


def _too_deep(op: str) -> ValueError:
    text = (f"cannot {op} the message: it is nested too deeply for the recursion limit "
            f"(sys.getrecursionlimit() = {sys.getrecursionlimit()}; roughly {_DEPTH_HINT} fit)")
    return DecodeError(text) if op == "decode" else ValueError(text)


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _pairs_to_dict(pairs: list) -> dict:
    if not all(type(p) is list and len(p) == 2 for p in pairs):
        raise DecodeError("corrupt message: a dict's items must be [key, value] pairs")
    return dict(pairs)


_DTYPE_CACHE: dict[bytes, np.dtype] = {}  # accepted descriptors (bounded, see below)


def _dtype_from(descr: bytes) -> np.dtype:
    """The numpy dtype a received array descriptor names; plain data types only.

    Raises:
        DecodeError: The descriptor is malformed, names no dtype, or names one
            holding Python objects (its bytes would be taken as pointers).
    """
    dt = _DTYPE_CACHE.get(descr)
    if dt is not None:
        return dt
    try:
        with warnings.catch_warnings():  # deprecated aliases ('a') warn; accept quietly
            warnings.simplefilter("ignore")
            if descr[:1] == b"\x00":
                dt = np.lib.format.descr_to_dtype(_tuplify(msgspec.msgpack.decode(descr[1:])))
            else:
                text = descr.decode("ascii")
                if not _DTYPE_STR.fullmatch(text):
                    raise DecodeError(f"corrupt message: {text!r} is not a plain numpy dtype")
                dt = np.dtype(text)
    except DecodeError:
        raise
    except Exception as e:  # numpy/msgspec/unicode: all mean a malformed descriptor
        raise DecodeError(f"corrupt message: bad array dtype ({type(e).__name__}: {e})") from None
    if dt.hasobject:
        raise DecodeError(f"corrupt message: array dtype {dt} holds Python objects")
    if len(_DTYPE_CACHE) < 256:  # a peer sending endless new dtypes cannot grow it
        _DTYPE_CACHE[descr] = dt
    return dt


def _torch_leaf_from(code: int, data: memoryview) -> Any:
    """A received ``torch.Size``, ``torch.dtype`` (known names only) or ``torch.device``."""
    torch = _TORCH if _TORCH is not None else _load_torch()
    if code == _EXT_TORCH_SIZE:
        if len(data) % 8 or len(data) > 8 * _MAX_NDIM:
            raise DecodeError(f"corrupt message: torch.Size of {len(data)} bytes")
        return torch.Size(_SHAPES[len(data) // 8].unpack_from(data, 0))
    text = bytes(data).decode("ascii")
    if code == _EXT_TORCH_DTYPE:
        if text not in _DTYPE_BY_NAME:
            raise DecodeError(f"corrupt message: unknown torch dtype {text[:40]!r}")
        return _DTYPE_BY_NAME[text]
    if len(text) > 64:
        raise DecodeError(f"corrupt message: device string of {len(text)} characters")
    return torch.device(text)


def _is_plain_npscalar(obj: Any) -> bool:
    return (isinstance(obj, np.generic) and type(obj).__module__ == "numpy"
            and obj.dtype.fields is None and not obj.dtype.hasobject
            and obj.dtype.kind != "V")


def _npscalar_state(obj: Any) -> bytes:
    return msgspec.msgpack.encode([obj.dtype.str, obj.tobytes()])


def _npscalar_from(data: memoryview) -> Any:
    fields = msgspec.msgpack.decode(data)
    if (type(fields) is not list or len(fields) != 2 or type(fields[0]) is not str
            or type(fields[1]) is not bytes):
        raise DecodeError("corrupt message: a numpy scalar must be [dtype, bytes]")
    dt = _dtype_from(fields[0].encode())
    if dt.fields is not None or dt.kind == "V" or dt.itemsize != len(fields[1]):
        raise DecodeError(
            f"corrupt message: numpy scalar of {dt} with {len(fields[1])} bytes of data")
    return np.frombuffer(fields[1], dt)[0]


def _memoryview_state(mv: memoryview) -> tuple[bytes, str, list[int], bool]:
    """``(C-order bytes, format, shape, readonly)`` of a memoryview (any layout)."""
    return mv.tobytes(), mv.format, list(mv.shape or ()), bool(mv.readonly)


def _memoryview_fields(fields: Any) -> tuple[bytes, str, list[int], bool]:
    """Check a received memoryview state; the shape's product is not trusted (cast checks)."""
    if (type(fields) is not list or len(fields) != 4 or type(fields[0]) is not bytes
            or type(fields[1]) is not str or type(fields[2]) is not list
            or type(fields[3]) is not bool or len(fields[2]) > _MAX_NDIM
            or not all(type(n) is int and n >= 0 for n in fields[2])):
        raise DecodeError("corrupt message: a memoryview must be [bytes, format, shape, readonly]")
    return fields[0], fields[1], fields[2], fields[3]


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
    """Pickler that sends plain tensors and ndarrays out-of-band (``allow_pickle`` only)."""

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
    """Unpickler resolving :class:`_OobPickler`'s out-of-band arrays (``allow_pickle`` only)."""

    def __init__(self, file: io.BytesIO, codec: Codec) -> None:
        super().__init__(file)
        self._codec = codec

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is not tuple or len(pid) != 2:
            raise DecodeError(f"corrupt message: bad persistent id {pid!r}")
        code, desc = pid
        if code == _EXT_TENSOR:
            return self._codec._tensor_from(desc)
        if code == _EXT_NDARRAY:
            return self._codec._array_from(desc)
        raise DecodeError(f"corrupt message: unknown persistent id code {code!r}")


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
    return _prep_leaf(obj, t)


def _prep_leaf(obj: Any, t: type) -> Any:
    """A value that is no container: itself when the encoder hook handles it, else boxed."""
    if t is memoryview:  # msgpack would turn it into bytes
        return _Box(_EXT_MEMORYVIEW, _memoryview_state(obj))
    if t is bytearray:  # likewise
        return _Box(_EXT_BYTEARRAY, obj)
    if _TORCH is not None and t in _TORCH_LEAVES:
        return _Box(_TORCH_LEAVES[t], obj)
    if t is SourceFailure or (t is _PARAMETER and t is not None):
        return obj
    if _is_plain_npscalar(obj):
        return _Box(_EXT_NPSCALAR, obj)
    return _Box(_EXT_PICKLE, obj)  # refused by the hook unless allow_pickle


def _prep_full(obj: Any, exact: bool) -> Any:
    """Like :func:`_prep`, but visits every value and boxes ints beyond 64 bits and
    strs with lone surrogates (msgpack holds neither). Only used after the fast
    path failed on one of those, so its cost per element does not matter."""
    t = type(obj)
    if t is int:
        return obj if _INT64_MIN <= obj < _UINT64_END else _Box(_EXT_BIGINT, obj)
    if t is str:
        try:
            obj.encode("utf-8")
            return obj
        except UnicodeEncodeError:
            return _Box(_EXT_SURROGATE_STR, obj)
    if t is dict:
        items = [(_prep_full(k, exact), _prep_full(v, exact)) for k, v in obj.items()]
        if all(type(k) in _PLAIN_KEYS for k, _ in items):
            return dict(items)
        return _Box(_EXT_DICT_PAIRS, [[k, v] for k, v in items])
    if t is list or (not exact and t is tuple):
        return [_prep_full(v, exact) for v in obj]
    if exact and t in (tuple, set, frozenset):
        code = {tuple: _EXT_TUPLE, set: _EXT_SET, frozenset: _EXT_FROZENSET}[t]
        return _Box(code, [_prep_full(v, exact) for v in obj])
    return _prep(obj) if exact else obj

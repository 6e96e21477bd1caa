"""What the codec's bytes look like: ext codes, descriptors, limits, leaf values.

A message's structure is msgpack (see :mod:`shm_broadcast.codec.message_codec` for what
round-trips); every value msgpack cannot hold exactly travels as an *ext*
whose code is one of the ``EXT_*`` constants below. The array descriptors:

* tensor (``EXT_TENSOR``): :data:`TENSOR_HEAD` ``<QQBBB`` (offset in the blob,
  nbytes, dtype code, flags, ndim), then ``ndim`` little-endian int64 dims.
  The dtype code is the index of the dtype's name in the stable name table
  of this module; flags are :data:`FLAG_REQUIRES_GRAD` and
  :data:`FLAG_PARAMETER`.
* ndarray (``EXT_NDARRAY``): :data:`ARRAY_HEAD` ``<QQBH`` (offset, nbytes,
  ndim, descriptor length), the dims, then the dtype: its ``dtype.str`` in
  ASCII, or ``\\x00`` followed by the msgpack of numpy's ``descr`` for
  structured and sub-array dtypes.

Array bytes start at :data:`ALIGN`-byte aligned offsets of the blob; shapes
have at most :data:`MAX_NDIM` dimensions. The leaf values (numpy scalars,
memoryviews, ``torch.Size``/``dtype``/``device``) have an encoder and a
checking decoder here (which raise :class:`~shm_broadcast.errors.DecodeError`
for what they check; ``Codec.decode`` turns any other failure on malformed
input into one too).

torch is loaded lazily: until the process imports it no value can be a tensor,
so the encoder loads the tables only once ``torch`` is in ``sys.modules``;
decoding a torch value imports it. :data:`TORCH` (the one :class:`TorchTypes`
of the process) holds the torch types and dtype tables, empty until
:meth:`TorchTypes.load` runs. Its containers are filled in place, never
replaced, so a module may keep a reference to one. ``load`` sets
``TORCH.module`` last, after every table: a thread that sees it set sees
complete tables, and ``torch.Tensor`` joins ``pass_types`` only after
``TORCH.tensor`` is set.
"""

from __future__ import annotations

import re
import struct
import warnings
from collections.abc import Callable
from types import GenericAlias
from typing import Any

import msgspec
import numpy as np

from shm_broadcast.errors import DecodeError

__all__ = [
    "EXT_TENSOR", "EXT_NDARRAY", "EXT_TUPLE", "EXT_SET", "EXT_FROZENSET", "EXT_DICT_PAIRS",
    "EXT_PICKLE", "EXT_MEMORYVIEW", "EXT_NPSCALAR", "EXT_BIGINT", "EXT_SURROGATE_STR",
    "EXT_FAILURE", "EXT_BYTEARRAY", "EXT_TORCH_SIZE", "EXT_TORCH_DTYPE", "EXT_TORCH_DEVICE",
    "ALIGN", "MAX_NDIM", "TENSOR_HEAD", "ARRAY_HEAD", "SHAPES",
    "DTYPE_CACHE_ENTRIES", "DTYPE_CACHE_BYTES",
    "FLAG_REQUIRES_GRAD", "FLAG_PARAMETER", "INT64_MIN", "UINT64_END",
    "TorchTypes", "TORCH", "SourceFailure",
    "dtype_from", "torch_leaf_bytes", "torch_leaf_from",
    "is_plain_npscalar", "npscalar_state", "npscalar_from",
    "memoryview_state", "memoryview_fields", "rebuild_memoryview",
]

EXT_TENSOR = 1
EXT_NDARRAY = 2
EXT_TUPLE = 3
EXT_SET = 4
EXT_FROZENSET = 5
EXT_DICT_PAIRS = 6
EXT_PICKLE = 7
EXT_MEMORYVIEW = 8
EXT_NPSCALAR = 9
EXT_BIGINT = 10
EXT_SURROGATE_STR = 11
EXT_FAILURE = 12
EXT_BYTEARRAY = 13
EXT_TORCH_SIZE = 14
EXT_TORCH_DTYPE = 15
EXT_TORCH_DEVICE = 16

ALIGN = 64
MAX_NDIM = 64
TENSOR_HEAD = struct.Struct("<QQBBB")  # offset, nbytes, dtype code, flags, ndim
ARRAY_HEAD = struct.Struct("<QQBH")  # offset, nbytes, ndim, len(dtype descr)
# Shape structs by ndim; numpy 2 and torch allow up to 64 dimensions.
SHAPES = [struct.Struct(f"<{n}q") for n in range(MAX_NDIM + 1)]
FLAG_REQUIRES_GRAD = 1
FLAG_PARAMETER = 2
#: A plain numpy dtype string: byte order, kind, size, optional datetime unit.
_DTYPE_STR = re.compile(r"[<>|=]?[?a-zA-Z][0-9]{0,9}(\[[0-9]{0,9}[a-zA-Z]{1,3}\])?")
INT64_MIN, UINT64_END = -(1 << 63), 1 << 64

# Stable dtype codes: index in this tuple (names missing in this torch are skipped).
_TORCH_DTYPE_NAMES = (
    "float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64",
    "uint8", "bool", "complex64", "complex128", "complex32", "uint16", "uint32",
    "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e8m0fnu", "float4_e2m1fn_x2", "bits8", "bits16",
    # Sub-byte dtypes: one element per byte in torch's storage, carried as those bytes.
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
    "int1", "int2", "int3", "int4", "int5", "int6", "int7",
    "bits1x8", "bits2x4", "bits4x2",
)
_UINT_BY_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64, 16: np.complex128}
_NONE_TYPE = type(None)


class TorchTypes:
    """The process's torch types and dtype tables, filled once by :meth:`load`.

    Attributes:
        module: The torch module once loaded (None before).
        tensor: ``torch.Tensor`` once loaded.
        parameter: ``torch.nn.Parameter`` once loaded.
        dtype_to_code: torch dtype -> its stable wire code.
        code_to_dtype: wire code -> ``(torch dtype, numpy dtype of its bytes,
            whether the tensor needs a ``view`` to that dtype, itemsize)``.
        dtype_by_name: ``"float32"`` -> ``torch.float32`` (known dtypes only).
        leaves: ``torch.Size``/``dtype``/``device`` -> their ext codes.
        pass_types: Types msgspec encodes natively and exactly, plus the
            array types the encoder hook handles (``torch.Tensor`` once loaded).
    """

    __slots__ = ("module", "tensor", "parameter", "dtype_to_code", "code_to_dtype",
                 "dtype_by_name", "leaves", "pass_types")

    def __init__(self) -> None:
        self.module: Any = None
        self.tensor: Any = None
        self.parameter: Any = None
        self.dtype_to_code: dict[Any, int] = {}
        self.code_to_dtype: dict[int, tuple[Any, np.dtype, bool, int]] = {}
        self.dtype_by_name: dict[str, Any] = {}
        self.leaves: dict[type, int] = {}
        self.pass_types: set[type] = {str, int, float, bool, _NONE_TYPE, bytes, np.ndarray}

    def load(self) -> Any:
        """Import torch (if needed) and fill the tables in place. Returns the module."""
        if self.module is not None:
            return self.module
        import torch

        same = {
            torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
            torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
            torch.int64: np.int64, torch.uint8: np.uint8, torch.bool: np.bool_,
            torch.complex64: np.complex64, torch.complex128: np.complex128,
        }
        for code, name in enumerate(_TORCH_DTYPE_NAMES):
            dt = getattr(torch, name, None)
            if isinstance(dt, torch.dtype) and dt not in self.dtype_to_code:
                self.dtype_to_code[dt] = code
                np_same = same.get(dt)
                np_dt = (np.dtype(np_same) if np_same is not None
                         else np.dtype(_UINT_BY_SIZE[dt.itemsize]))
                self.code_to_dtype[code] = (dt, np_dt, np_same is None, np_dt.itemsize)
        self.dtype_by_name.update(
            (str(dt).removeprefix("torch."), dt) for dt in self.dtype_to_code)
        self.leaves.update({torch.Size: EXT_TORCH_SIZE, torch.dtype: EXT_TORCH_DTYPE,
                            torch.device: EXT_TORCH_DEVICE})
        self.tensor = torch.Tensor
        self.parameter = torch.nn.Parameter
        self.pass_types.add(torch.Tensor)
        self.module = torch
        return torch


#: The one registry of this process (see the module docstring).
TORCH = TorchTypes()


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


# ---------------------------------------------------------------- dtypes
#: Accepted descriptors and their dtypes, kept for the process's lifetime: at
#: most :data:`DTYPE_CACHE_ENTRIES` of them, together at most
#: :data:`DTYPE_CACHE_BYTES` of descriptor bytes (a structured dtype takes a
#: small multiple of its descriptor's size, see ``docs/security-codec.md``), so
#: a peer sending endless or huge new dtypes cannot make the receiver keep
#: more. Descriptors beyond it are parsed for each array that carries them.
_DTYPE_CACHE: dict[bytes, np.dtype] = {}
DTYPE_CACHE_ENTRIES = 256
DTYPE_CACHE_BYTES = 64 << 10
_dtype_cache_bytes = 0


def dtype_from(descr: bytes) -> np.dtype:
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
                dt = np.lib.format.descr_to_dtype(_tuplify(_DESCR_DECODER.decode(descr[1:])))
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
    if dt.itemsize == 0:
        # With 0 data bytes any shape would pass the size check, and using the
        # array would not (S0/U0 arrays do not exist: numpy makes them S1/U1;
        # V0 and empty structured arrays are sent in-band with allow_pickle only).
        raise DecodeError(f"corrupt message: array dtype {descr!r} has no item size")
    _remember(descr, dt)
    return dt


def _remember(descr: bytes, dt: np.dtype) -> None:
    """Cache ``dt`` under ``descr`` while the cache's bounds allow."""
    global _dtype_cache_bytes
    size = _dtype_cache_bytes + len(descr)
    if len(_DTYPE_CACHE) < DTYPE_CACHE_ENTRIES and size <= DTYPE_CACHE_BYTES:
        _DTYPE_CACHE[descr] = dt
        _dtype_cache_bytes = size


def _descr_type(levels: int) -> Any:
    """The type of a structured dtype's msgpack descriptor: scalars and lists
    nested up to ``levels`` deep, no maps (numpy's descr format has none, and a
    map's keys would be built from the peer's bytes before the format is checked)."""
    scalar: Any = None | bool | int | float | str
    node = scalar
    for _ in range(levels):  # msgspec takes no recursive types: unrolled
        node = scalar | GenericAlias(list, (node,))
    return node


#: Decodes a structured dtype's descriptor (32 levels: 16 nested structures).
_DESCR_DECODER: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(_descr_type(32))


def _tuplify(descr: Any) -> Any:
    """Turn msgpack's lists back into the tuples numpy's descr format uses."""
    if isinstance(descr, list):
        return [tuple(_tuplify(x) for x in field) if isinstance(field, list) else field
                for field in descr]
    return descr


# ---------------------------------------------------------------- torch leaves
def torch_leaf_bytes(code: int, value: Any) -> bytes:
    """The ext payload of a ``torch.Size`` (its dims) or ``torch.dtype``/``device`` (names)."""
    if code == EXT_TORCH_SIZE:
        if len(value) > MAX_NDIM:
            raise ValueError(f"cannot send a torch.Size of {len(value)} dimensions: at most "
                             f"{MAX_NDIM} are supported (as for tensors)")
        return SHAPES[len(value)].pack(*value)
    return str(value).removeprefix("torch.").encode()


def torch_leaf_from(code: int, data: memoryview) -> Any:
    """A received ``torch.Size``, ``torch.dtype`` (known names only) or ``torch.device``."""
    torch = TORCH.module
    if torch is None:
        torch = TORCH.load()
    if code == EXT_TORCH_SIZE:
        if len(data) % 8 or len(data) > 8 * MAX_NDIM:
            raise DecodeError(f"corrupt message: torch.Size of {len(data)} bytes")
        return torch.Size(SHAPES[len(data) // 8].unpack_from(data, 0))
    text = bytes(data).decode("ascii")
    if code == EXT_TORCH_DTYPE:
        if text not in TORCH.dtype_by_name:
            raise DecodeError(f"corrupt message: unknown torch dtype {text[:40]!r}")
        return TORCH.dtype_by_name[text]
    if len(text) > 64:
        raise DecodeError(f"corrupt message: device string of {len(text)} characters")
    return torch.device(text)


# ---------------------------------------------------------------- numpy scalars
def is_plain_npscalar(obj: Any) -> bool:
    """Whether ``obj`` is a numpy scalar of a plain (non-object, non-structured) dtype."""
    return (isinstance(obj, np.generic) and type(obj).__module__ == "numpy"
            and obj.dtype.fields is None and not obj.dtype.hasobject
            and obj.dtype.kind != "V")


def npscalar_state(obj: Any) -> bytes:
    """The ext payload of a plain numpy scalar: msgpack ``[dtype.str, raw bytes]``."""
    return msgspec.msgpack.encode([obj.dtype.str, obj.tobytes()])


_NPSCALAR_DECODER = msgspec.msgpack.Decoder(tuple[str, bytes])


def npscalar_from(data: memoryview) -> Any:
    """The numpy scalar of a received :func:`npscalar_state` payload (checked)."""
    try:  # typed: the peer's bytes build no map
        fields = _NPSCALAR_DECODER.decode(data)
    except msgspec.DecodeError:  # ValidationError included
        raise DecodeError("corrupt message: a numpy scalar must be [dtype, bytes]") from None
    dt = dtype_from(fields[0].encode())
    if dt.fields is not None or dt.kind == "V" or dt.itemsize != len(fields[1]):
        raise DecodeError(
            f"corrupt message: numpy scalar of {dt} with {len(fields[1])} bytes of data")
    return np.frombuffer(fields[1], dt)[0]


# ---------------------------------------------------------------- memoryviews
_MEMORYVIEW_DECODER = msgspec.msgpack.Decoder(tuple[bytes, str, list[int], bool])

def memoryview_state(mv: memoryview) -> tuple[bytes, str, list[int], bool]:
    """``(C-order bytes, format, shape, readonly)`` of a memoryview (any layout)."""
    return mv.tobytes(), mv.format, list(mv.shape or ()), bool(mv.readonly)


def memoryview_fields(data: memoryview) -> tuple[bytes, str, list[int], bool]:
    """Decode and check a received memoryview state (typed: the peer's bytes build
    no map); the shape's product is not trusted (cast checks)."""
    try:
        fields = _MEMORYVIEW_DECODER.decode(data)
    except msgspec.DecodeError:  # ValidationError included
        fields = None
    if fields is None or len(fields[2]) > MAX_NDIM or not all(n >= 0 for n in fields[2]):
        raise DecodeError("corrupt message: a memoryview must be [bytes, format, shape, readonly]")
    return fields


#: ``memoryview.cast`` with a format known only at run time (typeshed lists the
#: literal formats only).
_cast: Callable[..., memoryview[Any]] = memoryview.cast


def rebuild_memoryview(data: bytes, fmt: str, shape: list[int], readonly: bool) -> memoryview:
    """A memoryview equal to the one :func:`memoryview_state` described, over fresh memory.

    Read-only views come back over ``bytes``, writable ones over a ``bytearray``.
    Formats ``memoryview.cast`` cannot restore (struct strings) come back as bytes ('B').
    """
    mv = memoryview(data if readonly else bytearray(data))
    if fmt == "B" and len(shape) == 1:
        return mv
    try:
        return _cast(mv.cast("B"), fmt, shape)
    except (TypeError, ValueError):
        return mv

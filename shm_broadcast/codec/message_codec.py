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
any dtype incl. bfloat16/float8/complex    contiguous first; requires_grad
and uint1-7/int1-7 (a byte an element),    and the Parameter type kept)
0-dim, empty, non-contiguous, conj/neg)
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
msgspec as is, which is faster for huge lists (no per-element type scan: the
exact-type scan's cost grows with the number of elements) but lossy where
msgpack is: tuples and sets come back as lists, dataclasses/Structs as dicts,
enums as their values.

Decoding trusts nothing it receives (see ``docs/security-codec.md``): every
declared size is checked against the bytes present before anything is
allocated (``prod(shape) * itemsize == nbytes`` and ``offset + nbytes`` inside
the data area), shapes must be non-negative with at most 64 dimensions,
dtypes must be known plain (non-object) ones, and any malformed input raises
:class:`~shm_broadcast.errors.DecodeError`, never ``IndexError``,
``struct.error``, ``MemoryError``, ``UnicodeDecodeError`` or msgspec's errors.
Its cost is linear in the bytes whatever they hold: sets, frozensets and dicts
are built only when at most
:data:`~shm_broadcast.codec.hash_flooding.MAX_SHARED_HASH` of their items share
a hash (:mod:`shm_broadcast.codec.hash_flooding`), and msgpack maps are read
by :mod:`shm_broadcast.codec.safe_msgpack`, which keeps the same rule for the
maps msgspec would build itself.

This module holds :class:`Codec` and :class:`Encoded`; the byte layout (ext
codes, descriptors, leaf values, the torch tables) is
:mod:`shm_broadcast.codec.wire_format`, the boxing of lossy types before msgspec
:mod:`shm_broadcast.codec.boxing`, and the pickle opt-in
:mod:`shm_broadcast.codec.pickle_opt_in`.
"""

from __future__ import annotations

import ctypes
import math
import struct
import sys
from typing import Any

import msgspec
import numpy as np

from shm_broadcast.codec.boxing import Box, prep, prep_full
from shm_broadcast.codec.hash_flooding import (
    CollisionBudget,
    dict_from_pairs,
    frozenset_from,
    set_from,
)
from shm_broadcast.codec.pickle_opt_in import pickle_oob, unpickle_oob
from shm_broadcast.codec.safe_msgpack import SMALL_FRAME, SafeDecoder
from shm_broadcast.codec.tensor_layout import contiguous
from shm_broadcast.codec.tensor_storage import check_storage
from shm_broadcast.codec.wire_format import (
    ALIGN,
    ARRAY_HEAD,
    EXT_BIGINT,
    EXT_BYTEARRAY,
    EXT_DICT_PAIRS,
    EXT_FAILURE,
    EXT_FROZENSET,
    EXT_MEMORYVIEW,
    EXT_NDARRAY,
    EXT_NPSCALAR,
    EXT_PICKLE,
    EXT_SET,
    EXT_SURROGATE_STR,
    EXT_TENSOR,
    EXT_TORCH_DEVICE,
    EXT_TORCH_DTYPE,
    EXT_TORCH_SIZE,
    EXT_TUPLE,
    FLAG_PARAMETER,
    FLAG_REQUIRES_GRAD,
    MAX_NDIM,
    SHAPES,
    TENSOR_HEAD,
    TORCH,
    SourceFailure,
    dtype_from,
    is_plain_npscalar,
    memoryview_fields,
    npscalar_from,
    npscalar_state,
    rebuild_memoryview,
    torch_leaf_bytes,
    torch_leaf_from,
)
from shm_broadcast.errors import DecodeError, EncodeError

__all__ = ["Codec", "Encoded", "SourceFailure", "PICKLE_OPT_IN", "carries_dtype"]

# Per-array names bound in this module by assignment. CPython 3.11 compiles
# ``name.method(...)`` on a name bound by an import as an attribute load that
# builds a bound method object per call, not as a method call (this runs per
# array); and the dtype tables (filled in place by TORCH.load(), so these stay
# current) skip a registry attribute load.
_TENSOR_HEAD, _ARRAY_HEAD = TENSOR_HEAD, ARRAY_HEAD
_DTYPE_TO_CODE, _CODE_TO_DTYPE = TORCH.dtype_to_code, TORCH.code_to_dtype
#: No array is this large: the view threshold of a blob that is not private.
_NEVER = 1 << 63
#: Depth hint for the error raised on messages nested too deeply.
_DEPTH_HINT = "a few hundred levels of tuples/sets, about a thousand of lists/dicts"

#: How an error tells the user to opt in to pickle (one wording everywhere).
PICKLE_OPT_IN = (
    "allow_pickle=True on both sides (MessageQueue / GroupCoordinator / "
    "init_distributed_environment / initialize_model_parallel), which lets the "
    "peer run code in this process: only between processes you trust"
)


class Encoded:
    """One encoded message, ready to be written.

    Attributes:
        msg: msgpack bytes of the structure.
        blob_len: Size of the raw-array area in bytes.
        copies: ``(source address, nbytes, offset in blob)`` per array.
        keep: The arrays/tensors the addresses point into (kept alive).
    """

    __slots__ = ("msg", "blob_len", "copies", "keep")

    def __init__(self, msg: bytes, blob_len: int, copies: list[tuple[int, int, int]],
                 keep: list[Any]) -> None:
        self.msg = msg
        self.blob_len = blob_len
        self.copies = copies
        self.keep = keep

    def write_blob(self, dst_addr: int) -> None:
        """Copy every array's bytes to ``dst_addr + offset`` (caller ensures room)."""
        memmove = ctypes.memmove
        for src, nbytes, off in self.copies:
            memmove(dst_addr + off, src, nbytes)

    def blob_bytes(self) -> memoryview:
        """Return the blob as one new buffer (for zmq transport).

        Every byte is written once: the arrays', and zeros in the alignment
        gaps between and after them (never what the allocator left there,
        which may be another message's or secret). A zero-filled buffer
        written over would be a second pass over the memory
        (docs/performance.md, "Messages larger than a chunk").
        """
        out = np.empty(self.blob_len, np.uint8)
        if self.blob_len:
            addr = out.ctypes.data
            self.write_blob(addr)
            memset, end = ctypes.memset, 0
            for _src, nbytes, off in self.copies:  # in offset order (Codec._reserve)
                if off > end:
                    memset(addr + end, 0, off - end)
                end = off + nbytes
            if self.blob_len > end:
                memset(addr + end, 0, self.blob_len - end)
        return out.data


def carries_dtype(dtype: Any) -> bool:
    """Whether tensors of torch ``dtype`` travel as themselves (others: as their bytes)."""
    if TORCH.module is None:
        TORCH.load()
    return dtype in _DTYPE_TO_CODE


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
        resizable: Decode tensors into storage torch allocates (resizable,
            like ``torch.empty``'s), not into a NumPy copy wrapped by
            ``torch.from_numpy`` (fixed size). It adds a ``torch.empty`` per
            tensor, which small tensors feel and large ones do not (there
            torch's copy is the faster one).

    Raises:
        TypeError: ``allow_pickle``, ``exact`` or ``resizable`` is not a bool.
    """

    def __init__(self, allow_pickle: bool = False, exact: bool = True,
                 resizable: bool = False) -> None:
        for name, value in (("allow_pickle", allow_pickle), ("exact", exact),
                            ("resizable", resizable)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        self.allow_pickle = allow_pickle
        self.exact = exact
        self.resizable = resizable
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._budget = CollisionBudget()
        self._safe = SafeDecoder(self._ext_hook)
        self._decoder = self._safe.fast
        self._copies: list[tuple[int, int, int]] = []
        self._keep: list[Any] = []
        self._cursor = 0
        self._src: Any = b""
        self._src_start = 0
        self._src_len = 0
        self._view_min = _NEVER

    # ---------------------------------------------------------------- encode
    def encode(self, obj: Any) -> Encoded:
        """Encode ``obj``; arrays are referenced, not copied (see :class:`Encoded`).

        Raises:
            TypeError: A value cannot be encoded (CUDA tensor, sparse tensor,
                or a type msgspec cannot carry while ``allow_pickle`` is off;
                the message names the type and the opt-in).
            EncodeError: A value is wrong rather than of the wrong type (a
                tensor whose storage was freed, nesting too deep); both a
                TypeError and a ValueError.
        """
        if TORCH.module is None and "torch" in sys.modules:
            TORCH.load()
        self._copies = []
        self._keep = []
        self._cursor = 0
        try:
            msg = self._encoder.encode(prep(obj) if self.exact else obj)
        except (OverflowError, UnicodeEncodeError):
            # An int beyond 64 bits or a lone surrogate somewhere: box those too.
            self._copies, self._keep, self._cursor = [], [], 0
            try:
                msg = self._encoder.encode(prep_full(obj, self.exact))
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
        self._cursor = off + (nbytes + ALIGN - 1) // ALIGN * ALIGN
        return off

    def _tensor_desc(self, t: Any, flags: int = 0) -> bytes:
        if t.dim() > MAX_NDIM:  # before any copy is reserved: a descriptor holds at most that
            raise EncodeError(f"a tensor in the message has {t.dim()} dimensions; at most "
                              f"{MAX_NDIM} travel (reshape it and send its shape alongside)")
        if not t.is_cpu:
            raise TypeError(
                f"MessageQueue carries CPU tensors only, got a tensor on {t.device}; "
                "move it with .cpu() or use a device communicator"
            )
        if t.layout is not TORCH.module.strided or t.is_nested:
            raise TypeError(f"MessageQueue carries strided tensors only, got "
                            f"{'a nested tensor' if t.is_nested else f'layout {t.layout}'}")
        code = _DTYPE_TO_CODE.get(t.dtype)
        if code is None:
            raise TypeError(f"tensor dtype {t.dtype} is not supported by MessageQueue")
        try:  # before any copy reads it by address
            check_storage(t, "a tensor in the message")
        except ValueError as e:
            raise EncodeError(str(e)) from None
        if t.requires_grad:
            flags |= FLAG_REQUIRES_GRAD
            t = t.detach()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        if not t.is_contiguous():
            t = contiguous(t)  # sub-byte dtypes too, which torch cannot copy
        nbytes = t.nbytes
        off = self._reserve(nbytes, t.data_ptr(), t)
        shape = t.shape
        ndim = len(shape)
        return _TENSOR_HEAD.pack(off, nbytes, code, flags, ndim) + SHAPES[ndim].pack(*shape)

    def _array_desc(self, a: np.ndarray) -> bytes:
        if not a.flags.c_contiguous:
            a = np.ascontiguousarray(a)
        dt = a.dtype
        if dt.fields is None and dt.subdtype is None:
            descr: bytes = dt.str.encode()
        else:
            descr = b"\x00" + msgspec.msgpack.encode(np.lib.format.dtype_to_descr(dt))
        nbytes = a.nbytes
        off = self._reserve(nbytes, a.__array_interface__["data"][0] if nbytes else 0, a)
        ndim = a.ndim
        return (
            _ARRAY_HEAD.pack(off, nbytes, ndim, len(descr))
            + SHAPES[ndim].pack(*a.shape)
            + descr
        )

    def _enc_hook(self, obj: Any) -> msgspec.msgpack.Ext:
        t = type(obj)
        if t is TORCH.tensor:  # None until torch is loaded
            return msgspec.msgpack.Ext(EXT_TENSOR, self._tensor_desc(obj))
        if t is np.ndarray and not obj.dtype.hasobject and obj.dtype.itemsize:
            return msgspec.msgpack.Ext(EXT_NDARRAY, self._array_desc(obj))
        if t is Box:
            return self._box_ext(obj)
        if t is TORCH.parameter:
            return msgspec.msgpack.Ext(EXT_TENSOR, self._tensor_desc(obj, FLAG_PARAMETER))
        if t is SourceFailure:
            return msgspec.msgpack.Ext(EXT_FAILURE, _utf8(obj.message))
        if is_plain_npscalar(obj):  # exact=False reaches here with numpy scalars
            return msgspec.msgpack.Ext(EXT_NPSCALAR, npscalar_state(obj))
        if t in TORCH.leaves:  # and with dtypes, devices
            return self._box_ext(Box(TORCH.leaves[t], obj))
        # A type msgspec does not know (custom classes...).
        return msgspec.msgpack.Ext(EXT_PICKLE, self._pickle(obj))

    def _box_ext(self, box: Box) -> msgspec.msgpack.Ext:
        code, value = box.code, box.value
        if code == EXT_PICKLE:
            return msgspec.msgpack.Ext(EXT_PICKLE, self._pickle(value))
        if code == EXT_NPSCALAR:
            return msgspec.msgpack.Ext(EXT_NPSCALAR, npscalar_state(value))
        if code == EXT_BIGINT:
            return msgspec.msgpack.Ext(
                EXT_BIGINT, value.to_bytes(value.bit_length() // 8 + 1, "little", signed=True))
        if code == EXT_SURROGATE_STR:
            return msgspec.msgpack.Ext(EXT_SURROGATE_STR, _utf8(value))
        if code == EXT_BYTEARRAY:
            return msgspec.msgpack.Ext(EXT_BYTEARRAY, bytes(value))
        if code in (EXT_TORCH_SIZE, EXT_TORCH_DTYPE, EXT_TORCH_DEVICE):
            return msgspec.msgpack.Ext(code, torch_leaf_bytes(code, value))
        return msgspec.msgpack.Ext(code, self._encoder.encode(value))

    def _pickle(self, obj: Any) -> bytes:
        if not self.allow_pickle:
            what = f"{type(obj).__module__}.{type(obj).__qualname__}"
            if isinstance(obj, np.ndarray):
                what += f" of dtype {obj.dtype}"
                if obj.dtype.hasobject:
                    what += " (Python objects)"
                elif not obj.dtype.itemsize:
                    what += " (items of 0 bytes, which a receiver cannot size-check)"
                elif type(obj) is not np.ndarray:
                    what += " (an ndarray subclass: send np.asarray(x))"
            raise TypeError(
                f"cannot send a value of type {what} without pickle: msgspec carries "
                "None, bool, int, float, str, bytes, lists, dicts, tuples, sets, numpy "
                "arrays and scalars and CPU tensors; convert it "
                "(dataclasses.asdict(x), an enum's .value...) or opt in with "
                + PICKLE_OPT_IN
            )
        return pickle_oob(obj, self._tensor_desc, self._array_desc)

    # ---------------------------------------------------------------- decode
    def decode(self, msg: Any, blob: Any, blob_start: int, blob_len: int,
               blob_private: bool = False) -> Any:
        """Decode a message whose arrays live in ``blob[blob_start:blob_start+blob_len]``.

        Args:
            msg: msgpack bytes (any buffer, e.g. a ``memoryview`` into the ring).
            blob: Buffer holding the raw array bytes.
            blob_start: Offset of the blob in ``blob``.
            blob_len: Size of the blob (checked against ``blob`` before any
                array is read).
            blob_private: ``blob`` is a writable buffer that nothing else reads
                or writes once this call returns (a frame this process received):
                a tensor of at least half the buffer is then a view of it, not
                a copy (unless ``resizable``; at most one per message, and only
                where it starts on a multiple of its item size: see
                :meth:`_plain_copy`), so the buffer lives as long as that
                tensor and holds at most twice its bytes.

        Returns:
            The object; every array in it is a private copy, or, with
            ``blob_private``, private memory of ``blob``.

        Raises:
            DecodeError: The bytes are malformed (sizes that do not match the
                bytes present, bad shapes, unknown dtypes or codes, bad UTF-8,
                nesting too deep), hold a set, frozenset or dict with more
                than :data:`~shm_broadcast.codec.hash_flooding.MAX_SHARED_HASH`
                items on one hash, or hold a pickled value while
                ``allow_pickle`` is off. Nothing is allocated for a claimed
                size before it is checked.
        """
        self._src = blob
        self._src_start = blob_start
        self._src_len = blob_len
        # A tensor at least this large is a view of a private blob (never, without one):
        # half the buffer the view would keep alive, whatever blob_len claims.
        self._view_min = ((memoryview(blob).nbytes - blob_start + 1) // 2 if blob_private
                          else _NEVER)
        self._src_span: tuple[int, int] | None = None  # (address, size), once needed
        self._budget.reset()
        try:
            if len(msg) <= SMALL_FRAME:
                return self._decoder.decode(msg)
            return self._safe.decode_large(msg, blob_len > 0)  # arrays: exts hold them
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
               shape: tuple[int, ...]) -> np.ndarray:
        """A copy of the message's array at ``off`` (see :meth:`_bytes`)."""
        raw = self._bytes(off, nbytes, dtype, itemsize, shape)
        if raw is None:
            return np.empty(shape, dtype)
        # Copy as raw bytes: a structured dtype's copy() skips its padding bytes
        # (left uninitialised), a byte copy is exact and a plain memcpy.
        out: np.ndarray = raw.copy().view(dtype).reshape(shape)
        return out

    def _plain_copy(self, off: int, nbytes: int, dtype: np.dtype, itemsize: int,
                    shape: tuple[int, ...], copy: bool = True) -> np.ndarray:
        """A copy of the message's array of plain (unstructured) ``dtype`` at ``off``.

        Plain dtypes have no padding, so numpy's copy of a contiguous array is
        a byte copy (NaN payloads and non-0/1 bools come through as sent), done
        in one call instead of :meth:`_slice`'s three.

        ``copy=False`` (a private blob): a view of the blob instead, if the blob
        is writable there and the array starts on a multiple of its item size
        (zmq frames start 8 bytes off 16, and torch's complex128 kernels fault
        on less than 16); it is the message's only view, so no two arrays of a
        message share memory, whatever offsets a writer claims.
        """
        if not self._in_area(off, nbytes, dtype, itemsize, shape):
            return np.empty(shape, dtype)
        try:  # frombuffer allocates nothing: it refuses a range the buffer does not hold
            raw = np.frombuffer(self._src, dtype, nbytes // itemsize, self._src_start + off)
        except ValueError:
            raise DecodeError(
                f"corrupt message: array of {nbytes} bytes at offset {off} extends beyond "
                f"the bytes received") from None
        out: np.ndarray = raw.reshape(shape)
        if copy or not out.flags.writeable or out.ctypes.data % itemsize:
            out = out.copy()
        else:
            self._view_min = _NEVER
        return out

    def _owned_tensor(self, off: int, nbytes: int, np_dtype: np.dtype, itemsize: int,
                      shape: tuple[int, ...], dtype: Any, torch: Any) -> Any:
        """The message's tensor at ``off`` in storage torch allocated (resizable)."""
        if self._in_area(off, nbytes, np_dtype, itemsize, shape):
            if self._src_span is None:  # once per message: its buffer's address and size
                whole = np.frombuffer(self._src, np.uint8)
                self._src_span = (whole.ctypes.data, whole.size)
            base, size = self._src_span
            if self._src_start + off + nbytes > size:
                raise DecodeError(
                    f"corrupt message: array of {nbytes} bytes at offset {off} extends beyond "
                    f"the bytes received")
            t = torch.empty(shape, dtype=dtype, device="cpu")
            ctypes.memmove(t.data_ptr(), base + self._src_start + off, nbytes)
            return t
        return torch.empty(shape, dtype=dtype, device="cpu")

    def _bytes(self, off: int, nbytes: int, dtype: np.dtype, itemsize: int,
               shape: tuple[int, ...]) -> np.ndarray | None:
        """The message's ``nbytes`` at ``off`` as uint8, uncopied (None when empty)."""
        if not self._in_area(off, nbytes, dtype, itemsize, shape):
            return None
        try:  # frombuffer allocates nothing: it refuses a range the buffer does not hold
            return np.frombuffer(self._src, np.uint8, nbytes, self._src_start + off)
        except ValueError:
            raise DecodeError(
                f"corrupt message: array of {nbytes} bytes at offset {off} extends beyond "
                f"the bytes received") from None

    def _in_area(self, off: int, nbytes: int, dtype: Any, itemsize: int,
                 shape: tuple[int, ...]) -> bool:
        """Whether the array is non-empty; raises unless 0 <= dims, prod(shape) *
        itemsize == nbytes and the bytes lie inside the declared data area."""
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
            return False
        if off + nbytes > self._src_len:
            raise DecodeError(
                f"corrupt message: array of {nbytes} bytes at offset {off} extends beyond "
                f"the message's data area ({self._src_len} bytes declared)")
        return True

    def _tensor_from(self, data: Any) -> Any:
        torch = TORCH.module
        if torch is None:
            torch = TORCH.load()
        try:  # a short descriptor or ndim > 64 fails here (struct.error / IndexError)
            off, nbytes, code, flags, ndim = _TENSOR_HEAD.unpack_from(data, 0)
            shape = SHAPES[ndim].unpack_from(data, _TENSOR_HEAD.size)
        except (struct.error, IndexError):
            raise DecodeError(
                f"corrupt message: bad tensor descriptor of {len(data)} bytes") from None
        entry = _CODE_TO_DTYPE.get(code)
        if entry is None:
            raise DecodeError(f"corrupt or incompatible message: unknown tensor dtype code {code}")
        dtype, np_dtype, needs_view, itemsize = entry
        if self.resizable:
            t = self._owned_tensor(off, nbytes, np_dtype, itemsize, shape, dtype, torch)
        else:
            t = torch.from_numpy(self._plain_copy(off, nbytes, np_dtype, itemsize, shape,
                                                  nbytes < self._view_min))
            if needs_view:
                t = t.view(dtype)
        if flags:
            if flags & FLAG_PARAMETER:
                return TORCH.parameter(t, requires_grad=bool(flags & FLAG_REQUIRES_GRAD))
            if flags & FLAG_REQUIRES_GRAD:
                t.requires_grad_(True)
        return t

    def _array_from(self, data: Any) -> np.ndarray:
        try:  # a short descriptor or ndim > 64 fails here (struct.error / IndexError)
            off, nbytes, ndim, dlen = _ARRAY_HEAD.unpack_from(data, 0)
            pos = _ARRAY_HEAD.size
            shape = SHAPES[ndim].unpack_from(data, pos)
        except (struct.error, IndexError):
            raise DecodeError(
                f"corrupt message: bad array descriptor of {len(data)} bytes") from None
        pos += 8 * ndim
        if len(data) != pos + dlen:
            raise DecodeError(f"corrupt message: array descriptor of {len(data)} bytes, "
                              f"{pos + dlen} expected")
        dt = dtype_from(bytes(data[pos:]))
        return self._slice(off, nbytes, dt, dt.itemsize, shape)

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == EXT_TENSOR:
            return self._tensor_from(data)
        if code == EXT_NDARRAY:
            return self._array_from(data)
        if code == EXT_TUPLE:
            return tuple(self._items(data, code))
        if code == EXT_DICT_PAIRS:
            return dict_from_pairs(self._items(data, code))
        if code == EXT_SET:
            return set_from(self._items(data, code))
        if code == EXT_FROZENSET:
            return frozenset_from(self._items(data, code), self._budget)
        if code == EXT_MEMORYVIEW:
            return rebuild_memoryview(*memoryview_fields(data))
        if code == EXT_NPSCALAR:
            return npscalar_from(data)
        if code == EXT_BIGINT:
            return int.from_bytes(data, "little", signed=True)
        if code == EXT_SURROGATE_STR:
            return bytes(data).decode("utf-8", "surrogatepass")
        if code == EXT_BYTEARRAY:
            return bytearray(data)
        if code in (EXT_TORCH_SIZE, EXT_TORCH_DTYPE, EXT_TORCH_DEVICE):
            return torch_leaf_from(code, data)
        if code == EXT_FAILURE:
            return SourceFailure(bytes(data).decode("utf-8", "surrogatepass"))
        if code == EXT_PICKLE:
            if not self.allow_pickle:
                raise DecodeError(
                    "received a pickled value, which this side refuses to unpickle "
                    "(allow_pickle is off): the sender must send plain data, or opt in with "
                    + PICKLE_OPT_IN)
            return unpickle_oob(data, self._tensor_from, self._array_from)
        raise DecodeError(f"corrupt or incompatible message: unknown ext code {code}")

    def _items(self, data: memoryview, code: int) -> list[Any]:
        items = (self._decoder.decode(data) if len(data) <= SMALL_FRAME
                 else self._safe.decode_large(data))
        if type(items) is not list:
            raise DecodeError(
                f"corrupt message: ext {code} must hold a list, got {type(items).__name__}")
        return items


def _too_deep(op: str) -> ValueError:
    text = (f"cannot {op} the message: it is nested too deeply for the recursion limit "
            f"(sys.getrecursionlimit() = {sys.getrecursionlimit()}; roughly {_DEPTH_HINT} fit)")
    return DecodeError(text) if op == "decode" else EncodeError(text)


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


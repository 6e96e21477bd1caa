"""Codec: exact round trips without pickle, out-of-band arrays, pickle only as an opt-in."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import pickle
import warnings

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shm_broadcast.codec.message_codec import Codec, SourceFailure
from shm_broadcast.errors import DecodeError


def roundtrip(obj, codec=None):
    codec = codec or Codec()
    enc = codec.encode(obj)
    blob = enc.blob_bytes()
    return codec.decode(enc.msg, blob, 0, enc.blob_len), enc, blob


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's logical values as raw bytes (bit-exact comparison, NaNs included)."""
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


ALL_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
]


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.randint(0, 256, (int(np.prod(shape)) * dtype.itemsize,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(7))
    if dtype == torch.bool:
        return (raw[: int(np.prod(shape))] % 2).to(torch.bool).reshape(shape)
    return raw.view(dtype).reshape(shape)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("resizable", [False, True], ids=["numpy-copy", "resizable"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_tensor_kinds_roundtrip_bit_exact(dtype, resizable):
    base = sample(dtype, (4, 6))
    cases = {
        "contiguous": base,
        "non_contiguous": base.t(),
        "strided_slice": base[::2, 1::3],
        "zero_dim": base[1, 2].clone(),
        "empty": base[:0],
        "empty_3d": torch.empty((0, 3, 2), dtype=dtype),
        "expanded": base[:1].expand(3, 6),
    }
    got, enc, _ = roundtrip(cases, Codec(resizable=resizable))
    assert set(got) == set(cases)
    for name, t in cases.items():
        g = got[name]
        assert type(g) is torch.Tensor, name
        assert g.dtype == t.dtype and g.shape == t.shape, name
        assert g.is_contiguous(), name
        assert torch.equal(bits(g), bits(t)), name
        if resizable:  # storage torch allocated: it grows like torch.empty's
            g.resize_(g.numel() + 5)
    # Tensors travel as raw bytes next to the msgpack, not inside it.
    assert enc.blob_len >= sum(t.numel() * t.element_size() for t in cases.values())
    assert len(enc.msg) < 1024


SUB_BYTE_DTYPES = [getattr(torch, name) for name in (
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
    "int1", "int2", "int3", "int4", "int5", "int6", "int7",
    "bits1x8", "bits2x4", "bits4x2") if isinstance(getattr(torch, name, None), torch.dtype)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("resizable", [False, True], ids=["numpy-copy", "resizable"])
@pytest.mark.parametrize("dtype", SUB_BYTE_DTYPES, ids=str)
def test_sub_byte_dtypes_travel_as_their_bytes(dtype, resizable):
    """torch.uint4 and its kin keep one element per byte and have no copy kernel
    (``contiguous()`` raises NotImplementedError): they travel as those bytes, in any
    layout, alone, nested, and as dtype values."""
    raw = torch.randint(0, 256, (24,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(3)).reshape(4, 6)
    base = raw.view(dtype)
    cases = {
        "contiguous": base,
        "non_contiguous": base.t(),
        "strided_slice": base[::2, 1::3],
        "expanded": base[:1].expand(3, 6),
        "zero_dim": raw[1, 2].view(dtype),
        "empty": torch.empty((0, 3), dtype=dtype),
    }
    got, _, _ = roundtrip({"cases": [cases], "dtype": dtype}, Codec(resizable=resizable))
    assert got["dtype"] is dtype
    for name, t in cases.items():
        g = got["cases"][0][name]
        assert type(g) is torch.Tensor and g.dtype == dtype and g.shape == t.shape, name
        assert g.is_contiguous(), name
        assert torch.equal(g.view(torch.uint8), t.view(torch.uint8).contiguous()), name


@pytest.mark.timeout(30)
@pytest.mark.parametrize("resizable", [False, True], ids=["numpy-copy", "resizable"])
def test_raw_bytes_survive_typed_copies(resizable):
    """Bytes no arithmetic would produce come back as sent: bools stored as 2 or
    255, signalling NaNs with payloads, negative zero."""
    cases = {
        "bool": torch.tensor([0, 1, 2, 255], dtype=torch.uint8).view(torch.bool),
        "f32": torch.tensor([0x7F800001, 0xFFC00123, 0x80000000], dtype=torch.int64)
        .to(torch.int32).view(torch.float32).reshape(3, 1),
        "f64": torch.tensor([0x7FF0000000000001, -0x8000000000000000], dtype=torch.int64)
        .view(torch.float64),
        "f16": torch.tensor([0x7C01, -0x8000], dtype=torch.int16).view(torch.float16),
    }
    got, _, _ = roundtrip(cases, Codec(resizable=resizable))
    for name, t in cases.items():
        assert torch.equal(bits(got[name]), bits(t)), name


@pytest.mark.timeout(30)
def test_tensor_flags_and_views():
    c = torch.randn(5, dtype=torch.complex64)
    src = {
        "grad": torch.ones(3, requires_grad=True),
        "conj": c.conj(),
        "neg": c.conj().imag,  # a real tensor carrying the negative bit
        "param": torch.nn.Parameter(torch.arange(4.0)),
    }
    got, _, _ = roundtrip(src)
    assert got["grad"].requires_grad and torch.equal(got["grad"], src["grad"])
    assert not got["conj"].is_conj() and torch.equal(got["conj"], c.conj().resolve_conj())
    assert torch.equal(got["neg"], src["neg"].resolve_neg())
    assert type(got["param"]) is torch.nn.Parameter  # its own flag, no pickle
    assert got["param"].requires_grad
    assert torch.equal(got["param"].data, src["param"].data)
    frozen = roundtrip(torch.nn.Parameter(torch.ones(2), requires_grad=False))[0]
    assert type(frozen) is torch.nn.Parameter and not frozen.requires_grad


@pytest.mark.timeout(30)
@pytest.mark.parametrize("resizable", [False, True], ids=["numpy-copy", "resizable"])
def test_decoded_tensors_do_not_alias_the_buffer(resizable):
    t = torch.arange(16, dtype=torch.int64)
    arr = np.arange(8, dtype=np.float32)
    got, enc, blob = roundtrip({"t": t, "a": arr}, Codec(resizable=resizable))
    blob[:] = b"\xff" * len(blob)  # the writer reuses the chunk
    assert torch.equal(got["t"], t)
    assert np.array_equal(got["a"], arr)
    got["t"][0] = 99  # and the copy is writable
    assert got["a"].flags.writeable


@pytest.mark.timeout(30)
def test_numpy_arrays_roundtrip():
    st_dtype = np.dtype([("a", "<i4"), ("b", "<f8", (2,))])
    src = {
        "f": np.linspace(0, 1, 7),
        "nc": np.arange(24, dtype=np.int16).reshape(4, 6)[:, ::2],
        "zero_dim": np.array(3.5, dtype=np.float16),
        "empty": np.zeros((0, 4), dtype=np.uint64),
        "big_endian": np.arange(5, dtype=">i4"),
        "structured": np.zeros(3, dtype=st_dtype),
        "dt64": np.array(["2024-01-01"], dtype="datetime64[ns]"),
        # Object arrays hold Python objects: only with the pickle opt-in.
        "objects": np.array([1, "x", None], dtype=object),
    }
    src["structured"]["b"] = 1.5
    with pytest.raises(TypeError, match="allow_pickle=True"):
        Codec().encode(src)
    got, _, _ = roundtrip(src, Codec(allow_pickle=True))
    for k, v in src.items():
        assert type(got[k]) is np.ndarray and got[k].dtype == v.dtype and got[k].shape == v.shape
        assert got[k].tobytes() == v.tobytes() if v.dtype != object else list(got[k]) == list(v)


@dataclasses.dataclass
class Step:
    ids: list
    hidden: torch.Tensor


class Color(enum.Enum):
    RED = 1


@pytest.mark.timeout(30)
def test_python_structures_are_exact_without_pickle():
    src = {
        "tuple": (1, (2, "x"), []),
        "set": {1, 2, 3},
        "frozenset": frozenset({"a"}),
        (1, 2): "tuple key",
        5: "int key",
        2**70: "big int key",
        "list_of_tuples": [(1, 2), (3, 4)],
        "none": None, "bool": True, "float": 1.5, "bytes": b"\x00\xff", "str": "é",
        "surrogate": "a\udc80b",
        "big_int": 2**80, "big_neg": -(2**200) - 7,
        "edges": [-(2**63), 2**64 - 1, 2**64, -(2**63) - 1],
        "np_scalars": [np.int64(7), np.float32(1.5), np.bool_(True), np.uint8(255),
                       np.complex64(1 + 2j), np.datetime64("2024-01-01", "D")],
        "failure": SourceFailure("why"),
    }
    got, _, _ = roundtrip(src)
    assert list(got) == list(src)
    for k, v in src.items():
        if k == "np_scalars":
            assert [type(x) for x in got[k]] == [type(x) for x in v] and got[k] == v
        else:
            assert type(got[k]) is type(v) and got[k] == v, k
    assert type(got["tuple"][1]) is tuple and type(got["list_of_tuples"][0]) is tuple


def _deep_types(x):
    """The structure's exact types, recursively (dict keys included)."""
    if isinstance(x, dict):
        return (dict, [(_deep_types(k), _deep_types(v)) for k, v in x.items()])
    if isinstance(x, (list, tuple, set, frozenset)):
        return (type(x), [_deep_types(v) for v in x])
    return type(x)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("rows", [
    [[1, 2], [3, 4], []],
    [[1, 2], [3, (4, 5)]],
    [[1], [2], {3}],
    [[1.5, "a"], [None, bytearray(b"x")]],
    [[2**70], [1]],
    [{"a": 1}, {"b": [2]}],
    [{"a": 1}, {"b": (2,)}],
    [{"a": 1}, {(1, 2): "tuple key"}],
    [{"a": 1}, {3: "int key"}],
    [{"a": 1}, [2]],
    [[], {}],
], ids=["plain-lists", "tuple-in-row", "set-row", "bytearray-in-row", "bigint-in-row",
        "plain-dicts", "tuple-in-dict-row", "tuple-key-row", "int-key-row", "mixed-rows",
        "empty-rows"])
def test_rows_of_lists_and_dicts_stay_exact(rows):
    """Lists of rows (block tables, per-request records) are checked in one scan;
    anything lossy in any row still takes the exact path."""
    got, _, _ = roundtrip({"rows": rows, "nested": [rows, rows]})
    assert got == {"rows": rows, "nested": [rows, rows]}
    assert _deep_types(got) == _deep_types({"rows": rows, "nested": [rows, rows]})


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value", [
    Step([1], torch.arange(2)), Color.RED, datetime.datetime(2024, 5, 1), lambda: 1,
    np.array([None], dtype=object),
], ids=["dataclass", "enum", "datetime", "lambda", "object-array"])
def test_values_msgspec_cannot_carry_are_refused_by_the_sender(value):
    """msgspec would turn these into dicts/values/strings (lossy): without the
    opt-in the sender refuses, naming the type and the opt-in."""
    with pytest.raises(TypeError, match=r"allow_pickle=True") as info:
        Codec().encode({"nested": [value]})
    assert type(value).__qualname__ in str(info.value)


@pytest.mark.timeout(30)
def test_python_structures_are_exact_with_the_pickle_opt_in():
    src = {
        "tuple": (1, (2, "x"), []),
        "set": {1, 2, 3},
        "frozenset": frozenset({"a"}),
        (1, 2): "tuple key",
        5: "int key",
        "list_of_tuples": [(1, 2), (3, 4)],
        "none": None, "bool": True, "float": 1.5, "bytes": b"\x00\xff", "str": "é",
        "big_int": 2**80,
        "dataclass": Step([1, 2], torch.arange(3)),
        "enum": Color.RED,
        "when": datetime.datetime(2024, 5, 1, 12, 0),
        "np_scalar": np.int64(7),
    }
    got, _, _ = roundtrip(src, Codec(allow_pickle=True))
    for k, v in src.items():
        if k == "dataclass":
            assert type(got[k]) is Step and got[k].ids == [1, 2]
            assert torch.equal(got[k].hidden, v.hidden)
        else:
            assert type(got[k]) is type(v) and got[k] == v, k
    assert roundtrip((1, 2))[0] == (1, 2)
    assert roundtrip("plain")[0] == "plain"


@pytest.mark.timeout(30)
def test_pickle_fallback_sends_tensors_out_of_band():
    big = torch.zeros(100_000)
    got, enc, _ = roundtrip(Step([1], big), Codec(allow_pickle=True))
    assert torch.equal(got.hidden, big)
    assert enc.blob_len >= big.numel() * 4
    assert len(enc.msg) < 1024  # the pickle holds a reference, not the 400 kB


@pytest.mark.timeout(30)
def test_pickle_is_off_by_default_on_both_sides():
    codec = Codec()
    assert codec.allow_pickle is False
    assert roundtrip({"a": (1, [2])}, codec)[0] == {"a": (1, [2])}  # no pickle needed
    with pytest.raises(TypeError, match="Step"):
        codec.encode({"x": Step([], torch.zeros(1))})
    enc = Codec(allow_pickle=True).encode(Color.RED)  # a peer that opted in
    with pytest.raises(DecodeError, match="allow_pickle"):
        codec.decode(enc.msg, b"", 0, 0)
    with pytest.raises(TypeError, match="allow_pickle must be a bool, got int"):
        Codec(allow_pickle=1)


@pytest.mark.timeout(30)
def test_unsupported_tensors_raise_type_error():
    codec = Codec()
    with pytest.raises(TypeError, match="CPU tensors only"):
        codec.encode({"t": torch.empty(2, device="meta")})
    with pytest.raises(TypeError, match="strided"):
        codec.encode(torch.eye(3).to_sparse())


@pytest.mark.timeout(30)
def test_torch_size_beyond_the_dimension_limit_is_a_value_error():
    codec = Codec()
    assert roundtrip(torch.Size([1] * 64), codec)[0] == torch.Size([1] * 64)
    with pytest.raises(ValueError, match="65 dimensions: at most 64"):
        codec.encode({"shape": torch.Size([1] * 65)})


@pytest.mark.timeout(30)
def test_fast_mode_is_msgspec_semantics():
    got, _, _ = roundtrip({"t": (1, 2), "x": torch.ones(2)}, Codec(exact=False))
    assert got["t"] == [1, 2]  # documented: tuples become lists
    assert torch.equal(got["x"], torch.ones(2))


@pytest.mark.timeout(30)
def test_corrupt_offsets_are_rejected():
    enc = Codec().encode(torch.arange(100))
    with pytest.raises(DecodeError, match="corrupt"):
        Codec().decode(enc.msg, bytearray(enc.blob_len), 0, 10)


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.tuples(children, children)
    | st.dictionaries(st.text(max_size=8) | st.integers(-5, 5), children, max_size=4),
    max_leaves=20,
)


@pytest.mark.timeout(60)
@settings(max_examples=150, deadline=None)
@given(json_like)
def test_property_roundtrip_equals_pickle_roundtrip(obj):
    got, _, _ = roundtrip(obj)
    assert got == pickle.loads(pickle.dumps(obj))
    assert type(got) is type(obj)


def _inside(t: torch.Tensor, buf: bytearray, start: int = 0) -> bool:
    """Whether tensor ``t``'s memory lies in ``buf[start:]``."""
    base = np.frombuffer(buf, np.uint8).ctypes.data
    return base + start <= t.data_ptr() < base + len(buf)


@pytest.mark.timeout(30)
def test_a_private_blob_lends_its_large_tensor_and_copies_the_rest():
    src = {"big": torch.arange(4096, dtype=torch.float32), "small": torch.arange(5),
           "arr": np.arange(3.0)}
    enc = Codec().encode(src)
    blob = enc.blob_bytes()
    got = Codec().decode(enc.msg, blob, 0, enc.blob_len, blob_private=True)
    assert torch.equal(got["big"], src["big"]) and torch.equal(got["small"], src["small"])
    assert _inside(got["big"], blob)  # a view: no copy of the bulk
    assert not _inside(got["small"], blob) and not np.shares_memory(got["arr"], blob)
    got["big"][0] = 7.0  # writable
    plain = Codec().decode(enc.msg, blob, 0, enc.blob_len)  # without the flag: copies only
    assert not _inside(plain["big"], blob) and plain["big"][0] == 7.0
    resizable = Codec(resizable=True).decode(enc.msg, blob, 0, enc.blob_len, blob_private=True)
    assert not _inside(resizable["big"], blob)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shift", range(0, 17, 4))
@pytest.mark.parametrize("dtype", [torch.complex128, torch.float64, torch.complex64,
                                   torch.bfloat16, torch.float32], ids=str)
def test_a_private_blob_lends_only_aligned_memory(dtype, shift):
    """zmq frames start 8 bytes off 16; torch's complex128 kernels fault on such
    memory, so a view is lent only where the tensor starts on its item size."""
    src = sample(dtype, (64, 33))
    enc = Codec().encode({"t": src})
    buf = bytearray(shift) + enc.blob_bytes()
    got = Codec().decode(enc.msg, buf, shift, enc.blob_len, blob_private=True)["t"]
    assert got.data_ptr() % got.element_size() == 0
    assert torch.equal(bits(got), bits(src))
    assert torch.equal(bits(got[::3, 1::2].clone()), bits(src[::3, 1::2]))  # a strided kernel
    if _inside(got, buf, shift):
        got.view(torch.uint8).fill_(0)
        assert not torch.equal(bits(got), bits(src))  # the view is the blob's memory


@pytest.mark.timeout(30)
def test_a_private_blob_lends_one_view_whatever_the_descriptors_say():
    """A hostile writer points two tensors at the same bytes: they must still not
    share memory."""
    t = torch.arange(1024, dtype=torch.float32)
    enc = Codec().encode({"a": t, "b": t.clone()})
    raw = msgspec.msgpack.Decoder().decode(enc.msg)
    raw["b"] = msgspec.msgpack.Ext(raw["a"].code, raw["a"].data)  # b's descriptor := a's
    blob = enc.blob_bytes()
    got = Codec().decode(msgspec.msgpack.encode(raw), blob, 0, enc.blob_len, blob_private=True)
    assert torch.equal(got["a"], t) and torch.equal(got["b"], t)
    got["a"].zero_()
    assert torch.equal(got["b"], t)


@pytest.mark.timeout(30)
def test_a_read_only_private_blob_is_copied_quietly():
    enc = Codec().encode({"t": torch.arange(1024, dtype=torch.float32)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it wraps read-only memory
        got = Codec().decode(enc.msg, bytes(enc.blob_bytes()), 0, enc.blob_len,
                             blob_private=True)
    got["t"].add_(1)
    assert got["t"][0] == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sizes", [(3, 5), (1, 63, 2), (100, 1), (70000, 3)], ids=str)
def test_the_blob_for_zmq_carries_zeros_between_its_arrays(sizes):
    """The alignment gaps of a blob sent over zmq hold zeros, never what the
    allocator left in the buffer (another message's bytes, a secret)."""
    arrays = {f"a{i}": np.full(n, 0x5A, np.uint8) for i, n in enumerate(sizes)}
    enc = Codec().encode(arrays)
    assert enc.blob_len > sum(sizes)  # there are gaps
    mask = np.zeros(enc.blob_len, bool)
    for _src, nbytes, off in enc.copies:
        mask[off : off + nbytes] = True
    for _ in range(20):  # dirty memory of the blob's size, freed just before
        junk = np.full(enc.blob_len, 0xEE, np.uint8)
        del junk
        blob = np.frombuffer(enc.blob_bytes(), np.uint8)
        assert (blob[mask] == 0x5A).all()
        assert not blob[~mask].any(), "a gap holds the allocator's leftovers"

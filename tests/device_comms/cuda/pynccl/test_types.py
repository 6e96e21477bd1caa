"""dtype and ReduceOp tables: complete, equal to nccl.h, and the conversions are exact."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from device_comms.cuda.pynccl import types as T
from device_comms.reduce_op import ReduceOp, reduce_local
from tests.device_comms.cuda.pynccl import _nccl_header as header

V = 23203  # the wheel's version; the gate itself is tested separately
ALL_DTYPES = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str)
NATIVE = {
    torch.int8, torch.uint8, torch.int32, torch.uint32, torch.int64, torch.uint64,
    torch.float16, torch.float32, torch.float64, torch.bfloat16,
}
FP8 = {torch.float8_e4m3fn, torch.float8_e5m2}
WIDEN = {torch.int16, torch.uint16}
COMPLEX = {torch.complex32, torch.complex64, torch.complex128}
BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def test_datatype_codes_match_header(nccl_header) -> None:
    enum = header.enums(nccl_header)["ncclDataType_t"]
    for name, code in T.DATATYPE_CODES.items():
        assert enum[name] == code, name
    # Every type of this header is known (aliases share a value with a known name).
    assert {v for k, v in enum.items() if k != "ncclNumTypes"} == set(T.DATATYPE_CODES.values())


def test_redop_codes_match_header(nccl_header) -> None:
    enum = header.enums(nccl_header)["ncclRedOp_t"]
    for name, code in T.REDOP_CODES.items():
        assert enum[name] == code, name
    assert len(T.REDOP_CODES) == enum["ncclNumOps"]


def test_fp8_gate_matches_header(nccl_lib, nccl_header) -> None:
    """The header of a version >= the gate declares the float8 types with our codes."""
    assert nccl_lib.version() >= T.FP8_MIN_VERSION
    enum = header.enums(nccl_header)["ncclDataType_t"]
    assert (enum["ncclFloat8e4m3"], enum["ncclFloat8e5m2"]) == (10, 11)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_has_a_rule(dtype: torch.dtype) -> None:
    """Each (dtype, op) maps, has a documented conversion, or raises a clear error."""
    for op in ReduceOp:
        try:
            plan = T.reduction_plan(dtype, op, V)
        except TypeError as e:
            assert str(dtype) in str(e) and ("convert" in str(e) or "use " in str(e)), str(e)
            assert _type_error_expected(dtype, op), f"{dtype} {op} unexpectedly refused: {e}"
            continue
        except ValueError as e:
            assert op in BITWISE and f"ReduceOp.{op.name}" in str(e), str(e)
            assert "use " in str(e)  # suggests an alternative
            continue
        assert op not in BITWISE or dtype == torch.bool, (dtype, op)
        assert plan.kind == _expected_kind(dtype), (dtype, op, plan)
        assert plan.dtype in T.DATATYPE_CODES.values() and plan.op in T.REDOP_CODES.values()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized and complex32 dtypes warn on creation
        x = torch.empty(3, dtype=dtype)  # data movement: any dtype as bytes
    assert T.bytes_view(x).dtype == torch.uint8 and T.bytes_view(x).numel() == x.nbytes
    assert T.bytes_view(x).data_ptr() == x.data_ptr()


def _expected_kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype in NATIVE or dtype in FP8:
        return "native"
    return "widen" if dtype in WIDEN else "complex"


def _type_error_expected(dtype: torch.dtype, op: ReduceOp) -> bool:
    if op is ReduceOp.AVG and (
            dtype == torch.bool or not (dtype.is_floating_point or dtype.is_complex)):
        return True
    if dtype in COMPLEX:
        return op not in (ReduceOp.SUM, ReduceOp.AVG)
    return dtype not in NATIVE | FP8 | WIDEN | {torch.bool}


def test_native_codes() -> None:
    want = {
        torch.int8: "ncclInt8", torch.uint8: "ncclUint8", torch.int32: "ncclInt32",
        torch.uint32: "ncclUint32", torch.int64: "ncclInt64", torch.uint64: "ncclUint64",
        torch.float16: "ncclFloat16", torch.float32: "ncclFloat32", torch.float64: "ncclFloat64",
        torch.bfloat16: "ncclBfloat16", torch.float8_e4m3fn: "ncclFloat8e4m3",
        torch.float8_e5m2: "ncclFloat8e5m2",
    }
    for dt, name in want.items():
        assert T.native_dtype(dt, V) == T.DATATYPE_CODES[name], dt
        assert T.reduction_plan(dt, ReduceOp.MAX, V).dtype == T.DATATYPE_CODES[name]
    assert T.native_dtype(torch.int16, V) is None and T.native_dtype(torch.bool, V) is None


@pytest.mark.parametrize("op, name", [(ReduceOp.SUM, "ncclSum"), (ReduceOp.PRODUCT, "ncclProd"),
                                      (ReduceOp.MAX, "ncclMax"), (ReduceOp.MIN, "ncclMin"),
                                      (ReduceOp.AVG, "ncclAvg")])
def test_op_codes(op: ReduceOp, name: str) -> None:
    assert T.reduction_plan(torch.float32, op, V).op == T.REDOP_CODES[name]
    assert T.reduction_plan(torch.float32, op.name.lower(), V).op == T.REDOP_CODES[name]


@pytest.mark.parametrize("op", BITWISE)
def test_bitwise_ops_raise_value_error(op: ReduceOp) -> None:
    with pytest.raises(ValueError, match=f"op=ReduceOp.{op.name} is not supported by NCCL"):
        T.reduction_plan(torch.int32, op, V)


def test_bad_op_type() -> None:
    with pytest.raises(TypeError, match="op must be a ReduceOp"):
        T.reduction_plan(torch.float32, "median", V)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        T.reduction_plan("float32", ReduceOp.SUM, V)


def test_fp8_gate() -> None:
    for dt, name in ((torch.float8_e4m3fn, "ncclFloat8e4m3"),
                     (torch.float8_e5m2, "ncclFloat8e5m2")):
        assert T.native_dtype(dt, T.FP8_MIN_VERSION) == T.DATATYPE_CODES[name]
        assert T.native_dtype(dt, T.FP8_MIN_VERSION - 1) is None
        with pytest.raises(TypeError, match=r"NCCL 2\.23\.4 cannot reduce .*need NCCL >= 2\.24\.0"):
            T.reduction_plan(dt, ReduceOp.SUM, 22304)
    assert T.FP8_MIN_VERSION == 22400


# ---------------------------------------------------------------------- exact conversions
def _inputs(dtype: torch.dtype, n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    if dtype == torch.bool:
        return [torch.randint(0, 2, (64,), generator=g).bool() for _ in range(n)]
    lo, hi = {torch.int16: (-2**15, 2**15), torch.uint16: (0, 2**16)}[dtype]
    return [torch.randint(lo, hi, (64,), generator=g, dtype=torch.int64).to(dtype)
            for _ in range(n)]


def _wire_reduce(dtype: torch.dtype, op: ReduceOp, xs: list[torch.Tensor]) -> torch.Tensor:
    """What NCCL computes under the plan (emulated with reduce_local on the wire type)."""
    plan = T.reduction_plan(dtype, op, V)
    nccl_op = {v: k for k, v in T.REDOP_CODES.items()}[plan.op]
    rop = {"ncclSum": ReduceOp.SUM, "ncclProd": ReduceOp.PRODUCT, "ncclMax": ReduceOp.MAX,
           "ncclMin": ReduceOp.MIN}[nccl_op]
    if plan.kind == "widen":
        return reduce_local([x.to(plan.wide) for x in xs], rop).to(dtype)
    return reduce_local([plan.wire(x) for x in xs], rop).view(dtype)


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT,
                                ReduceOp.BOR, ReduceOp.BAND])
def test_bool_reductions_are_logical(op: ReduceOp) -> None:
    xs = _inputs(torch.bool)
    assert torch.equal(_wire_reduce(torch.bool, op, xs), reduce_local(xs, op))


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint16])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX])
def test_widened_reductions_wrap_like_the_narrow_type(dtype: torch.dtype, op: ReduceOp) -> None:
    xs = _inputs(dtype)
    got = _wire_reduce(dtype, op, xs)
    np_type = np.int16 if dtype == torch.int16 else np.uint16
    arrs = [x.view(torch.int16).numpy().view(np_type) for x in xs]
    fn = {ReduceOp.SUM: np.add, ReduceOp.PRODUCT: np.multiply, ReduceOp.MIN: np.minimum,
          ReduceOp.MAX: np.maximum}[op]
    want = arrs[0].copy()
    for a in arrs[1:]:
        want = fn(want, a, dtype=np_type)  # numpy wraps modulo 2**16
    assert np.array_equal(got.view(torch.int16).numpy().view(np_type), want)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_sum_is_a_sum_of_real_pairs(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(10, generator=g, dtype=dtype) for _ in range(3)]
    plan = T.reduction_plan(dtype, ReduceOp.SUM, V)
    assert plan.factor == 2 and plan.wire(xs[0]).numel() == 20
    assert plan.wire(xs[0]).data_ptr() == xs[0].data_ptr()
    got = torch.view_as_complex(reduce_local([plan.wire(x) for x in xs], ReduceOp.SUM).view(-1, 2))
    assert torch.equal(got, reduce_local(xs, ReduceOp.SUM))


def test_widen_has_no_view() -> None:
    plan = T.reduction_plan(torch.int16, ReduceOp.SUM, V)
    assert plan.wide == torch.int32
    with pytest.raises(ValueError, match="no same-memory view"):
        plan.wire(torch.zeros(2, dtype=torch.int16))

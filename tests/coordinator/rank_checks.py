"""Inputs, references and assertions shared by the functions run on pool ranks.

Used by the coordinator test modules whose module-level functions run on the
ranks as ``fn(rank, world_size, *args)`` (the pool pickles them by reference:
test_group_coordinator, test_errors_and_failures, test_parallel_state,
test_tensor_dict, test_general_cases). The checks compute their reference
results locally: every rank can build every other rank's input (inputs are a
deterministic function of the group rank and a case tag), so no reference data
has to travel. A failed check raises ``AssertionError`` on the rank, which the
pool re-raises in the test with the remote traceback.

Inputs are small integers stored in the tested dtype, so sums, products and
averages of up to four ranks are exact in float32 *and* bfloat16: results are
compared with ``torch.equal`` whatever order the transport reduces in.
"""

from __future__ import annotations

import contextlib
import functools
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from device_comms import ReduceOp

DTYPES = (torch.float32, torch.bfloat16, torch.int64)
FLOAT_OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)
INT_OPS = (
    ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX,
    ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR,
)
DIMS = (0, 1, -1)
# Types without (full) backend kernels: data movement must still carry them.
EXOTIC = (torch.uint16, torch.float8_e4m3fn, torch.complex64, torch.int16, torch.bool)


# ---------------------------------------------------------------------- helpers
def make(rank: int, shape: Sequence[int], dtype: torch.dtype, tag: str) -> torch.Tensor:
    """The deterministic input of group rank ``rank`` for case ``tag``."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{tag}|{rank}".encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randint(-4, 5, tuple(shape), generator=g).to(dtype)
    return torch.randint(-1000, 1000, tuple(shape), generator=g, dtype=torch.int64).to(dtype)


def ref_reduce(ts: Sequence[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """Reference reduction, written independently of ``device_comms.reduce_local``."""
    s = torch.stack(list(ts))
    if op is ReduceOp.SUM:
        return s.sum(0)
    if op is ReduceOp.AVG:
        return s.sum(0) / len(ts)
    if op is ReduceOp.PRODUCT:
        return s.prod(0)
    if op is ReduceOp.MIN:
        return s.amin(0)
    if op is ReduceOp.MAX:
        return s.amax(0)
    fn = {ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or,
          ReduceOp.BXOR: torch.bitwise_xor}[op]
    return functools.reduce(fn, ts)


def expect_equal(case: str, got: Any, want: torch.Tensor) -> None:
    """Assert ``got`` is a tensor equal to ``want`` in dtype, shape and every value."""
    assert isinstance(got, torch.Tensor), f"{case}: expected a tensor, got {type(got).__name__}"
    assert got.dtype == want.dtype, f"{case}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{case}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype in EXOTIC and not got.dtype.is_complex and got.dtype != torch.bool:
        got, want = (x.contiguous().reshape(-1).view(torch.uint8) for x in (got, want))
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[:5].tolist()
        raise AssertionError(f"{case}: values differ at {bad}: got {got.flatten()[:8]}, "
                             f"want {want.flatten()[:8]}")


def expect_raises(case: str, exc: type[BaseException] | tuple, fn: Callable[[], Any],
                  *words: str) -> str:
    """Assert ``fn()`` raises ``exc`` whose message contains every one of ``words``."""
    try:
        fn()
    except exc as e:
        msg = str(e)
        for w in words:
            assert w in msg, f"{case}: message {msg!r} does not mention {w!r}"
        return msg
    raise AssertionError(f"{case}: expected {exc}, nothing was raised")


def allowed(op: ReduceOp, dtype: torch.dtype) -> bool:
    return op in (FLOAT_OPS if dtype.is_floating_point else INT_OPS)


def with_size(shape: Sequence[int], dim: int, size: int) -> list[int]:
    out = list(shape)
    out[dim] = size
    return out


@contextlib.contextmanager
def env_set(var: str, value: str) -> Iterator[None]:
    """``var=value`` in this rank's environment for the block, then as it was: the
    pool's ranks run later tests too."""
    kept = os.environ.get(var)
    os.environ[var] = value
    try:
        yield
    finally:
        if kept is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = kept

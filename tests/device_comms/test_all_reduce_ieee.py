"""Sums that overflow or are invalid give torch's IEEE results, silently, whatever the
warnings filter.

The shared-memory engine adds float32/float64 with numpy, which reports
overflow (``3e38 + 3e38``) and invalid operations (``inf + -inf``) as a
RuntimeWarning where torch says nothing. The results must be torch's (inf,
nan) with no warning under the default filters, and under a user's
``warnings.simplefilter("error")`` the call must still return them instead of
raising on some ranks (in the two-rank pipelined scheme each rank reduces a
different half, so one rank raising would leave the other waiting); so must
it under ``np.seterr(all="raise")``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from device_comms import CpuCommunicator, ReduceOp, reduce_local

#: one small step, the two-rank one-step scheme, the pipelined / one-shot schemes
_SIZES = [256, 16_384, 600_000]


def _input(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    big = torch.finfo(dtype).max
    x = torch.linspace(-1.0, 1.0, n, dtype=torch.float64).to(dtype)
    x[: n // 4] = big * 0.75  # overflows when two ranks add
    x[n // 4 : n // 2] = float("inf") if rank % 2 == 0 else float("-inf")  # inf + -inf: nan
    x[-3:] = big * 0.75 if rank == 0 else 1.0  # one rank only: no overflow
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(torch.isnan(a), torch.isnan(b))
                and torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)))


def ieee_rank(rank: int, world_size: int, action: str) -> list[str]:
    import numpy as np

    if action == "numpy-raise":  # numpy raises FloatingPointError instead of warning
        np.seterr(all="raise")
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="ieee", timeout=20)
    bad: list[str] = []
    try:
        for dtype in (torch.float32, torch.float64):
            for n in _SIZES:
                ref = reduce_local([_input(r, n, dtype) for r in range(world_size)], ReduceOp.SUM)
                for form in ("new", "in-place"):
                    x = _input(rank, n, dtype)
                    with warnings.catch_warnings(record=True) as seen:
                        if action == "error":
                            warnings.simplefilter("error")
                        try:
                            got = comm.all_reduce(x, out=x if form == "in-place" else None)
                        except Exception as e:
                            bad.append(f"{dtype} n={n} {form}: raised {type(e).__name__}: {e}")
                            raise
                    if not _same(got, ref):
                        bad.append(f"{dtype} n={n} {form}: not torch's result")
                    if seen:
                        bad.append(f"{dtype} n={n} {form}: warned {seen[0].message}")
        if not torch.equal(comm.all_reduce(torch.ones(5)), torch.full((5,), float(world_size))):
            bad.append("the group is out of step afterwards")
    finally:
        comm.destroy()
    return bad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("action", ["default-filters", "error", "numpy-raise"])
def test_overflow_and_nan_sums_are_torchs(dist_pool: Any, action: str, world_size: int) -> None:
    assert dist_pool(world_size).run(ieee_rank, action, timeout=110) == [[]] * world_size

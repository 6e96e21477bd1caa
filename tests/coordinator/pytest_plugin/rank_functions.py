"""Functions the pool tests send to ranks as tests (by module and name)."""

from __future__ import annotations

import time


def passes(rank: int, group: object) -> None:
    import torch

    assert group.all_reduce(torch.ones(1)).item() == 2  # type: ignore[attr-defined]


def fails_on_rank_1(rank: int) -> None:
    assert rank != 1, "rank 1 refuses"


def sleeps_on_rank_0(rank: int) -> None:
    if rank == 0:
        time.sleep(60)


def fails_on_rank_1_before_a_barrier(rank: int, group: object) -> None:
    assert rank != 1, "rank 1 refuses"
    group.barrier()  # type: ignore[attr-defined]  # rank 0 waits here for rank 1

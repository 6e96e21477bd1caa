"""A tensor only one rank gets wrong (sparse, meta, quantised) is refused before any
communication: that rank raises the argument error, its peers learn of it and raise
instead of waiting, and the group keeps working."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(240)

_BAD = ["sparse_coo", "sparse_csr", "meta", "quantised"]


def _bad_tensor(kind: str) -> Any:
    import torch

    if kind == "sparse_coo":
        return torch.ones(8).to_sparse()
    if kind == "sparse_csr":
        return torch.ones(2, 4).to_sparse_csr()
    if kind == "meta":
        return torch.empty(8, device="meta")
    return torch.quantize_per_tensor(torch.ones(8), 0.1, 0, torch.qint8)


def _one_rank_passes(
    rank: int, world_size: int, kind: str, op: str
) -> tuple[str, float, str, bool]:
    import warnings

    import torch

    from coordinator import parallel_state as ps

    warnings.simplefilter("ignore")  # beta/deprecation warnings of sparse CSR / quantised
    g = ps.get_world_group()
    x = _bad_tensor(kind) if rank == world_size - 1 else torch.ones(8)
    t0 = time.monotonic()
    try:
        if op == "all_reduce":
            g.all_reduce(x)
        else:
            g.all_gather(x, dim=0)
        outcome = ("returned", "")
    except (TypeError, ValueError) as e:
        outcome = (type(e).__name__, str(e))
    elapsed = time.monotonic() - t0
    after = g.all_reduce(torch.ones(2))
    agreed = bool(torch.equal(after, torch.full((2,), float(world_size))))
    return outcome[0], elapsed, outcome[1], agreed


@pytest.mark.parametrize("op", ["all_reduce", "all_gather"])
@pytest.mark.parametrize("kind", _BAD)
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_bad_layout_on_one_rank_is_refused_everywhere(dist_pool, world_size: int, kind: str,
                                                        op: str) -> None:
    res = dist_pool(world_size).run(_one_rank_passes, kind, op, timeout=120)
    culprit = world_size - 1
    for rank, (what, elapsed, msg, ok_after) in enumerate(res):
        assert elapsed < 20, (rank, elapsed)
        assert ok_after, f"rank {rank}: the group is broken after the rejection"
        if rank == culprit:
            assert what in ("TypeError", "ValueError") and "input_" in msg, (rank, what, msg)
        else:
            assert what in ("PeerRejectedError", "CollectiveMismatch"), (rank, what, msg)
            assert str(culprit) in msg, msg

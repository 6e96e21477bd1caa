"""A DDP training step on the groupcoord backend equals the same steps on gloo.

Each rank wraps two copies of one small model (same seed) in
``DistributedDataParallel``, one over a process group of the backend under
test and one over a gloo group of the same ranks, and takes the same SGD steps
(momentum, each rank its own batch). DDP broadcasts rank 0's parameters and
buffers when it wraps the model and averages the gradients with an all-reduce
per bucket (two buckets here: ``bucket_cap_mb`` is set small so more than one
is in flight). After the steps both copies' parameters must agree.

Equality: gradients are summed over ranks; float addition is not associative
and the two backends may add the ranks' gradients in different orders, so the
parameters are compared with ``torch.testing.assert_close``'s float32
tolerance (rtol 1.3e-6, atol 1e-5; a few SGD steps with learning rate 0.1 on
parameters of order 1 keep the difference at rounding level); the test also
reports whether they were bitwise equal.
"""

from __future__ import annotations

from typing import Any

import pytest

#: The backend whose results are compared with gloo's.
UNDER_TEST = "groupcoord"

_STEPS = 3


def _train(group: Any, rank: int) -> dict[str, Any]:
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(11 + rank)  # different initial weights per rank: DDP must broadcast
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 8))
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.005)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(_STEPS):
        x = torch.randn(16, 32, generator=gen)
        y = torch.randn(16, 8, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state


def ddp_rank(rank: int, world_size: int) -> dict[str, Any]:
    """On every rank: the steps on both groups; how the parameters compare."""
    import torch
    import torch.distributed as dist

    import coordinator  # noqa: F401  registers the groupcoord backend

    under_test = dist.new_group(backend=UNDER_TEST)
    gloo = dist.new_group(backend="gloo")
    try:
        ours = _train(under_test, rank)
        theirs = _train(gloo, rank)
    finally:
        dist.destroy_process_group(under_test)
        dist.destroy_process_group(gloo)
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], msg=lambda m, n=name: f"{n}: {m}")
    return {"bitwise": all(torch.equal(ours[n], theirs[n]) for n in ours),
            "state": {n: t for n, t in ours.items() if n.endswith("weight")}}


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_steps_equal_gloo(dist_pool: Any, world_size: int) -> None:
    results = dist_pool(world_size).run(ddp_rank, timeout=90)
    # DDP keeps the replicas identical: every rank ends with rank 0's parameters
    for r in results[1:]:
        for name, t in r["state"].items():
            assert t.equal(results[0]["state"][name]), name

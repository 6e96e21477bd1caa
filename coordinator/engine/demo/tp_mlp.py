"""A tensor-parallel MLP on CPU ranks, checked against the unsharded computation.

The smallest complete use of groupcoord: a column-parallel linear (each rank
holds a slice of the hidden units), an activation, and a row-parallel linear
whose partial outputs are summed with ``all_reduce``. Each rank builds the full
weights from the same seed, keeps its shard, and the result is compared with
the single-process MLP.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["tp_mlp_rank", "run_tp_mlp"]


def _full_weights(d_model: int, d_ff: int,
                  seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, d_model, generator=g)
    w1 = torch.randn(d_ff, d_model, generator=g) / d_model**0.5
    w2 = torch.randn(d_model, d_ff, generator=g) / d_ff**0.5
    return x, w1, w2


def tp_mlp_rank(rank: int, world_size: int, d_model: int, d_ff: int, seed: int) -> dict[str, Any]:
    """Run on every rank: sharded MLP forward, returns the output and timing."""
    from coordinator import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp = ps.get_tp_group()
    x, w1, w2 = _full_weights(d_model, d_ff, seed)
    shard = d_ff // tp.world_size
    lo, hi = tp.rank_in_group * shard, (tp.rank_in_group + 1) * shard
    w1_local, w2_local = w1[lo:hi], w2[:, lo:hi]  # column- then row-parallel
    t0 = time.perf_counter()
    h = torch.nn.functional.gelu(x @ w1_local.t())
    y = tp.all_reduce(h @ w2_local.t())
    elapsed = time.perf_counter() - t0
    return {"y": y, "seconds": elapsed, "comm": type(tp.comm).__name__}


def run_tp_mlp(tp: int = 2, d_model: int = 64, d_ff: int = 256, seed: int = 0) -> bool:
    """Spawn ``tp`` ranks, run the sharded MLP and print whether it matches."""
    from coordinator.testing import run_distributed

    if d_ff % tp:
        raise ValueError(f"d_ff ({d_ff}) must be divisible by tp ({tp})")
    print(f"groupcoord demo: tensor-parallel MLP on {tp} CPU processes "
          f"(d_model={d_model}, d_ff={d_ff})")
    results = run_distributed(tp_mlp_rank, tp, d_model, d_ff, seed, timeout=120)
    x, w1, w2 = _full_weights(d_model, d_ff, seed)
    ref = torch.nn.functional.gelu(x @ w1.t()) @ w2.t()
    same_across = all(torch.equal(r["y"], results[0]["y"]) for r in results)
    err = max(float((r["y"] - ref).abs().max()) for r in results)
    ok = same_across and err < 1e-4
    print(f"  communicator: {results[0]['comm']}; forward on rank 0: "
          f"{results[0]['seconds'] * 1e3:.2f} ms")
    print(f"  ranks agree bitwise: {same_across}; max |sharded - unsharded| = {err:.2e}")
    print(f"  verification: {'PASS' if ok else 'FAIL'} (sharded output matches the unsharded MLP)")
    return ok

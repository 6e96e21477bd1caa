"""Tensor-parallel MLP on two CPU processes, checked against the unsharded MLP.

What it shows:
    The Megatron pattern every sharded transformer block uses. The first
    linear layer is *column parallel* (each rank holds half of the hidden
    units, so it computes half of the activations, no communication); the
    second is *row parallel* (each rank holds the matching half of the input
    features and produces a partial sum). One ``all_reduce`` over the
    tensor-parallel group completes the sum. The layers come from
    ``coordinator.engine.layers``; each parameter's weight loader cuts this rank's
    shard out of the full (checkpoint) tensor.

    ``coordinator.testing.run_distributed`` starts the two processes with
    torch.distributed (gloo) initialised, runs ``mlp_rank`` on each and
    returns their results to this process, which compares them with the MLP
    computed unsharded.

Run:
    python examples/tp_mlp.py

Expected output (numbers vary):
    tp_mlp: 2 ranks, d_model=64, d_ff=256, communicator CpuCommunicator
    tp_mlp: each rank holds up.weight (128, 64) of (256, 64)
    tp_mlp: ranks agree bitwise: True; max |sharded - unsharded| = 0.00e+00
    tp_mlp: PASS

Exits with status 1 if the sharded result differs from the unsharded one.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

TP = 2
D_MODEL, D_FF, TOKENS = 64, 256, 8


def full_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """The unsharded "checkpoint": input batch and both layers' weights and biases."""
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(TOKENS, D_MODEL, generator=g),
        "up.weight": torch.randn(D_FF, D_MODEL, generator=g) / D_MODEL**0.5,
        "up.bias": torch.randn(D_FF, generator=g) * 0.1,
        "down.weight": torch.randn(D_MODEL, D_FF, generator=g) / D_FF**0.5,
        "down.bias": torch.randn(D_MODEL, generator=g) * 0.1,
    }


def mlp_rank(rank: int, world_size: int) -> dict[str, Any]:
    """Runs on every rank: build this rank's shard of the MLP and run it."""
    from coordinator import parallel_state as ps
    from coordinator.engine.layers import ColumnParallelLinear, RowParallelLinear

    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp = ps.get_tp_group()
    up = ColumnParallelLinear(D_MODEL, D_FF, bias=True, tp_group=tp)     # [D_FF/tp, D_MODEL]
    down = RowParallelLinear(D_FF, D_MODEL, bias=True, tp_group=tp)      # [D_MODEL, D_FF/tp]
    ckpt = full_weights()
    for prefix, layer in (("up", up), ("down", down)):
        for pname, param in layer.named_parameters():
            param.weight_loader(param, ckpt[f"{prefix}.{pname}"])  # keeps this rank's slice
    with torch.no_grad():
        h = torch.nn.functional.gelu(up(ckpt["x"]))  # this rank's D_FF/tp activations
        y = down(h)                                  # partial sums + all_reduce inside
    return {"y": y, "up_shape": tuple(up.weight.shape), "comm": type(tp.comm).__name__}


def main() -> int:
    from coordinator.testing import run_distributed

    results = run_distributed(mlp_rank, TP, timeout=120)
    w = full_weights()
    ref = torch.nn.functional.gelu(w["x"] @ w["up.weight"].t() + w["up.bias"])
    ref = ref @ w["down.weight"].t() + w["down.bias"]
    agree = all(torch.equal(r["y"], results[0]["y"]) for r in results)
    err = max(float((r["y"] - ref).abs().max()) for r in results)
    print(f"tp_mlp: {TP} ranks, d_model={D_MODEL}, d_ff={D_FF}, communicator {results[0]['comm']}")
    print(f"tp_mlp: each rank holds up.weight {results[0]['up_shape']} of {(D_FF, D_MODEL)}")
    print(f"tp_mlp: ranks agree bitwise: {agree}; max |sharded - unsharded| = {err:.2e}")
    ok = agree and err < 1e-4
    print(f"tp_mlp: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

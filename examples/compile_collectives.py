"""Tensor-parallel collectives inside torch.compile(fullgraph=True): one graph, eager's numbers.

What it shows:
    A TP=2 module whose forward calls ``get_tp_group().all_reduce(...)`` and
    ``get_tp_group().all_gather(...)`` directly. A process-group call cannot
    be traced, so a naive collective would split the compiled graph. While
    Dynamo traces, ``GroupCoordinator`` emits the custom ops
    ``groupcoord::all_reduce`` / ``groupcoord::all_gather`` instead: opaque
    graph nodes with a fake (shape-only) implementation for the compiler,
    whose real implementation runs the group's ordinary collective when the
    compiled graph executes. ``torch._dynamo.explain`` reports one graph and
    zero graph breaks, and the compiled result equals the eager one.

    The module is compiled with the ``aot_eager`` backend (AOTAutograd
    tracing, eager kernels), which exercises the whole tracing stack without a
    C++ compiler; ``inductor`` works the same way. The ops also carry autograd
    formulas, so the example finally runs one compiled backward pass.

Run:
    python examples/compile_collectives.py

Expected output:
    compile_collectives: TP=2; torch._dynamo.explain: 1 graph(s), 0 graph break(s)
    compile_collectives: collective nodes in the graph: groupcoord.all_gather, groupcoord.all_reduce
    compile_collectives: compiled == eager on every rank: True (max |diff| 0.00e+00)
    compile_collectives: compiled backward matches the hand-computed gradient: True
    compile_collectives: PASS

Exits with status 1 on a graph break or a mismatch.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

TP = 2
HIDDEN, FF, TOKENS = 32, 64, 6


class ShardedBlock(torch.nn.Module):
    """Row-parallel projection + all-reduce, then a column-parallel head + all-gather."""

    def __init__(self, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        down = torch.randn(FF, HIDDEN, generator=g) / FF**0.5      # full weights, then
        head = torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5
        rows, cols = FF // tp_size, HIDDEN // tp_size             # this rank's shard
        self.down = torch.nn.Parameter(down[tp_rank * rows : (tp_rank + 1) * rows].clone())
        self.head = torch.nn.Parameter(head[:, tp_rank * cols : (tp_rank + 1) * cols].clone())

    def forward(self, h_shard: torch.Tensor) -> torch.Tensor:
        from coordinator import get_tp_group

        x = get_tp_group().all_reduce(h_shard @ self.down)          # [T, HIDDEN], summed
        y = torch.relu(x) @ self.head                              # [T, HIDDEN / tp]
        return get_tp_group().all_gather(y, dim=-1)                # [T, HIDDEN]


def rank_main(rank: int, world_size: int) -> dict[str, Any]:
    """Runs on every rank: eager vs compiled forward, explain, one compiled backward."""
    from coordinator import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp = ps.get_tp_group()
    block = ShardedBlock(tp.rank_in_group, tp.world_size)
    k = FF // world_size
    h_full = torch.randn(TOKENS, FF, generator=torch.Generator().manual_seed(1))
    h = h_full[:, tp.rank_in_group * k : (tp.rank_in_group + 1) * k]  # output of a column layer
    with torch.no_grad():
        eager = block(h)
        explain = torch._dynamo.explain(block)(h)
        torch._dynamo.reset()
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
        out = compiled(h)
    nodes = {  # Dynamo records the op packet ("groupcoord.all_reduce"), AOT the overload
        str(n.target).removesuffix(".default")
        for gm in explain.graphs for n in gm.graph.nodes if "groupcoord" in str(n.target)
    }
    # one training-style step through the compiled module: d(sum(out))/d(head)
    compiled(h).sum().backward()
    with torch.no_grad():
        x = tp.all_reduce(h @ block.down)
    # out[:, slice r] = relu(x) @ head_r on rank r; every rank's loss sums all of out,
    # so the global loss's gradient for head_r is world_size * relu(x)^T @ ones
    want = world_size * torch.relu(x).t() @ torch.ones(TOKENS, HIDDEN // world_size)
    return {
        "graphs": explain.graph_count,
        "breaks": explain.graph_break_count,
        "nodes": sorted(nodes),
        "diff": float((out - eager).abs().max()),
        "equal": torch.equal(out, eager),
        "grad_ok": bool(torch.allclose(block.head.grad, want, atol=1e-4)),
    }


def main() -> int:
    from coordinator.testing import run_distributed

    results = run_distributed(rank_main, TP, timeout=120)
    r0 = results[0]
    print(f"compile_collectives: TP={TP}; torch._dynamo.explain: {r0['graphs']} graph(s), "
          f"{r0['breaks']} graph break(s)")
    print(f"compile_collectives: collective nodes in the graph: {', '.join(r0['nodes'])}")
    equal = all(r["equal"] for r in results)
    diff = max(r["diff"] for r in results)
    print(f"compile_collectives: compiled == eager on every rank: {equal} (max |diff| {diff:.2e})")
    grad_ok = all(r["grad_ok"] for r in results)
    print(f"compile_collectives: compiled backward matches the hand-computed gradient: {grad_ok}")
    ok = (
        equal and grad_ok
        and all(r["breaks"] == 0 and r["graphs"] == 1 for r in results)
        and r0["nodes"] == ["groupcoord.all_gather", "groupcoord.all_reduce"]
    )
    print(f"compile_collectives: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

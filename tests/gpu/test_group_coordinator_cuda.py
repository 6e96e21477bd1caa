"""The GroupCoordinator API on CUDA tensors at world size 1, graph capture and torch.compile."""

from __future__ import annotations

import pytest
import torch

from coordinator.testing import run_distributed

pytestmark = pytest.mark.timeout(300)


def _api(rank: int, world_size: int) -> dict:
    from coordinator import parallel_state as ps

    ps.initialize_model_parallel(1, 1)
    tp = ps.get_tp_group()
    dev = tp.device
    x = torch.randn(8, 16, device=dev)
    got = {
        "device": str(dev),
        "all_reduce": torch.equal(tp.all_reduce(x), x),
        "all_gather": torch.equal(tp.all_gather(x, dim=-1), x),
        "all_gatherv": torch.equal(tp.all_gatherv(x, 0, [8]), x),
        "reduce_scatter": torch.equal(tp.reduce_scatter(x, dim=0), x),
        "gather": torch.equal(tp.gather(x, 0, -1), x),
        "broadcast": torch.equal(tp.broadcast(x.clone(), 0), x),
        "all_to_all": torch.equal(tp.all_to_all(x), x),
        "all_to_allv": torch.equal(tp.all_to_allv(x, [8], [8]), x),
    }
    d = tp.broadcast_tensor_dict({"a": x, "n": 3})
    got["tensor_dict"] = torch.equal(d["a"], x) and d["n"] == 3
    got["graph"] = _graph_capture(tp, dev)
    got["compiled"] = _compiled(tp, dev)
    return got


def _graph_capture(tp, dev) -> bool:
    from coordinator import parallel_state as ps

    x = torch.randn(4, 32, device=dev)
    with ps.graph_capture(dev) as ctx:
        assert ctx.stream is not None and ctx.stream == torch.cuda.current_stream()
        assert ctx.stream != torch.cuda.default_stream()
        y = tp.all_reduce(x) * 2  # warm-up on the capture stream
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=ctx.stream):
            y = tp.all_reduce(x) * 2
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    return torch.equal(y, x * 2)


def _compiled(tp, dev) -> bool:
    """torch.compile with CUDA graphs, through the group and through the traced custom ops
    themselves (a group of one does not trace them, so they are called directly)."""
    from coordinator import custom_ops

    def f(t: torch.Tensor) -> torch.Tensor:
        return tp.all_reduce(t.sin()) + 1

    def g(t: torch.Tensor) -> torch.Tensor:
        a = custom_ops.traced_all_reduce(tp, t.sin())
        b = custom_ops.traced_all_gather(tp, a, 0)
        return custom_ops.traced_reduce_scatter(tp, b * 2, 0) + 1

    ok = True
    for fn in (f, g):
        fc = torch.compile(fn, mode="reduce-overhead")
        for _ in range(4):
            t = torch.randn(64, device=dev)
            ok &= torch.allclose(fc(t), f(t) if fn is f else t.sin() * 2 + 1)
    return bool(ok)


def test_coordinator_api_on_cuda_world_size_1() -> None:
    (out,) = run_distributed(_api, 1, backend="nccl")
    assert out.pop("device") == "cuda:0"
    assert all(out.values()), out

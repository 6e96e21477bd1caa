"""Autograd through the ``groupcoord::*`` custom ops, eager and under torch.compile.

Each rank's loss is ``L_r = sum(out_r * w_r)`` with per-rank weights ``w_r``;
the gradients checked are those of the global loss ``sum_r L_r``. Every rank
rebuilds every other rank's inputs and weights from seeds, so the expected
gradients are computed locally, by hand, from the formulas below -- not by
running the ops:

* ``y = all_reduce(sin(a))``        -> ``grad a_r = cos(a_r) * sum_s w_s``
* ``y = all_gather(b * b, dim=1)``  -> ``grad b_r = 2 b_r * (sum_s w_s)[:, slice r]``
* ``y = reduce_scatter(3 c, dim=0)``-> ``grad c_r = 3 * cat_s(w_s, dim=0)``
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import coordinator.custom_ops  # noqa: F401  (registers the ops)

ROWS, COLS = 4, 3


def _gen(tag: str, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * rank + sum(map(ord, tag)))


def _inputs(rank: int, ws: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a = torch.randn(ROWS, COLS, generator=_gen("a", rank))
    b = torch.randn(ROWS, COLS, generator=_gen("b", rank))
    c = torch.randn(ROWS * ws, COLS, generator=_gen("c", rank))
    return a, b, c


def _weights(rank: int, ws: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w1 = torch.randn(ROWS, COLS, generator=_gen("w1", rank))
    w2 = torch.randn(ROWS, COLS * ws, generator=_gen("w2", rank))
    w3 = torch.randn(ROWS, COLS, generator=_gen("w3", rank))
    return w1, w2, w3


def _three_ops(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, ws: int, name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ops = torch.ops.groupcoord
    return (
        ops.all_reduce(a.sin(), name),
        ops.all_gather(b * b, 1, ws, name),
        ops.reduce_scatter(c * 3.0, 0, ws, name),
    )


def _expected_grads(rank: int, ws: int) -> list[torch.Tensor]:
    a, b, c = _inputs(rank, ws)
    ws_all = [_weights(s, ws) for s in range(ws)]
    w1_sum = sum(w[0] for w in ws_all)
    w2_sum = sum(w[1] for w in ws_all)
    return [
        a.cos() * w1_sum,
        2 * b * w2_sum[:, rank * COLS : (rank + 1) * COLS],
        3.0 * torch.cat([w[2] for w in ws_all], dim=0),
    ]


def _grads_of(fn: Any, rank: int, ws: int, name: str) -> list[torch.Tensor]:
    leaves = [t.requires_grad_() for t in _inputs(rank, ws)]
    outs = fn(*leaves, ws, name)
    loss = sum((o * w).sum() for o, w in zip(outs, _weights(rank, ws), strict=False))
    loss.backward()
    return [t.grad for t in leaves]  # type: ignore[misc]


class _Recorder:
    """An aot_autograd backend that records the ops of the forward and backward graphs."""

    def __init__(self) -> None:
        from torch._dynamo.backends.common import aot_autograd

        self.graphs: dict[str, list[str]] = {"fw": [], "bw": []}
        self.backend = aot_autograd(fw_compiler=self._make("fw"), bw_compiler=self._make("bw"))

    def _make(self, kind: str) -> Any:
        def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            self.graphs[kind] += [
                str(n.target) for n in gm.graph.nodes
                if n.op == "call_function" and "groupcoord" in str(n.target)
            ]
            return gm.forward

        return compiler


class _RowParallel(torch.nn.Module):
    """A trainable row-parallel projection: ``all_reduce(x @ W_r)`` (partial sums completed)."""

    def __init__(self, tp: Any, weight: torch.Tensor) -> None:
        super().__init__()
        self.tp = tp
        self.weight = torch.nn.Parameter(weight.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(x @ self.weight)


def _module_case(rank: int, ws: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(5, 4, generator=_gen("x", rank))
    weight = torch.randn(4, 6, generator=_gen("W", rank))
    g = torch.randn(5, 6, generator=_gen("g", rank))
    return x, weight, g


def _autograd_checks(rank: int, world_size: int) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    from coordinator import parallel_state as ps

    ps.initialize_model_parallel(world_size, 1)
    try:
        tp = ps.get_tp_group()
        name, ws = tp.unique_name, world_size
        want = _expected_grads(rank, ws)
        out: dict[str, Any] = {}

        # eager: the ops called directly
        eager = _grads_of(_three_ops, rank, ws, name)
        out["eager_err"] = [float((g - w).abs().max()) for g, w in zip(eager, want, strict=False)]

        # compiled, aot_eager: one graph, same gradients
        torch._dynamo.reset()
        counters.clear()
        fn = torch.compile(_three_ops, fullgraph=True, backend="aot_eager")
        compiled = _grads_of(fn, rank, ws, name)
        out["compiled_err"] = [float((g - w).abs().max())
                               for g, w in zip(compiled, want, strict=False)]
        out["compiled_breaks"] = sum(counters["graph_break"].values())

        # the backward graph is made of the adjoint collectives
        torch._dynamo.reset()
        rec = _Recorder()
        fn = torch.compile(_three_ops, fullgraph=True, backend=rec.backend)
        recorded = _grads_of(fn, rank, ws, name)
        out["recorded_err"] = [float((g - w).abs().max())
                               for g, w in zip(recorded, want, strict=False)]
        out["fw_ops"], out["bw_ops"] = sorted(rec.graphs["fw"]), sorted(rec.graphs["bw"])

        # GroupCoordinator.all_reduce in a compiled module with a Parameter
        x, weight, g = _module_case(rank, ws)
        module = _RowParallel(tp, weight)
        with torch.no_grad():
            eager_y = tp.all_reduce(x @ module.weight)
        # eager GroupCoordinator collectives are not differentiable (like torch.distributed)
        out["eager_method_requires_grad"] = tp.all_reduce(x @ module.weight).requires_grad
        torch._dynamo.reset()
        counters.clear()
        y = torch.compile(module, fullgraph=True, backend="aot_eager")(x)
        out["module_breaks"] = sum(counters["graph_break"].values())
        out["module_forward_err"] = float((y - eager_y).abs().max())
        (y * g).sum().backward()
        g_sum = sum(_module_case(s, ws)[2] for s in range(ws))
        out["module_grad_err"] = float((module.weight.grad - x.t() @ g_sum).abs().max())
        return out
    finally:
        torch._dynamo.reset()
        ps.destroy_model_parallel()


@pytest.mark.timeout(240)
def test_gradients_through_the_custom_ops(dist_pool: Any) -> None:
    for rank, res in enumerate(dist_pool(2).run(_autograd_checks, timeout=220)):
        where = f"rank {rank}: {res}"
        assert max(res["eager_err"]) < 1e-5, where
        assert max(res["compiled_err"]) < 1e-5, where
        assert res["compiled_breaks"] == 0, where
        assert max(res["recorded_err"]) < 1e-5, where
        assert res["fw_ops"] == [
            "groupcoord.all_gather.default",
            "groupcoord.all_reduce.default",
            "groupcoord.reduce_scatter.default",
        ], where
        # adjoints: all_reduce -> all_reduce, all_gather <-> reduce_scatter
        assert res["bw_ops"] == res["fw_ops"], where
        assert res["eager_method_requires_grad"] is False, where
        assert res["module_breaks"] == 0, where
        assert res["module_forward_err"] < 1e-5, where
        assert res["module_grad_err"] < 1e-4, where

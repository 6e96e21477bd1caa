"""Traceable collectives: the ``groupcoord::*`` custom ops under eager, fake and compiled runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import coordinator.custom_ops  # noqa: F401  (registers the ops)


def test_fake_implementations_give_shapes_without_a_group() -> None:
    with FakeTensorMode():
        t = torch.empty(6, 4, 3)
        assert torch.ops.groupcoord.all_reduce(t, "no-such-group").shape == (6, 4, 3)
        assert torch.ops.groupcoord.all_gather(t, 1, 4, "no-such-group").shape == (6, 16, 3)
        assert torch.ops.groupcoord.reduce_scatter(t, 0, 3, "no-such-group").shape == (2, 4, 3)
        with pytest.raises(Exception, match="not divisible by 4"):
            torch.ops.groupcoord.reduce_scatter(t, 0, 4, "no-such-group")


def test_real_call_names_an_unknown_group() -> None:
    with pytest.raises(ValueError, match="no-such-group"):
        torch.ops.groupcoord.all_reduce(torch.ones(2), "no-such-group")


# ---------------------------------------------------------------------- on real groups
class _TPBlock(torch.nn.Module):
    """Column(gather) -> row(reduce-scatter) -> all-gather -> row(all-reduce): all three ops."""

    def __init__(self, tp: Any) -> None:
        super().__init__()
        from coordinator.engine.layers import ColumnParallelLinear, RowParallelLinear, tp_all_gather

        self.tp = tp
        self.gather = tp_all_gather
        self.up = ColumnParallelLinear(8, 16, bias=True, tp_group=tp)
        self.down_rs = RowParallelLinear(16, 8, reduce_scatter=True, tp_group=tp)
        self.up2 = ColumnParallelLinear(8, 16, gather_output=True, tp_group=tp)
        self.down = RowParallelLinear(16, 8, input_is_parallel=False, tp_group=tp)
        g = torch.Generator().manual_seed(7)
        for layer in (self.up, self.down_rs, self.up2, self.down):
            for p in layer.parameters():
                full = torch.randn(*_full_shape(layer, p), generator=g)
                p.weight_loader(p, full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down_rs(torch.relu(self.up(x)))  # this rank's token slice
        h = self.gather(self.tp, h, 0)
        return self.down(torch.relu(self.up2(h)))


def _full_shape(layer: Any, p: torch.nn.Parameter) -> tuple[int, ...]:
    """The checkpoint (unsharded) shape of ``p``."""
    return (layer.output_size,) if p is layer.bias else (layer.output_size, layer.input_size)


def _direct(tp: Any, x: torch.Tensor) -> torch.Tensor:
    """GroupCoordinator methods called directly inside the compiled function."""
    a = tp.all_reduce(x * 2)
    b = tp.all_gather(a + 1, dim=-1)
    return tp.reduce_scatter(b, dim=0) - 1


def _custom_op_checks(rank: int, world_size: int) -> dict[str, Any]:
    from torch._dynamo.utils import counters
    from torch.utils._python_dispatch import TorchDispatchMode

    from coordinator import parallel_state as ps
    from coordinator.custom_ops import traced_all_gather, traced_all_reduce, traced_reduce_scatter

    ps.initialize_model_parallel(world_size, 1)
    try:
        tp = ps.get_tp_group()
        out: dict[str, Any] = {}
        x = torch.arange(24, dtype=torch.float32).reshape(4, 6) * (rank + 1)

        # eager op calls give exactly the group's results
        out["eager_equal"] = [
            torch.equal(traced_all_reduce(tp, x), tp.all_reduce(x)),
            torch.equal(traced_all_gather(tp, x, -1), tp.all_gather(x, -1)),
            torch.equal(traced_reduce_scatter(tp, x, 0), tp.reduce_scatter(x, 0)),
        ]

        # torch's own consistency checks of schema, fake impl and dispatch (every rank runs
        # the same sequence of calls, so the collectives inside stay matched)
        for op, args in (
            (torch.ops.groupcoord.all_reduce.default, (x, tp.unique_name)),
            (torch.ops.groupcoord.all_gather.default, (x, 0, world_size, tp.unique_name)),
            (torch.ops.groupcoord.reduce_scatter.default, (x, 0, world_size, tp.unique_name)),
        ):
            torch.library.opcheck(
                op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
            )

        # eager layers never dispatch the custom ops (no compile-time machinery in eager)
        class _Log(TorchDispatchMode):
            def __init__(self) -> None:
                super().__init__()
                self.ops: list[str] = []

            def __torch_dispatch__(
                self, func: Any, types: Any, args: Any = (), kwargs: Any = None
            ) -> Any:
                self.ops.append(str(func))
                return func(*args, **(kwargs or {}))

        block = _TPBlock(tp).eval()
        inp = torch.randn(2 * world_size, 8, generator=torch.Generator().manual_seed(1))
        with torch.no_grad(), _Log() as log:
            eager = block(inp)
        out["eager_dispatched_groupcoord"] = [o for o in log.ops if "groupcoord" in o]

        # fullgraph compile of the layers: one graph, no breaks, eager's numbers
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            compiled = torch.compile(block, fullgraph=True, dynamic=False, backend="aot_eager")(inp)
        out["layers_breaks"] = sum(counters["graph_break"].values())
        out["layers_equal"] = torch.equal(compiled, eager)
        explain = torch._dynamo.explain(block)(inp)
        out["layers_explain"] = (explain.graph_count, explain.graph_break_count)
        ops = {
            str(n.target) for g in explain.graphs for n in g.graph.nodes if n.op == "call_function"
        }
        out["layers_ops"] = sorted(o for o in ops if "groupcoord" in o)

        # GroupCoordinator's own methods inside a compiled function
        torch._dynamo.reset()
        counters.clear()
        y = torch.randn(2 * world_size, 3, generator=torch.Generator().manual_seed(rank))
        want = _direct(tp, y)
        got = torch.compile(_direct, fullgraph=True, backend="aot_eager")(tp, y)
        out["direct_equal"] = torch.equal(got, want)
        out["direct_breaks"] = sum(counters["graph_break"].values())
        explain = torch._dynamo.explain(_direct)(tp, y)
        ops = {
            str(n.target) for g in explain.graphs for n in g.graph.nodes if n.op == "call_function"
        }
        out["direct_ops"] = sorted(o for o in ops if "groupcoord" in o)
        return out
    finally:
        ps.destroy_model_parallel()


@pytest.mark.timeout(180)
def test_custom_ops_on_real_groups(dist_pool: Any) -> None:
    for res in dist_pool(2).run(_custom_op_checks, timeout=150):
        assert res["eager_equal"] == [True, True, True]
        assert res["eager_dispatched_groupcoord"] == []
        assert res["layers_breaks"] == 0 and res["layers_equal"]
        assert res["layers_explain"] == (1, 0)
        assert len(res["layers_ops"]) == 3, res["layers_ops"]
        assert res["direct_breaks"] == 0 and res["direct_equal"]
        # through our custom ops (not torch's own rewrite of gloo collectives, which a
        # shared-memory communicator would not get)
        assert len(res["direct_ops"]) == 3, res["direct_ops"]

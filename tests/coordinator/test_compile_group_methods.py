"""GroupCoordinator.all_reduce/all_gather/reduce_scatter trace under
torch.compile(fullgraph=True)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from coordinator import parallel_state as ps


@pytest.mark.timeout(300)
def test_group_methods_compile_without_graph_breaks(dist_pool) -> None:
    res = dist_pool(2).run(compiled_matches_eager, timeout=280)
    for r in res:
        assert r["graph_breaks"] == 0, r
        assert r["graphs"] == 1, r
        assert r["match"] and r["match2"], r
        assert [o.removesuffix(".default") for o in r["ops"]] == [
            "groupcoord.all_gather", "groupcoord.all_reduce", "groupcoord.reduce_scatter"
        ], r["ops"]


# ---------------------------------------------------------------------- on the ranks
class _Block(torch.nn.Module):
    def __init__(self, group) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.group = group
        self.w = torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.group.all_reduce(x @ self.w)            # row-parallel style
        g = self.group.all_gather(h, dim=-1)             # column gather
        r = self.group.reduce_scatter(g * 2.0, dim=-1)   # back to the shard
        return torch.relu(r) + h


@torch.no_grad()  # serving code runs without autograd
def compiled_matches_eager(rank: int, world_size: int) -> dict:
    import torch._dynamo

    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    block = _Block(ps.get_tp_group())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 + rank))
    eager = block(x)
    torch._dynamo.reset()
    explain = torch._dynamo.explain(block)(x)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out2 = compiled(x + 1)
    return {
        "graph_breaks": explain.graph_break_count,
        "graphs": explain.graph_count,
        "match": torch.allclose(out, eager, atol=1e-5),
        "match2": torch.allclose(out2, block(x + 1), atol=1e-5),
        "ops": sorted({str(n.target) for g in explain.graphs for n in g.graph.nodes
                       if "groupcoord" in str(n.target)}),
    }


@pytest.mark.timeout(300)
def test_all_reduce_out_under_compile(dist_pool) -> None:
    for r in dist_pool(2).run(compiled_out, timeout=280):
        assert r["graph_breaks"] == 0 and r["in_place"], r
        assert r["bad_shape"].startswith("ValueError"), r
        assert "out must have shape" in r["bad_shape"], r
        assert r["bad_dtype"].startswith("TypeError") and "out must have dtype" in r["bad_dtype"], r


@torch.no_grad()
def compiled_out(rank: int, world_size: int) -> dict:
    import torch._dynamo

    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp = ps.get_tp_group()

    def step(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return tp.all_reduce(x * 2.0, out=out)

    x = torch.full((4, 8), float(rank + 1))
    torch._dynamo.reset()
    explain = torch._dynamo.explain(step)(x, torch.empty(4, 8))
    buf = torch.empty(4, 8)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(x, buf)
    want = 2.0 * sum(range(1, world_size + 1))
    res = {"graph_breaks": explain.graph_break_count,
           "in_place": got is buf and torch.equal(buf, torch.full((4, 8), want))}
    for key, bad in (("bad_shape", torch.empty(3, 4, 8)),
                     ("bad_dtype", torch.empty(4, 8, dtype=torch.float64))):
        torch._dynamo.reset()
        try:
            torch.compile(step, backend="aot_eager")(x, bad)
            res[key] = "accepted"
        except (TypeError, ValueError) as e:
            res[key] = f"{type(e).__name__}: {e}"
    return res


_ALONE = ("all_reduce", "all_reduce_max", "all_gather", "reduce_scatter", "gather")


@pytest.mark.timeout(300)
def test_a_tp_group_of_one_compiles_with_fullgraph(dist_pool) -> None:
    """TP=1 (the commonest engine): every helper traces with fullgraph and
    returns what eager mode returns, bad dims raise as in eager mode."""
    (r,) = dist_pool(1).run(compiled_alone, timeout=280)
    for name in _ALONE:
        assert r[name] == "same", (name, r[name])
    assert r["bad_dim"].startswith("ValueError") and "dim must be in" in r["bad_dim"], r


@pytest.mark.timeout(300)
@pytest.mark.parametrize("op,dim", [("all_gather", 2), ("all_gather", -3), ("reduce_scatter", 2)])
def test_an_out_of_range_dim_raises_under_compile(dist_pool, op: str, dim: int) -> None:
    """Eager mode refuses the dim; the traced op must not wrap it onto another dim."""
    for r in dist_pool(2).run(compiled_bad_dim, op, dim, timeout=280):
        assert r.startswith("ValueError") and "dim must be in" in r, r


@torch.no_grad()
def compiled_alone(rank: int, world_size: int) -> dict:
    import torch._dynamo

    from device_comms import ReduceOp

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    tp = ps.get_tp_group()
    fns = {
        "all_reduce": lambda t: ps.tensor_model_parallel_all_reduce(t * 2),
        "all_reduce_max": lambda t: tp.all_reduce(t * 2, ReduceOp.MAX),
        "all_gather": lambda t: ps.tensor_model_parallel_all_gather(t * 2, -1),
        "reduce_scatter": lambda t: tp.reduce_scatter(t * 2, 0),
        "gather": lambda t: ps.tensor_model_parallel_gather(t * 2, 0, -1),
    }
    x = torch.arange(6.0).reshape(2, 3)
    res = {}
    for name, fn in fns.items():
        torch._dynamo.reset()
        try:
            got = torch.compile(fn, fullgraph=True, backend="aot_eager")(x)
            res[name] = "same" if torch.equal(got, fn(x)) else f"differs: {got}"
        except Exception as e:
            res[name] = f"{type(e).__name__}: {str(e)[:300]}"
    torch._dynamo.reset()
    try:
        torch.compile(lambda t: tp.all_gather(t * 2, 2), backend="aot_eager")(x)
        res["bad_dim"] = "accepted"
    except Exception as e:
        res["bad_dim"] = f"{type(e).__name__}: {e}"
    return res


@torch.no_grad()
def compiled_bad_dim(rank: int, world_size: int, op: str, dim: int) -> str:
    import torch._dynamo

    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp = ps.get_tp_group()
    x = torch.ones(2, 4)
    torch._dynamo.reset()
    try:
        y = torch.compile(lambda t: getattr(tp, op)(t * 2, dim), backend="aot_eager")(x)
        return f"returned shape {tuple(y.shape)}"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


UNTRACED = ["broadcast", "gather", "all_reduce-max", "all_gatherv", "scatter"]
#: Calls of objects, tensor dicts and point-to-point transfers, and a reduce_scatter
#: whose op has no custom op.
UNTRACED_OBJECTS_P2P = ["reduce_scatter-max", "broadcast_tensor_dict", "broadcast_object",
                        "send-recv", "isend-irecv", "send-recv_tensor_dict", "barrier"]


@pytest.mark.timeout(300)
def test_calls_without_a_custom_op_run_eagerly_as_shapes_change(dist_pool) -> None:
    """Collectives that have no custom op run outside the graph, also when the
    batch size changes and torch.compile recompiles with dynamic shapes (they
    used to fail there: the tracer followed them into the library's waits)."""
    res = dist_pool(2).run(untraced_calls_in_a_loop, UNTRACED, timeout=280)
    for r in res:
        assert r == {name: ["ok"] * 4 for name in UNTRACED}, r


@pytest.mark.timeout(300)
def test_object_dict_and_p2p_calls_run_eagerly_as_shapes_change(dist_pool) -> None:
    """The same for calls that move objects, tensor dicts and point-to-point tensors
    (a recompile for a new batch size failed in the sender's encoder, and the
    receivers waited for the message until the group's timeout)."""
    res = dist_pool(2).run(untraced_calls_in_a_loop, UNTRACED_OBJECTS_P2P, timeout=280)
    for r in res:
        assert r == {name: ["ok"] * 4 for name in UNTRACED_OBJECTS_P2P}, r


@torch.no_grad()
def untraced_calls_in_a_loop(rank: int, world_size: int, names: list[str]) -> dict:
    import torch._dynamo

    from device_comms import ReduceOp

    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        tp = ps.get_tp_group()
        sizes = [r + 1 for r in range(world_size)]

        def gathered(t: torch.Tensor) -> torch.Tensor:
            g = tp.gather(t * 1, 0, 0)
            return t * 0 if g is None else g[: t.shape[0]]

        def sent_back(t: torch.Tensor) -> torch.Tensor:  # rank 0 -> 1, then 1 -> 0
            if rank == 0:
                tp.send(t * 1, 1)
                return tp.recv(t.shape, t.dtype, 1) + 1
            got = tp.recv(t.shape, t.dtype, 0)
            tp.send(got * 1, 0)
            return got + 1

        def sent_back_async(t: torch.Tensor) -> torch.Tensor:
            peer = 1 - rank
            buf = torch.empty_like(t)
            handles = [tp.isend(t * 1, peer), tp.irecv(buf, peer)]
            for h in handles:
                h.wait()
            return buf + 1

        def dict_sent_back(t: torch.Tensor) -> torch.Tensor:
            if rank == 0:
                tp.send_tensor_dict({"a": t * 1, "step": 1}, 1)
                return tp.recv_tensor_dict(1)["a"] + 1
            got = tp.recv_tensor_dict(0)["a"]
            tp.send_tensor_dict({"a": got * 1, "step": 1}, 0)
            return got + 1

        bodies = {
            "broadcast": lambda t: tp.broadcast(t * 1, 0) + 1,
            "gather": lambda t: gathered(t) + 1,
            "all_reduce-max": lambda t: tp.all_reduce(t * 1, ReduceOp.MAX) + 1,
            "all_gatherv": lambda t: tp.all_gatherv(t[: rank + 1].contiguous() * 1, 0,
                                                     sizes) + 1,
            "scatter": lambda t: tp.scatter(t.repeat(world_size, 1) * 1, 0, 0) + 1,
            "reduce_scatter-max": lambda t: tp.reduce_scatter(t.repeat(world_size, 1) * 1, 0,
                                                              ReduceOp.MAX) + 1,
            "broadcast_tensor_dict": lambda t: tp.broadcast_tensor_dict(
                {"a": t * 1, "n": 3} if rank == 0 else None, 0)["a"] + 1,
            "broadcast_object": lambda t: t * tp.broadcast_object(
                int(t.shape[0]) if rank == 0 else None, 0),
            "send-recv": sent_back,
            "isend-irecv": sent_back_async,
            "send-recv_tensor_dict": dict_sent_back,
            "barrier": lambda t: (tp.barrier(), t + 1)[1],
        }

        out: dict = {}
        for name in names:
            body = bodies[name]
            torch._dynamo.reset()
            compiled = torch.compile(body, backend="aot_eager")
            got = []
            for i, rows in enumerate((3, 3, 4, 5)):
                x = torch.full((rows, 2), float(i + rank))
                try:
                    same = torch.equal(compiled(x.clone()), body(x.clone()))
                    got.append("ok" if same else "WRONG")
                except Exception as e:
                    got.append(f"{type(e).__name__}: {str(e)[:200]}")
                    break
            out[name] = got
        tp.barrier()
        return out
    finally:
        ps.destroy_model_parallel()


#: Eager calls made while another thread compiles, with what each must return.
WHILE_COMPILING = ["all_reduce-sum", "all_reduce-sum-out", "all_reduce-max", "broadcast",
                   "reduce_scatter-sum", "reduce_scatter-max", "all_gather", "all_gatherv",
                   "send-recv", "send_object-recv_object", "broadcast_object",
                   "broadcast_tensor_dict", "barrier"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", WHILE_COMPILING)
def test_eager_calls_while_another_thread_compiles(dist_pool, name: str) -> None:
    """torch's "is compiling" flag is process-wide: while one thread compiles, a
    collective in another thread sees it set. The call must still run eagerly and
    give its result (the eager routes asked the flag again and recursed without
    end: RecursionError)."""
    for r in dist_pool(2).run(eager_while_compiling, name, timeout=280):
        assert r == {"flag_set": True, name: "ok"}, r


def eager_while_compiling(rank: int, world_size: int, name: str) -> dict:
    import threading

    from device_comms import ReduceOp

    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp = ps.get_tp_group()
    started, done = threading.Event(), threading.Event()

    def held_backend(gm, example_inputs):  # type: ignore[no-untyped-def]
        started.set()
        done.wait(120)  # the flag stays set until the eager call below is over
        return gm.forward

    import torch._dynamo

    torch._dynamo.reset()  # a pool's process compiled this function before: compile afresh
    compiling = threading.Thread(
        target=lambda: torch.compile(lambda t: t * 2 + 1, backend=held_backend)(torch.ones(3)))
    x = torch.arange(world_size * 2 * 2, dtype=torch.float32).view(world_size * 2, 2) + rank
    peer = 1 - rank

    def exchange(send: Any, recv: Any) -> Any:  # rank 0 sends first, rank 1 receives first
        if rank == 0:
            send()
            return recv()
        got = recv()
        send()
        return got

    total = sum(torch.arange(world_size * 4, dtype=torch.float32).view(-1, 2) + r
                for r in range(world_size))
    top = torch.arange(world_size * 4, dtype=torch.float32).view(-1, 2) + world_size - 1
    mine = slice(2 * rank, 2 * rank + 2)
    checks = {
        "all_reduce-sum": lambda: torch.equal(tp.all_reduce(x.clone()), total),
        "all_reduce-sum-out": lambda: torch.equal(tp.all_reduce(x.clone(), out=torch.empty_like(x)),
                                                  total),
        "all_reduce-max": lambda: torch.equal(tp.all_reduce(x.clone(), ReduceOp.MAX), top),
        "broadcast": lambda: torch.equal(tp.broadcast(x.clone(), 0), x - rank),
        "reduce_scatter-sum": lambda: torch.equal(tp.reduce_scatter(x.clone(), 0), total[mine]),
        "reduce_scatter-max": lambda: torch.equal(tp.reduce_scatter(x.clone(), 0, ReduceOp.MAX),
                                                  top[mine]),
        "all_gather": lambda: tp.all_gather(x.clone(), 0).shape == (world_size * x.shape[0], 2),
        "all_gatherv": lambda: tp.all_gatherv(x.clone(), 0).shape == (world_size * x.shape[0], 2),
        "send-recv": lambda: exchange(lambda: tp.send(x.clone(), peer), lambda: torch.equal(
            tp.recv(x.shape, x.dtype, peer), x - rank + peer)),
        "send_object-recv_object": lambda: exchange(lambda: tp.send_object(rank, peer),
                                                    lambda: tp.recv_object(peer) == peer),
        "broadcast_object": lambda: tp.broadcast_object(5 if rank == 0 else None, 0) == 5,
        "broadcast_tensor_dict": lambda: torch.equal(tp.broadcast_tensor_dict(
            {"a": x.clone()} if rank == 0 else None, 0)["a"], x - rank),
        "barrier": lambda: tp.barrier() is None,
    }
    out: dict = {}
    compiling.start()
    try:
        if not started.wait(60):
            return {"compile": "did not start"}
        out["flag_set"] = torch.compiler.is_compiling()
        try:
            out[name] = "ok" if checks[name]() else "WRONG"
        except Exception as e:  # the parent shows which call failed, and how
            out[name] = f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        done.set()
        compiling.join(120)
        ps.destroy_model_parallel()
    return out

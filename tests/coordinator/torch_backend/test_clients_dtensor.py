"""DTensor tensor parallelism on the groupcoord backend equals the same run on gloo.

Each rank builds two process groups over the same ranks, one of the backend
under test and one of gloo, a ``DeviceMesh("cpu")`` over each
(:meth:`DeviceMesh.from_group`), and shards two copies of the same module
(same seed) with ``parallelize_module``: ``ColwiseParallel`` on the first
projections, ``RowwiseParallel`` on the last. Forward and backward run on both;
outputs, the input's gradient and the full (gathered) weight gradients must
agree.

Two modules:

* an MLP ``w2(relu(w1(x)))``;
* the demo's Llama decoder block (:mod:`coordinator.engine.models.llama`) with
  the demo's architecture (:func:`~coordinator.engine.models.config.default_config`:
  width 256, 8 query heads sharing 4 KV heads, SwiGLU width 688) and its
  ``RMSNorm`` and ``RotaryEmbedding`` layers. The demo's own block is built from
  our pre-sharded layers (merged QKV, paged attention over a KV cache), which
  ``parallelize_module`` cannot shard, so :class:`LlamaBlock` is the same block
  with one ``nn.Linear`` per Hugging Face projection (q/k/v/o, gate/up/down) and
  causal attention over one sequence: the plan torchtitan uses (q, k, v, gate, up
  column-wise; o, down row-wise).

Equality: the row-wise projections end in a sum over ranks (an all-reduce in
forward, and in backward for the input's gradient); float addition is not
associative, and the two backends may add the ranks' partial sums in different
orders, so float results are compared with ``torch.testing.assert_close``'s
float32 tolerance (rtol 1.3e-6, atol 1e-5: a few rounding steps of values of
order 1); the test also reports whether they were bitwise equal.
"""

from __future__ import annotations

from typing import Any

import pytest

#: The backend whose results are compared with gloo's.
UNDER_TEST = "groupcoord"


def _groups() -> tuple[Any, Any]:
    import torch.distributed as dist

    import coordinator  # noqa: F401  registers the groupcoord backend

    return dist.new_group(backend=UNDER_TEST), dist.new_group(backend="gloo")


def _make_mlp(seed: int) -> Any:
    import torch
    from torch import nn

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Linear(16, 32)
            self.w2 = nn.Linear(32, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w2(torch.relu(self.w1(x)))

    torch.manual_seed(seed)
    return MLP()


def _make_llama_block(seed: int) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from coordinator.engine.layers import RMSNorm, RotaryEmbedding
    from coordinator.engine.models.config import default_config

    cfg = default_config()

    class LlamaBlock(nn.Module):
        """The demo's decoder layer with one ``nn.Linear`` per projection."""

        def __init__(self) -> None:
            super().__init__()
            d, hd = cfg.hidden_size, cfg.head_dim
            self.head_dim = hd
            self.rep = cfg.num_attention_heads // cfg.num_key_value_heads
            self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
            self.q_proj = nn.Linear(d, cfg.num_attention_heads * hd, bias=False)
            self.k_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=False)
            self.v_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=False)
            self.o_proj = nn.Linear(cfg.num_attention_heads * hd, d, bias=False)
            self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
            self.gate_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
            self.up_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
            self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)
            self.rotary = RotaryEmbedding(hd, cfg.rope_theta)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            t = x.shape[0]
            h = self.input_layernorm(x)
            # this rank's heads: column-wise projections give it a slice of them
            q = self.q_proj(h).view(t, -1, self.head_dim)
            k = self.k_proj(h).view(t, -1, self.head_dim)
            v = self.v_proj(h).view(t, -1, self.head_dim)
            q, k = self.rotary(torch.arange(t), q, k)
            k = k.repeat_interleave(self.rep, dim=1)
            v = v.repeat_interleave(self.rep, dim=1)
            a = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
            x = x + self.o_proj(a.transpose(0, 1).reshape(t, -1))
            h = self.post_attention_layernorm(x)
            return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    torch.manual_seed(seed)
    return LlamaBlock(), cfg.hidden_size


_PLANS = {
    "mlp": (("w1",), ("w2",)),
    "llama_block": (("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"),
                    ("o_proj", "down_proj")),
}


def _run_sharded(group: Any, which: str) -> dict[str, Any]:
    """Forward and backward of the ``which`` module sharded over ``group``'s ranks."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if which == "mlp":
        module, width = _make_mlp(seed=5), 16
    else:
        module, width = _make_llama_block(seed=5)
    colwise, rowwise = _PLANS[which]
    plan: dict[str, Any] = {name: ColwiseParallel() for name in colwise}
    plan.update({name: RowwiseParallel() for name in rowwise})
    mesh = DeviceMesh.from_group(group, "cpu")
    parallelize_module(module, mesh, plan)
    torch.manual_seed(7)  # the same input on every rank: TP replicates activations
    x = torch.randn(12, width, requires_grad=True)
    out = module(x)
    out.square().mean().backward()
    assert x.grad is not None
    grads = {}
    for name, p in module.named_parameters():
        if p.grad is None:
            continue
        g = p.grad
        grads[name] = g.full_tensor() if isinstance(g, DTensor) else g
    return {"out": out.detach(), "x_grad": x.grad.clone(), "grads": grads}


def dtensor_rank(rank: int, world_size: int, which: str) -> dict[str, Any]:
    """On every rank: the ``which`` module on both groups; how they compare."""
    import torch
    import torch.distributed as dist

    under_test, gloo = _groups()
    try:
        ours = _run_sharded(under_test, which)
        theirs = _run_sharded(gloo, which)
    finally:
        dist.destroy_process_group(under_test)
        dist.destroy_process_group(gloo)
    pairs = [("out", ours["out"], theirs["out"]), ("x_grad", ours["x_grad"], theirs["x_grad"])]
    assert ours["grads"].keys() == theirs["grads"].keys()
    pairs += [(f"grad {n}", ours["grads"][n], theirs["grads"][n]) for n in ours["grads"]]
    for what, a, b in pairs:
        torch.testing.assert_close(a, b, msg=lambda m, what=what: f"{which} {what}: {m}")
    return {"bitwise": all(torch.equal(a, b) for _, a, b in pairs),
            "compared": [what for what, _, _ in pairs]}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("which", ["mlp", "llama_block"])
def test_tensor_parallel_module_equals_gloo(dist_pool: Any, world_size: int, which: str) -> None:
    results = dist_pool(world_size).run(dtensor_rank, which, timeout=90)
    assert len(results) == world_size
    assert len(results[0]["compared"]) >= 4  # out, x_grad and the weight gradients

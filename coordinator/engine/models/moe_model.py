"""A Mixtral / Qwen2-MoE decoder: Llama attention sharded by TP, experts sharded by EP.

:class:`MoeForCausalLM` is a :class:`~coordinator.engine.models.llama.LlamaForCausalLM`
whose layers' feed-forward halves are :class:`~coordinator.engine.models.moe_block.SparseMoeBlock`
(dense TP-sharded SwiGLU for Qwen2-MoE's ``mlp_only_layers``), so the
:class:`~coordinator.engine.models.runner.ModelRunner`, the KV cache and the
pipeline hand-off are the Llama ones. Checkpoint names (Hugging Face)::

    Mixtral    model.layers.{i}.block_sparse_moe.gate.weight             -> mlp.gate
               model.layers.{i}.block_sparse_moe.experts.{e}.w1/w3/w2    -> mlp.w13 (gate, up)
                                                                            / mlp.w2

    Qwen2-MoE  model.layers.{i}.mlp.gate.weight                          -> mlp.gate
               model.layers.{i}.mlp.experts.{e}.gate_proj/up_proj/down_proj
               model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj    -> TP-sharded MLP
               model.layers.{i}.mlp.shared_expert_gate.weight

A rank reads only its stage's layers and, of those, only its own experts.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from coordinator.engine.layers import RowParallelLinear
from coordinator.engine.layers.weights import TPGroup, tp_size_and_rank
from coordinator.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from coordinator.engine.models.moe_block import MoeComm, SparseMoeBlock
from coordinator.engine.models.moe_config import MoeModelConfig

__all__ = ["MoeForCausalLM"]

_EXPERT_RE = re.compile(r"\.mlp\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_HALF = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}
_SHARED = (
    (".shared_expert.gate_proj.", ".shared_expert.gate_up_proj.", 0),
    (".shared_expert.up_proj.", ".shared_expert.gate_up_proj.", 1),
)


def _hf_name(name: str) -> str:
    """Mixtral's ``block_sparse_moe`` spelled ``mlp`` (the module's name here)."""
    return name.replace(".block_sparse_moe.", ".mlp.")


class MoeForCausalLM(LlamaForCausalLM):
    """One rank's shard of a MoE causal LM (the whole model without groups).

    Args:
        config: Architecture.
        tp_group: Tensor-parallel group or ``None``.
        pp_group: Pipeline-parallel group or ``None``.
        ep_group: Expert-parallel group (the DP x TP ranks of this stage) or ``None``.
        dtype: Parameter and activation dtype.
        comm: How the sparse blocks' rows reach the experts on other EP ranks
            (:class:`~coordinator.engine.models.moe_block.MoeComm`; default
            all2all, sequence parallel).
    """

    def __init__(self, config: MoeModelConfig, tp_group: TPGroup | None = None,
                 pp_group: Any | None = None, ep_group: Any | None = None,
                 dtype: torch.dtype = torch.float32, comm: MoeComm | None = None) -> None:
        if not isinstance(config, MoeModelConfig):
            raise TypeError(f"config must be a MoeModelConfig, got {type(config).__name__}")
        tp = tp_size_and_rank(tp_group)[0]
        config.check_parallel(tp, tp_size_and_rank(pp_group)[0], tp_size_and_rank(ep_group)[0])
        super().__init__(config.attention_skeleton(tp), tp_group, pp_group, dtype)
        self.config = self.model.config = config
        self.ep_group = ep_group
        for i in range(self.model.start_layer, self.model.end_layer):
            layer = self.model.layers[i]
            if not isinstance(layer, LlamaDecoderLayer):
                raise TypeError(f"layer {i} is a {type(layer).__name__}, not a decoder layer")

            prefix = f"model.layers.{i}"
            if i in config.sparse_layers:
                layer.mlp = SparseMoeBlock(config, tp_group, ep_group, dtype, f"{prefix}.mlp",
                                           comm)
            else:
                layer.mlp = LlamaMLP(config, tp_group, dtype, False, f"{prefix}.mlp")
            if config.attention_bias and not config.o_proj_bias:
                layer.self_attn.o_proj = RowParallelLinear(
                    config.num_attention_heads * config.head_dim, config.hidden_size, bias=False,
                    tp_group=tp_group, params_dtype=dtype, prefix=f"{prefix}.self_attn.o_proj")

    def sparse_blocks(self) -> Iterator[SparseMoeBlock]:
        """This stage's sparse blocks, in layer order."""
        for i in range(self.model.start_layer, self.model.end_layer):
            mlp = self.model.layers[i].mlp
            if isinstance(mlp, SparseMoeBlock):
                yield mlp

    def idle(self) -> None:
        """Serve this stage's experts for one step in which this rank has no tokens."""
        for block in self.sparse_blocks():
            block.idle()

    # ------------------------------------------------------------------ weights
    def _block(self, name: str) -> SparseMoeBlock | None:
        layer = self._layer_of(name)
        if layer is None or not self.model.start_layer <= layer < self.model.end_layer:
            return None
        mlp = self.model.layers[layer].mlp
        return mlp if isinstance(mlp, SparseMoeBlock) else None

    def wants(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` is needed here (only this rank's experts)."""
        name = _hf_name(name)
        m = _EXPERT_RE.search(name)
        if m:
            block = self._block(name)
            return block is not None and block.local_index(int(m.group(1))) is not None
        return super().wants(name)

    def _known(self, name: str) -> bool:
        return super()._known(_hf_name(name))

    def _target(self, name: str) -> tuple[str, Any]:
        name = _hf_name(name)
        m = _EXPERT_RE.search(name)
        if m:
            base = name[: m.start()] + ".mlp."
            expert, proj = int(m.group(1)), m.group(2)
            if proj in _HALF:
                return base + "w13", (expert, _HALF[proj])
            return base + "w2", expert
        if name.endswith(".mlp.gate.weight"):
            return name[: -len(".weight")], None
        if name.endswith(".mlp.shared_expert_gate.weight"):
            return name[: -len(".weight")], None
        for frag, ours, shard in _SHARED:
            if frag in name:
                return name.replace(frag, ours), shard
        return super()._target(name)

    def _expected_loads(self, params: dict[str, nn.Parameter]) -> set[str]:
        out: set[str] = set()
        plain = {}
        for pname, p in params.items():
            if pname.endswith(".mlp.w13") or pname.endswith(".mlp.w2"):
                block = self._block(pname)
                if block is None:  # unreachable: w13/w2 exist only in sparse blocks
                    raise RuntimeError(f"parameter {pname} is outside a sparse block")
                experts = range(block.first_expert, block.first_expert + block.num_local)
                if pname.endswith("w13"):
                    out.update(f"{pname}#{(e, h)}" for e in experts for h in (0, 1))
                else:
                    out.update(f"{pname}#{e}" for e in experts)
            else:
                plain[pname] = p
        return out | super()._expected_loads(plain)

    def load_weights(self, weights: Any) -> None:
        """Load Hugging Face-named tensors (Mixtral's ``block_sparse_moe`` included)."""
        super().load_weights((_hf_name(n), t) for n, t in weights)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_pretrained(  # type: ignore[override]  # adds ep_group, comm; no sequence_parallel
        cls, model_dir: str | os.PathLike[str], tp_group: TPGroup | None = None,
        pp_group: Any | None = None, ep_group: Any | None = None,
        dtype: torch.dtype | str | None = None, comm: MoeComm | None = None,
    ) -> MoeForCausalLM:
        """Build this rank's shard from a Mixtral or Qwen2-MoE checkpoint directory
        (float32 compute by default, as :meth:`LlamaForCausalLM.from_pretrained`)."""
        from coordinator.engine.models.checkpoint import iter_checkpoint
        from coordinator.engine.models.config import resolve_dtype

        config = MoeModelConfig.from_json(model_dir)
        model = cls(config, tp_group, pp_group, ep_group, resolve_dtype(dtype, config), comm)
        model.load_weights(
            iter_checkpoint(model_dir, lambda n: model.wants(n) or not model._known(n)))
        return model.eval()

    @classmethod
    def from_seed(  # type: ignore[override]  # adds ep_group, comm; no sequence_parallel
        cls, config: MoeModelConfig | None = None, seed: int = 0,
        tp_group: TPGroup | None = None, pp_group: Any | None = None,
        ep_group: Any | None = None, dtype: torch.dtype = torch.float32,
        comm: MoeComm | None = None,
    ) -> MoeForCausalLM:
        """This rank's shard of a random Mixtral-style model (``default_moe_config()``)."""
        from coordinator.engine.models.moe_checkpoint import random_moe_state_dict
        from coordinator.engine.models.moe_config import default_moe_config

        config = config or default_moe_config()
        model = cls(config, tp_group, pp_group, ep_group, dtype, comm)
        model.load_weights(random_moe_state_dict(config, seed).items())
        return model.eval()

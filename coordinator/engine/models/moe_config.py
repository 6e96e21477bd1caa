"""Configuration of a mixture-of-experts decoder (Mixtral, Qwen2-MoE), from a HF ``config.json``.

The attention half of every layer is a Llama layer (see
:class:`~coordinator.engine.models.config.LlamaModelConfig`, whose fields and
checks are inherited); the feed-forward half is a sparse block of
``num_experts`` SwiGLU experts of width ``moe_intermediate_size`` of which
each token uses ``num_experts_per_tok``:

* Mixtral (``model_type: mixtral``): every layer sparse; softmax over all
  experts, top-k, weights renormalised to sum to 1.
* Qwen2-MoE (``model_type: qwen2_moe``): softmax, top-k, renormalised only
  with ``norm_topk_prob``; plus a shared expert (width
  ``shared_expert_intermediate_size``, scaled by ``sigmoid(shared_expert_gate(x))``)
  every token goes through; q/k/v have biases, o_proj has none; layers in
  ``mlp_only_layers`` or not on the ``decoder_sparse_step`` are dense
  (width ``intermediate_size``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from coordinator.engine.models.config import (
    LlamaModelConfig,
    bool_field,
    count_field,
    is_int,
    read_hf_config,
)

__all__ = ["MoeModelConfig", "default_moe_config", "MOE_MODEL_TYPES"]

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe")


@dataclasses.dataclass(frozen=True)
class MoeModelConfig(LlamaModelConfig):
    """A Llama config plus the sparse feed-forward's shape (HF field names where they exist).

    Attributes:
        model_type: ``mixtral`` or ``qwen2_moe``.
        num_experts: Routed experts per sparse layer.
        num_experts_per_tok: Experts each token is routed to (top-k).
        moe_intermediate_size: Width of each routed expert.
        norm_topk_prob: Renormalise the top-k weights to sum to 1.
        shared_expert_intermediate_size: Width of the shared expert (0: none).
        sparse_layers: Indices of the layers with a sparse block (the others are dense).
        o_proj_bias: o_proj has a bias (``attention_bias`` covers q/k/v).
    """

    model_type: str = "mixtral"
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    sparse_layers: tuple[int, ...] = ()
    o_proj_bias: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model_type not in MOE_MODEL_TYPES:
            raise ValueError(
                f"model_type must be one of {MOE_MODEL_TYPES}, got {self.model_type!r}")
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config field {name} must be a positive int, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                             f"num_experts ({self.num_experts})")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError("shared_expert_intermediate_size must be >= 0, got "
                             f"{self.shared_expert_intermediate_size}")
        bad = [i for i in self.sparse_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(
                f"sparse layer indices {bad} are outside [0, {self.num_hidden_layers})")


    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> MoeModelConfig:
        """Read a Mixtral or Qwen2-MoE ``config.json`` (the file, or its directory)."""
        return cls.from_hf_dict(read_hf_config(path))

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> MoeModelConfig:
        """Build from a parsed Mixtral or Qwen2-MoE ``config.json``.

        Raises:
            ValueError: Another architecture, or a missing/invalid field (named).
        """
        if not isinstance(d, Mapping):
            raise TypeError(f"config must be a mapping, got {type(d).__name__}")
        mt = d.get("model_type")
        if mt not in MOE_MODEL_TYPES:
            raise ValueError(f"model_type must be one of {MOE_MODEL_TYPES} for --model moe, "
                             f"got {mt!r}")
        qwen = mt == "qwen2_moe"
        if qwen and d.get("use_sliding_window"):
            raise ValueError("use_sliding_window: sliding-window attention is not supported")
        window = None if qwen else d.get("sliding_window")
        if window is not None and not is_int(window):
            raise ValueError(f"config field sliding_window must be an int or null, got {window!r}")
        if window is not None and window < count_field(d, "max_position_embeddings", 2048):
            raise ValueError(f"sliding_window ({window}) < max_position_embeddings: "
                             "sliding-window attention is not supported (null = full attention)")
        key = "num_experts" if qwen else "num_local_experts"
        for k in (key, "num_experts_per_tok"):
            if k not in d:
                raise ValueError(f"config.json lacks required field {k!r}")
        base = LlamaModelConfig.from_hf_dict(
            {**d, "model_type": "llama",
             "attention_bias": bool_field(d, "qkv_bias", True) if qwen
             else bool_field(d, "attention_bias"), "mlp_bias": False})
        layers = base.num_hidden_layers
        if qwen:
            step = count_field(d, "decoder_sparse_step", 1)
            if step == 0:
                raise ValueError("config field decoder_sparse_step must be an int >= 1 or null, "
                                 "got 0")
            dense_layers = d.get("mlp_only_layers") or []
            if not isinstance(dense_layers, list) or not all(map(is_int, dense_layers)):
                raise ValueError(f"config field mlp_only_layers must be a list of layer "
                                 f"indices or null, got {dense_layers!r:.80}")
            dense = set(dense_layers)
            sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        else:
            sparse = tuple(range(layers))
        # None when a Qwen2-MoE config lacks it: __post_init__ names the field
        expert_size: Any = d.get("moe_intermediate_size") if qwen else d["intermediate_size"]
        return cls(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaModelConfig)},
            model_type=mt,
            num_experts=d[key],
            num_experts_per_tok=d["num_experts_per_tok"],
            moe_intermediate_size=expert_size,

            norm_topk_prob=bool_field(d, "norm_topk_prob") if qwen else True,
            shared_expert_intermediate_size=count_field(d, "shared_expert_intermediate_size", 0)
            if qwen else 0,
            sparse_layers=sparse,
            o_proj_bias=False if qwen else base.attention_bias,
        )

    @property
    def has_dense_layers(self) -> bool:
        """Some layer has a dense (TP-sharded) MLP."""
        return len(self.sparse_layers) < self.num_hidden_layers

    def check_parallel(self, tp: int, pp: int, ep: int = 1) -> None:
        """Check that this model shards over ``tp`` x ``pp`` ranks with ``ep`` expert ranks.

        Attention splits as for Llama; routed experts are whole on their EP rank
        (``num_experts`` must be a multiple of ``ep``); dense MLPs and the shared
        expert split by TP (their widths must divide by ``tp``).

        Raises:
            TypeError: A size is not an int.
            ValueError: A size the model cannot be split by, naming the field.
        """
        dense = self.intermediate_size if self.has_dense_layers else tp
        LlamaModelConfig.check_parallel(dataclasses.replace(self, intermediate_size=dense), tp, pp)
        if not isinstance(ep, int) or isinstance(ep, bool):
            raise TypeError(f"expert-parallel size (ep) must be an int, got {type(ep).__name__}")
        if ep < 1 or self.num_experts % ep:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by the "
                             f"expert-parallel size (ep = dp x tp = {ep})")
        if self.shared_expert_intermediate_size % tp:
            raise ValueError(f"shared_expert_intermediate_size "
                             f"({self.shared_expert_intermediate_size}) must be divisible by the "
                             f"tensor-parallel size (tp={tp})")

    def attention_skeleton(self, tp: int) -> MoeModelConfig:
        """This config with ``intermediate_size`` set so the Llama base builds only tiny
        placeholder MLPs (the MoE model replaces every layer's MLP)."""
        return dataclasses.replace(self, intermediate_size=max(tp, 1))


def default_moe_config() -> MoeModelConfig:
    """The embedded MoE demo model: Mixtral-style, 2 layers, width 128, 8 experts, top-2."""
    return MoeModelConfig(
        vocab_size=512, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
        rope_theta=1e6, max_position_embeddings=2048, bos_token_id=1,
        model_type="mixtral", num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=192, sparse_layers=(0, 1),
    )

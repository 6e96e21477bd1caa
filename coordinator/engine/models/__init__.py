"""Decoder models built from :mod:`coordinator.engine.layers`, sharded over TP x PP ranks.

* :class:`LlamaForCausalLM` — one rank's shard (or the whole model) of a
  Llama-architecture decoder; loads Hugging Face checkpoints.
* :class:`ModelRunner` / :class:`StepInput` — run scheduler steps (prefill and
  decode mixed) with a paged KV cache and pipeline hand-off.
* :func:`generate_greedy` — a small continuous-batching greedy loop.
* :class:`MoeForCausalLM` / :class:`MoeModelConfig` — Mixtral / Qwen2-MoE: attention
  by TP, experts by EP (:mod:`coordinator.moe` dispatch/combine).
"""

from coordinator.engine.models.config import LlamaModelConfig, default_config
from coordinator.engine.models.generate import GenerationRequest, generate_greedy
from coordinator.engine.models.kv_cache import AttentionInputs, KVCache, KVCacheFullError
from coordinator.engine.models.llama import LlamaForCausalLM, partition_layers
from coordinator.engine.models.moe_config import MoeModelConfig, default_moe_config
from coordinator.engine.models.moe_model import MoeForCausalLM
from coordinator.engine.models.runner import ModelRunner, StepInput

__all__ = [
    "LlamaModelConfig",
    "default_config",
    "LlamaForCausalLM",
    "partition_layers",
    "MoeModelConfig",
    "default_moe_config",
    "MoeForCausalLM",
    "KVCache",
    "KVCacheFullError",
    "AttentionInputs",
    "ModelRunner",
    "StepInput",
    "GenerationRequest",
    "generate_greedy",
]

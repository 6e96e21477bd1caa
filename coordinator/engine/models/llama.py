"""A Llama-architecture decoder sharded over tensor- and pipeline-parallel ranks.

One :class:`LlamaForCausalLM` object is one rank's shard: the layers of its
pipeline stage (stage ``k`` of ``pp`` holds a contiguous range of layers, the
first stage also the token embedding, the last the final norm and the LM
head), each cut along heads / features for its tensor-parallel rank. With
``tp_group=None`` and ``pp_group=None`` it is the whole model in one process:
the unsharded reference.

Per decoder layer (matching Hugging Face's ``LlamaDecoderLayer``)::

    h = x + o_proj(attn(rope(qkv_proj(rmsnorm(x)))))      o_proj: all-reduce
    y = h + down_proj(silu(gate(rmsnorm(h))) * up(...))   down_proj: all-reduce

With ``sequence_parallel=True`` (TP > 1) the residual stream between blocks
is split over tokens instead of replicated: the two all-reduces become
reduce-scatters, and an all-gather before attention/MLP rebuilds the full
token set. Same math, less replicated norm work, and every one of the three
traceable collectives appears in the model.

The forward is a pure function of tensors (token ids, positions, attention
metadata, KV cache tensors), so it compiles with
``torch.compile(fullgraph=True, dynamic=True)`` into one graph per stage.
Pipeline communication and the KV-cache bookkeeping live in
:class:`~coordinator.engine.models.runner.ModelRunner`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from coordinator.engine.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    tp_all_gather,
)
from coordinator.engine.layers.weights import TPGroup, tp_size_and_rank, weight_loader_of
from coordinator.engine.models import attention as _attention  # noqa: F401  (registers the op)
from coordinator.engine.models.config import LlamaModelConfig, stage_layer_ranges
from coordinator.engine.models.kv_cache import AttentionInputs, KVCache

__all__ = ["LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer", "partition_layers"]

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
# checkpoint name fragment -> (our parameter fragment, shard id)
_STACKED = (
    (".self_attn.q_proj.", ".self_attn.qkv_proj.", "q"),
    (".self_attn.k_proj.", ".self_attn.qkv_proj.", "k"),
    (".self_attn.v_proj.", ".self_attn.qkv_proj.", "v"),
    (".mlp.gate_proj.", ".mlp.gate_up_proj.", 0),
    (".mlp.up_proj.", ".mlp.gate_up_proj.", 1),
)


def partition_layers(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` layer ranges of the ``pp_size`` pipeline stages: vLLM's
    ``get_pp_indices`` split (:func:`coordinator.get_pp_indices`).

    Raises:
        ValueError: Fewer layers than stages (vLLM would leave stages empty), or
            ``VLLM_PP_LAYER_PARTITION`` gives a stage no layers (naming it).
    """
    if not isinstance(pp_size, int) or isinstance(pp_size, bool) or pp_size <= 0:
        raise ValueError(f"pipeline-parallel size must be a positive int, got {pp_size!r}")
    if num_layers < pp_size:
        raise ValueError(
            f"cannot split {num_layers} layers over {pp_size} pipeline stages "
            f"(num_hidden_layers={num_layers}, pp_size={pp_size}); use a "
            f"pipeline-parallel size <= num_hidden_layers")
    return stage_layer_ranges(num_layers, pp_size)


def _sp_pad(num_tokens: int, tp: int) -> int:
    return (-num_tokens) % tp


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with rotary embeddings, split over heads."""

    def __init__(
        self,
        c: LlamaModelConfig,
        tp_group: TPGroup | None,
        dtype: torch.dtype,
        sp: bool,
        prefix: str,
    ) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            c.hidden_size,
            c.head_dim,
            c.num_attention_heads,
            c.num_key_value_heads,
            bias=c.attention_bias,
            tp_group=tp_group,
            params_dtype=dtype,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            c.num_attention_heads * c.head_dim,
            c.hidden_size,
            bias=c.attention_bias,
            reduce_scatter=sp,
            tp_group=tp_group,
            params_dtype=dtype,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = RotaryEmbedding(
            c.head_dim, c.rope_theta, c.rope_type, c.rope_params, c.max_position_embeddings
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = c.head_dim
        self.scale = c.head_dim**-0.5
        self.sp = sp
        self.tp_size = self.qkv_proj.tp_size

    def forward(
        self, x: torch.Tensor, attn: AttentionInputs, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(x))
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(attn.positions, q, k, attn.seq_lens)
        o = torch.ops.groupcoord.paged_attention(
            q,
            k,
            v,
            kv_cache,
            attn.slot_mapping,
            attn.query_start_loc,
            attn.context_slots,
            attn.context_start_loc,
            self.scale,
        )
        o = o.reshape(t, self.num_heads * self.head_dim)
        if self.sp:
            o = F.pad(o, (0, 0, 0, _sp_pad(t, self.tp_size)))
        out: torch.Tensor = self.o_proj(o)
        return out


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(
        self,
        c: LlamaModelConfig,
        tp_group: TPGroup | None,
        dtype: torch.dtype,
        sp: bool,
        prefix: str,
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            c.hidden_size,
            [c.intermediate_size] * 2,
            bias=c.mlp_bias,
            tp_group=tp_group,
            params_dtype=dtype,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            c.intermediate_size,
            c.hidden_size,
            bias=c.mlp_bias,
            reduce_scatter=sp,
            tp_group=tp_group,
            params_dtype=dtype,
            prefix=f"{prefix}.down_proj",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return out


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block followed by a pre-norm SwiGLU block."""

    def __init__(
        self,
        c: LlamaModelConfig,
        tp_group: TPGroup | None,
        dtype: torch.dtype,
        sp: bool,
        prefix: str,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.sp = sp
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(c, tp_group, dtype, sp, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp: nn.Module = LlamaMLP(c, tp_group, dtype, sp, f"{prefix}.mlp")

    def forward(
        self, x: torch.Tensor, attn: AttentionInputs, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """``x``: ``[T, H]``, or with sequence parallelism this rank's ``[ceil(T/tp), H]`` slice."""
        h: torch.Tensor = self.input_layernorm(x)
        if self.sp:
            h = tp_all_gather(self.tp_group, h, 0)[: attn.positions.shape[0]]
        h = x + self.self_attn(h, attn, kv_cache)
        m = self.post_attention_layernorm(h)
        if self.sp:
            m = tp_all_gather(self.tp_group, m, 0)
        out: torch.Tensor = h + self.mlp(m)
        return out


class LlamaModel(nn.Module):
    """Embedding (first stage), this stage's decoder layers, final norm (last stage).

    Layers of other stages are ``nn.Identity`` placeholders so parameter
    names keep the global layer index (``layers.7.mlp...``).
    """

    def __init__(
        self,
        config: LlamaModelConfig,
        tp_group: TPGroup | None,
        pp_rank: int,
        pp_size: int,
        dtype: torch.dtype,
        sequence_parallel: bool,
    ) -> None:
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = tp_size_and_rank(tp_group)
        self.sp = sequence_parallel and self.tp_size > 1
        self.is_first = pp_rank == 0
        self.is_last = pp_rank == pp_size - 1
        self.start_layer, self.end_layer = partition_layers(config.num_hidden_layers, pp_size)[
            pp_rank
        ]
        if self.is_first:
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size,
                config.hidden_size,
                tp_group,
                dtype,
                reduce_scatter=self.sp,
                prefix="model.embed_tokens",
            )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, tp_group, dtype, self.sp, f"model.layers.{i}")
            if self.start_layer <= i < self.end_layer
            else nn.Identity()
            for i in range(config.num_hidden_layers)
        )
        if self.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        attn: AttentionInputs,
        kv_caches: list[torch.Tensor],
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run this stage: ids (first stage) or the previous stage's hidden states in."""
        if self.is_first:
            if input_ids is None:
                raise ValueError("the first pipeline stage needs input_ids")
            ids = (
                F.pad(input_ids, (0, _sp_pad(input_ids.shape[0], self.tp_size)))
                if self.sp
                else input_ids
            )
            h: torch.Tensor = self.embed_tokens(ids)
        else:
            if hidden_states is None:
                raise ValueError("a later pipeline stage needs the previous stage's hidden_states")
            h = hidden_states
        for i in range(self.start_layer, self.end_layer):
            h = self.layers[i](h, attn, kv_caches[i - self.start_layer])
        if self.is_last:
            h = self.norm(h)
            if self.sp:
                h = tp_all_gather(self.tp_group, h, 0)[: attn.positions.shape[0]]
        return h


class LlamaForCausalLM(nn.Module):
    """One rank's shard of a Llama causal LM (the whole model when unsharded).

    Args:
        config: Architecture.
        tp_group: Tensor-parallel group (``world_size``, ``rank_in_group``,
            collectives), or ``None`` for no tensor parallelism.
        pp_group: Pipeline-parallel group (only its ``world_size`` and
            ``rank_in_group`` are used here), or ``None``.
        dtype: Parameter and activation dtype.
        sequence_parallel: Split the residual stream over tokens within the
            TP group (reduce-scatter/all-gather instead of all-reduce).
    """

    def __init__(
        self,
        config: LlamaModelConfig,
        tp_group: TPGroup | None = None,
        pp_group: Any | None = None,
        dtype: torch.dtype = torch.float32,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(config, LlamaModelConfig):
            raise TypeError(f"config must be a LlamaModelConfig, got {type(config).__name__}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.config = config
        self.dtype = dtype
        self.tp_group = tp_group
        self.pp_group = pp_group
        self.pp_size, self.pp_rank = tp_size_and_rank(pp_group)
        config.check_parallel(tp_size_and_rank(tp_group)[0], self.pp_size)
        self.model = LlamaModel(
            config, tp_group, self.pp_rank, self.pp_size, dtype, sequence_parallel
        )
        self.is_first_stage = self.model.is_first
        self.is_last_stage = self.model.is_last
        if self.is_last_stage:
            self.lm_head = ParallelLMHead(
                config.vocab_size,
                config.hidden_size,
                tp_group=tp_group,
                params_dtype=dtype,
                prefix="lm_head",
            )
            if config.tie_word_embeddings and self.is_first_stage:
                self.lm_head.tie_to(self.model.embed_tokens)

    # ------------------------------------------------------------------ shapes
    @property
    def num_local_layers(self) -> int:
        """Decoder layers held by this stage."""
        return self.model.end_layer - self.model.start_layer

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads held by this TP rank."""
        tp, _ = tp_size_and_rank(self.tp_group)
        kv = self.config.num_key_value_heads
        return kv // tp if kv >= tp else 1

    def make_kv_cache(self, num_blocks: int, block_size: int = 16) -> KVCache:
        """A KV cache sized for this shard's layers and heads."""
        return KVCache(
            self.num_local_layers,
            self.num_local_kv_heads,
            self.config.head_dim,
            num_blocks,
            block_size,
            self.dtype,
        )

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor | None,
        attn: AttentionInputs,
        kv_caches: list[torch.Tensor],
        hidden_states: torch.Tensor | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Run this rank's shard for one step.

        Args:
            input_ids: ``[T]`` token ids (first stage; ignored elsewhere).
            attn: Attention metadata of the step.
            kv_caches: This stage's KV cache tensors, one per local layer.
            hidden_states: The previous stage's output (later stages).
            all_logits: Return logits of every token, not only each request's last.

        Returns:
            On the last stage, logits ``[R, vocab]`` (``[T, vocab]`` with
            ``all_logits``); elsewhere the hidden states to send on.
        """
        h: torch.Tensor = self.model(input_ids, attn, kv_caches, hidden_states)
        if not self.is_last_stage:
            return h
        if not all_logits:
            h = h.index_select(0, attn.logits_indices)
        logits: torch.Tensor = self.lm_head(h)
        return logits

    # ------------------------------------------------------------------ weights
    def _layer_of(self, name: str) -> int | None:
        m = _LAYER_RE.match(name)
        return int(m.group(1)) if m else None

    def wants(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` is needed by this stage."""
        layer = self._layer_of(name)
        if layer is not None:
            return (
                self.model.start_layer <= layer < self.model.end_layer and "rotary_emb" not in name
            )
        if name.startswith("model.embed_tokens."):
            return self.is_first_stage or (self.is_last_stage and self.config.tie_word_embeddings)
        if name.startswith("model.norm.") or name.startswith("lm_head."):
            return self.is_last_stage and not (
                name.startswith("lm_head.") and self.config.tie_word_embeddings
            )
        return False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named full tensors, keeping this rank's shards.

        Tensors this stage does not need are skipped; unknown names are an
        error (a checkpoint of another architecture), and so is any local
        parameter left unloaded.

        Raises:
            ValueError: Unknown tensor, shape mismatch, or missing parameters.
        """
        params = dict(
            self.named_parameters()
        )  # a tied head on the embedding's stage is deduplicated
        loaded: set[str] = set()
        for name, tensor in weights:
            if not self.wants(name):
                if not self._known(name):
                    raise ValueError(f"checkpoint tensor {name!r} is not a Llama parameter")
                continue
            target, shard = self._target(name)
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter {target!r}")
            loader = weight_loader_of(param)
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(target if shard is None else f"{target}#{shard}")
        missing = sorted(self._expected_loads(params) - loaded)
        if missing:
            raise ValueError(
                f"checkpoint lacks {len(missing)} tensor(s) this rank needs: {missing[:8]}"
            )

    def _target(self, name: str) -> tuple[str, str | int | None]:
        """Our parameter name and shard id for checkpoint tensor ``name``."""
        for frag, ours, shard in _STACKED:
            if frag in name:
                return name.replace(frag, ours), shard
        if name.startswith("model.embed_tokens.") and not self.is_first_stage:
            return name.replace(
                "model.embed_tokens.", "lm_head."
            ), None  # tied head on a later stage
        return name, None

    def _known(self, name: str) -> bool:
        if "rotary_emb" in name:
            return True
        return (
            name.startswith(("model.embed_tokens.", "model.norm.", "lm_head."))
            or self._layer_of(name) is not None
        )

    def _expected_loads(self, params: dict[str, nn.Parameter]) -> set[str]:
        out: set[str] = set()
        for pname in params:
            if ".qkv_proj." in pname:
                out.update(f"{pname}#{s}" for s in ("q", "k", "v"))
            elif ".gate_up_proj." in pname:
                out.update(f"{pname}#{s}" for s in (0, 1))
            else:
                out.add(pname)
        return out

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | os.PathLike[str],
        tp_group: TPGroup | None = None,
        pp_group: Any | None = None,
        dtype: torch.dtype | str | None = None,
        sequence_parallel: bool = False,
    ) -> LlamaForCausalLM:
        """Build this rank's shard from a Hugging Face checkpoint directory.

        The default compute dtype is float32 whatever the checkpoint's
        ``torch_dtype``: bf16/fp16 weights are upcast exactly, so the result is
        Hugging Face's float32 forward of the same weights, and TP/PP sharding
        changes the logits only by float32 rounding (greedy ids stay identical
        on random tiny models). ``dtype="auto"`` computes in the checkpoint
        dtype instead (vLLM's default; closer to ``transformers`` loaded with
        its default ``dtype="auto"``, but sharding then moves logits by bf16/fp16
        rounding, enough to flip near-tied greedy choices).

        Args:
            model_dir: Directory with ``config.json`` and ``*.safetensors``.
            tp_group: Tensor-parallel group or ``None``.
            pp_group: Pipeline-parallel group or ``None``.
            dtype: Compute dtype: ``None`` (float32), ``"auto"``, a name or a ``torch.dtype``.
            sequence_parallel: See the class docstring.
        """
        from coordinator.engine.models.checkpoint import iter_checkpoint
        from coordinator.engine.models.config import resolve_dtype

        config = LlamaModelConfig.from_json(model_dir)
        model = cls(config, tp_group, pp_group, resolve_dtype(dtype, config), sequence_parallel)
        model.load_weights(
            iter_checkpoint(model_dir, lambda n: model.wants(n) or not model._known(n))
        )
        return model.eval()

    @classmethod
    def from_seed(
        cls,
        config: LlamaModelConfig | None = None,
        seed: int = 0,
        tp_group: TPGroup | None = None,
        pp_group: Any | None = None,
        dtype: torch.dtype = torch.float32,
        sequence_parallel: bool = False,
    ) -> LlamaForCausalLM:
        """Build this rank's shard of a random model (``default_config()`` unless given).

        Every rank draws the same full weights from ``seed`` and keeps its shard.
        """
        from coordinator.engine.models.checkpoint import random_state_dict
        from coordinator.engine.models.config import default_config

        config = config or default_config()
        model = cls(config, tp_group, pp_group, dtype, sequence_parallel)
        model.load_weights(random_state_dict(config, seed).items())
        return model.eval()

"""Configuration of a Llama-architecture decoder, read from a Hugging Face ``config.json``.

Only what the model needs is kept, validated once, with errors naming the
field. Both config dialects are understood: the older top-level
``rope_theta`` + ``rope_scaling`` and the newer ``rope_parameters`` dict.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import torch

from coordinator.engine.layers.rotary import SUPPORTED_ROPE_TYPES

__all__ = ["LlamaModelConfig", "default_config", "DTYPES", "resolve_dtype", "read_json",
           "read_hf_config"]


DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}

_ARCH_TYPES = ("llama",)


@dataclasses.dataclass(frozen=True)
class LlamaModelConfig:
    """Architecture of a Llama decoder (field names follow Hugging Face's ``LlamaConfig``).

    Attributes:
        vocab_size: Vocabulary size.
        hidden_size: Model width.
        intermediate_size: SwiGLU inner width.
        num_hidden_layers: Decoder layers.
        num_attention_heads: Query heads.
        num_key_value_heads: Key/value heads (grouped-query attention).
        head_dim: Features per head.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base.
        rope_type: ``default``, ``linear`` or ``llama3``.
        rope_params: Extra parameters of the RoPE variant.
        max_position_embeddings: Longest supported sequence.
        tie_word_embeddings: The LM head reuses the embedding matrix.
        attention_bias: q/k/v/o projections have biases.
        mlp_bias: gate/up/down projections have biases.
        bos_token_id: Beginning-of-sequence id (informational).
        eos_token_ids: End-of-sequence ids; generation stops on any of them.
        dtype: Checkpoint dtype name (``float32``, ``bfloat16``...).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config field {name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary embeddings), got {self.head_dim}")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {self.rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    # ------------------------------------------------------------------ HF dialect
    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> LlamaModelConfig:
        """Build from a parsed Hugging Face ``config.json``.

        Raises:
            ValueError: Not a Llama config, an unsupported activation or RoPE
                type, or a missing/invalid field.
        """
        if not isinstance(d, Mapping):
            raise TypeError(f"config must be a mapping, got {type(d).__name__}")
        model_type = d.get("model_type", "llama")
        if model_type not in _ARCH_TYPES:
            raise ValueError(f"model_type must be one of {_ARCH_TYPES}, got {model_type!r}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act must be 'silu' (SwiGLU), got {act!r}")
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            if key not in d:
                raise ValueError(f"config.json lacks required field {key!r}")
        # checked before use (a division, float(), int()), so a bad value is named here
        for key in ("hidden_size", "num_attention_heads"):
            _positive_int_field(key, d[key])
        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        rope_type, theta, params = _parse_rope(d)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        for e in eos_ids:
            if not is_int(e) or e < 0:
                raise ValueError(f"config field eos_token_id must be a token id (an int >= 0), "
                                 f"a list of them or null, got {eos!r}")
        bos = d.get("bos_token_id")
        if bos is not None and (not is_int(bos) or bos < 0):
            raise ValueError(f"config field bos_token_id must be a token id (an int >= 0) or "
                             f"null, got {bos!r}")
        dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_positive_number_field("rms_norm_eps", d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_type=rope_type,
            rope_params=params,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool_field(d, "tie_word_embeddings"),
            attention_bias=bool_field(d, "attention_bias"),
            mlp_bias=bool_field(d, "mlp_bias"),
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            dtype=str(dtype),
        )

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> LlamaModelConfig:
        """Read ``path`` (a ``config.json`` file or the directory holding one); see
        :func:`read_hf_config`."""
        return cls.from_hf_dict(read_hf_config(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """A Hugging Face style ``config.json`` dict describing this architecture."""
        rope: dict[str, Any] = {
            "rope_type": self.rope_type,
            "rope_theta": self.rope_theta,
            **self.rope_params,
        }
        eos: Any = (
            list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0]
        )
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "rope_scaling": None if self.rope_type == "default" else dict(rope),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos if self.eos_token_ids else None,
            "torch_dtype": self.dtype,
        }

    def check_parallel(self, tp: int, pp: int) -> None:
        """Check that this model can be sharded over ``tp`` x ``pp`` ranks.

        The rules follow vLLM: query heads, ``intermediate_size`` and (when
        there are at least ``tp`` of them) KV heads split evenly over the
        tensor-parallel ranks; with fewer KV heads than ``tp`` each KV head is
        replicated on ``tp / num_key_value_heads`` ranks, so that must divide.
        The vocabulary is padded, so any ``vocab_size`` works. Every pipeline
        stage needs at least one decoder layer (vLLM would create empty
        stages; here that is refused as a wasted process).

        Raises:
            TypeError: ``tp`` or ``pp`` is not an int.
            ValueError: A size the model cannot be split by, naming the field; or
                ``VLLM_PP_LAYER_PARTITION`` gives a stage no layers (naming the stage).
        """
        for name, value in (("tensor-parallel size (tp)", tp), ("pipeline-parallel size (pp)", pp)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads % tp:
            raise ValueError(
                f"num_attention_heads ({heads}) must be divisible by the tensor-parallel size "
                f"(tp={tp}); use a tp that divides {heads}"
            )
        if kv >= tp and kv % tp:
            raise ValueError(
                f"num_key_value_heads ({kv}) must be divisible by the tensor-parallel size "
                f"(tp={tp}) when it is >= tp"
            )
        if kv < tp and tp % kv:
            raise ValueError(
                f"num_key_value_heads ({kv}) is smaller than the tensor-parallel size (tp={tp}) "
                f"and does not divide it, so KV heads cannot be replicated evenly"
            )
        if self.intermediate_size % tp:
            raise ValueError(
                f"intermediate_size ({self.intermediate_size}) must be divisible by the "
                f"tensor-parallel size (tp={tp})"
            )
        if pp > self.num_hidden_layers:
            raise ValueError(
                f"cannot split {self.num_hidden_layers} layers over {pp} pipeline stages: the "
                f"pipeline-parallel size (pp={pp}) must be <= num_hidden_layers "
                f"({self.num_hidden_layers})"
            )
        stage_layer_ranges(self.num_hidden_layers, pp)  # VLLM_PP_LAYER_PARTITION, if set

    @property
    def torch_dtype(self) -> torch.dtype:
        """The checkpoint dtype as a ``torch.dtype``."""
        return DTYPES[self.dtype]


#: The variable vLLM reads a pipeline's layer split from (``get_pp_indices`` reads it).
_PARTITION_VAR = "VLLM_PP_LAYER_PARTITION"


def stage_layer_ranges(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` layers of each of ``pp_size`` stages (:func:`coordinator.get_pp_indices`,
    so ``VLLM_PP_LAYER_PARTITION`` when set), every stage at least one.

    Raises:
        ValueError: ``VLLM_PP_LAYER_PARTITION`` gives a stage no layers, or is
            malformed (named).
    """
    from coordinator import get_pp_indices

    ranges = [get_pp_indices(num_layers, stage, pp_size) for stage in range(pp_size)]
    for stage, (start, end) in enumerate(ranges):
        if start == end:
            raise ValueError(
                f"{_PARTITION_VAR}={os.environ.get(_PARTITION_VAR, '')!r} gives pipeline stage "
                f"{stage} no layers; every stage needs at least one decoder layer (layer "
                f"counts >= 1 summing to num_hidden_layers={num_layers})")
    return ranges


def read_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed ``config.json`` at ``path`` (the file, or the directory holding it).

    When a ``generation_config.json`` sits next to it and names an
    ``eos_token_id``, that one wins: it is what ``transformers``' ``generate``
    stops on.

    Raises:
        ValueError: No ``config.json`` there, or it is not a JSON object.
    """
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    data = read_json(p, required=True)
    if not isinstance(data, Mapping):
        raise ValueError(f"{p} must hold a JSON object, got {type(data).__name__}")
    gen = read_json(os.path.join(os.path.dirname(p), "generation_config.json"), False)
    if isinstance(gen, Mapping) and gen.get("eos_token_id") is not None:
        return {**data, "eos_token_id": gen["eos_token_id"]}
    return dict(data)


def read_json(path: str, required: bool) -> Any:
    """Parsed JSON at ``path``; ``None`` when absent and not ``required``."""
    if not os.path.isfile(path):
        if not required:
            return None
        raise ValueError(f"no config.json at {path!r}; expected a Hugging Face model directory")
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e


def resolve_dtype(dtype: torch.dtype | str | None, config: LlamaModelConfig) -> torch.dtype:
    """The compute dtype for ``dtype``: ``None``/``"float32"`` -> float32 (the default),
    ``"auto"`` -> the checkpoint's dtype, a name from :data:`DTYPES`, or a floating ``torch.dtype``.

    Raises:
        ValueError: An unknown name.
        TypeError: Neither a string, ``None`` nor a floating ``torch.dtype``.
    """
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        if dtype == "auto":
            return config.torch_dtype
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    raise TypeError(f"dtype must be a floating torch.dtype, a name or 'auto', got {dtype!r}")


def is_int(value: Any) -> bool:
    """Whether ``value`` is an int and not a bool (JSON's true is no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int_field(name: str, value: Any) -> int:
    """``value`` of config field ``name``, which must be an int > 0."""
    if not is_int(value) or value <= 0:
        raise ValueError(f"config field {name} must be a positive int, got {value!r}")
    return int(value)


def count_field(d: Mapping[str, Any], name: str, default: int) -> int:
    """Config field ``name`` of ``d``: an int >= 0 (absent or null: ``default``)."""
    value = d.get(name)
    if value is None:
        return default
    if not is_int(value) or value < 0:
        raise ValueError(f"config field {name} must be an int >= 0 or null, got {value!r}")
    return int(value)


def _positive_number_field(name: str, value: Any) -> float:
    """``value`` of config field ``name`` as a float; it must be a finite number > 0."""
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not math.isfinite(value) or value <= 0):
        raise ValueError(f"config field {name} must be a positive number, got {value!r}")
    return float(value)


def bool_field(d: Mapping[str, Any], name: str, default: bool = False) -> bool:
    """Config field ``name`` of ``d``: true/false (absent or null: ``default``). Not
    ``bool()`` of anything else: ``bool("false")`` is True."""
    value = d.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"config field {name} must be true, false or null, got {value!r}")
    return value


def _parse_rope(d: Mapping[str, Any]) -> tuple[str, float, dict[str, Any]]:
    """``(rope_type, theta, extra params)`` from either config dialect."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"rope_parameters/rope_scaling must be a dict or null, got {params!r}")
    if params and all(isinstance(v, Mapping) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported for Llama models")
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    extra = {k: v for k, v in params.items() if k not in ("rope_type", "type", "rope_theta")}
    if rope_type == "llama3":
        extra.setdefault("original_max_position_embeddings", d.get("max_position_embeddings", 2048))
    if rope_type in ("linear", "dynamic", "llama3"):
        factor = extra.get("factor")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
            raise ValueError(
                f"rope_scaling of type {rope_type!r} needs a positive numeric 'factor', "
                f"got {factor!r}"
            )
    return str(rope_type), _positive_number_field("rope_theta", theta), extra


def default_config() -> LlamaModelConfig:
    """The embedded demo model: small enough for a CPU, big enough to be a real decoder.

    4 layers, width 256, 8 query heads sharing 4 KV heads, vocabulary 512
    (weights come from :func:`coordinator.engine.models.checkpoint.random_state_dict`).
    """
    return LlamaModelConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_ids=(),
    )

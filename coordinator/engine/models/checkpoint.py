"""Hugging Face Llama checkpoints: read, write, and the seeded random default.

A checkpoint directory holds ``config.json`` and one or more ``*.safetensors``
files whose tensors carry Hugging Face parameter names
(``model.layers.3.self_attn.q_proj.weight`` ...). Reading is lazy: callers pass
a predicate and only the tensors it accepts are read from disk, so a pipeline
stage never loads the other stages' layers.

:func:`random_state_dict` builds the full weights of a model from a seed with a
private generator, in a fixed order, so every rank of a job builds the same
tensors and then keeps its own shard.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator, Mapping

import torch

from coordinator.engine.models.config import LlamaModelConfig

__all__ = [
    "checkpoint_files",
    "iter_checkpoint",
    "save_checkpoint",
    "random_state_dict",
    "random_weights",
    "hf_parameter_shapes",
]


def checkpoint_files(model_dir: str | os.PathLike[str]) -> list[str]:
    """The ``*.safetensors`` files of ``model_dir``, sorted.

    Raises:
        ValueError: ``model_dir`` is not a directory or holds no safetensors file.
    """
    d = os.fspath(model_dir)
    if not os.path.isdir(d):
        raise ValueError(
            f"model_dir must be a directory with config.json and *.safetensors, got {d!r}"
        )
    files = sorted(glob.glob(os.path.join(d, "*.safetensors")))
    if not files:
        other = sorted(os.path.basename(p) for p in glob.glob(os.path.join(d, "*.bin")))
        hint = (
            f" (found {other}: convert them with save_pretrained(safe_serialization=True))"
            if other
            else ""
        )
        raise ValueError(f"no *.safetensors file in {d!r}{hint}")
    return files


def iter_checkpoint(
    model_dir: str | os.PathLike[str], want: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every checkpoint tensor ``want(name)`` accepts.

    Tensors are read one at a time, on the CPU, in their stored dtype.
    """
    from safetensors import safe_open

    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if want is None or want(name):
                    yield name, f.get_tensor(name)


def hf_parameter_shapes(config: LlamaModelConfig) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of every ``LlamaForCausalLM`` parameter, in a fixed order."""
    c = config
    h, hd = c.hidden_size, c.head_dim
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[p + f"self_attn.{name}.weight"] = (rows, h)
            if c.attention_bias:
                shapes[p + f"self_attn.{name}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if c.attention_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for name, shape in (
            ("gate_proj", (c.intermediate_size, h)),
            ("up_proj", (c.intermediate_size, h)),
            ("down_proj", (h, c.intermediate_size)),
        ):
            shapes[p + f"mlp.{name}.weight"] = shape
            if c.mlp_bias:
                shapes[p + f"mlp.{name}.bias"] = (shape[0],)
    shapes["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes


def random_state_dict(config: LlamaModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full float32 weights for ``config`` drawn from ``seed`` (identical on every call).

    Matrices are scaled by ``1/sqrt(fan_in)`` so activations stay O(1) and
    logits are well separated (greedy decoding is then insensitive to the
    rounding differences between sharded and unsharded runs); norm weights
    are ``1 + 0.1 * noise`` so a wrongly loaded norm shows up; biases are small.
    """
    return random_weights(hf_parameter_shapes(config), seed)


def random_weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Float32 weights of the named ``shapes`` from ``seed``, scaled as
    :func:`random_state_dict` says (by name: norms, biases, embeddings, matrices)."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=g, dtype=torch.float32)
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            out[name] = 0.02 * noise
        elif name == "model.embed_tokens.weight":
            out[name] = noise
        else:
            out[name] = noise / shape[1] ** 0.5
    return out


def save_checkpoint(
    model_dir: str | os.PathLike[str],
    config: LlamaModelConfig,
    state_dict: Mapping[str, torch.Tensor],
) -> None:
    """Write ``config.json`` and ``model.safetensors`` (Hugging Face layout) into ``model_dir``."""
    from safetensors.torch import save_file

    d = os.fspath(model_dir)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config.to_hf_dict(), f, indent=2)
    tensors = {
        k: v.detach().to(config.torch_dtype).contiguous().clone() for k, v in state_dict.items()
    }
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})

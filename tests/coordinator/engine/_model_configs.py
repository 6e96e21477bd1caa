"""Data of test_model_configs: tiny random HF Llama checkpoints of many shapes, and HF's
greedy ids and logits for them (the rank functions that serve them sharded are in
the test module).

Each case is a set of ``transformers.LlamaConfig`` overrides. The checkpoint is saved
in the case's dtype; the reference is Hugging Face's model run in float32 on exactly
the saved (rounded) weights, which is what our model computes (it upcasts to float32).
"""

from __future__ import annotations

from typing import Any

import torch

BASE: dict[str, Any] = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=None,
)

# prompt lengths 1, 2, 4, 13: a length-1 prefill, and several requests in one batch
PROMPTS: list[list[int]] = [[7], [88, 3], [5, 17, 42, 9],
                            [100, 7, 64, 21, 33, 2, 90, 11, 4, 58, 6, 77, 12]]
MAX_NEW: list[int] = [6, 1, 9, 5]  # max_new_tokens 1 included

CASES: dict[str, dict[str, Any]] = {
    # TP=4 family: 4 query heads
    "mqa_headdim": dict(num_key_value_heads=1, head_dim=24, vocab_size=161),
    "gqa2_bias_tied": dict(
        num_key_value_heads=2, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
        vocab_size=203,
    ),
    "kv4_llama3_bf16": dict(
        num_key_value_heads=4, rms_norm_eps=1e-2, torch_dtype="bfloat16",
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8),
        rope_theta=500000.0,
    ),
    "linear_fp16_eos": dict(
        num_key_value_heads=2, rope_scaling=dict(rope_type="linear", factor=4.0),
        rope_theta=1000.0, torch_dtype="float16", eos="auto",
    ),
    "dynamic_small_ctx": dict(
        num_key_value_heads=1, max_position_embeddings=8,
        rope_scaling=dict(rope_type="dynamic", factor=2.0),
    ),
    # pipeline family: more layers, uneven splits
    "layers3_tied": dict(num_hidden_layers=3, tie_word_embeddings=True, vocab_size=131),
    "layers5_bias": dict(num_hidden_layers=5, attention_bias=True, head_dim=8,
                         num_attention_heads=8, num_key_value_heads=2),

}


def _hf_config(overrides: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    ov = {k: v for k, v in overrides.items() if k not in ("torch_dtype", "eos")}
    return LlamaConfig(**{**BASE, **ov})


def _greedy(hf: Any, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for p, n in zip(prompts, max_new, strict=True):
            ids = torch.tensor([p])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              do_sample=False, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


def build_case(path: str, name: str, seed: int = 0) -> dict[str, Any]:
    """Save case ``name`` to ``path``; returns HF's greedy ids and full-sequence logits."""
    from transformers import LlamaForCausalLM as HFLlama

    overrides = CASES[name]
    torch.manual_seed(seed)
    hf = HFLlama(_hf_config(overrides)).eval()
    with torch.no_grad():  # larger than the default init, so greedy tokens vary
        for p in hf.parameters():
            p.normal_(0.0, 0.2)
        dtype = overrides.get("torch_dtype")
        if dtype:  # round to the checkpoint dtype, keep computing in float32
            for p in hf.parameters():
                p.copy_(p.to(getattr(torch, dtype)).float())
    max_new = list(MAX_NEW)
    eos = None
    if overrides.get("eos") == "auto":
        # an eos id that the longest generation meets early: generation must stop there
        free = _greedy(hf, PROMPTS, [12] * len(PROMPTS))
        eos = free[2][3]
        hf.config.eos_token_id = eos
        hf.generation_config.eos_token_id = eos
        max_new = [12] * len(PROMPTS)
    expected = _greedy(hf, PROMPTS, max_new)
    if eos is not None:
        assert any(len(e) < 12 for e in expected), "the eos id never ends a generation"
    seq = PROMPTS[3] + expected[3]
    with torch.no_grad():
        logits = hf(torch.tensor([seq])).logits[0]
    to_save = hf.to(getattr(torch, overrides["torch_dtype"])) if "torch_dtype" in overrides else hf
    to_save.save_pretrained(path, safe_serialization=True)
    return {"ids": expected, "max_new": max_new, "logits": logits, "seq": seq, "path": path}

"""The sharded Llama over the Llama config space, against Hugging Face ``transformers``.

Tiny random checkpoints of many shapes (MQA/GQA with TP > KV heads, explicit
head_dim, padded vocabularies, tied embeddings, biases, RoPE variants, bf16/fp16
checkpoints, eos, small max_position_embeddings) are served over real gloo
process groups at several TP x PP layouts; every rank must produce HF's greedy
ids and the last stage HF's logits. Several configs share one distributed run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.engine.models import LlamaForCausalLM, LlamaModelConfig, partition_layers
from tests.coordinator.engine._model_configs import CASES, PROMPTS, build_case

# The ranks import this module (for the functions at the bottom): look for
# transformers without importing it there.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="needs transformers")

LOGIT_ATOL = 2e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("model_configs")
    return {name: build_case(str(root / name), name, seed=i) for i, name in enumerate(CASES)}


def _check(results: list[list[dict[str, Any]]], names: list[str], ckpts: dict[str, Any],
           tp: int, pp: int) -> None:
    last_stage_ranks = range((pp - 1) * tp, pp * tp)
    for rank, per_rank in enumerate(results):
        for name, res in zip(names, per_rank, strict=True):
            exp = ckpts[name]
            assert res["ids"] == exp["ids"], (name, tp, pp, rank)
            if rank in last_stage_ranks:
                diff = (res["logits"] - exp["logits"]).abs().max().item()
                assert diff < LOGIT_ATOL, (name, tp, pp, rank, diff)
            else:
                assert res["logits"] is None


# ---------------------------------------------------------------------- sharded vs HF
TP4_CASES = ["mqa_headdim", "gqa2_bias_tied", "kv4_llama3_bf16", "linear_fp16_eos",
             "dynamic_small_ctx"]


@pytest.mark.timeout(300)
def test_tp4_gqa_mqa_rope_dtypes_match_hf(dist_pool: Any, checkpoints: dict[str, Any]) -> None:
    """TP=4 with 1, 2 and 4 KV heads (replicated when fewer than 4), head_dim 24,
    vocabularies 161/203 padded to 4, biases, tied head, llama3/linear/dynamic RoPE,
    bf16 and fp16 checkpoints, an eos id that stops generation."""
    cases = [(checkpoints[n]["path"], checkpoints[n]["max_new"], checkpoints[n]["seq"])
             for n in TP4_CASES]
    results = dist_pool(4).run(sharded_cases, 4, 1, cases, timeout=260)
    _check(results, TP4_CASES, checkpoints, 4, 1)


@pytest.mark.timeout(300)
def test_pipeline_layouts_match_hf(dist_pool: Any, checkpoints: dict[str, Any]) -> None:
    """Uneven pipeline splits (3 layers over 2 stages, 5 over 3 and over 4) and TP x PP."""
    layouts = [
        (2, 2, ["layers3_tied", "layers5_bias"]),
        (1, 4, ["layers5_bias"]),
    ]
    for tp, pp, names in layouts:
        cases = [(checkpoints[n]["path"], checkpoints[n]["max_new"], checkpoints[n]["seq"])
                 for n in names]
        results = dist_pool(tp * pp).run(sharded_cases, tp, pp, cases, timeout=260)
        _check(results, names, checkpoints, tp, pp)
        if (tp, pp) == (1, 4):  # vLLM's split: the extra layer goes to the second-to-last stage
            assert [r[0]["layers"] for r in results] == [(0, 1), (1, 2), (2, 4), (4, 5)]
    cases = [(checkpoints["layers5_bias"]["path"], checkpoints["layers5_bias"]["max_new"],
              checkpoints["layers5_bias"]["seq"])]
    results = dist_pool(3).run(sharded_cases, 1, 3, cases, timeout=260)
    _check(results, ["layers5_bias"], checkpoints, 1, 3)
    assert [r[0]["layers"] for r in results] == [(0, 2), (2, 4), (4, 5)]


@pytest.mark.timeout(200)
def test_unshardable_layouts_raise_clear_errors(
    dist_pool: Any, checkpoints: dict[str, Any]
) -> None:
    """Inside real ranks: pp > num_hidden_layers, heads or KV heads not splittable."""
    two_layers = checkpoints["mqa_headdim"]["path"]  # 2 layers, 4 heads, 1 KV head
    msgs = dist_pool(4).run(sharded_error, 1, 4, two_layers, timeout=120)
    assert all("cannot split 2 layers over 4 pipeline stages" in m and "pp=4" in m for m in msgs)
    msgs = dist_pool(3).run(sharded_error, 3, 1, two_layers, timeout=120)
    assert all("num_attention_heads (4)" in m and "tp=3" in m for m in msgs), msgs


def test_parallel_config_checks() -> None:
    cfg = LlamaModelConfig(vocab_size=100, hidden_size=48, intermediate_size=90,
                           num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3,
                           head_dim=8)
    cfg.check_parallel(3, 3)
    cfg.check_parallel(6, 1)  # 3 KV heads, each replicated on 2 of 6 ranks
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\).*tp=4"):
        cfg.check_parallel(4, 1)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\).*tp=2"):
        cfg.check_parallel(2, 1)
    with pytest.raises(ValueError, match=r"cannot split 3 layers over 4.*pp=4"):
        cfg.check_parallel(1, 4)
    with pytest.raises(ValueError, match=r"tp.*>= 1, got 0"):
        cfg.check_parallel(0, 1)
    with pytest.raises(TypeError, match=r"pipeline-parallel size \(pp\) must be an int"):
        cfg.check_parallel(1, 2.0)  # type: ignore[arg-type]
    odd_ffn = LlamaModelConfig(vocab_size=100, hidden_size=32, intermediate_size=50,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                               head_dim=8)
    with pytest.raises(ValueError, match=r"intermediate_size \(50\).*tp=4"):
        odd_ffn.check_parallel(4, 1)
    with pytest.raises(ValueError, match=r"intermediate_size \(50\)"):
        LlamaForCausalLM(odd_ffn, tp_group=_FakeSize(4))
    # vLLM's get_pp_indices split
    assert partition_layers(6, 4) == [(0, 1), (1, 3), (3, 5), (5, 6)]
    assert partition_layers(7, 4) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert partition_layers(3, 2) == [(0, 2), (2, 3)]


class _FakeSize:
    """Only the size of a group: construction fails before any collective is used."""

    world_size = 4
    rank_in_group = 0
    unique_name = "size-only"

    def __init__(self, n: int) -> None:
        self.world_size = n


def test_rope_config_errors() -> None:
    base = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    for bad in ("yarn", "longrope", "su"):
        with pytest.raises(ValueError, match=f"rope type '{bad}' is not supported.*dynamic"):
            LlamaModelConfig.from_hf_dict(
                {**base, "rope_scaling": {"rope_type": bad, "factor": 2.0}})

    with pytest.raises(ValueError, match="'linear' needs a positive numeric 'factor'"):
        LlamaModelConfig.from_hf_dict({**base, "rope_scaling": {"type": "linear"}})
    cfg = LlamaModelConfig.from_hf_dict(
        {**base, "max_position_embeddings": 8, "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    )
    assert cfg.rope_type == "dynamic" and cfg.rope_params == {"factor": 2.0}


def test_dynamic_rope_matches_hf_frequencies() -> None:
    """Our per-token dynamic NTK frequencies equal HF's for lengths below/at/above the limit."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from coordinator.engine.layers import RotaryEmbedding

    hf_cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=8,
                         rope_scaling={"rope_type": "dynamic", "factor": 3.0}, rope_theta=1000.0)
    ours = RotaryEmbedding(16, 1000.0, "dynamic", {"factor": 3.0}, 8)
    x = torch.zeros(1, 1, 16)
    for length in (3, 8, 9, 30):
        hf = LlamaRotaryEmbedding(hf_cfg)  # fresh: HF's module keeps the longest length seen
        pos = torch.arange(length)
        hf_cos, hf_sin = hf(x, pos[None])
        cos, sin = ours.cos_sin(pos, torch.float32, torch.full((length,), length))
        # HF's operation order changes between releases (a last-bit difference);
        # a wrong frequency or scaling rule is off by far more than 1e-6.
        torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        RotaryEmbedding(16, 1000.0, "dynamic", {"factor": 3.0})


# ---------------------------------------------------------------------- the real CLI
def _cli_argv(ckpt: str, tp: int, pp: int, max_new: int, *extra: str) -> list[str]:
    """``groupcoord demo ...`` arguments for ``ckpt`` over TP x PP."""
    prompt_ids = ";".join(",".join(map(str, p)) for p in PROMPTS)
    return ["demo", "--tp", str(tp), "--pp", str(pp), "--model-dir", ckpt,
            "--prompt-ids", prompt_ids, "--max-new-tokens", str(max_new), "--no-progress",
            "--timeout", "200", *extra]


def _cli(tmp_path: Path, ckpt: str, tp: int, pp: int, max_new: int, *extra: str
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coordinator", *_cli_argv(ckpt, tp, pp, max_new, *extra)],
        capture_output=True, text=True, timeout=240,
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_tp2_pp2_bf16_gqa_tied_matches_hf(tmp_path: Path, checkpoints: dict[str, Any]
                                             ) -> None:
    """The real CLI on a bf16, llama3-RoPE, 4-KV-head checkpoint over TP=2 x PP=2."""
    exp = checkpoints["kv4_llama3_bf16"]
    out = tmp_path / "demo.json"
    proc = _cli(tmp_path, exp["path"], 2, 2, 5, "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    ids = [e[:5] for e in exp["ids"]]  # the CLI uses one max_new_tokens for all prompts
    # (only prefixes can be compared where HF generated fewer tokens)
    for got, want, n in zip(report["generated"], ids, exp["max_new"], strict=True):
        assert got[: min(n, 5)] == want[: min(n, 5)]
    assert report["verified"] and report["tokens_identical"]


@pytest.mark.timeout(120)
def test_cli_rejects_unshardable_layouts_before_starting(checkpoints: dict[str, Any],
                                                         run_cli: Any) -> None:
    """In this process (``run_cli``): refused before any rank starts, so nothing
    starts here either; an exception other than the refusal would propagate."""
    ckpt = checkpoints["mqa_headdim"]["path"]  # 2 layers, 4 heads
    code, out, err = run_cli(_cli_argv(ckpt, 1, 3, 2))
    assert code == 2, out + err
    assert "cannot split 2 layers over 3 pipeline stages" in err
    assert "Traceback" not in err
    code, out, err = run_cli(_cli_argv(ckpt, 3, 1, 2))
    assert code == 2, out + err
    assert "num_attention_heads (4)" in err and "tp=3" in err


def test_dtype_choice_and_generation_config_eos(checkpoints: dict[str, Any], tmp_path: Path
                                                ) -> None:
    """float32 compute by default for a bf16 checkpoint; ``auto`` keeps bf16; bad names
    are refused; generation_config.json's eos (what HF generate uses) wins."""
    from coordinator.engine.models.config import resolve_dtype

    path = checkpoints["kv4_llama3_bf16"]["path"]
    cfg = LlamaModelConfig.from_json(path)
    assert cfg.dtype == "bfloat16"
    assert LlamaForCausalLM.from_pretrained(path).lm_head.weight.dtype == torch.float32
    auto = LlamaForCausalLM.from_pretrained(path, dtype="auto")
    assert auto.lm_head.weight.dtype == torch.bfloat16
    assert auto.make_kv_cache(2, 4).layers[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        resolve_dtype("fp8", cfg)
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        resolve_dtype(torch.int32, cfg)  # type: ignore[arg-type]
    eos_path = Path(checkpoints["linear_fp16_eos"]["path"])
    eos = checkpoints["linear_fp16_eos"]["ids"]
    assert LlamaModelConfig.from_json(eos_path).eos_token_ids != ()
    (tmp_path / "config.json").write_text((eos_path / "config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    assert LlamaModelConfig.from_json(tmp_path).eos_token_ids == (3, 4)
    assert any(len(e) < 12 for e in eos)


# ---------------------------------------------------------------------- on the ranks
def sharded_cases(
    rank: int, world_size: int, tp: int, pp: int, cases: list[tuple[str, list[int], list[int]]]
) -> list[dict[str, Any]]:
    """On every rank: for each ``(model_dir, max_new, verify_seq)`` build the TP x PP shard,
    generate greedily (batched, staggered arrivals, chunked prefill) and score ``verify_seq``.

    Returns, per case, the generated ids and (last stage only) the logits of ``verify_seq``.
    """
    from coordinator import parallel_state as ps
    from coordinator.engine.models import (
        GenerationRequest,
        LlamaForCausalLM,
        ModelRunner,
        StepInput,
        generate_greedy,
    )

    torch.set_num_threads(1)
    ps.initialize_model_parallel(tp, pp)
    out = []
    try:
        for model_dir, max_new, seq in cases:
            pp_group = ps.get_pp_group()
            model = LlamaForCausalLM.from_pretrained(
                model_dir, ps.get_tp_group(), pp_group if pp_group.world_size > 1 else None
            )
            runner = ModelRunner(model, num_kv_blocks=64, block_size=4)
            eos = model.config.eos_token_ids
            reqs = [GenerationRequest(i, p, n, arrival_step=i % 2)
                    for i, (p, n) in enumerate(zip(PROMPTS, max_new, strict=True))]
            # dynamic NTK depends on the sequence length at each step, so a chunked
            # prefill legitimately differs from HF's one-shot prefill: no chunks there
            chunk = None if model.config.rope_type == "dynamic" else 5
            ids = generate_greedy(runner.step, reqs, eos_token_ids=eos, prefill_chunk=chunk)
            logits = runner.run(StepInput([99], [seq], [0]), all_logits=True)
            runner.close()
            out.append({
                "ids": [ids[i] for i in range(len(PROMPTS))],
                "logits": logits,
                "layers": (model.model.start_layer, model.model.end_layer),
                "name": os.path.basename(model_dir),
            })
    finally:
        ps.destroy_model_parallel()
    return out


def sharded_error(rank: int, world_size: int, tp: int, pp: int, model_dir: str) -> str:
    """The error message building a TP x PP shard of ``model_dir`` raises on this rank."""
    from coordinator import parallel_state as ps
    from coordinator.engine.models import LlamaForCausalLM

    ps.initialize_model_parallel(tp, pp)
    try:
        pp_group = ps.get_pp_group()
        LlamaForCausalLM.from_pretrained(
            model_dir, ps.get_tp_group(), pp_group if pp_group.world_size > 1 else None
        )
    except ValueError as e:
        return str(e)
    finally:
        ps.destroy_model_parallel()
    return ""

"""`groupcoord demo` end to end: a random Hugging Face Llama checkpoint, served over
TP/PP through the real CLI, must generate what transformers' own greedy generate does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 42, 9], [88, 3], [100, 7, 64, 21, 33, 2, 90]]
MAX_NEW = 8


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """A random tiny Llama in HF format, and its greedy continuations of PROMPTS."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger weights than the default init, so tokens vary
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp("hf_llama")
    model.save_pretrained(path, safe_serialization=True)
    expected = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                 do_sample=False, pad_token_id=0)
            expected.append(out[0, len(prompt):].tolist())
    return path, expected


def _demo(tmp_path: Path, ckpt: Path, tp: int, pp: int) -> dict:
    out = tmp_path / f"demo_tp{tp}_pp{pp}.json"
    prompt_ids = ";".join(",".join(map(str, p)) for p in PROMPTS)
    proc = subprocess.run(
        [sys.executable, "-m", "coordinator", "demo", "--tp", str(tp), "--pp", str(pp),
         "--model-dir", str(ckpt), "--prompt-ids", prompt_ids, "--max-new-tokens", str(MAX_NEW),
         "--json", str(out), "--no-progress", "--timeout", "240"],
        capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout
    return json.loads(out.read_text())


@pytest.mark.timeout(300)
# CI runs the demo itself (.ci/run) and HF checkpoints are matched in test_model_configs.
@pytest.mark.parametrize("tp,pp", [pytest.param(2, 1, marks=pytest.mark.slow),
                                   pytest.param(1, 2, marks=pytest.mark.slow),
                                   pytest.param(2, 2, marks=pytest.mark.slow)])
def test_demo_matches_hf_greedy(tmp_path: Path, hf_checkpoint, tp: int, pp: int) -> None:
    ckpt, expected = hf_checkpoint
    report = _demo(tmp_path, ckpt, tp, pp)
    assert report["generated"] == expected
    assert report["tokens_identical"] and report["verified"]
    assert report["max_logit_diff"] < 1e-3
    assert report["tp"] == tp and report["pp"] == pp
    assert report["metadata_broadcast_us"]["n"] == report["steps"]
    # Every worker reports the arrival of each timed step and what its wait cost.
    workers = report["workers"]
    assert [w["rank"] for w in workers] == list(range(1, tp * pp))
    for w in workers:
        assert w["arrival_us"]["n"] == report["steps"]
        assert 0 < w["arrival_us"]["p50"] <= w["arrival_us"]["p99"] <= w["arrival_us"]["max"]
        assert w["wait_cpu_us_per_step"] >= 0 and 0 <= w["wait_cpu_percent"] <= 100
        assert "planned" in w["queue_wait_stats"]  # the metadata queue waits predictively


def test_demo_rejects_bad_prompt_ids(run_cli) -> None:
    code, _, err = run_cli(["demo", "--prompt-ids", "1,x;2"])
    assert code == 2
    assert "--prompt-ids" in err and "'1,x'" in err


@pytest.mark.parametrize("update,needle", [
    ({"num_attention_heads": 0}, "config field num_attention_heads must be a positive int, got 0"),
    ({"rms_norm_eps": None}, "config field rms_norm_eps must be a positive number, got None"),
    ({"eos_token_id": "</s>"}, "config field eos_token_id must be a token id"),
], ids=["heads-zero", "eps-null", "eos-str"])
def test_demo_names_a_malformed_config_field(tmp_path: Path, run_cli, update: dict[str, Any],
                                             needle: str) -> None:
    """A bad config.json: exit status 2 and the field, before any rank starts."""
    cfg = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, **update}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, err = run_cli(["demo", "--model-dir", str(tmp_path), "--no-progress"])
    assert code == 2 and out == "", out + err
    assert f"groupcoord demo: error: {needle}" in err, err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [str(2**64), str(-2**63 - 1), "99999999999999999999"],
                         ids=["2**64", "below-int64", "20-digits"])
def test_demo_refuses_a_seed_torch_cannot_take(run_cli, seed: str) -> None:
    code, out, err = run_cli(["demo", f"--seed={seed}"])
    assert code == 2 and out == ""
    assert "argument --seed: expected an int from -9223372036854775808" in err, err


# ------------------------------------------------------------- the verdict
_T = ((7, 10.0), (9, 9.99))  # the reference's top two at a near-tie: gap 0.01 (tolerance 0.01)
_VERDICTS = {
    # name: (sharded ids, reference ids, reference top two per id, sharded logits offset,
    #        verified, near_tie of the divergence or None for none)
    "identical": ([[3, 7, 5]], [[3, 7, 5]], [[((3, 9.0), (1, 1.0)), _T, ((5, 3.0), None)]],
                  0.0, True, None),
    "near-tie": ([[3, 9, 2]], [[3, 7, 5]], [[((3, 9.0), (1, 1.0)), _T, ((5, 3.0), None)]],
                 0.0, True, True),
    "gap-too-wide": ([[3, 9, 2]], [[3, 7, 5]], [[((3, 9.0), (1, 1.0)), ((7, 10.0), (9, 9.0)),
                                                 ((5, 3.0), None)]], 0.0, False, False),
    "not-the-runner-up": ([[3, 4, 2]], [[3, 7, 5]], [[((3, 9.0), (1, 1.0)), _T,
                                                      ((5, 3.0), None)]], 0.0, False, False),
    "one-run-ended": ([[3]], [[3, 7]], [[((3, 9.0), (1, 1.0)), _T]], 0.0, False, False),
    "logits-too-far": ([[3, 7]], [[3, 7]], [[((3, 9.0), (1, 1.0)), _T]], 0.02, False, None),
}


@pytest.mark.parametrize("name", list(_VERDICTS))
def test_demo_verdict_allows_only_near_tie_divergences(name: str) -> None:
    """Greedy ids must match, except that the first divergence may be a near-tie of the
    reference's top two (gap within the tolerance, the sharded id the runner-up): bf16
    rounding under TP flips those. The divergence is reported either way."""
    from coordinator.engine.demo.reference import (
        Reference,
        compare_with_reference,
        describe_divergence,
    )

    generated, ref_ids, top2, offset, verified, near_tie = _VERDICTS[name]
    ref = Reference(ref_ids, torch.full((4, 8), 10.0), top2)
    v = compare_with_reference(generated, ref.logits + offset, ref)
    assert v.tolerance == pytest.approx(1e-3 * 10.0)  # float32: 1e-3 x the largest logit
    assert v.verified is verified
    assert v.tokens_identical is (near_tie is None)
    if near_tie is None:
        assert v.divergences == []
        return
    (d,) = v.divergences
    assert d["prompt"] == 0 and d["near_tie"] is near_tie
    assert d["index"] == 1 and d["reference"] == 7
    line = describe_divergence(d, v.tolerance)
    assert line.startswith("prompt 0: first differs at new token 1")
    assert line.endswith("-> near-tie" if near_tie else "-> not a near-tie")


def test_demo_reference_records_its_top_two() -> None:
    """The unsharded run records, per generated id, its top two logits: the id first."""
    from coordinator.engine.demo.engine import EngineConfig, build_model
    from coordinator.engine.demo.reference import reference_run

    cfg = EngineConfig(tp=1, pp=1, model_dir=None, seed=0, progress=False, kv_blocks=8,
                       requests=(((5, 17, 42), 3, 0), ((9, 1), 2, 1)))
    ref = reference_run(cfg, [[5, 17, 42, 1], [9, 1, 2]], build_model)
    assert [len(t) for t in ref.top2] == [len(t) for t in ref.tokens] == [3, 2]
    for ids, tops in zip(ref.tokens, ref.top2, strict=True):
        for tok, ((first, v1), (second, v2)) in zip(ids, tops, strict=True):
            assert tok == first != second and v1 >= v2


# ------------------------------------------------------------- KV capacity
_LONG = ";".join(",".join(str((i * 7 + j) % 500) for j in range(200)) for i in range(5))


@pytest.mark.parametrize("argv,needle", [
    (["--kv-blocks", "64", "--prompt-ids", _LONG, "--max-new-tokens", "1"],
     "--kv-blocks 64 holds 1024 tokens (blocks of 16), but the 5 requests need 65 blocks"),
    (["--model", "moe", "--tp", "1", "--pp", "1", "--dp", "2", "--kv-blocks", "38",
      "--prompt-ids", _LONG, "--max-new-tokens", "1"],
     "--kv-blocks 38 holds 608 tokens per replica (blocks of 16), but the busiest replica's "
     "requests (of 5, over --dp 2) need 39 blocks"),
    (["--kv-blocks", "0"], "--kv-blocks must be >= 1, got 0"),
], ids=["dense", "moe-per-replica", "zero"])
def test_demo_refuses_a_kv_cache_too_small_before_starting(run_cli, argv: list[str],
                                                           needle: str) -> None:
    """Requests the KV cache cannot hold at once: exit status 2 naming --kv-blocks and
    the capacities, before any rank starts (it used to fail mid-run, "KV cache full")."""
    code, out, err = run_cli(["demo", *argv, "--no-progress"])
    assert code == 2 and out == "", out + err
    assert needle in err, err


@pytest.mark.parametrize("replicas,want", [(1, 65), (2, 39), (5, 13)],
                         ids=["one-replica", "dp2", "dp5"])
def test_demo_kv_blocks_default_fits_the_requests(replicas: int, want: int) -> None:
    """By default the cache holds every request of the busiest replica at once: 200-token
    prompts + 1 new token = 13 blocks of 16 each; 5 requests over the replicas."""
    import argparse

    from coordinator.engine.demo.requests import (
        kv_blocks_from_args,
        kv_blocks_needed,
        parse_prompt_ids,
    )

    reqs = [(tuple(p), 1, 0) for p in parse_prompt_ids(_LONG)]
    assert kv_blocks_needed(reqs, replicas) == want
    assert kv_blocks_from_args(argparse.Namespace(kv_blocks=None), reqs, replicas) == want
    assert kv_blocks_from_args(argparse.Namespace(kv_blocks=want), reqs, replicas) == want


def test_demo_reference_cache_fits_every_request() -> None:
    """The unsharded reference runs all requests in one process: its cache fits them all,
    whatever the per-replica kv_blocks (with --dp N it used to get one replica's)."""
    from coordinator.engine.demo.engine import EngineConfig, build_model
    from coordinator.engine.demo.reference import reference_run

    prompts = [tuple(range(i, i + 20)) for i in range(3)]  # 2 blocks each with 2 new tokens
    cfg = EngineConfig(tp=1, pp=1, model_dir=None, seed=0, progress=False, kv_blocks=2,
                       requests=tuple((p, 2, 0) for p in prompts))
    ref = reference_run(cfg, [[*p, 1, 2] for p in prompts], build_model)
    assert [len(t) for t in ref.tokens] == [2, 2, 2]


# ------------------------------------------------------------- --launcher env
def _torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run"]


def _env_without_launcher() -> dict[str, str]:
    import os

    drop = {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
            "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"}
    return {k: v for k, v in os.environ.items() if k not in drop}


@pytest.mark.slow  # CI runs the demo under torchrun across two hosts (tests/multihost)
@pytest.mark.timeout(240)
def test_demo_under_torchrun(tmp_path: Path) -> None:
    """torchrun starts the ranks (--launcher env): rank 0 alone reports, verified
    against the unsharded model (tests/multihost compares it bit for bit with
    the default launcher, across two simulated hosts)."""
    env = {**_env_without_launcher(), "OMP_NUM_THREADS": "1"}
    launched = tmp_path / "env.json"
    proc = subprocess.run([*_torchrun(), "--standalone", "--nproc-per-node", "2",
                           "-m", "coordinator", "demo", "--launcher", "env", "--tp", "2",
                           "--pp", "1", "--max-new-tokens", "6", "--no-progress",
                           "--timeout", "120", "--json", str(launched)],
                          capture_output=True, text=True, timeout=200, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("PASS") == 1  # only global rank 0 reports
    b = json.loads(launched.read_text())
    assert b["launcher"] == "env" and (b["tp"], b["pp"]) == (2, 1)
    assert b["verified"] and b["tokens_identical"] and b["generated"] == b["reference_generated"]
    # every worker's report reached the driver: one arrival per timed step
    assert b["worker_recv_latency_us"]["n"] == b["steps"] > 0
    assert [w["rank"] for w in b["workers"]] == [1]
    assert b["workers"][0]["arrival_us"]["n"] == b["steps"]


@pytest.mark.parametrize("env_update,needle", [
    ({}, "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set"),
    ({"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
     "needs 4 ranks, but the launcher started WORLD_SIZE=3"),
    ({"RANK": "0", "WORLD_SIZE": "four", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
     "WORLD_SIZE must be an int, got 'four'"),
], ids=["not-launched", "wrong-world-size", "bad-world-size"])
def test_demo_launcher_env_refuses_a_wrong_environment(env_update, needle, monkeypatch,
                                                       run_cli) -> None:
    _launcher_env(monkeypatch, env_update)
    code, _, err = run_cli(["demo", "--launcher", "env", "--no-progress"])
    assert code == 2, err
    assert needle in err, err
    assert "--launcher env" in err


def test_demo_mlp_refuses_launcher_env(monkeypatch, run_cli) -> None:
    _launcher_env(monkeypatch, {})
    code, _, err = run_cli(["demo", "--mlp", "--launcher", "env"])
    assert code == 2 and "--mlp runs with --launcher spawn only" in err, err


def _launcher_env(monkeypatch: Any, env_update: dict[str, str]) -> None:
    """This process's environment without a launcher's variables, plus ``env_update``."""
    for k in set(os.environ) - set(_env_without_launcher()):
        monkeypatch.delenv(k)
    for k, v in env_update.items():
        monkeypatch.setenv(k, v)

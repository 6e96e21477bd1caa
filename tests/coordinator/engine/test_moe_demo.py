"""The MoE demo (``groupcoord demo --model moe``) against Hugging Face ``transformers``.

Tiny random Mixtral and Qwen2-MoE checkpoints (2-3 layers, hidden 64, 8 experts,
top-2) are saved by ``transformers``; the demo engine serves them with attention
sharded by TP and experts by EP over each stage's DP x TP ranks, on real gloo /
shared-memory groups, and must generate HF's greedy ids (and HF's logits for the
generated sequences, within float32 rounding), with either MoE path (``--moe-comm
all2all``: token all-to-all; ``allgather``: the seed's GroupCoordinator
dispatch/combine, with and without sequence parallelism).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# after the skips above: these import transformers-backed code
from coordinator.engine.demo.moe_engine import MoeEngineConfig, moe_engine_rank  # noqa: E402
from coordinator.engine.models.moe_config import MoeModelConfig  # noqa: E402

# 5 prompts over 2 replicas (ids 0, 2, 4 | 1, 3); different lengths and max_new_tokens
# so replicas go idle while the other still runs (their experts keep serving).
PROMPTS = [[5, 17, 42, 9], [88, 3], [100, 7, 64, 21, 33, 2, 90], [1], [60, 61, 62, 63, 64, 65]]
MAX_NEW = [6, 2, 5, 1, 4]
SMALL = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=None)


def _hf_model(kind: str) -> Any:
    cls = (transformers.MixtralForCausalLM if kind == "mixtral"
           else transformers.Qwen2MoeForCausalLM)
    return cls(_hf_model_config(kind)).eval()


def _hf_model_config(kind: str) -> Any:
    if kind == "mixtral":
        return transformers.MixtralConfig(**SMALL, intermediate_size=48, num_hidden_layers=2,
                                          num_local_experts=8, num_experts_per_tok=2)
    return transformers.Qwen2MoeConfig(**SMALL, intermediate_size=42, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=48, num_hidden_layers=3,
                                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                                      mlp_only_layers=[1])


def _build(root: Path, kind: str) -> dict[str, Any]:
    """Save a random ``kind`` checkpoint; HF's greedy ids and its logits of the sequences."""
    torch.manual_seed(3)
    hf = _hf_model(kind)
    std = 0.2 if kind == "mixtral" else 0.1  # chosen so that greedy tokens vary
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, std)
    path = root / kind
    hf.save_pretrained(path, safe_serialization=True)
    ids, logits = [], []
    with torch.no_grad():
        for p, n in zip(PROMPTS, MAX_NEW, strict=True):
            x = torch.tensor([p])
            gen = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                              do_sample=False, pad_token_id=0)[0]
            ids.append(gen[len(p):].tolist())
            seq = gen.tolist()
            logits.append(hf(torch.tensor([seq[:-1] if len(seq) > 1 else seq])).logits[0])
    return {"path": str(path), "ids": ids, "logits": logits}


class _Checkpoints(dict):
    """Checkpoints built on first use (a deselected case costs nothing)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, kind: str) -> dict[str, Any]:
        self[kind] = _build(self.root, kind)
        return self[kind]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return _Checkpoints(tmp_path_factory.mktemp("moe_ckpts"))


def _engine_cfg(path: str, tp: int, pp: int, dp: int, comm: str = "all2all",
                sp: bool = True) -> MoeEngineConfig:
    pairs = enumerate(zip(PROMPTS, MAX_NEW, strict=True))
    reqs = tuple((tuple(p), n, i % 2) for i, (p, n) in pairs)
    return MoeEngineConfig(tp=tp, pp=pp, dp=dp, model_dir=path, seed=0, requests=reqs,
                           kv_blocks=64, moe_comm=comm, moe_sp=sp)


def _check_ranks(results: list[dict[str, Any]], exp: dict[str, Any], tp: int, pp: int,
                 dp: int, comm: str = "all2all", sp: bool = True) -> None:
    assert all(r["generated"] == exp["ids"] for r in results)  # every rank, HF's ids
    assert {r["ep_size"] for r in results} == {dp * tp}
    # the path asked for, and sequence parallelism only where there is a TP split
    assert {(r["moe_comm"], r["moe_sp"]) for r in results} == {(comm, sp and tp > 1)}
    seen = set()
    for d in range(dp):
        last = results[d * pp * tp + (pp - 1) * tp]
        lens = [max(1, len(last["sequences"][i]) - 1) for i in last["verify_indices"]]
        for i, got in zip(last["verify_indices"], last["logits"].split(lens), strict=True):
            assert (got - exp["logits"][i]).abs().max().item() < 1e-4, (i, d)
            seen.add(i)
    assert seen == set(range(len(PROMPTS)))
    if dp > 1:  # a replica ran out of requests while the other had some: the idle path ran
        assert any(r["idle_steps"] > 0 for r in results)
    # every expert of every sparse layer is on exactly one EP rank of its stage
    for p in range(pp):
        experts = sorted(e for r in results if r["stage"] == p for e in sum(r["experts"], []))
        assert experts in ([], list(range(8)))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("comm,sp,kind,tp,pp,dp", [
    ("all2all", True, "mixtral", 2, 1, 2),    # EP=4: TP=2 x EP over DP=2
    ("all2all", True, "qwen2_moe", 2, 1, 1),  # EP=2 over TP: shared expert and a dense
    # layer (mlp_only_layers) TP-sharded, q/k/v biases
    ("all2all", True, "mixtral", 1, 2, 2),    # EP=2 per stage, PP=2: one EP group per stage
    # allgather: GroupCoordinator.dispatch/combine
    ("allgather", True, "mixtral", 1, 1, 2),     # EP=2 over DP: the token peers are all of EP
    ("allgather", True, "qwen2_moe", 2, 1, 1),   # EP=2 over TP, each TP rank its own slice
    ("allgather", False, "qwen2_moe", 2, 1, 1),  # token peers: one rank; TP all_reduce
    ("allgather", True, "mixtral", 2, 1, 2),     # EP=4: gather over all 4 ranks
    ("allgather", False, "mixtral", 2, 1, 2),    # EP=4: gather over DP, then TP all_reduce
    pytest.param("allgather", False, "qwen2_moe", 2, 2, 2, marks=pytest.mark.slow),
    pytest.param("allgather", True, "qwen2_moe", 2, 2, 2, marks=pytest.mark.slow),
], ids=["all2all-mixtral-tp2-dp2-ep4", "all2all-qwen2moe-tp2-ep2", "all2all-mixtral-pp2-dp2-ep2",
        "allgather-mixtral-tp1-dp2-ep2", "allgather-sp-qwen2moe-tp2-ep2",
        "allgather-nosp-qwen2moe-tp2-ep2", "allgather-sp-mixtral-tp2-dp2-ep4",
        "allgather-nosp-mixtral-tp2-dp2-ep4", "allgather-nosp-qwen2moe-tp2-pp2-dp2-ep4",
        "allgather-sp-qwen2moe-tp2-pp2-dp2-ep4"])
def test_moe_engine_matches_hf(dist_pool: Any, checkpoints: dict[str, Any], comm: str, sp: bool,
                               kind: str, tp: int, pp: int, dp: int) -> None:
    exp = checkpoints[kind]
    results = dist_pool(tp * pp * dp).run(
        moe_engine_rank, _engine_cfg(exp["path"], tp, pp, dp, comm, sp), timeout=150)
    _check_ranks(results, exp, tp, pp, dp, comm, sp)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("comm,sp", [("all2all", True), ("allgather", False)],
                         ids=["all2all", "allgather-tp1-sp-off"])
def test_moe_replica_without_requests_serves_its_experts(dist_pool: Any,
                                                         checkpoints: dict[str, Any], comm: str,
                                                         sp: bool) -> None:
    """One request over DP=2: replica 1 never has a request, yet holds experts 4-7, so
    every step (and the verification pass) it only serves the other replica's tokens
    (with zero rows of its own in each dispatch/combine)."""
    exp = checkpoints["mixtral"]
    cfg = dataclasses.replace(_engine_cfg(exp["path"], 1, 1, 2, comm, sp),
                              requests=((tuple(PROMPTS[0]), MAX_NEW[0], 0),))
    r0, r1 = dist_pool(2).run(moe_engine_rank, cfg, timeout=100)
    assert r0["moe_comm"] == comm and not r0["moe_sp"]  # TP=1: no token split either way
    assert r0["generated"] == r1["generated"] == [exp["ids"][0]]
    # every step that schedules the request (the last step only releases its KV blocks)
    assert r1["idle_steps"] == MAX_NEW[0] == r1["steps"] - 1 and r0["idle_steps"] == 0
    assert r1["verify_indices"] == [] and r1["logits"] is None
    assert (r0["logits"] - exp["logits"][0]).abs().max().item() < 1e-4
    assert r1["experts"] == [[4, 5, 6, 7]] and sum(map(sum, r1["expert_rows"])) > 0


def _block_rank(rank: int, world_size: int, layouts: list[list[int]]) -> list[dict[str, Any]]:
    """TP=2 x DP=2, one sparse layer: per layout, each replica's rows (``layout[replica]``
    of them, 0: the replica is idle) through the block with every MoE path, against the
    unsharded block on the same rows. Per layout and path: the largest difference,
    whether the block gathers, and the rows its experts ran."""
    from coordinator import parallel_state as ps
    from coordinator.engine.models.moe_block import MoeComm, SparseMoeBlock
    from coordinator.engine.models.moe_config import default_moe_config

    torch.set_num_threads(1)
    config = default_moe_config()
    ps.initialize_model_parallel(2, 1, 2, enable_expert_parallel=True)
    try:
        tp, dp, ep = ps.get_tp_group(), ps.get_dp_group(), ps.get_ep_group()
        torch.manual_seed(0)
        ref = SparseMoeBlock(config, None, None, torch.float32, "mlp")
        for param in ref.parameters():
            param.data.normal_(0.0, 0.1)
        blocks = {}
        for comm in (MoeComm("all2all"), MoeComm("allgather", True),
                     MoeComm("allgather", False)):
            block = SparseMoeBlock(config, tp, ep, torch.float32, "mlp", comm)
            lo = block.first_expert
            block.gate.data.copy_(ref.gate.data)
            block.w13.data.copy_(ref.w13.data[lo:lo + block.num_local])
            block.w2.data.copy_(ref.w2.data[lo:lo + block.num_local])
            blocks[f"{comm.kind}-{'sp' if comm.sequence_parallel else 'nosp'}"] = block
        replica = dp.rank_in_group
        out = []
        for layout in layouts:
            x = torch.randn(layout[replica], config.hidden_size,
                            generator=torch.Generator().manual_seed(10 + replica))
            want = ref(x)
            seen: dict[str, Any] = {}
            for key, block in blocks.items():
                block.expert_rows.zero_()
                if x.shape[0]:
                    diff = (block(x) - want).abs().max().item()
                else:
                    block.idle()
                    diff = 0.0
                seen[key] = (diff, block.gathers, int(block.expert_rows.sum()))
            out.append(seen)
        return out
    finally:
        ps.destroy_model_parallel()


@pytest.mark.timeout(120)
def test_moe_block_paths_match_unsharded(dist_pool: Any) -> None:
    """The block alone, EP=4 (TP=2 x DP=2): every path gives the unsharded block's rows,
    with uneven replicas (5 and 2 tokens: TP slices of 3, 2, 1 and 1 rows) and with one
    replica idle (it still serves its experts)."""
    layouts = [[5, 2], [3, 0]]
    per_rank = dist_pool(4).run(_block_rank, layouts, timeout=100)
    for i, tokens in enumerate(layouts):
        results = [r[i] for r in per_rank]
        for r in results:
            assert set(r) == {"all2all-sp", "allgather-sp", "allgather-nosp"}
            for key, (diff, gathers, _) in r.items():
                assert diff < 1e-5, (tokens, key, diff)
                assert gathers == key.startswith("allgather")
        # each token's top-2 slots ran once in all (TP=2: the TP ranks of a replica
        # hold the same tokens; the paths must not run them once per TP rank)
        for key in results[0]:
            assert sum(r[key][2] for r in results) == 2 * sum(tokens), (tokens, key)


def test_moe_comm_refuses_bad_settings() -> None:
    from coordinator.engine.models.moe_block import MoeComm

    with pytest.raises(ValueError, match="moe comm must be one of all2all, allgather"):
        MoeComm("alltoall")
    with pytest.raises(ValueError, match="sequence_parallel=False needs the allgather path"):
        MoeComm("all2all", False)
    with pytest.raises(TypeError, match="sequence_parallel must be a bool, got str"):
        MoeComm("allgather", "off")  # type: ignore[arg-type]  # the wrong type under test
    with pytest.raises(ValueError, match="sequence_parallel=False needs the allgather path"):
        _engine_cfg("unused", 2, 1, 1, "all2all", False)


@dataclasses.dataclass
class _FakeEpGroup:
    """What SparseMoeBlock's constructor reads of an EP group."""

    world_size: int
    rank_in_group: int = 0


@pytest.mark.parametrize("comm", ["allgather", "all2all"])
def test_moe_block_refuses_experts_not_divisible_by_ep(comm: str) -> None:
    """3 experts over 2 EP ranks: refused when built (the allgather path used to run
    with expert 2 held by no rank), with the all2all dispatch's message."""
    from coordinator.engine.models.moe_block import MoeComm, SparseMoeBlock
    from coordinator.engine.models.moe_config import default_moe_config

    config = dataclasses.replace(default_moe_config(), num_experts=3)
    with pytest.raises(ValueError, match=r"num_experts must be a positive multiple of the EP "
                                         r"group's size 2 .*got 3"):
        SparseMoeBlock(config, None, _FakeEpGroup(2), torch.float32, "mlp", MoeComm(comm))
    SparseMoeBlock(config, None, _FakeEpGroup(3, 2), torch.float32, "mlp", MoeComm(comm))


@pytest.mark.slow  # 13 s each; the engine's EP over DP is matched in test_moe_engine_matches_hf
@pytest.mark.timeout(180)
@pytest.mark.parametrize("comm", ["all2all", "allgather"])
def test_cli_moe_ep2_over_dp_matches_hf(tmp_path: Path, checkpoints: dict[str, Any],
                                        comm: str) -> None:
    """The real command, EP=2 over DP=2 (TP=1): HF's greedy ids, verified vs unsharded."""
    exp = checkpoints["mixtral"]
    out = tmp_path / "moe.json"
    prompt_ids = ";".join(",".join(map(str, p)) for p in PROMPTS)
    proc = subprocess.run(
        [sys.executable, "-m", "coordinator", "demo", "--model", "moe", "--model-dir",
         exp["path"], "--tp", "1", "--pp", "1", "--dp", "2", "--prompt-ids", prompt_ids,
         "--max-new-tokens", "4", "--no-progress", "--timeout", "150", "--json", str(out),
         "--moe-comm", comm],
        capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout and "EP=2 per stage" in proc.stdout
    assert f"MoE comm {comm} (TP=1: sequence parallelism does not apply)" in proc.stdout
    report = json.loads(out.read_text())
    assert report["moe_comm"] == comm and report["moe_sp"] is False
    # one --max-new-tokens for every prompt: compare with HF's ids as far as both go
    for got, want in zip(report["generated"], exp["ids"], strict=True):
        n = min(len(got), len(want))
        assert n >= 1 and got[:n] == want[:n]
    assert report["generated"] == report["reference_generated"]
    assert report["tokens_identical"] and report["verified"] and report["ep"] == 2
    assert report["max_logit_diff"] < 1e-3


@pytest.mark.parametrize("argv,needle", [
    (["--dp", "2"], "--dp 2 needs --model moe"),
    (["--model", "moe", "--tp", "1", "--pp", "1", "--dp", "3"],
     "num_experts (8) must be divisible by the expert-parallel size (ep = dp x tp = 3)"),
    (["--model", "moe", "--compile"], "--model moe does not support --compile"),
    (["--model", "moe", "--launcher", "env"], "--model moe runs with --launcher spawn only"),
    (["--model", "moe", "--dp", "0"], "--dp must be >= 1, got 0"),
    (["--moe-comm", "allgather"], "--moe-comm needs --model moe"),
    (["--moe-sp", "off"], "--moe-sp needs --model moe"),
    (["--model", "moe", "--moe-sp", "off"], "--moe-sp off needs --moe-comm allgather"),
], ids=["dp-without-moe", "experts-not-divisible", "compile", "launcher-env", "dp-zero",
        "moe-comm-without-moe", "moe-sp-without-moe", "moe-sp-off-all2all"])
def test_cli_moe_refuses_bad_layouts(argv: list[str], needle: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI's entry point, in-process: exit status 2 and the reason, before any rank starts."""
    from coordinator.cli import main

    assert main(["demo", *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert needle in err, err


def test_cli_dense_demo_points_to_model_moe(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from coordinator.cli import main

    _hf_model_config("mixtral").save_pretrained(tmp_path)
    assert main(["demo", "--model-dir", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "is a mixtral (mixture-of-experts) checkpoint: pass --model moe" in err


def test_moe_config_from_hf_and_checks(tmp_path: Path) -> None:
    _hf_model_config("mixtral").save_pretrained(tmp_path / "mixtral")
    _hf_model_config("qwen2_moe").save_pretrained(tmp_path / "qwen")
    mix = MoeModelConfig.from_json(tmp_path / "mixtral")
    assert (mix.model_type, mix.num_experts, mix.num_experts_per_tok) == ("mixtral", 8, 2)
    assert mix.sparse_layers == (0, 1) and mix.norm_topk_prob and mix.moe_intermediate_size == 48
    qwen = MoeModelConfig.from_json(tmp_path / "qwen")
    assert qwen.sparse_layers == (0, 2) and not qwen.norm_topk_prob
    assert qwen.attention_bias and not qwen.o_proj_bias
    assert qwen.shared_expert_intermediate_size == 48

    qwen.check_parallel(2, 3, 8)
    with pytest.raises(ValueError, match=r"num_experts \(8\) must be divisible.*ep = dp x tp = 3"):
        qwen.check_parallel(1, 1, 3)
    with pytest.raises(ValueError, match=r"intermediate_size \(42\).*tp=4"):
        qwen.check_parallel(4, 1, 4)  # the dense layer's MLP splits by TP
    mix.check_parallel(4, 1, 8)  # no dense layer: expert width 48 need not split by TP
    with pytest.raises(ValueError, match="model_type must be one of"):
        MoeModelConfig.from_hf_dict({"model_type": "llama"})
    with pytest.raises(ValueError, match="lacks required field 'num_local_experts'"):
        MoeModelConfig.from_hf_dict({"model_type": "mixtral"})
    windowed = {**_hf_model_config("mixtral").to_dict(), "sliding_window": 16}
    with pytest.raises(ValueError, match=r"sliding_window \(16\)"):
        MoeModelConfig.from_hf_dict(windowed)
    with pytest.raises(ValueError, match="num_experts_per_tok \\(9\\) must be <= num_experts"):
        MoeModelConfig.from_hf_dict({**windowed, "sliding_window": None, "num_experts_per_tok": 9})


_BAD_MOE_FIELDS = [
    ("qwen2_moe", {"qkv_bias": "false"}, "qkv_bias must be true, false or null"),
    ("qwen2_moe", {"norm_topk_prob": "true"}, "norm_topk_prob must be true, false or null"),
    ("qwen2_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step must be an int >= 1"),
    ("qwen2_moe", {"decoder_sparse_step": "2"}, "decoder_sparse_step must be an int >= 0"),
    ("qwen2_moe", {"mlp_only_layers": "1"}, "mlp_only_layers must be a list of layer indices"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 4.5},
     "shared_expert_intermediate_size must be an int >= 0 or null"),
    ("mixtral", {"sliding_window": "4096"}, "sliding_window must be an int or null"),
    ("mixtral", {"attention_bias": 1}, "attention_bias must be true, false or null"),
]


@pytest.mark.parametrize("kind,update,message", _BAD_MOE_FIELDS,
                         ids=["qkv-bias-str", "norm-topk-str", "sparse-step-zero",
                              "sparse-step-str", "dense-layers-str", "shared-size-float",
                              "window-str", "attention-bias-int"])
def test_moe_config_names_a_malformed_field(kind: str, update: dict[str, Any],
                                            message: str) -> None:
    """Each field is checked, not converted: ``bool("false")`` is True, ``int(4.5)`` 4,
    and a step of 0 divided by zero."""
    with pytest.raises(ValueError, match=f"config field {message}"):
        MoeModelConfig.from_hf_dict({**_hf_model_config(kind).to_dict(), **update})

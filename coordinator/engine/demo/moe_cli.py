"""``groupcoord demo --model moe``: a Mixtral-style decoder over TP x PP x DP CPU processes.

Attention is sharded by TP, the experts of each pipeline stage by EP over
that stage's DP x TP ranks (:mod:`coordinator.engine.demo.moe_engine`). The
result is checked against the same model unsharded in this process: greedy
tokens identical and logits within float rounding.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

__all__ = ["run_moe", "refuse_moe_checkpoint"]


def refuse_moe_checkpoint(model_dir: str) -> None:
    """Raise ValueError when the dense demo is pointed at a MoE checkpoint."""
    import os

    from coordinator.engine.models.config import read_json
    from coordinator.engine.models.moe_config import MOE_MODEL_TYPES

    path = os.path.join(model_dir, "config.json") if os.path.isdir(model_dir) else model_dir
    data = read_json(path, required=False)
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if model_type in MOE_MODEL_TYPES:
        raise ValueError(f"--model-dir {model_dir} is a {model_type} (mixture-of-experts) "
                         f"checkpoint: pass --model moe")


def _check(args: argparse.Namespace) -> None:
    if args.launcher != "spawn":
        raise ValueError(f"--model moe runs with --launcher spawn only, got --launcher "
                         f"{args.launcher}")
    if args.compile:
        raise ValueError("--model moe does not support --compile (routing makes shapes "
                         "data-dependent)")
    if args.moe_sp == "off" and args.moe_comm != "allgather":
        raise ValueError("--moe-sp off needs --moe-comm allgather (the all2all path always "
                         "gives each TP rank its own slice of the tokens)")


def _comm_text(cfg: Any) -> str:
    """The MoE path as the report's first line names it."""
    if cfg.tp == 1:
        sp = "TP=1: sequence parallelism does not apply"
    elif cfg.moe_sp:
        sp = "sequence parallel: each TP rank routes its own tokens"
    else:
        sp = "no sequence parallelism: all_reduce over TP"
    return f"MoE comm {cfg.moe_comm} ({sp})"


def run_moe(args: argparse.Namespace) -> int:
    """Run the MoE demo; 0 when the sharded run matches the unsharded reference."""
    from coordinator.engine.demo.moe_engine import MoeEngineConfig, moe_engine_rank
    from coordinator.engine.demo.requests import kv_blocks_from_args, requests_from_args
    from coordinator.engine.models.moe_config import MoeModelConfig, default_moe_config
    from coordinator.testing import run_distributed

    _check(args)
    mcfg = MoeModelConfig.from_json(args.model_dir) if args.model_dir else default_moe_config()
    mcfg.check_parallel(args.tp, args.pp, args.dp * args.tp)
    requests = tuple(requests_from_args(args, mcfg.vocab_size))
    cfg = MoeEngineConfig(tp=args.tp, pp=args.pp, dp=args.dp, model_dir=args.model_dir,
                          seed=args.seed, requests=requests, ignore_eos=args.ignore_eos,
                          kv_blocks=kv_blocks_from_args(args, requests, args.dp), dtype=args.dtype,
                          moe_comm=args.moe_comm or "all2all", moe_sp=args.moe_sp != "off")
    world = args.tp * args.pp * args.dp
    t0 = time.perf_counter()
    results = run_distributed(moe_engine_rank, world, cfg, timeout=args.timeout)
    wall = time.perf_counter() - t0
    src = args.model_dir or f"embedded model (seed {args.seed})"
    shared = (f", shared expert {mcfg.shared_expert_intermediate_size}"
              if mcfg.shared_expert_intermediate_size else "")
    print(f"groupcoord demo: MoE decoder [{mcfg.model_type}, {src}: {mcfg.num_hidden_layers} "
          f"layers, hidden {mcfg.hidden_size}, heads {mcfg.num_attention_heads}/"
          f"{mcfg.num_key_value_heads} kv, {mcfg.num_experts} experts top-"
          f"{mcfg.num_experts_per_tok}{shared}, vocab {mcfg.vocab_size}] on TP={args.tp} x "
          f"PP={args.pp} x DP={args.dp} = {world} CPU processes, EP={args.dp * args.tp} per "
          f"stage, {len(cfg.requests)} requests; {_comm_text(cfg)}")
    return _report(args, cfg, mcfg, results, wall)


def _sharded_logits(cfg: Any, results: list[dict[str, Any]]) -> Any:
    """The verification logits of every sequence, in sequence order, from each replica's
    last stage (TP rank 0)."""
    import torch

    per_seq: dict[int, Any] = {}
    for d in range(cfg.dp):
        r = results[d * cfg.pp * cfg.tp + (cfg.pp - 1) * cfg.tp]
        if r["logits"] is None:
            continue
        lens = [max(1, len(r["sequences"][i]) - 1) for i in r["verify_indices"]]
        for i, chunk in zip(r["verify_indices"], r["logits"].split(lens), strict=True):
            per_seq[i] = chunk
    return torch.cat([per_seq[i] for i in sorted(per_seq)])


def _report(args: argparse.Namespace, cfg: Any, mcfg: Any, results: list[dict[str, Any]],
            wall: float) -> int:
    from coordinator.engine.demo.moe_engine import build_moe_model
    from coordinator.engine.demo.reference import (
        compare_with_reference,
        reference_run,
        verdict_text,
    )

    drv = results[0]
    agree = all(r["generated"] == drv["generated"] for r in results)
    logits = _sharded_logits(cfg, results)
    ref = reference_run(cfg, drv["sequences"], build_moe_model)
    v = compare_with_reference(drv["generated"], logits, ref)
    ok = agree and v.verified
    print("  generated token ids (new tokens per prompt):")
    for i, (gen, (prompt, _, _)) in enumerate(zip(drv["generated"], cfg.requests, strict=True)):
        print(f"    prompt {i} ({len(prompt)} tokens, replica {i % cfg.dp}): {gen}")
    new = sum(len(g) for g in drv["generated"])
    secs = max(r["seconds"] for r in results)
    step = drv["step_us"]
    print(f"  throughput: {new / secs:.1f} tokens/s ({new} tokens, {drv['steps']} steps, "
          f"{secs:.2f} s; warm-up {drv['warmup_seconds']:.2f} s; {wall:.1f} s with process "
          f"start-up); time per step p50 / p99: {step['p50'] / 1e3:.2f} / "
          f"{step['p99'] / 1e3:.2f} ms (rank 0)")
    print("  expert load (rows routed to each expert, generation and verification; per stage, "
          "by EP rank):")

    for p in range(cfg.pp):
        stage = sorted((r for r in results if r["stage"] == p), key=lambda r: r["ep_rank"])
        cells = [f"ep{r['ep_rank']} (rank {r['rank']}) experts {r['experts'][0][0]}-"
                 f"{r['experts'][0][-1]}: {[sum(c) for c in zip(*r['expert_rows'], strict=True)]}"
                 for r in stage if r["experts"]]
        print(f"    stage {p}: " + "; ".join(cells))
    if not agree:
        print("  the ranks disagree on the generated ids (each should hold every replica's)")
    print(verdict_text(dataclasses.replace(v, verified=ok)))
    if args.json_path:
        out = {"model": src_name(args), "model_type": mcfg.model_type, "tp": args.tp,
               "pp": args.pp, "dp": args.dp, "ep": args.dp * args.tp,
               "moe_comm": cfg.moe_comm, "moe_sp": cfg.sequence_parallel(),
               "generated": drv["generated"], "reference_generated": ref.tokens,
               "tokens_identical": agree and v.tokens_identical,
               "max_logit_diff": v.max_logit_diff, "logit_tolerance": v.tolerance,
               "divergences": v.divergences, "verified": ok,
               "steps": drv["steps"], "seconds": secs, "new_tokens": new,
               "tokens_per_s": new / secs, "step_us": step,
               "warmup_seconds": drv["warmup_seconds"],
               "idle_steps": {r["rank"]: r["idle_steps"] for r in results},
               "expert_rows": {r["rank"]: r["expert_rows"] for r in results}}
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=2)
        print(f"  wrote {args.json_path}")
    return 0 if ok else 1


def src_name(args: argparse.Namespace) -> str:
    """The model's source as the report names it."""
    return args.model_dir or f"embedded model (seed {args.seed})"

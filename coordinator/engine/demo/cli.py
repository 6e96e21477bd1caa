"""``groupcoord demo``: a Llama decoder served over TP x PP CPU processes, verified.

Runs :mod:`coordinator.engine.demo.engine` on ``tp * pp`` processes, then the same
model unsharded in the driver's process, and reports whether the greedy tokens
are identical and how far the logits are apart.

Launchers: by default (``--launcher spawn``) this command starts the ``tp * pp``
ranks itself, on this host. With ``--launcher env`` another launcher has
started them -- ``torchrun --nnodes N --nproc-per-node M -m coordinator demo
--launcher env ...``, on one host or several -- and this process is one rank
(:mod:`coordinator.engine.demo.external`); global rank 0 reports.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

from coordinator.engine.demo.requests import (
    default_requests,
    kv_blocks_from_args,
    parse_prompt_ids,
    requests_from_args,
)

__all__ = ["add_args", "run", "parse_prompt_ids", "default_requests"]


def add_args(p: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``p``."""
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    p.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (default 2)")
    p.add_argument("--model", choices=("llama", "moe"), default="llama",
                   help="llama: the dense decoder (default); moe: a Mixtral-style decoder, "
                        "experts sharded by EP over each stage's DP x TP ranks "
                        "(coordinator.engine.demo.moe_cli)")
    p.add_argument("--dp", type=int, default=1,
                   help="data-parallel replicas (--model moe only; default 1)")
    p.add_argument("--moe-comm", choices=("all2all", "allgather"), default=None,
                   help="--model moe only: how tokens reach the experts on other EP ranks; "
                        "all2all (default): each token to its experts' ranks and back; "
                        "allgather: every rank gathers its peers' tokens, runs its own experts "
                        "on all of them, and a reduce-scatter sums the outputs back")
    p.add_argument("--moe-sp", choices=("on", "off"), default=None,
                   help="--model moe only: sequence-parallel MoE, each TP rank routes its own "
                        "slice of the tokens (on, default); off (--moe-comm allgather only): "
                        "every TP rank routes all tokens and an all-reduce over TP adds the "
                        "other TP ranks' experts. No effect at --tp 1")
    p.add_argument("--model-dir", default=None,
                   help="Hugging Face checkpoint dir (config.json + *.safetensors): Llama, or "
                        "with --model moe Mixtral / Qwen2-MoE; "
                        "default: the embedded fixed-seed model")
    p.add_argument("--prompt-ids", default=None,
                   help='prompts as token ids, ";" between prompts: "1,2,3;4,5"')
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate (default 16)")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="KV cache capacity per rank (per replica with --dp) in blocks of 16 "
                        "tokens; refused up front when it cannot hold every request at once "
                        "(default: just what the requests need)")
    p.add_argument("--compile", action="store_true",
                   help="run the model under torch.compile(fullgraph=True)")
    p.add_argument("--compile-backend", default="aot_eager",
                   help="torch.compile backend for --compile (default aot_eager; inductor "
                        "works too)")
    p.add_argument("--dtype", default="float32",
                   choices=("float32", "auto", "bfloat16", "float16"),
                   help="compute dtype (default float32: bf16/fp16 checkpoints are upcast, which "
                        "reproduces transformers' float32 forward; auto = the checkpoint's dtype)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at end-of-sequence tokens")
    p.add_argument("--seed", type=_seed, default=0,
                   help="seed of the embedded model, -2**63 to 2**64-1 (default 0)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                   help="write generated ids and timings as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress line while running")
    p.add_argument("--timeout", type=_seconds, default=600.0,
                   help="seconds: with --launcher spawn, before the ranks are killed; with "
                        "--launcher env, the groups' timeout (bounds every wait) (default 600)")
    p.add_argument("--mlp", action="store_true",
                   help="run the minimal tensor-parallel MLP demo instead")
    p.add_argument("--launcher", choices=("spawn", "env"), default="spawn",
                   help="spawn: start the tp*pp ranks here (default); env: this process is one "
                        "rank started by an external launcher such as torchrun, which sets "
                        "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (hosts may differ); "
                        "global rank 0 prints the report")


def _seconds(text: str) -> float:
    """argparse type of ``--timeout``: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


#: The seeds torch's generators take (any other int raises deep in the run, with
#: a message that does not say which option).
_SEED_MIN, _SEED_MAX = -2**63, 2**64 - 1


def _seed(text: str) -> int:
    """argparse type of ``--seed``: an int torch's generators take."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not _SEED_MIN <= value <= _SEED_MAX:
        raise argparse.ArgumentTypeError(
            f"expected an int from {_SEED_MIN} to {_SEED_MAX}, got {text!r}")
    return value


def _check_args(args: argparse.Namespace) -> None:
    for name in ("tp", "pp", "dp", "max_new_tokens", "kv_blocks"):
        if getattr(args, name, 1) is not None and getattr(args, name, 1) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.mlp and args.launcher != "spawn":
        raise ValueError(f"--mlp runs with --launcher spawn only, got --launcher {args.launcher}")
    if args.dp != 1 and args.model != "moe":
        raise ValueError(f"--dp {args.dp} needs --model moe (the dense demo has no DP replicas)")
    if args.mlp and args.model == "moe":
        raise ValueError("--mlp and --model moe are different demos; pass one")
    if args.mlp and args.json_path:
        raise ValueError("--json reports the engine demo; --mlp only prints its check")
    if args.json_path is not None:  # checked before the run, which it would otherwise lose
        where = os.path.dirname(os.path.abspath(args.json_path))
        if os.path.isdir(args.json_path) or not os.access(where, os.W_OK | os.X_OK):
            raise ValueError(f"--json: cannot write {args.json_path!r}")
    for name in ("moe_comm", "moe_sp"):
        if getattr(args, name) is not None and args.model != "moe":
            raise ValueError(f"--{name.replace('_', '-')} needs --model moe")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit code 0 when the sharded run matches the reference."""
    from coordinator.errors import DistributedTimeout, GroupCoordError, RankFailedError

    try:
        _check_args(args)
        if args.mlp:
            from coordinator.engine.demo.tp_mlp import run_tp_mlp

            return 0 if run_tp_mlp(tp=args.tp) else 1
        if args.model == "moe":
            from coordinator.engine.demo.moe_cli import run_moe

            return run_moe(args)
        return _run_engine(args)
    except ValueError as e:
        print(f"groupcoord demo: error: {e}", file=sys.stderr)
        return 2
    except (RankFailedError, DistributedTimeout, GroupCoordError) as e:
        print(f"groupcoord demo: failed: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1


def _run_engine(args: argparse.Namespace) -> int:
    from coordinator.engine.demo.engine import EngineConfig, build_model, engine_rank
    from coordinator.engine.models.config import LlamaModelConfig, default_config

    if args.model_dir:
        from coordinator.engine.demo.moe_cli import refuse_moe_checkpoint

        refuse_moe_checkpoint(args.model_dir)
    mcfg = LlamaModelConfig.from_json(args.model_dir) if args.model_dir else default_config()
    # refuse an unshardable layout here, with the field's name, before any rank starts
    mcfg.check_parallel(args.tp, args.pp)
    requests = tuple(requests_from_args(args, mcfg.vocab_size))
    cfg = EngineConfig(
        tp=args.tp, pp=args.pp, model_dir=args.model_dir, seed=args.seed,
        requests=requests, compile=args.compile,
        compile_backend=args.compile_backend, ignore_eos=args.ignore_eos,
        progress=not args.no_progress, dtype=args.dtype,
        kv_blocks=kv_blocks_from_args(args, requests),
    )
    src = args.model_dir or f"embedded model (seed {args.seed})"
    if args.launcher == "env":
        from coordinator.engine.demo.external import run_this_rank

        drv, workers, wall = run_this_rank(cfg, args.timeout)
        if drv is None:
            return 0  # a worker: rank 0 reports
        where = "processes started by an external launcher"
    else:
        from coordinator.testing import run_distributed

        _warn_if_under_launcher()
        t0 = time.perf_counter()
        results = run_distributed(engine_rank, args.tp * args.pp, cfg, timeout=args.timeout)
        wall = time.perf_counter() - t0
        drv, workers = results[0], results[1:]
        where = "CPU processes"
    print(f"groupcoord demo: Llama decoder [{src}: {mcfg.num_hidden_layers} layers, hidden "
          f"{mcfg.hidden_size}, heads {mcfg.num_attention_heads}/{mcfg.num_key_value_heads} kv, "
          f"vocab {mcfg.vocab_size}] on TP={args.tp} x PP={args.pp} = {args.tp * args.pp} {where}, "
          f"{len(cfg.requests)} requests{' (compiled)' if args.compile else ''}")
    return _report(args, cfg, src, drv, workers, wall, build_model)


def _warn_if_under_launcher() -> None:
    """``torchrun`` started this process but the demo would start its own ranks."""
    import os

    if os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("LOCAL_WORLD_SIZE"):
        print("groupcoord demo: note: this process was started by torchrun; each process "
              "starts its own tp*pp ranks with --launcher spawn (pass --launcher env to make "
              "it one rank of the launched world)", file=sys.stderr)


def _report(args: argparse.Namespace, cfg: Any, src: str, drv: dict[str, Any],
            workers: list[dict[str, Any]], wall: float, build_model: Any) -> int:
    """Print the driver's results, verify them, write the JSON; the exit status."""
    from coordinator.engine.demo.reference import (
        compare_with_reference,
        reference_run,
        verdict_text,
    )

    ref = reference_run(cfg, drv["sequences"], build_model)
    v = compare_with_reference(drv["generated"], drv["logits"], ref)

    print("  generated token ids (new tokens per prompt):")
    for i, (gen, (prompt, _, _)) in enumerate(zip(drv["generated"], cfg.requests, strict=True)):
        print(f"    prompt {i} ({len(prompt)} tokens): {gen}")
    mb, comp = drv["metadata_broadcast_us"], drv["step_compute_us"]
    print(f"  throughput: {drv['tokens_per_s']:.1f} tokens/s ({drv['new_tokens']} tokens, "
          f"{drv['steps']} steps, {drv['seconds']:.2f} s; warm-up {drv['warmup_seconds']:.2f} s; "
          f"{wall:.1f} s with "
          f"{'process start-up' if args.launcher == 'spawn' else 'group set-up'})")
    print(f"  time per step (p50 / p99): metadata broadcast {mb['p50']:.1f} / {mb['p99']:.1f} us "
          f"(driver enqueue); compute {comp['p50'] / 1e3:.2f} / {comp['p99'] / 1e3:.2f} ms")
    _print_arrivals(workers, mb)
    print(f"  TP communicator: {drv['communicator']}")
    print(verdict_text(v))
    if args.json_path:
        _write_json(args, src, drv, workers, {"reference_generated": ref.tokens,
                                           "tokens_identical": v.tokens_identical,
                                           "max_logit_diff": v.max_logit_diff,
                                           "logit_tolerance": v.tolerance,
                                           "divergences": v.divergences,
                                           "verified": v.verified,
                                           "logits_sha256": _digest(drv["logits"])})
    return 0 if v.verified else 1


def _print_arrivals(workers: list[dict[str, Any]], enqueue: dict[str, float]) -> None:
    """Per worker: metadata arrival latency and the CPU its wait cost."""
    if not workers:
        return
    print("  metadata arrival at workers (driver's clock before encoding -> worker's dequeue "
          "returned), p50 / p99; waiting CPU (the waiting thread's CPU time in dequeue):")
    for w in workers:
        a = w["arrival_us"]
        ratio = a["p50"] / enqueue["p50"] if enqueue["p50"] > 0 else float("nan")
        print(f"    rank {w['rank']}: {a['p50']:.1f} / {a['p99']:.1f} us ({ratio:.2f}x the "
              f"driver's enqueue p50); waiting CPU {w['wait_cpu_us_per_step']:.0f} us per step = "
              f"{w['wait_cpu_percent']:.1f}% of a core over {w['wait_ms_per_step']:.2f} ms waited")


def _digest(t: Any) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes: equal digests, bit-identical logits."""
    import hashlib

    import torch

    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _write_json(args: argparse.Namespace, src: str, drv: dict[str, Any],
                workers: list[dict[str, Any]], verdict: dict[str, Any]) -> None:
    out: dict[str, Any] = {
        "generated": drv["generated"],
        "tp": args.tp, "pp": args.pp, "model": src,
        "steps": drv["steps"], "new_tokens": drv["new_tokens"],
        "seconds": drv["seconds"], "warmup_seconds": drv["warmup_seconds"],
        "tokens_per_s": drv["tokens_per_s"],
        "metadata_broadcast_us": drv["metadata_broadcast_us"],
        "step_compute_us": drv["step_compute_us"],
        "worker_recv_latency_us": workers[0]["arrival_us"] if workers else None,
        "workers": workers,
        **verdict, "compiled": args.compile, "launcher": args.launcher,
    }
    with open(args.json_path, "w") as f:
        json.dump(out, f, indent=2)
    print(f"  wrote {args.json_path}")

"""The demo engine: a driver, TP x PP workers, and groupcoord between them.

Every rank holds one shard of the model (a :class:`ModelRunner`). Global rank 0
is also the *driver*: it runs the scheduler (:func:`generate_greedy`, greedy
decoding with continuous batching) and, each step::

    driver (rank 0)                              every other rank
    ---------------                              ----------------
    step = scheduler.next()
    meta_q.enqueue(step)      == shared memory ==> step = meta_q.dequeue()
    runner.execute(step)      <== TP all-reduce / PP send/recv ==> runner.execute(step)
    tokens = result_q.dequeue() <== single-reader queue == last PP stage, TP rank 0
    scheduler.update(tokens)

``meta_q`` is the world group's message queue (one writer, all ranks read;
its readers wait predictively, see :mod:`shm_broadcast.waiting.predictive`, and time
each step's arrival and the CPU their wait cost);
``result_q`` is a single-reader queue from the last pipeline stage to the
driver (unused when the driver is itself the last stage, i.e. PP=1).

After generation the driver asks every rank to run the full sequences once
more and returns the logits, so the caller can compare them with the
unsharded reference.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import msgspec
import torch

__all__ = ["EngineConfig", "engine_rank"]

_STOP = "stop"
_VERIFY = "verify"


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What every rank needs to build its shard and run.

    Attributes:
        tp: Tensor-parallel size.
        pp: Pipeline-parallel size.
        model_dir: Hugging Face Llama checkpoint directory, or None for the
            embedded fixed-seed model.
        seed: Seed of the embedded model.
        requests: ``(prompt ids, max_new_tokens, arrival_step)`` per request.
        compile: Run the model through ``torch.compile(fullgraph=True)``.
        compile_backend: Backend for ``--compile``.
        ignore_eos: Do not stop at the model's end-of-sequence ids.
        progress: Print progress lines while running.
        kv_blocks: KV cache capacity in blocks of 16 tokens.
        dtype: Compute dtype: ``float32`` (default; bf16/fp16 checkpoints are
            upcast), ``auto`` (the checkpoint's dtype), ``bfloat16`` or ``float16``.
    """

    tp: int
    pp: int
    model_dir: str | None
    seed: int
    requests: tuple[tuple[tuple[int, ...], int, int], ...]
    compile: bool = False
    compile_backend: str = "aot_eager"
    ignore_eos: bool = False
    progress: bool = True
    kv_blocks: int = 512
    dtype: str = "float32"


def build_model(cfg: EngineConfig, tp_group: Any, pp_group: Any) -> Any:
    """This rank's shard (or the whole model when both groups are None)."""
    from coordinator.engine.models.config import default_config, resolve_dtype
    from coordinator.engine.models.llama import LlamaForCausalLM

    if cfg.model_dir:
        return LlamaForCausalLM.from_pretrained(cfg.model_dir, tp_group, pp_group, cfg.dtype)
    return LlamaForCausalLM.from_seed(
        seed=cfg.seed,
        tp_group=tp_group,
        pp_group=pp_group,
        dtype=resolve_dtype(cfg.dtype, default_config()),
    )


def _stats_us(samples_ns: list[int]) -> dict[str, float]:
    if not samples_ns:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0, "mean": 0.0, "n": 0}
    t = torch.tensor(samples_ns, dtype=torch.float64) / 1e3
    return {
        "p50": float(t.quantile(0.5)),
        "p90": float(t.quantile(0.9)),
        "p99": float(t.quantile(0.99)),
        "max": float(t.max()),
        "mean": float(t.mean()),
        "n": len(samples_ns),
    }


class _Arrivals:
    """A worker's record of each timed step message: arrival latency (driver's
    clock read before encoding -> ``dequeue`` returned, one monotonic clock for
    every process of the host) and the CPU its waiting thread spent in
    ``dequeue`` (thread CPU time, so the model's compute threads don't count)."""

    def __init__(self) -> None:
        self.latency_ns: list[int] = []
        self.wait_cpu_ns = 0
        self.wait_wall_ns = 0

    def receive(self, meta_q: Any) -> Any:
        """``meta_q.dequeue()``, timed."""
        # The CPU interval nests inside the wall interval (wall read first and
        # last), so a fully busy wait reports at most 100% of a core.
        w0 = time.perf_counter_ns()
        c0 = time.thread_time_ns()
        msg = meta_q.dequeue()
        c1 = time.thread_time_ns()
        now = time.perf_counter_ns()
        if msg.get("timed"):
            self.latency_ns.append(now - msg["t_ns"])
            self.wait_cpu_ns += c1 - c0
            self.wait_wall_ns += now - w0
        return msg

    def report(self, rank: int, meta_q: Any) -> dict[str, Any]:
        n = len(self.latency_ns)
        return {
            "rank": rank,
            "arrival_us": _stats_us(self.latency_ns),
            "wait_cpu_us_per_step": self.wait_cpu_ns / 1e3 / n if n else 0.0,
            "wait_cpu_percent": 100.0 * self.wait_cpu_ns / self.wait_wall_ns
            if self.wait_wall_ns else 0.0,
            "wait_ms_per_step": self.wait_wall_ns / 1e6 / n if n else 0.0,
            "queue_wait_stats": meta_q.park_stats(),
        }


def engine_rank(rank: int, world_size: int, cfg: EngineConfig) -> dict[str, Any]:
    """Run on every rank (via ``run_distributed``); the driver's dict has the results."""
    from coordinator import parallel_state as ps
    from coordinator.engine.models.runner import ModelRunner

    ps.initialize_model_parallel(cfg.tp, cfg.pp)
    world, tp, pp = ps.get_world_group(), ps.get_tp_group(), ps.get_pp_group()
    model = build_model(cfg, tp, pp if pp.world_size > 1 else None)
    runner = ModelRunner(
        model, num_kv_blocks=cfg.kv_blocks, compile=cfg.compile, compile_backend=cfg.compile_backend
    )
    meta_q = world.create_mq_broadcaster(writer_rank=0)
    result_rank = (cfg.pp - 1) * cfg.tp  # last stage, TP rank 0 (DP = 1)
    writer, readers = world.create_single_reader_mq_broadcasters(0, blocking=True)
    try:
        if rank == 0:
            return _drive(cfg, runner, meta_q, readers, result_rank, model, type(tp.comm).__name__)
        return _serve(rank, runner, meta_q, writer if rank == result_rank else None)
    finally:
        for q in [meta_q, writer, *readers]:
            if q is not None:
                q.close()
        runner.close()


def _serve(rank: int, runner: Any, meta_q: Any, result_q: Any) -> dict[str, Any]:
    """Worker loop: run whatever the driver sends until it says stop."""
    from coordinator.engine.models.runner import StepInput

    arrivals = _Arrivals()
    while True:
        msg = arrivals.receive(meta_q)
        if msg["kind"] == _STOP:
            break
        step = StepInput(**msg["step"])
        if msg["kind"] == _VERIFY:
            logits = runner.run(step, all_logits=True)
            if result_q is not None:
                result_q.enqueue(logits)
            continue
        tokens = runner.execute(step)
        if result_q is not None:
            result_q.enqueue(tokens)
    return arrivals.report(rank, meta_q)


def _drive(
    cfg: EngineConfig,
    runner: Any,
    meta_q: Any,
    readers: list[Any],
    result_rank: int,
    model: Any,
    comm_name: str,
) -> dict[str, Any]:
    """Driver loop: schedule, broadcast each step, collect next tokens."""
    from coordinator.engine.models.generate import GenerationRequest, generate_greedy

    driver = _Driver(cfg, runner, meta_q, readers, result_rank)
    warmup_s = driver.warm_up()
    eos = () if cfg.ignore_eos else model.config.eos_token_ids
    reqs = [
        GenerationRequest(i, list(p), n, arrival) for i, (p, n, arrival) in enumerate(cfg.requests)
    ]
    driver.restart_clock()
    generated = generate_greedy(driver.step, reqs, eos_token_ids=eos)
    elapsed = time.perf_counter() - driver.start
    if cfg.progress:
        print(file=sys.stderr)
    seqs = [list(r.prompt) + generated[r.req_id] for r in reqs]
    logits = driver.verify(seqs, first_id=1 + max(r.req_id for r in reqs))
    driver.send(_STOP, None)
    new_tokens = sum(len(v) for v in generated.values())
    return {
        "generated": [generated[r.req_id] for r in reqs],
        "sequences": seqs,
        "logits": logits,
        "steps": driver.counters["steps"],
        "seconds": elapsed,
        "warmup_seconds": warmup_s,
        "new_tokens": new_tokens,
        "tokens_per_s": new_tokens / elapsed if elapsed > 0 else 0.0,
        "metadata_broadcast_us": _stats_us(driver.bcast_ns[: driver.counters["steps"]]),
        "step_compute_us": _stats_us(driver.compute_ns),
        "communicator": comm_name,
    }


class _Driver:
    """The driver's side of each step: broadcast it, run it, collect its tokens, time both."""

    def __init__(self, cfg: EngineConfig, runner: Any, meta_q: Any, readers: list[Any],
                 result_rank: int) -> None:
        self.cfg, self.runner, self.meta_q = cfg, runner, meta_q
        self.readers, self.result_rank = readers, result_rank
        self.bcast_ns: list[int] = []
        self.compute_ns: list[int] = []
        self.counters: dict[str, Any] = {"steps": 0, "tokens": 0}
        self.restart_clock()

    def restart_clock(self) -> None:
        self.start = time.perf_counter()
        self.counters["last_print"] = self.start

    def send(self, kind: str, step: Any) -> None:
        """Broadcast one step (or a control message) to every worker; steps are
        timed here and, on arrival, by the workers."""
        t0 = time.perf_counter_ns()
        body = msgspec.structs.asdict(step) if step is not None else None
        self.meta_q.enqueue({"kind": kind, "step": body, "t_ns": t0, "timed": kind == "step"})
        self.bcast_ns.append(time.perf_counter_ns() - t0)

    def result(self, local: Any) -> Any:
        """The step's result: ours on rank 0, else the last pipeline stage's."""
        return local if self.result_rank == 0 else self.readers[self.result_rank].dequeue()

    def step(self, step: Any) -> list[int]:
        """One timed decoding step (the callback of generate_greedy)."""
        self.send("step", step)
        t0 = time.perf_counter_ns()
        tokens: list[int] = self.result(self.runner.execute(step))
        self.compute_ns.append(time.perf_counter_ns() - t0)
        self.counters["steps"] += 1
        self.counters["tokens"] += sum(1 for _ in step.req_ids)
        _progress(self.cfg, self.counters, self.start)
        return tokens

    def warm_up(self) -> float:
        """One dummy request through the whole pipeline, so one-time costs (first
        kernels, thread pools, compilation) stay out of the step timings."""
        from coordinator.engine.models.runner import StepInput

        t0 = time.perf_counter()
        warm_id = -1
        for warm in (StepInput([warm_id], [[0, 1, 2, 3]], [0]),
                     StepInput([], [], [], [warm_id])):
            self.meta_q.enqueue({"kind": "step", "step": msgspec.structs.asdict(warm),
                                 "t_ns": time.perf_counter_ns()})
            self.result(self.runner.execute(warm))
        return time.perf_counter() - t0

    def verify(self, seqs: list[list[int]], first_id: int) -> Any:
        """The full sequences once more, all logits back to the driver."""
        from coordinator.engine.models.runner import StepInput

        verify = StepInput(
            [first_id + i for i in range(len(seqs))],
            [s[:-1] if len(s) > 1 else s for s in seqs],
            [0] * len(seqs),
        )
        self.send(_VERIFY, verify)
        return self.result(self.runner.run(verify, all_logits=True))


def _progress(cfg: EngineConfig, counters: dict[str, Any], start: float) -> None:
    if not cfg.progress:
        return
    now = time.perf_counter()
    if now - counters["last_print"] < 0.5:
        return
    counters["last_print"] = now
    rate = counters["tokens"] / max(now - start, 1e-9)
    print(
        f"\r  step {counters['steps']:4d} | {counters['tokens']:5d} tokens scheduled | "
        f"{rate:7.1f} tok/s",
        end="",
        file=sys.stderr,
        flush=True,
    )

"""What every rank of ``groupcoord bench engine`` runs: the step loop, timed.

Rank 0 (the driver) and every other TP rank (workers)::

    driver                                          workers
    ------                                          -------
    sleep until the step's start (fixed clock)
    t0 = clock; q.enqueue({step, t_ns: t0, meta})  ==> msg = q.dequeue()
                                                        arrival = clock - msg.t_ns
    all_reduce x layers           <== TP group ==>      all_reduce x layers

``q`` is the TP group's broadcaster (``GroupCoordinator.mq_broadcaster``,
predictive by default) for the ``predictive`` policy, and a broadcaster of the
same group with the named :data:`POLICIES` entry otherwise. Policies run in
interleaved blocks of ``warmup_steps + steps`` steps; a block ends with a
``switch`` message on its queue naming the next policy's queue (or ``stop``),
so readers always know where the next message comes from. Only the last
``steps`` of each block are recorded: the first ones let a predictive reader
re-learn the rhythm broken by the switch.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

__all__ = ["EngineBenchConfig", "POLICY_NAMES", "bench_rank", "step_metadata"]

#: Wait policies a run can compare (see :func:`_policy`).
POLICY_NAMES = ("predictive", "plain", "spin")


@dataclasses.dataclass(frozen=True)
class EngineBenchConfig:
    """What every rank needs to run the benchmark.

    Attributes:
        tp: TP group size (the world: one TP group).
        step_ms: Time between the starts of two steps (the driver's clock).
        steps: Recorded steps per block.
        warmup_steps: Unrecorded steps at the start of each block.
        layers: ``all_reduce`` calls per step.
        allreduce_bytes: Bytes of each ``all_reduce`` (float32).
        meta_bytes: About this many bytes of metadata per step (msgpack).
        threads: torch intra-op threads per rank.
        load: ``"none"``, ``"thread"`` (matmuls in every rank) or ``"process"``
            (started by the caller, outside the ranks).
        load_size: Matrix dimension of the load.
        policies: Names from :data:`POLICY_NAMES`, compared in this order.
        rounds: Blocks per policy (interleaved).
    """

    tp: int = 2
    step_ms: float = 10.0
    steps: int = 300
    warmup_steps: int = 30
    layers: int = 8
    allreduce_bytes: int = 64 << 10
    meta_bytes: int = 3000
    threads: int = 1
    load: str = "none"
    load_size: int = 256
    policies: tuple[str, ...] = ("predictive",)
    rounds: int = 1


def _policy(name: str) -> Any:
    """``predictive``: the broadcaster default; ``plain``: spin -> yield (2 ms) ->
    park; ``spin``: yield-poll up to 1 s after each message (what vLLM's reader
    does), so at step times below 1 s it never parks."""
    from shm_broadcast import WaitPolicy

    return {"predictive": WaitPolicy.predictive(), "plain": WaitPolicy(),
            "spin": WaitPolicy(yield_s=1.0)}[name]


def step_metadata(step: int, nbytes: int) -> dict[str, Any]:
    """Scheduler-like metadata of about ``nbytes`` bytes as msgpack (lists of
    ids, positions and block tables for ``nbytes // 33`` requests)."""
    reqs = max(1, nbytes // 33)
    return {
        "step": step, "t_ns": 0,
        "req_ids": [f"r{i:05d}" for i in range(reqs)],
        "num_tokens": [1 + (i * 7 + step) % 5 for i in range(reqs)],
        "positions": [(step * 3 + i * 11) % 4096 for i in range(reqs)],
        "new_token_ids": [(step * 131 + i * 17) % 32000 for i in range(reqs)],
        "block_tables": [[(i * 16 + j) % 8192 for j in range(6)] for i in range(reqs)],
    }


def bench_rank(rank: int, world_size: int, cfg: EngineBenchConfig) -> dict[str, Any]:
    """Run on every rank (via ``run_distributed``); returns this rank's blocks."""
    import torch

    from coordinator import parallel_state as ps
    from coordinator.bench.load import LoadThread

    torch.set_num_threads(cfg.threads)
    ps.initialize_model_parallel(cfg.tp, 1)
    tp = ps.get_tp_group()
    own = {name: tp.create_mq_broadcaster(writer_rank=0, wait_policy=_policy(name))
           for name in dict.fromkeys(cfg.policies) if name != "predictive"}
    queues = {"predictive": tp.mq_broadcaster, **own}
    x = torch.ones(max(1, cfg.allreduce_bytes // 4), dtype=torch.float32)
    load = LoadThread(cfg.load_size) if cfg.load == "thread" else None
    try:
        tp.barrier()
        run = _drive if tp.rank_in_group == 0 else _serve
        blocks = run(tp, queues, x, cfg)
    finally:
        if load is not None:
            load.close()
        for q in own.values():
            q.close()
    return {"rank": rank, "blocks": blocks,
            "load_products": load.products if load is not None else None}


def _schedule(cfg: EngineBenchConfig) -> list[str]:
    return [name for _ in range(cfg.rounds) for name in cfg.policies]


def _layers(tp: Any, x: Any, n: int, into: list[int] | None) -> None:
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        tp.all_reduce(x)
        if into is not None:
            into.append(clock() - t0)


def _new_block(name: str) -> dict[str, Any]:
    return {"policy": name, "arrival_ns": [], "enqueue_ns": [], "allreduce_ns": [],
            "wait_cpu_ns": 0, "wait_wall_ns": 0, "late_starts": 0}


def _drive(tp: Any, queues: dict[str, Any], x: Any, cfg: EngineBenchConfig) -> list[dict[str, Any]]:
    """The driver: every block's steps on a fixed clock, then the switch message."""
    schedule = _schedule(cfg)
    blocks = []
    for k, name in enumerate(schedule):
        q, block = queues[name], _new_block(name)
        msg = step_metadata(0, cfg.meta_bytes)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        _drive_block(tp, q, x, msg, block, cfg)
        block["cpu_s"], block["wall_s"] = time.process_time() - cpu0, time.perf_counter() - wall0
        q.enqueue({"cmd": "switch", "to": schedule[k + 1] if k + 1 < len(schedule) else None})
        blocks.append(block)
    return blocks


def _drive_block(tp: Any, q: Any, x: Any, msg: dict[str, Any], block: dict[str, Any],
                 cfg: EngineBenchConfig) -> None:
    clock, step_s = time.perf_counter, cfg.step_ms / 1e3
    nxt = clock() + step_s
    for i in range(cfg.warmup_steps + cfg.steps):
        delay = nxt - clock()
        if delay > 0:
            time.sleep(delay)
        elif i >= cfg.warmup_steps:
            block["late_starts"] += 1  # the previous step overran the step time
        rec = i >= cfg.warmup_steps
        t0 = time.perf_counter_ns()
        msg["step"], msg["t_ns"] = i, t0
        q.enqueue(msg)
        if rec:
            block["enqueue_ns"].append(time.perf_counter_ns() - t0)
        _layers(tp, x, cfg.layers, block["allreduce_ns"] if rec else None)
        nxt = max(nxt + step_s, clock())


def _serve(tp: Any, queues: dict[str, Any], x: Any, cfg: EngineBenchConfig) -> list[dict[str, Any]]:
    """A worker: dequeue, time the arrival and the wait's CPU, run the layers."""
    blocks = []
    name: str | None = cfg.policies[0]
    while name is not None:
        q, block = queues[name], _new_block(name)
        before = q.park_stats()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        while True:
            w0 = time.perf_counter_ns()  # CPU interval nested in the wall interval
            c0 = time.thread_time_ns()
            msg = q.dequeue()
            c1 = time.thread_time_ns()
            now = time.perf_counter_ns()
            if "cmd" in msg:
                name = msg["to"]
                break
            if msg["step"] >= cfg.warmup_steps:
                block["arrival_ns"].append(now - msg["t_ns"])
                block["wait_cpu_ns"] += c1 - c0
                block["wait_wall_ns"] += now - w0
            _layers(tp, x, cfg.layers,
                    block["allreduce_ns"] if msg["step"] >= cfg.warmup_steps else None)
        block["cpu_s"], block["wall_s"] = time.process_time() - cpu0, time.perf_counter() - wall0
        after = q.park_stats()
        block["queue_stats"] = {k: v - before.get(k, 0) for k, v in after.items()}
        blocks.append(block)
    return blocks

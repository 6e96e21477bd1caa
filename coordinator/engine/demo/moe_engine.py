"""The MoE demo engine: DP replicas of a TP x PP decoder whose experts span each stage's
DP x TP ranks.


World layout (:mod:`coordinator.parallel_state`): ``r = d * PP * TP + p * TP + t``.
Replica ``d`` (its TP x PP ranks) serves the requests with ``req_id % DP == d``
with its own KV cache; attention is sharded by TP inside the replica, the
experts of stage ``p`` over the EP group of that stage (all DP x TP ranks,
``ep_rank = d * TP + t``), so every MoE layer's dispatch/combine crosses the
replicas: a token all-to-all (``moe_comm="all2all"``) or the seed's all-gather /
reduce-scatter (``"allgather"``), see :mod:`coordinator.engine.models.moe_block`.

Every rank runs the same deterministic scheduler (:func:`generate_greedy`) in
lockstep; per step, on every rank::

    my = the step's requests (and finished requests) of my replica
    my non-empty: tokens = runner.step(my)        TP collectives, PP hand-off,
                                                  EP dispatch/combine per MoE layer
    my empty:     free KV; model.idle()           EP dispatch/combine with zero rows:
                                                  my experts still serve the others
    DP all_gather of every replica's tokens (sizes known to all: same schedule)
    -> the step's next tokens, in the step's request order, on every rank

Because the idle path makes the same EP calls, in layer order, as a forward
of the stage, the EP group's calls stay paired whatever the routing and
however requests are spread over replicas. For the same reason a step is one
forward per stage when DP > 1: pipeline micro-batches
(:mod:`coordinator.engine.models.pipeline`) are split from each replica's own
requests, so replicas would run different numbers of them (with DP = 1 every
rank of a stage splits the same step, and micro-batches stay on).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from coordinator.engine.models.moe_block import MoeComm

__all__ = ["MoeEngineConfig", "build_moe_model", "moe_engine_rank"]


@dataclasses.dataclass(frozen=True)
class MoeEngineConfig:
    """What every rank needs.

    Attributes:
        tp: Tensor-parallel size (attention and dense/shared MLPs).
        pp: Pipeline-parallel size.
        dp: Data-parallel replicas (experts span ``dp * tp`` ranks per stage).
        model_dir: Mixtral / Qwen2-MoE checkpoint dir, or None for the embedded model.
        seed: Seed of the embedded model.
        requests: ``(prompt ids, max_new_tokens, arrival_step)`` per request.
        ignore_eos: Do not stop at end-of-sequence ids.
        kv_blocks: KV cache capacity in blocks of 16 tokens (per replica).
        dtype: Compute dtype name (``float32``, ``auto``, ``bfloat16``, ``float16``).
        moe_comm: ``all2all`` or ``allgather``
            (:class:`~coordinator.engine.models.moe_block.MoeComm`).
        moe_sp: Sequence-parallel MoE: each TP rank routes its own token slice
            (False needs ``allgather``; no effect at TP = 1).

    Raises:
        ValueError: ``moe_comm`` is unknown, or ``moe_sp`` is False with ``all2all``.
    """

    tp: int
    pp: int
    dp: int
    model_dir: str | None
    seed: int
    requests: tuple[tuple[tuple[int, ...], int, int], ...]
    ignore_eos: bool = False
    kv_blocks: int = 512
    dtype: str = "float32"
    moe_comm: str = "all2all"
    moe_sp: bool = True

    def __post_init__(self) -> None:
        self.comm()  # refuse a bad moe_comm / moe_sp here, not on every rank

    def comm(self) -> MoeComm:
        """The sparse blocks' :class:`~coordinator.engine.models.moe_block.MoeComm`."""
        from coordinator.engine.models.moe_block import MoeComm

        return MoeComm(self.moe_comm, self.moe_sp)

    def sequence_parallel(self) -> bool:
        """Whether the MoE blocks split the tokens over TP (never with one TP rank)."""
        return self.moe_sp and self.tp > 1


def build_moe_model(cfg: MoeEngineConfig, tp_group: Any, pp_group: Any,
                    ep_group: Any = None) -> Any:
    """This rank's shard (the whole model when every group is None)."""
    from coordinator.engine.models.config import resolve_dtype
    from coordinator.engine.models.moe_config import default_moe_config
    from coordinator.engine.models.moe_model import MoeForCausalLM

    if cfg.model_dir:
        return MoeForCausalLM.from_pretrained(cfg.model_dir, tp_group, pp_group, ep_group,
                                              cfg.dtype, cfg.comm())
    return MoeForCausalLM.from_seed(seed=cfg.seed, tp_group=tp_group, pp_group=pp_group,
                                    ep_group=ep_group,
                                    dtype=resolve_dtype(cfg.dtype, default_moe_config()),
                                    comm=cfg.comm())


class _ReplicaStepper:
    """One rank's part of each lockstep step (see the module docstring)."""

    def __init__(self, runner: Any, model: Any, dp_group: Any) -> None:
        self.runner, self.model, self.dp_group = runner, model, dp_group
        self.dp, self.replica = dp_group.world_size, dp_group.rank_in_group
        #: Steps with requests in which this replica had none (it only served its experts).
        self.idle_steps = 0

    def _mine(self, step: Any) -> Any:
        from coordinator.engine.models.runner import StepInput

        keep = [i for i, r in enumerate(step.req_ids) if r % self.dp == self.replica]
        return StepInput([step.req_ids[i] for i in keep], [step.token_ids[i] for i in keep],
                         [step.num_computed[i] for i in keep],
                         [r for r in step.finished_req_ids if r % self.dp == self.replica])

    def step(self, step: Any) -> list[int]:
        """The step's next tokens (every request, in order), on every rank."""
        mine = self._mine(step)
        if mine.req_ids:
            tokens: list[int] = self.runner.step(mine)
        else:
            self.runner.run(mine)  # frees finished requests' KV blocks
            self.model.idle()
            self.idle_steps += bool(step.req_ids)
            tokens = []
        if self.dp == 1:
            return tokens
        owners = [r % self.dp for r in step.req_ids]
        width = max((owners.count(d) for d in range(self.dp)), default=0)
        if width == 0:
            return []
        buf = torch.full((width,), -1, dtype=torch.long)
        buf[: len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        table = self.dp_group.all_gather(buf, dim=0).view(self.dp, width).tolist()
        taken = [0] * self.dp
        out = []
        for d in owners:
            out.append(table[d][taken[d]])
            taken[d] += 1
        return out

    def verify(self, seqs: list[list[int]], first_id: int) -> tuple[list[int], Any]:
        """Score this replica's sequences (index ``i % dp == replica``) with all logits.

        Returns the sequence indices and, on the last stage, their logits (else None).
        """
        from coordinator.engine.models.runner import StepInput

        idx = [i for i in range(len(seqs)) if i % self.dp == self.replica]
        step = StepInput([first_id + i for i in idx],
                         [seqs[i][:-1] if len(seqs[i]) > 1 else seqs[i] for i in idx],
                         [0] * len(idx))
        if not idx:
            self.model.idle()
            return idx, None
        return idx, self.runner.run(step, all_logits=True)

    def warm_up(self) -> float:
        """One dummy request per replica through the model, so one-time costs (first
        shared-memory segments, thread pools, peers still loading weights) stay out of
        the step timings; the expert load counters restart after it. Returns seconds."""
        from coordinator.engine.models.runner import StepInput

        t0 = time.perf_counter()
        ids = [-1 - d for d in range(self.dp)]  # -1 - d covers every residue mod dp
        self.step(StepInput(ids, [[0, 1, 2, 3]] * self.dp, [0] * self.dp))
        self.step(StepInput([], [], [], ids))
        for block in self.model.sparse_blocks():
            block.expert_rows.zero_()
        self.idle_steps = 0
        return time.perf_counter() - t0


def moe_engine_rank(rank: int, world_size: int, cfg: MoeEngineConfig) -> dict[str, Any]:
    """Run on every rank (via ``run_distributed``): generate, verify pass, per-rank report."""
    from coordinator import parallel_state as ps
    from coordinator.engine.demo.engine import _stats_us
    from coordinator.engine.models.generate import GenerationRequest, generate_greedy
    from coordinator.engine.models.runner import ModelRunner

    torch.set_num_threads(1)  # tiny model, many ranks on few cores
    ps.initialize_model_parallel(cfg.tp, cfg.pp, cfg.dp, enable_expert_parallel=True)
    runner = None
    try:
        tp, pp, dp, ep = ps.get_tp_group(), ps.get_pp_group(), ps.get_dp_group(), ps.get_ep_group()
        model = build_moe_model(cfg, tp, pp if pp.world_size > 1 else None, ep)
        # Pipeline micro-batches are split per replica from its own requests, so with
        # DP > 1 replicas would make different numbers of EP calls per step: one
        # forward per stage per step keeps them paired (DP = 1 keeps the overlap).
        runner = ModelRunner(model, num_kv_blocks=cfg.kv_blocks,
                             micro_batches=2 if cfg.dp == 1 else 1)
        stepper = _ReplicaStepper(runner, model, dp)
        eos = () if cfg.ignore_eos else model.config.eos_token_ids
        reqs = [GenerationRequest(i, list(p), n, a) for i, (p, n, a) in enumerate(cfg.requests)]
        step_ns: list[int] = []

        def timed(step: Any) -> list[int]:
            t = time.perf_counter_ns()
            out = stepper.step(step)
            step_ns.append(time.perf_counter_ns() - t)
            return out

        warmup = stepper.warm_up()
        t0 = time.perf_counter()
        generated = generate_greedy(timed, reqs, eos_token_ids=eos)
        seconds = time.perf_counter() - t0
        seqs = [list(r.prompt) + generated[r.req_id] for r in reqs]
        idx, logits = stepper.verify(seqs, first_id=len(reqs))
        return {
            "rank": rank, "replica": dp.rank_in_group, "stage": pp.rank_in_group,
            "tp_rank": tp.rank_in_group, "ep_rank": ep.rank_in_group, "ep_size": ep.world_size,
            "moe_comm": cfg.moe_comm, "moe_sp": cfg.sequence_parallel(),
            "generated": [generated[r.req_id] for r in reqs], "sequences": seqs,
            "verify_indices": idx, "logits": logits if tp.rank_in_group == 0 else None,
            "steps": len(step_ns), "seconds": seconds, "step_us": _stats_us(step_ns),
            "warmup_seconds": warmup, "idle_steps": stepper.idle_steps,
            "experts": [list(range(b.first_expert, b.first_expert + b.num_local))
                        for b in model.sparse_blocks()][:1],
            "expert_rows": [b.expert_rows.tolist() for b in model.sparse_blocks()],
        }
    finally:
        if runner is not None:
            runner.close()
        ps.destroy_model_parallel()

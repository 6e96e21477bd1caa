"""The unsharded reference run of the demo (one process, no groups)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["reference_run"]


def reference_run(
    cfg: Any, sequences: list[list[int]], build_model: Callable[..., Any]
) -> tuple[list[list[int]], torch.Tensor]:
    """Generate with the whole model, and score the sharded run's sequences.

    Args:
        cfg: The demo's :class:`~coordinator.engine.demo.engine.EngineConfig`.
        sequences: Prompt + generated ids of the sharded run, per request.
        build_model: Builds the model for ``(cfg, tp_group, pp_group)``.

    Returns:
        The reference's generated ids per request, and its logits for
        ``sequences`` laid out like the sharded verification pass.
    """
    from coordinator.engine.models.generate import GenerationRequest, generate_greedy
    from coordinator.engine.models.runner import ModelRunner, StepInput

    torch.set_num_threads(1)  # tiny model: one thread avoids OpenMP spin on busy cores
    model = build_model(cfg, None, None)
    runner = ModelRunner(model, num_kv_blocks=cfg.kv_blocks)
    try:
        eos = () if cfg.ignore_eos else model.config.eos_token_ids
        reqs = [GenerationRequest(i, list(p), n, a) for i, (p, n, a) in enumerate(cfg.requests)]
        out = generate_greedy(runner.step, reqs, eos_token_ids=eos)
        base = 1 + len(reqs)
        verify = StepInput(
            [base + i for i in range(len(sequences))],
            [s[:-1] if len(s) > 1 else s for s in sequences],
            [0] * len(sequences),
        )
        logits = runner.run(verify, all_logits=True)
        if logits is None:  # one process is its own last stage: run() returns the logits
            raise RuntimeError("the unsharded reference run returned no logits")

    finally:
        runner.close()
    return [out[r.req_id] for r in reqs], logits

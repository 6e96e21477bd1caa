"""The unsharded reference run of the demo (one process, no groups), and the verdict."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Reference", "Verdict", "reference_run", "compare_with_reference", "logit_tolerance",
           "describe_divergence", "verdict_text"]


@dataclasses.dataclass
class Reference:
    """What the unsharded run gives the verdict.

    Attributes:
        tokens: The reference's generated ids, per request.
        logits: Its logits for the sharded run's sequences, laid out like the
            sharded verification pass.
        top2: Per request, per generated token: the reference's two highest
            logits at that step as ``((token, logit), (token, logit))`` (the
            second ``None`` with a one-token vocabulary).
    """

    tokens: list[list[int]]
    logits: torch.Tensor
    top2: list[list[tuple[tuple[int, float], tuple[int, float] | None]]]


@dataclasses.dataclass
class Verdict:
    """The sharded run against the reference (see :func:`compare_with_reference`).

    Attributes:
        tokens_identical: Every request generated the reference's ids.
        max_logit_diff: Largest ``|sharded - reference|`` logit over the sequences.
        tolerance: The bound on both that difference and a near-tie's gap.
        divergences: Per request whose ids differ, where and how (see
            :func:`compare_with_reference`).
        verified: Logits within ``tolerance`` and every divergence a near-tie.
    """

    tokens_identical: bool
    max_logit_diff: float
    tolerance: float
    divergences: list[dict[str, Any]]
    verified: bool


def reference_run(cfg: Any, sequences: list[list[int]], build_model: Callable[..., Any]
                  ) -> Reference:
    """Generate with the whole model, and score the sharded run's sequences.

    Args:
        cfg: The demo's :class:`~coordinator.engine.demo.engine.EngineConfig`.
        sequences: Prompt + generated ids of the sharded run, per request.
        build_model: Builds the model for ``(cfg, tp_group, pp_group)``.

    Returns:
        The reference's generated ids and top-two logits per step, and its
        logits for ``sequences``.
    """
    from coordinator.engine.demo.requests import kv_blocks_needed
    from coordinator.engine.models.generate import GenerationRequest, generate_greedy
    from coordinator.engine.models.runner import ModelRunner, StepInput

    torch.set_num_threads(1)  # tiny model: one thread avoids OpenMP spin on busy cores
    model = build_model(cfg, None, None)
    # one process runs every request (cfg.kv_blocks is per replica with --dp): size the
    # cache to all of them (the verification pass, after they are freed, needs no more)
    runner = ModelRunner(model, num_kv_blocks=kv_blocks_needed(cfg.requests))
    top2: dict[int, list[Any]] = {}

    def step(s: StepInput) -> list[int]:
        # one process is its own last stage: run() returns the logits; every scheduled
        # request samples (no chunked prefill), so each row is its next token's
        logits = runner.run(s)
        if logits is None:
            raise RuntimeError("the unsharded reference run returned no logits")
        chosen: list[int] = logits.argmax(dim=-1).tolist()
        if s.req_ids:
            vals, idx = logits.float().topk(min(2, logits.shape[-1]), dim=-1)
            for req, tok, v, i in zip(s.req_ids, chosen, vals.tolist(), idx.tolist(),
                                      strict=True):
                # the chosen id first, then the best other one (at an exact tie, topk's
                # order may differ from argmax's)
                others = [(t, x) for t, x in zip(i, v, strict=True) if t != tok]
                top2.setdefault(req, []).append(((tok, max(v)), others[0] if others else None))
        return chosen

    try:
        eos = () if cfg.ignore_eos else model.config.eos_token_ids
        reqs = [GenerationRequest(i, list(p), n, a) for i, (p, n, a) in enumerate(cfg.requests)]
        out = generate_greedy(step, reqs, eos_token_ids=eos)
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
    return Reference([out[r.req_id] for r in reqs], logits,
                     [top2.get(r.req_id, []) for r in reqs])


def logit_tolerance(ref_logits: torch.Tensor, dtype: torch.dtype) -> float:
    """How far sharded logits may be from the reference's: sharding only reorders float
    sums, so rounding relative to the logits' scale (the largest reference logit, at
    least 1): ``1e-3`` of it in float32, ``5e-2`` in the 16-bit dtypes."""
    scale = max(1.0, float(ref_logits.abs().max())) if ref_logits.numel() else 1.0
    return (1e-3 if dtype == torch.float32 else 5e-2) * scale


def compare_with_reference(generated: list[list[int]], sharded_logits: torch.Tensor,
                           ref: Reference) -> Verdict:
    """The verdict on a sharded run.

    Greedy ids must be the reference's, with one exception: where a request's
    ids first differ, the reference's top two logits may be a near-tie (their
    gap within :func:`logit_tolerance`) with the sharded run's id the
    reference's runner-up -- rounding that sharding reorders can flip such a
    choice (bf16/fp16 under TP), and after it the sequences differ by
    construction. Either way each first divergence is reported: request,
    index among the new ids, both ids, the reference's top two and their gap,
    and whether that was a near-tie. The logits (both scored on the sharded
    run's sequences) must also be within the tolerance.
    """
    diff = (float((sharded_logits - ref.logits).abs().max())
            if sharded_logits.numel() else 0.0)
    tol = logit_tolerance(ref.logits, sharded_logits.dtype)
    divergences = []
    for i, (got, want) in enumerate(zip(generated, ref.tokens, strict=True)):
        if got == want:
            continue
        # first differing index (or where the shorter ends)
        k = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                 min(len(got), len(want)))
        tops = ref.top2[i][k] if k < len(ref.top2[i]) else None
        gap, near_tie = None, False
        if tops is not None and tops[1] is not None and k < len(got) and k < len(want):
            (t1, v1), (t2, v2) = tops[0], tops[1]
            gap = v1 - v2
            near_tie = gap <= tol and {got[k], want[k]} == {t1, t2}
        divergences.append({
            "prompt": i, "index": k,
            "sharded": got[k] if k < len(got) else None,
            "reference": want[k] if k < len(want) else None,
            "reference_top2": [list(t) for t in tops if t is not None] if tops else [],
            "gap": gap, "near_tie": near_tie,
        })
    ok = diff < tol and all(d["near_tie"] for d in divergences)
    return Verdict(not divergences, diff, tol, divergences, ok)


def describe_divergence(d: dict[str, Any], tol: float) -> str:
    """One report line for a divergence from :func:`compare_with_reference`."""
    where = (f"prompt {d['prompt']}: first differs at new token {d['index']}: sharded "
             f"{d['sharded']} vs reference {d['reference']}")
    if d["gap"] is None:
        return f"{where} (one run ended there) -> not a near-tie"
    tops = ", ".join(f"{t} ({v:.4g})" for t, v in d["reference_top2"])
    return (f"{where}; reference top two {tops}, gap {d['gap']:.2e} "
            f"{'<=' if d['gap'] <= tol else '>'} tolerance {tol:.2e} -> "
            f"{'near-tie' if d['near_tie'] else 'not a near-tie'}")


def verdict_text(v: Verdict) -> str:
    """The demo report's verification lines (dense and ``--model moe``)."""
    near = (" (first divergences are near-ties of the reference's top two)"
            if v.divergences and v.verified else "")
    lines = [f"  verification vs unsharded reference: greedy tokens identical: "
             f"{v.tokens_identical}{near}; max |logit diff| = {v.max_logit_diff:.2e} "
             f"(tolerance {v.tolerance:.2e}) -> {'PASS' if v.verified else 'FAIL'}"]
    lines += [f"    {describe_divergence(d, v.tolerance)}" for d in v.divergences]
    return "\n".join(lines)

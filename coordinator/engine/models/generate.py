"""Greedy generation with continuous batching, over any step function.

:func:`generate_greedy` is a small deterministic scheduler: requests arrive
at given steps, their prompts are prefilled (optionally in chunks) in the
same step as other requests' decodes, each request stops at its own
``max_new_tokens`` or at an end-of-sequence token, and its KV cache is freed
in the next step. It drives a ``step_fn(StepInput) -> next tokens``, which is
:meth:`ModelRunner.step` on a sharded job (every rank runs the same loop) or
on the unsharded reference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

from coordinator.engine.models.runner import StepInput

__all__ = ["GenerationRequest", "generate_greedy"]


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One prompt to complete.

    Attributes:
        req_id: Distinct id.
        prompt: Prompt token ids (non-empty).
        max_new_tokens: Tokens to generate at most (>= 1).
        arrival_step: First step at which the request may be scheduled.
    """

    req_id: int
    prompt: Sequence[int]
    max_new_tokens: int
    arrival_step: int = 0


@dataclasses.dataclass
class _Live:
    req: GenerationRequest
    prefilled: int = 0
    output: list[int] = dataclasses.field(default_factory=list)


def generate_greedy(
    step_fn: Callable[[StepInput], list[int]],
    requests: Iterable[GenerationRequest],
    eos_token_ids: Iterable[int] = (),
    prefill_chunk: int | None = None,
    max_steps: int = 100_000,
) -> dict[int, list[int]]:
    """Greedily complete every request; returns generated ids by request id.

    Args:
        step_fn: Runs one step, returns the next token of each scheduled request.
        requests: The requests (ids distinct, prompts non-empty).
        eos_token_ids: Tokens that end a request (included in its output).
        prefill_chunk: Prefill at most this many prompt tokens per request per step.
        max_steps: Safety bound on the number of steps.

    Raises:
        ValueError: Invalid requests or arguments, or ``max_steps`` exceeded.
    """
    reqs = list(requests)
    _check_requests(reqs, prefill_chunk)
    eos = set(eos_token_ids)
    waiting = sorted(reqs, key=lambda r: (r.arrival_step, r.req_id))
    running: list[_Live] = []
    done: dict[int, list[int]] = {}
    finished_last_step: list[int] = []
    for step_no in range(max_steps):
        while waiting and waiting[0].arrival_step <= step_no:
            running.append(_Live(waiting.pop(0)))
        if not running and not waiting:
            if finished_last_step:
                step_fn(StepInput([], [], [], finished_last_step))  # release the last caches
            return done
        step, sampling = _schedule(running, finished_last_step, prefill_chunk)
        finished_last_step = []
        if not step.req_ids:
            step_fn(step)  # releases caches; nothing scheduled (waiting for arrivals)
            continue
        running, finished_last_step = _take_tokens(running, step_fn(step), sampling, eos, done)
    raise ValueError(f"generation did not finish within max_steps={max_steps}")


def _check_requests(reqs: list[GenerationRequest], prefill_chunk: int | None) -> None:
    if len({r.req_id for r in reqs}) != len(reqs):
        raise ValueError("request ids must be distinct")
    for r in reqs:
        if not r.prompt:
            raise ValueError(f"request {r.req_id} has an empty prompt")
        if r.max_new_tokens < 1:
            raise ValueError(
                f"request {r.req_id}: max_new_tokens must be >= 1, got {r.max_new_tokens}"
            )
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1 or None, got {prefill_chunk}")


def _schedule(running: list[_Live], finished: list[int],
              prefill_chunk: int | None) -> tuple[StepInput, list[bool]]:
    """One step for every running request: its next prompt chunk, or its last token.

    Returns the step and, per request, whether this step samples a new token
    (False for a prefill chunk that does not reach the prompt's end).
    """
    ids, toks, computed, sampling = [], [], [], []
    for live in running:
        prompt = list(live.req.prompt)
        ids.append(live.req.req_id)
        if live.prefilled < len(prompt):
            n = len(prompt) - live.prefilled
            n = n if prefill_chunk is None else min(n, prefill_chunk)
            toks.append(prompt[live.prefilled : live.prefilled + n])
            computed.append(live.prefilled)
            sampling.append(live.prefilled + n == len(prompt))
            live.prefilled += n
        else:
            toks.append([live.output[-1]])
            computed.append(len(prompt) + len(live.output) - 1)
            sampling.append(True)
    return StepInput(ids, toks, computed, finished), sampling


def _take_tokens(running: list[_Live], next_tokens: list[int], sampling: list[bool],
                 eos: set[int], done: dict[int, list[int]]) -> tuple[list[_Live], list[int]]:
    """Append sampled tokens; move finished requests to ``done``.

    Returns the requests still running and the ids that finished this step.
    """
    still: list[_Live] = []
    finished: list[int] = []
    for live, tok, sample in zip(running, next_tokens, sampling, strict=True):
        if sample:
            live.output.append(int(tok))
        if sample and (len(live.output) >= live.req.max_new_tokens or int(tok) in eos):
            done[live.req.req_id] = live.output
            finished.append(live.req.req_id)
        else:
            still.append(live)
    return still, finished

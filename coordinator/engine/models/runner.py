"""Drives one rank's model shard through scheduler steps.

A step (:class:`StepInput`) lists, for every scheduled request, the tokens to
run now and how many of its tokens are already cached. A prefill is a request
with ``num_computed == 0`` and its prompt (or a chunk of it); a decode is one
token. Any mix of both is one step (continuous batching). The step is a
msgspec struct, so an engine's driver can broadcast it to the workers as is.

Per step on every rank::

    free finished requests' KV blocks
    reserve KV slots, build AttentionInputs            (same on every rank)
    first stage: embed token ids  | later stage: recv hidden states from prev
    run the local layers           (TP collectives inside)
    not last stage: send hidden states to next stage -> None
    last stage: greedy next token of every request    -> list[int]

With several pipeline stages the step runs in micro-batches of requests whose
transfers are asynchronous, so a stage sends one micro-batch while it
computes the next (:mod:`coordinator.engine.models.pipeline`).

The next tokens exist on the last pipeline stage;
:meth:`ModelRunner.share_next_tokens` broadcasts them to the whole
pipeline group so the first stage (the driver's) has them.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from coordinator.engine.models.kv_cache import AttentionInputs
from coordinator.engine.models.llama import LlamaForCausalLM
from coordinator.engine.models.pipeline import run_stage

__all__ = ["StepInput", "ModelRunner"]


class StepInput(msgspec.Struct, frozen=True):
    """One scheduler step.

    Attributes:
        req_ids: Scheduled requests (distinct).
        token_ids: For each scheduled request, its tokens to run now.
        num_computed: For each scheduled request, its tokens already in the KV cache.
        finished_req_ids: Requests whose KV cache to release before the step.
    """

    req_ids: list[int]
    token_ids: list[list[int]]
    num_computed: list[int]
    finished_req_ids: list[int] = []


def _refuse_token_ids(req: int, suspects: list[Any], vocab: int) -> None:
    """Raise for the first non-integer or out-of-vocabulary id among ``suspects`` (ids
    that are not plain ints or are out of range); other integer types in range (a
    NumPy int) pass."""
    for t in suspects:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(
                f"step.token_ids: request {req} has token id {t!r} of type "
                f"{type(t).__name__}; token ids must be ints (not bool)")
    bad = [t for t in suspects if not 0 <= t < vocab]
    if bad:
        raise ValueError(
            f"request {req}: token ids {bad[:4]} are outside the vocabulary [0, {vocab})")


class ModelRunner:
    """Owns a model shard and its KV cache; runs :class:`StepInput` steps.

    Args:
        model: This rank's shard.
        num_kv_blocks: KV cache capacity in blocks.
        block_size: Tokens per KV block.
        compile: Run the forward through ``torch.compile(fullgraph=True, dynamic=True)``.
        compile_backend: ``torch.compile`` backend: a name (``inductor``,
            ``aot_eager``...) or a backend callable.
        micro_batches: With several pipeline stages, split each step into at
            most this many micro-batches of requests, so that sending one
            overlaps computing the next (1: whole steps). Every rank must
            pass the same value.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_kv_blocks: int = 256,
        block_size: int = 16,
        compile: bool = False,
        compile_backend: str | Callable[..., Any] = "inductor",
        micro_batches: int = 2,
    ) -> None:
        if not isinstance(model, LlamaForCausalLM):
            raise TypeError(f"model must be a LlamaForCausalLM, got {type(model).__name__}")
        if not isinstance(micro_batches, int) or isinstance(micro_batches, bool):
            raise TypeError(f"micro_batches must be an int, got {type(micro_batches).__name__}")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.micro_batches = micro_batches
        self.model = model
        self.kv_cache = model.make_kv_cache(num_kv_blocks, block_size)
        self.pp_group = model.pp_group
        self._forward: Callable[..., torch.Tensor] = model
        if compile:
            self._forward = torch.compile(
                model, fullgraph=True, dynamic=True, backend=compile_backend
            )

    @property
    def is_first_stage(self) -> bool:
        return self.model.is_first_stage

    @property
    def is_last_stage(self) -> bool:
        return self.model.is_last_stage

    def _check(self, step: StepInput) -> None:
        if not isinstance(step, StepInput):
            raise TypeError(f"step must be a StepInput, got {type(step).__name__}")
        n = len(step.req_ids)
        if len(step.token_ids) != n or len(step.num_computed) != n:
            raise ValueError(
                f"step.req_ids, step.token_ids and step.num_computed must have equal lengths, got "
                f"{n}, {len(step.token_ids)}, {len(step.num_computed)}"
            )
        vocab = self.model.config.vocab_size
        for req, toks in zip(step.req_ids, step.token_ids, strict=True):
            # one pass per step: plain ints in range cost a type() test more than before
            bad = [t for t in toks if type(t) is not int or not 0 <= t < vocab]
            if bad:
                _refuse_token_ids(req, bad, vocab)

    @torch.no_grad()
    def run(self, step: StepInput, all_logits: bool = False) -> torch.Tensor | None:
        """Run one step; returns logits on the last stage (``[R, V]``, or ``[T, V]``), else None."""
        self._check(step)
        for req in step.finished_req_ids:
            self.kv_cache.free(req)
        if not step.req_ids:
            return torch.empty(0, self.model.config.vocab_size) if self.is_last_stage else None
        attn: AttentionInputs = self.kv_cache.prepare_step(
            step.req_ids, step.num_computed, [len(t) for t in step.token_ids]
        )
        layers = self.kv_cache.layers
        if self.is_first_stage and self.is_last_stage:
            ids = torch.tensor([t for toks in step.token_ids for t in toks], dtype=torch.long)
            return self._forward(ids, attn, layers, None, all_logits)
        return run_stage(
            lambda ids, a, hidden: self._forward(ids, a, layers, hidden, all_logits),
            self._pp(), step.token_ids, attn, self.is_first_stage, self.is_last_stage,
            self.micro_batches,
        )

    def _pp(self) -> Any:
        if self.pp_group is None:  # only reachable with a single stage, which never sends
            raise RuntimeError("a pipeline stage other than the only one needs a pp_group")
        return self.pp_group

    def execute(self, step: StepInput) -> list[int] | None:
        """Run one step; the greedy next token of each request on the last stage, else None."""
        logits = self.run(step)
        return None if logits is None else logits.argmax(dim=-1).tolist()

    def share_next_tokens(self, tokens: list[int] | None, num_requests: int) -> list[int]:
        """Broadcast the last stage's ``tokens`` to every rank of the pipeline group."""
        if self.pp_group is None or self.pp_group.world_size == 1:
            if tokens is None:
                raise ValueError("tokens must be given on the last pipeline stage")
            return list(tokens)
        src = self.pp_group.world_size - 1
        if self.is_last_stage:
            if tokens is None or len(tokens) != num_requests:
                raise ValueError(f"the last stage must pass {num_requests} tokens, got {tokens!r}")
            buf = torch.tensor(tokens, dtype=torch.long)
        else:
            buf = torch.empty(num_requests, dtype=torch.long)
        if num_requests == 0:
            return []
        out: Any = self.pp_group.broadcast(buf, src=src)
        return (buf if out is None else out).tolist()

    def step(self, step: StepInput) -> list[int]:
        """:meth:`execute` then :meth:`share_next_tokens`: next tokens on every rank."""
        return self.share_next_tokens(self.execute(step), len(step.req_ids))

    def close(self) -> None:
        """Release the KV cache."""
        self.kv_cache.reset()
        self.kv_cache.layers.clear()

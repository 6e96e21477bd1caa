"""The demo's workload: built-in requests, or prompts given on the command line."""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence

__all__ = ["parse_prompt_ids", "default_requests", "requests_from_args", "KV_BLOCK_SIZE",
           "kv_blocks_needed", "kv_blocks_from_args"]

#: Tokens per KV-cache block (``ModelRunner``'s default, which the demos use).
KV_BLOCK_SIZE = 16


def parse_prompt_ids(text: str) -> list[list[int]]:
    """Parse ``"1,2,3;4,5"`` into ``[[1, 2, 3], [4, 5]]``.

    Raises:
        ValueError: Empty prompts or non-integer ids (the message shows which).
    """
    prompts = []
    for i, part in enumerate(text.split(";")):
        part = part.strip()
        if not part:
            raise ValueError(f"--prompt-ids: prompt {i} is empty in {text!r}")
        try:
            prompts.append([int(x) for x in part.split(",")])
        except ValueError:
            raise ValueError(
                f"--prompt-ids: prompt {i} ({part!r}) must be comma-separated ints") from None
    return prompts


def default_requests(vocab: int, max_new: int,
                     seed: int = 0) -> list[tuple[tuple[int, ...], int, int]]:
    """Built-in workload: prompts of different lengths arriving over time, with
    different output lengths (at most ``max_new`` tokens each), so batches change
    every few steps."""
    rng = random.Random(seed)
    shape = [(5, 0, 0), (9, -4, 0), (3, 4, 1), (12, -8, 3), (7, 0, 5), (4, -2, 8)]
    return [
        (tuple(rng.randrange(vocab) for _ in range(n)), min(max_new, max(1, max_new + dn)),
         arrival)
        for n, dn, arrival in shape
    ]


def requests_from_args(args: argparse.Namespace,
                       vocab: int) -> list[tuple[tuple[int, ...], int, int]]:
    """The demo's requests: ``--prompt-ids`` when given (each checked against the
    vocabulary), else :func:`default_requests`."""
    if args.prompt_ids is None:
        return default_requests(vocab, args.max_new_tokens, args.seed)
    prompts = parse_prompt_ids(args.prompt_ids)
    for i, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"--prompt-ids: prompt {i} has ids {bad} outside the vocabulary "
                             f"[0, {vocab})")

    return [(tuple(p), args.max_new_tokens, 0) for p in prompts]


def kv_blocks_needed(requests: Sequence[tuple[Sequence[int], int, int]],
                     replicas: int = 1) -> int:
    """KV blocks that hold every request of the busiest replica at once.

    A request caches at most its prompt and all but its last new token; the
    scheduler admits every request that has arrived (no preemption), so this
    is what one replica's cache must hold in the worst case. Replica ``d``
    serves the requests whose index ``% replicas == d``. At least 1 (the
    warm-up request).
    """
    per = [0] * replicas
    for i, (prompt, max_new, _) in enumerate(requests):
        per[i % replicas] += -(-(len(prompt) + max_new - 1) // KV_BLOCK_SIZE)
    return max(1, *per)


def kv_blocks_from_args(args: argparse.Namespace,
                        requests: Sequence[tuple[Sequence[int], int, int]],
                        replicas: int = 1) -> int:
    """The KV capacity to run with: ``--kv-blocks``, checked against the requests, or by
    default just what they need (:func:`kv_blocks_needed`).

    Raises:
        ValueError: ``--kv-blocks`` cannot hold the requests (naming the options and
            both capacities), before any rank starts rather than mid-run.
    """
    need = kv_blocks_needed(requests, replicas)
    given = getattr(args, "kv_blocks", None)
    if given is None:
        return need
    if given < need:
        per = " per replica" if replicas > 1 else ""
        which = (f"the busiest replica's requests (of {len(requests)}, over --dp {replicas})"
                 if replicas > 1 else f"the {len(requests)} requests")
        raise ValueError(
            f"--kv-blocks {given} holds {given * KV_BLOCK_SIZE} tokens{per} (blocks of "
            f"{KV_BLOCK_SIZE}), but {which} need {need} blocks when all are in the cache at "
            f"once (each its prompt + --max-new-tokens - 1 tokens); pass --kv-blocks {need} "
            f"or more, or omit it (the default sizes the cache to the requests), or give "
            f"fewer or shorter --prompt-ids or a smaller --max-new-tokens")
    return int(given)

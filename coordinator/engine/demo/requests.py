"""The demo's workload: built-in requests, or prompts given on the command line."""

from __future__ import annotations

import argparse
import random

__all__ = ["parse_prompt_ids", "default_requests", "requests_from_args"]


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

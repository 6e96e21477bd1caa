"""A paged key/value cache for continuous batching (one rank's layers and heads).

Storage is one tensor per local layer, ``[2, num_blocks * block_size,
num_kv_heads, head_dim]`` (keys, values), addressed by *slot*: token ``p`` of
a request lives in slot ``table[p // block_size] * block_size + p % block_size``,
where ``table`` is the request's list of blocks. Blocks are handed out from a
free list as requests grow and returned when they finish, so requests of any
length come and go without moving data.

The cache also turns one scheduler step into the tensors attention needs
(:meth:`KVCache.prepare_step` returns an :class:`AttentionInputs`): where each
new token's key/value goes (``slot_mapping``), and for each request which
slots hold its whole context (``context_slots``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from coordinator.errors import GroupCoordError

__all__ = ["KVCache", "AttentionInputs", "KVCacheFullError"]


class KVCacheFullError(GroupCoordError, RuntimeError):
    """The cache has too few free blocks for the step; nothing was allocated."""


class AttentionInputs(NamedTuple):
    """Per-step attention metadata for a flattened batch of ``T`` tokens and ``R`` requests.

    Attributes:
        positions: ``[T]`` position of each token in its request.
        slot_mapping: ``[T]`` cache slot receiving each token's key/value.
        query_start_loc: ``[R + 1]`` offsets of each request's tokens in the batch.
        context_slots: ``[sum(seq_lens)]`` slots of every request's full context, concatenated.
        context_start_loc: ``[R + 1]`` offsets of each request's context in ``context_slots``.
        logits_indices: ``[R]`` batch index of each request's last token.
        seq_lens: ``[T]`` length of each token's request after the step (its
            context length; dynamic RoPE scaling depends on it).
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    context_slots: torch.Tensor
    context_start_loc: torch.Tensor
    logits_indices: torch.Tensor
    seq_lens: torch.Tensor | None = None


class KVCache:
    """Paged KV storage plus the block tables of the requests using it.

    Args:
        num_layers: Layers held by this rank (its pipeline stage).
        num_kv_heads: KV heads held by this rank (its tensor-parallel shard).
        head_dim: Features per head.
        num_blocks: Capacity in blocks.
        block_size: Tokens per block.
        dtype: Storage dtype.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        slots = num_blocks * block_size
        self.layers: list[torch.Tensor] = [
            torch.zeros(2, slots, num_kv_heads, head_dim, dtype=dtype) for _ in range(num_layers)
        ]
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, ...
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}

    # ------------------------------------------------------------------ bookkeeping
    @property
    def num_free_blocks(self) -> int:
        """Blocks not used by any request."""
        return len(self._free)

    @property
    def request_ids(self) -> list[int]:
        """Requests that hold cache space."""
        return list(self._tables)

    def length(self, req_id: int) -> int:
        """Tokens cached for ``req_id`` (0 for an unknown request)."""
        return self._lengths.get(req_id, 0)

    def blocks_needed(self, req_id: int, new_tokens: int) -> int:
        """Extra blocks ``req_id`` needs to append ``new_tokens`` tokens."""
        have = len(self._tables.get(req_id, ()))
        total = self.length(req_id) + new_tokens
        return max(0, -(-total // self.block_size) - have)

    def free(self, req_id: int) -> None:
        """Return ``req_id``'s blocks to the free list (unknown ids are ignored)."""
        blocks = self._tables.pop(req_id, None)
        self._lengths.pop(req_id, None)
        if blocks:
            self._free.extend(reversed(blocks))

    def reset(self) -> None:
        """Forget every request."""
        for req in list(self._tables):
            self.free(req)

    def _slot(self, req_id: int, pos: int) -> int:
        table = self._tables[req_id]
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    # ------------------------------------------------------------------ one step
    def prepare_step(
        self,
        req_ids: Sequence[int],
        num_computed: Sequence[int],
        num_new: Sequence[int],
    ) -> AttentionInputs:
        """Reserve space for one step's tokens and build its attention metadata.

        Request ``i`` appends ``num_new[i]`` tokens after the ``num_computed[i]``
        it already has in the cache. All-or-nothing: on any error no request
        changes.

        Raises:
            ValueError: Mismatched lengths, a repeated request id, a count that
                disagrees with the cache, or a request with no new tokens.
            KVCacheFullError: Not enough free blocks.
        """
        self._check_step(req_ids, num_computed, num_new)
        positions: list[int] = []
        slot_mapping: list[int] = []
        context: list[int] = []
        token_seq_lens: list[int] = []
        qsl, csl = [0], [0]
        for req, done, new in zip(req_ids, num_computed, num_new, strict=True):
            table = self._tables.setdefault(req, [])
            for _ in range(self.blocks_needed(req, new)):
                table.append(self._free.pop())
            self._lengths[req] = done + new
            positions.extend(range(done, done + new))
            token_seq_lens.extend([done + new] * new)
            slot_mapping.extend(self._slot(req, p) for p in range(done, done + new))
            context.extend(self._slot(req, p) for p in range(done + new))
            qsl.append(qsl[-1] + new)
            csl.append(csl[-1] + done + new)
        def as_long(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long)

        return AttentionInputs(

            positions=as_long(positions),
            slot_mapping=as_long(slot_mapping),
            query_start_loc=as_long(qsl),
            context_slots=as_long(context),
            context_start_loc=as_long(csl),
            logits_indices=as_long([q - 1 for q in qsl[1:]]),
            seq_lens=as_long(token_seq_lens),
        )

    def _check_step(self, req_ids: Sequence[int], num_computed: Sequence[int],
                    num_new: Sequence[int]) -> None:
        """Raise unless the step agrees with the cache and fits in the free blocks."""
        n = len(req_ids)
        if len(num_computed) != n or len(num_new) != n:
            raise ValueError(
                f"req_ids, num_computed and num_new must have equal lengths, got "
                f"{n}, {len(num_computed)}, {len(num_new)}"
            )
        if len(set(req_ids)) != n:
            raise ValueError(f"req_ids must be distinct within a step, got {list(req_ids)}")
        needed = 0
        for req, done, new in zip(req_ids, num_computed, num_new, strict=True):
            if new <= 0:
                raise ValueError(
                    f"request {req} has {new} new tokens; every scheduled request needs >= 1"
                )
            if done != self.length(req):
                raise ValueError(
                    f"request {req}: num_computed is {done} but the KV cache holds "
                    f"{self.length(req)} tokens for it; the scheduler and the cache disagree"
                )
            needed += self.blocks_needed(req, new)
        if needed > len(self._free):
            raise KVCacheFullError(
                f"KV cache full: the step needs {needed} more blocks of {self.block_size} tokens, "
                f"{len(self._free)} of {self.num_blocks} are free; finish or preempt requests first"
            )

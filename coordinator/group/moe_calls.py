"""The seed's MoE calls of a group: ``dispatch`` (an all-gather of tokens) and
``combine`` (a reduce-scatter back), as vLLM's all-gather / reduce-scatter path.

On an expert-parallel group every rank holds every expert's weights for its
shard of each expert, or whole experts, and runs them on *every* rank's
tokens. So each MoE layer gathers the tokens (and whatever travels with
them: router logits, or routing already done, plus extra per-token tensors)
from the ranks that hold different tokens, runs the experts on all of them,
and sums the partial outputs back onto the rank each token came from::

    rank r: hidden (n_r, H), logits (n_r, E)
       |  dispatch: one all_gatherv of every tensor's rows (row counts
       |            exchanged in the same call unless the caller gives them)
       v
    hidden (N, H), logits (N, E)        N = sum of n_r over the token peers
       |  the caller runs its experts on every row
       v
    partial (N, H)
       |  combine: reduce_scatterv with the row counts of that dispatch
       v
    out (n_r, H) = sum over the token peers of their partial rows of rank r

Which ranks gather (the *token peers*): with ``is_sequence_parallel=True``
every rank of the group holds its own slice of the sequence, so the whole
group. With ``False`` the ranks of one TP group hold the same tokens, so the
gather runs over the ranks that share this rank's TP position
(:meth:`MoeCalls.set_token_peers`; ``coordinator.parallel_state`` sets it
on the EP group: the DP group, or the PCP group, or the DP x PCP ranks of
one TP position). A group that was never told gathers over all its ranks.

Each ``dispatch`` leaves a record of the group it ran on and its row counts;
``combine`` takes the oldest record of the same ``is_sequence_parallel``
(first in, first out, so two micro-batches in flight pair up in order).
Every dispatch must be combined: to gather tokens for another use, call
``all_gatherv_rows``, which leaves no record. A ``combine`` with no record,
or whose rows do not add up to the record's, raises ``ValueError`` on that
rank and, on the CPU transports, ``PeerRejectedError`` on its peers (NCCL
calls carry no "rejected" mark: there the peers wait, bounded by the
group's timeout). A combine takes its record only when it succeeds, so
after a rejected one every rank still holds it and the corrected call
pairs with the same dispatch. At most :data:`MAX_PENDING` records are kept per flag, so
a program that forgets its combines does not grow without bound.

Arguments whose group is unknown (an ``is_sequence_parallel`` that is not a
bool, a call that does not bind to either form of ``dispatch``) raise on
this rank before any collective; the peers then wait until the group's
timeout names this rank as missing.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from device_comms import ReduceOp, validation

__all__ = ["MoeCalls", "TokenGroup", "MAX_PENDING"]

#: Dispatch records kept per ``is_sequence_parallel`` value (the oldest goes first).
MAX_PENDING = 64


class TokenGroup(Protocol):
    """What :class:`MoeCalls` uses of a group (its own and its token peers)."""

    @property
    def unique_name(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def ranks(self) -> list[int]: ...
    @property
    def rank_in_group(self) -> int: ...
    @property
    def world_size(self) -> int: ...

    def all_gatherv_rows(self, tensors: Sequence[torch.Tensor],
                         sizes: Sequence[int] | None = None
                         ) -> tuple[list[torch.Tensor], list[int]]: ...

    def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1,
                        sizes: Sequence[int] | None = None,
                        op: ReduceOp = ReduceOp.SUM) -> torch.Tensor: ...

    def reject_call(self, op: str, error: BaseException, data: Any = None) -> None: ...


@dataclasses.dataclass(frozen=True)
class _Dispatched:
    """What one dispatch leaves for its combine: where it ran, how many rows each gave."""

    group: TokenGroup
    sizes: list[int]


class MoeCalls:
    """``dispatch``/``combine`` of one group, and its pending dispatches.

    Args:
        owner: The group the calls are made on.
    """

    def __init__(self, owner: TokenGroup) -> None:
        self._owner = owner
        self._peers: TokenGroup = owner
        self._pending: dict[bool, collections.deque[_Dispatched]] = {
            False: collections.deque(maxlen=MAX_PENDING),
            True: collections.deque(maxlen=MAX_PENDING),
        }

    @property
    def token_peers(self) -> TokenGroup:
        """The group ``is_sequence_parallel=False`` calls gather over."""
        return self._peers

    def set_token_peers(self, group: TokenGroup) -> None:
        """Gather over ``group`` when ``is_sequence_parallel`` is False (not collective).

        Raises:
            TypeError: ``group`` lacks the group calls used.
            ValueError: ``group`` holds a rank outside this group, or not this rank.
        """
        for name in ("all_gatherv_rows", "reduce_scatterv", "reject_call", "ranks"):
            if not hasattr(group, name):
                raise TypeError(f"group must be a GroupCoordinator, got {type(group).__name__}")
        owner = self._owner
        outside = sorted(set(group.ranks) - set(owner.ranks))
        if outside or owner.rank not in group.ranks:
            why = (f"ranks {outside} are not in it" if outside
                   else f"this rank ({owner.rank}) is not in it")
            raise ValueError(f"group {group.unique_name!r} (ranks {group.ranks}) cannot be the "
                             f"token peers of group {owner.unique_name!r} (ranks "
                             f"{owner.ranks}): {why}")
        self._peers = group

    def group_for(self, is_sequence_parallel: Any) -> TokenGroup:
        """The group a call with this flag runs on.

        Raises:
            TypeError: ``is_sequence_parallel`` is not a bool.
        """
        if not isinstance(is_sequence_parallel, bool):
            raise TypeError(f"is_sequence_parallel must be a bool, got "
                            f"{type(is_sequence_parallel).__name__}")
        return self._owner if is_sequence_parallel else self._peers

    # ------------------------------------------------------------------ dispatch
    def dispatch(
        self,
        named: Sequence[tuple[str, Any]],
        is_sequence_parallel: Any,
        extra_tensors: Any,
        sizes: Any,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Gather the ``named`` tensors (and ``extra_tensors``) over the token peers.

        Returns:
            The gathered named tensors in order, and the gathered extra
            tensors (None when ``extra_tensors`` was None).

        Raises:
            TypeError: A tensor, ``extra_tensors``, ``sizes`` or the flag has
                the wrong type.
            ValueError: The tensors' row counts differ, or ``sizes`` does not
                fit them.
            PeerRejectedError: A peer rejected its arguments.
            CollectiveMismatch: The peers' tensors are laid out differently.
        """
        group = self.group_for(is_sequence_parallel)
        op = "all_gatherv_rows" if sizes is None else "all_gatherv"
        try:
            tensors = _check_named(named, extra_tensors)
        except (TypeError, ValueError) as e:
            given = [t for _, t in named]
            if isinstance(extra_tensors, (list, tuple)):
                given += list(extra_tensors)
            group.reject_call(op, e, given)
            raise
        gathered, counts = group.all_gatherv_rows(tensors, sizes)
        self._pending[is_sequence_parallel].append(_Dispatched(group, counts))
        k = len(named)
        return gathered[:k], (None if extra_tensors is None else gathered[k:])

    # ------------------------------------------------------------------ combine
    def combine(self, hidden_states: Any, is_sequence_parallel: Any,
                sizes: Any) -> torch.Tensor:
        """Sum the gathered rows back onto the ranks they came from (see the module).

        Raises:
            TypeError: ``hidden_states`` is not a tensor, or the flag not a bool.
            ValueError: No dispatch to match, or the rows do not add up to it.
            PeerRejectedError: A peer rejected its arguments.
        """
        group = self.group_for(is_sequence_parallel)
        pending = self._pending[is_sequence_parallel]
        # The record is taken only once the reduce-scatter returned: a combine
        # that this rank or a peer rejected leaves every rank's record in place,
        # so the corrected call pairs with the same dispatch.
        record = pending[0] if pending else None
        if record is not None:
            group = record.group
        try:
            counts = _combine_sizes(hidden_states, record, sizes, group)
        except (TypeError, ValueError) as e:
            group.reject_call("reduce_scatterv", e, hidden_states)
            raise
        out = group.reduce_scatterv(hidden_states, 0, counts)
        if record is not None:
            pending.popleft()
        return out


def _check_named(named: Sequence[tuple[str, Any]], extra_tensors: Any) -> list[torch.Tensor]:
    """The tensors of one dispatch, checked by name: tensors with the first one's rows."""
    items = list(named)
    if extra_tensors is not None:
        if not isinstance(extra_tensors, (list, tuple)):
            raise TypeError(f"extra_tensors must be a list of tensors or None, got "
                            f"{type(extra_tensors).__name__}")
        items += [(f"extra_tensors[{i}]", t) for i, t in enumerate(extra_tensors)]
    first, rows = items[0][0], -1
    out = []
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 1:
            raise ValueError(f"{name} must have a token dimension (dim 0), got a 0-dim tensor")
        if rows < 0:
            rows = t.shape[0]
        elif t.shape[0] != rows:
            raise ValueError(f"{name} has {t.shape[0]} rows (dim 0) but {first} has {rows}; "
                             f"every tensor of a dispatch has one row per token")
        out.append(t)
    return out


def _combine_sizes(hidden_states: Any, record: _Dispatched | None, sizes: Any,
                   group: TokenGroup) -> list[int]:
    """The row counts a combine scatters back: the matching dispatch's, checked."""
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor, got "
                        f"{type(hidden_states).__name__}")
    if hidden_states.dim() < 1:
        raise ValueError("hidden_states must have a token dimension (dim 0), got a 0-dim tensor")
    given = None if sizes is None else validation.check_sizes(sizes, group.world_size)
    if record is not None:
        counts = record.sizes
    elif given is not None:
        counts = given
    else:
        raise ValueError(f"combine on group {group.unique_name!r} has no dispatch to match: "
                         f"call dispatch first (its row counts say what goes back to whom), "
                         f"or pass sizes=")
    if given is not None and given != counts:
        raise ValueError(f"sizes={given} differ from the row counts {counts} of the dispatch "
                         f"this combine matches")
    rows = hidden_states.shape[0]
    if rows != sum(counts):
        raise ValueError(f"hidden_states has {rows} rows (dim 0) but the dispatch it matches "
                         f"gathered {sum(counts)} (row counts {counts} by rank)")
    return counts

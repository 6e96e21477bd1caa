"""Keeping a node's ranks on different CPUs while they wait for each other's steps.

Ranks wait for a step by polling the peers' generation words with
``sched_yield`` in between (:mod:`device_comms.cpu_shm.sync`). That is fast
only when the ranks run on different CPUs: on one CPU every step waits for a
context switch. Measured on the 2-vCPU development VM (world size 2, 4 KiB
all_reduce, 400 back-to-back calls per fresh run): 4.4-6.6 us with the ranks
on different CPUs, 18-22 us with both on one, and both on one in most fresh
runs (``docs/performance.md``, "Placement of the ranks").

Linux does not separate them by itself. Two tasks that hand one CPU to each
other every few microseconds always look cache-hot to the load balancer,
which then leaves them where they are; and they come together after waits
that sleep (the store's and gloo's at start-up, a gloo collective between
ours), when a wake-up puts the woken task on its waker's CPU.

What a rank does (:class:`CpuSpread`): at the first ``sched_yield`` of a wait
it records its CPU and the step in its header line (:data:`PLACED`, one
8-byte word, so never torn). If a peer with a lower local index recorded
the same CPU for this step or the one before, the two share a CPU, and the
rank moves: it narrows its thread's affinity to the CPUs it may run on less
this one and those its peers recorded lately (the kernel migrates the thread
before the call returns) and at once restores the affinity it had, so
nothing stays pinned and the kernel may place the thread anywhere
afterwards. Only the higher index of a pair moves, so two ranks never swap
places; there are no fixed targets, so a process in several groups (each
with its own workspace and indices) is not pulled two ways.

The record is advisory: a stale or missed one costs at most a move that was
not needed, or one made a step later. A move costs about 40 us (the
migration; 2-vCPU VM). Moves of one rank are at least :data:`MOVE_EVERY`
apart; a move needed again within :data:`UNDONE_WITHIN` of the spacing's end
doubles the spacing, up to :data:`MOVE_MAX`, so ranks whose moves the kernel
keeps undoing (more runnable threads than CPUs) pay at most about 0.04% of a
CPU for them. It is off where no spread exists (a rank may run on fewer CPUs
than its node has ranks), where the platform lacks ``sched_getcpu`` or
thread affinity, and with ``GROUPCOORD_CPU_SPREAD=0``. The move itself, and
the queue readers' own moves, are :mod:`shm_broadcast.waiting.thread_cpu`'s.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any

from shm_broadcast.waiting.thread_cpu import (
    SPREAD_ENV,
    current_cpu,
    move_off,
    sched_getcpu,
    spread_enabled,
)

__all__ = ["CpuSpread", "SPREAD_ENV", "spread_enabled", "MOVE_EVERY", "UNDONE_WITHIN", "MOVE_MAX",
           "current_cpu"]

#: Shortest time between two moves of one rank, in seconds.
MOVE_EVERY = 0.001
#: A move needed again within this many seconds after the spacing allowed it doubles
#: the spacing ...
UNDONE_WITHIN = 0.05
#: ... up to this many seconds.
MOVE_MAX = 0.1
_CPU_BITS = 16  # a record is step << 16 | (cpu + 1); 0 is "no record"
_CPU_MASK = (1 << _CPU_BITS) - 1
#: Called on every wait's first yield: typed loosely, as mypy cannot see it is set
#: whenever a spread is active.
_getcpu: Any = sched_getcpu


class CpuSpread:
    """One rank's moves off CPUs its peers wait on (see the module docstring).

    Args:
        hdr: The workspace header as int64 words.
        my_word: Index of this rank's :data:`PLACED` word.
        peer_words: ``(local index, index of its PLACED word)`` of every peer.
        local_rank: This rank's index among the node's ranks.
        local_size: Number of the node's ranks.
        enabled: False turns the moves off; None reads :data:`SPREAD_ENV`.

    Attributes:
        active: Whether this rank records its CPU and may move.
        moves: How many times this rank moved.
    """

    def __init__(
        self,
        hdr: Any,
        my_word: int,
        peer_words: Sequence[tuple[int, int]],
        local_rank: int,
        local_size: int,
        enabled: bool | None = None,
    ) -> None:
        self._hdr = hdr
        self._my_word = my_word
        self._peer_words = [word for _, word in peer_words]
        #: the peers a shared CPU makes this rank leave (those with lower indices)
        self._yield_to = [word for peer, word in peer_words if peer < local_rank]
        if enabled is None:
            enabled = spread_enabled()
        self.active = False
        if enabled and _getcpu is not None and local_size > 1:
            try:
                self.active = len(os.sched_getaffinity(0)) >= local_size
            except OSError:  # pragma: no cover - affinity unavailable
                self.active = False
        self.moves = 0
        self._last_move = -math.inf
        self._spacing = 0.0  # seconds the next move waits after the last one

    def waiting(self, gen: int) -> None:
        """Record that this rank waits in step ``gen`` on its CPU, and move when a peer
        with a lower index recorded the same CPU for this step or the one before.

        Args:
            gen: The step the caller waits for.
        """
        if not self.active:
            return
        cpu = _getcpu()
        hdr = self._hdr
        hdr[self._my_word] = (cpu + 1) | (gen << _CPU_BITS)
        recent = (gen - 1) << _CPU_BITS
        for word in self._yield_to:
            seen = hdr[word]
            if seen >= recent and seen & _CPU_MASK == cpu + 1:
                self._move(cpu, recent)
                return

    def _move(self, cpu: int, recent: int) -> None:
        """Leave ``cpu`` for one no peer recorded since ``recent`` (spaced, see the
        module docstring); the thread's affinity is what it was afterwards."""
        now = time.monotonic()
        since = now - self._last_move
        if since < self._spacing:
            return
        undone = since < self._spacing + UNDONE_WITHIN  # the kernel undid the last one
        self._spacing = min(MOVE_MAX, max(MOVE_EVERY, 2 * self._spacing)) if undone else MOVE_EVERY
        self._last_move = now
        hdr = self._hdr
        taken = {cpu}
        for word in self._peer_words:
            seen = hdr[word]
            if seen >= recent:
                taken.add((seen & _CPU_MASK) - 1)
        try:
            moved = move_off(taken)  # the thread's affinity is what it was afterwards
        except OSError:  # pragma: no cover - refused (a seccomp policy)
            self.active = False
            return
        if moved:
            self.moves += 1

"""Hierarchical all-reduce for groups whose ranks span several nodes.

Three stages, as in Bagua's hierarchical communicators:

1. **intra-node reduce** to the node's *leader* (its lowest group rank)
   through the node's shared-memory engine;
2. **inter-node all-reduce among the leaders** over gloo;
3. **intra-node broadcast** of the result from the leader through shared memory.

Stage 2 uses point-to-point gloo messages on the communicator's own CPU group
(tag :data:`LEADER_TAG`) instead of a separate leaders' process group:
``torch.distributed.new_group`` needs every rank of the *world* (or, with
``use_local_synchronization=True``, derives the group's store prefix from the
number of groups each process already holds, which differs between leaders
and non-leaders), while a communicator is built collectively only by its own
group. The leaders run a reduce-scatter then an all-gather: leader ``j`` sums
piece ``j`` of every node's partial result in node order, so every rank ends
with bitwise identical values.

Reduction order: ranks within a node in rank order, then nodes in node order;
AVG sums throughout and divides by the group size once at the end.

Errors name the caller's op, ``all_reduce``, and the stage that failed: an
error of a shared-memory stage (which names the engine's own step, ``reduce``
or ``broadcast``) is re-raised as the same class with that context, and a gloo
failure between leaders names the leaders this rank was exchanging with.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from device_comms import host_alloc
from device_comms.errors import GroupCoordError, translate_backend_error
from device_comms.fixed_reduce import reduce_views
from device_comms.reduce_op import ReduceOp
from device_comms.shm_engine import ShmEngine

__all__ = ["HierarchicalAllReduce", "LEADER_TAG"]

LEADER_TAG = 0x6763  # "gc": keeps leader traffic apart from user send/recv (tag 0)


class HierarchicalAllReduce:
    """All-reduce over several nodes: shared memory inside, gloo between leaders.

    Args:
        engine: This node's shared-memory engine (None when the node has one rank).
        cpu_group: The communicator's gloo group.
        leaders: Global rank of every node's leader, in node order.
        node: This rank's node index.
        is_leader: Whether this rank leads its node.
        world_size: Ranks in the whole group (for AVG).
        name: The group's name, for error messages.

    Attributes:
        calls: Hierarchical all-reduces run.
        intra_node_shm_steps: Intra-node shared-memory collectives run (for tests).
    """

    def __init__(
        self,
        engine: ShmEngine | None,
        cpu_group: dist.ProcessGroup,
        leaders: Sequence[int],
        node: int,
        is_leader: bool,
        world_size: int,
        name: str = "",
    ) -> None:
        if len(leaders) < 2:
            raise ValueError(f"leaders must name at least 2 nodes' leaders, got {list(leaders)}")
        self.engine = engine
        self.cpu_group = cpu_group
        self.leaders = list(leaders)
        self.node = node
        self.is_leader = is_leader
        self.world_size = world_size
        self.name = name
        self.calls = 0
        self.intra_node_shm_steps = 0

    def all_reduce(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        """All-reduce contiguous ``t`` over every rank of every node."""
        self.calls += 1
        inner = ReduceOp.SUM if op is ReduceOp.AVG else op
        eng = self.engine
        partial: torch.Tensor | None
        if eng is not None:
            partial = _in_stage("1/3, reduce to the node's leader in shared memory",
                                eng.reduce, t, 0, inner)
            self.intra_node_shm_steps += 1
        else:
            partial = t
        if self.is_leader and partial is not None:  # the leader is local rank 0
            result = self._leaders_all_reduce(partial, inner)  # always a new tensor
        else:
            result = host_alloc.empty(t.shape, t.dtype)
        if eng is not None:
            _in_stage("3/3, broadcast from the node's leader in shared memory",
                      eng.broadcast, result, 0)
            self.intra_node_shm_steps += 1
        if op is ReduceOp.AVG:
            result.div_(self.world_size)
        return result

    def _leaders_all_reduce(self, x: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        k = len(self.leaders)
        me = self.node
        flat = x.reshape(-1)
        n = flat.numel()
        bounds = [n * j // k for j in range(k + 1)]
        lo, hi = bounds[me], bounds[me + 1]
        # Reduce-scatter: piece j of every leader's partial goes to leader j.
        recv = {j: torch.empty(hi - lo, dtype=x.dtype) for j in range(k) if j != me}
        works = []
        for j in range(k):
            if j == me:
                continue
            if bounds[j + 1] > bounds[j]:
                works.append(self._isend(flat[bounds[j] : bounds[j + 1]], j))
            if hi > lo:
                works.append(self._irecv(recv[j], j))
        self._wait(works)
        out = host_alloc.empty(n, x.dtype)
        if hi > lo:
            srcs = [flat[lo:hi] if j == me else recv[j] for j in range(k)]
            reduce_views(srcs, op, out=out[lo:hi])
        # All-gather the reduced pieces.
        works = []
        for j in range(k):
            if j == me:
                continue
            if hi > lo:
                works.append(self._isend(out[lo:hi], j))
            if bounds[j + 1] > bounds[j]:
                works.append(self._irecv(out[bounds[j] : bounds[j + 1]], j))
        self._wait(works)
        return out.view(x.shape)

    def _wait(self, works: list[dist.Work]) -> None:
        """Wait for the leaders' messages; a gloo failure names the other leaders."""
        try:
            for w in works:
                w.wait()
        except RuntimeError as e:
            if isinstance(e, GroupCoordError):
                raise
            peers = [dist.get_group_rank(self.cpu_group, g)
                     for j, g in enumerate(self.leaders) if j != self.node]
            err = translate_backend_error(
                e, f"group {self.name!r}, op all_reduce (hierarchical, stage 2/3: exchange "
                   f"between node leaders; this leader waited for leader rank(s) {peers})")
            if err is e:
                raise
            raise err from e

    def _isend(self, t: torch.Tensor, node: int) -> dist.Work:
        return dist.isend(_bytes(t), dst=self.leaders[node], group=self.cpu_group, tag=LEADER_TAG)

    def _irecv(self, t: torch.Tensor, node: int) -> dist.Work:
        return dist.irecv(_bytes(t), src=self.leaders[node], group=self.cpu_group, tag=LEADER_TAG)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Contiguous ``t`` as flat bytes (gloo moves any dtype that way)."""
    return t.reshape(-1).view(torch.uint8)


def _in_stage(stage: str, fn: Any, *args: Any) -> Any:
    """Run a shared-memory stage; its errors say they happened inside ``all_reduce``."""
    try:
        return fn(*args)
    except GroupCoordError as e:
        if type(e).__init__ is not GroupCoordError.__init__:
            raise  # a class with its own constructor (PeerRejectedError names its op)
        raise type(e)(f"op all_reduce (hierarchical, stage {stage}): {e}", queue=e.queue,
                      side=e.side, peers=e.peers) from e

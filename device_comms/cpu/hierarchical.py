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
group. Small partial results (at most
:data:`~device_comms.signatures.envelopes.INLINE_MAX` bytes) travel whole in one round
and every leader reduces all of them; larger ones go as a reduce-scatter then
an all-gather: leader ``j`` sums piece ``j`` of every node's partial result in
node order. Either way every rank ends with bitwise identical values.

Reduction order: ranks within a node in rank order, then nodes in node order;
AVG sums throughout and divides by the group size once at the end.

Signatures. Stage 1 is a shared-memory step carrying the call's signature,
so the ranks of a node agree first. Each leader's first message of stage 2 is
an envelope (:mod:`device_comms.signatures.envelopes`): its node's call header, with the
partial result when it is small, or a REJECTED/FAILED header passing on what
went wrong on its node. Leaders count ranks, not nodes: a leader speaks for
its node's ranks, and one whose own ranks disagree among themselves sends a
SPLIT header listing every local call and who made it, so one rank of a
two-rank node that skipped a call is named by every other node, though its
own node saw a 1-1 tie (that node's ranks raise their local error at once).
Every leader settles the same headers alike (a mismatch between tied classes,
e.g. two nodes of equal size, names the other side on each node:
:func:`~device_comms.signatures.call_signature.settle`). Stage 3 (the broadcast step)
carries the verdict to the node's other ranks:
the result, or the error relayed with :meth:`StepSync.relay`::

    node A: rank 0 (leader), rank 1          node B: rank 2 (leader), rank 3
    step 1 (shm): sig(all_reduce ...)        step 1 (shm): sig(...)
    rank 0 -- header + partial -->  <-- header + partial -- rank 2
    both leaders: settle(headers) -> verdict
    step 2 (shm): result or relay(error)     step 2 (shm): result or relay(error)

When a leader's exchange fails (a remote leader timed out, died or closed
its connections), the leader relays the failure to its node's ranks, naming
the other nodes' ranks: a :class:`CollectiveTimeout` when gloo timed out, a
:class:`PeerDiedError` marked ``suspected`` when a connection closed (its
receivers check which of those ranks' processes are gone before they call
any of them dead, as for a closed connection of their own). The node's
ranks wait for the verdict a little longer than the group's timeout
(:data:`VERDICT_GRACE_S`) so that it reaches them; they then know which
ranks did not arrive, not just that their leader did not answer.

The other collectives of a hierarchical communicator run over gloo; they
first :meth:`HierarchicalAllReduce.agree` the same way (a step, the leaders'
headers, a verdict step), so a rank in one of them and a rank in an
all-reduce raise :class:`~device_comms.errors.CollectiveMismatch` instead of
waiting for each other. A rejected call (:meth:`reject`) is a REJECTED step
on its node, and its leader passes it on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist

from device_comms.cpu_shm import host_alloc
from device_comms.cpu_shm.engine import ShmEngine
from device_comms.errors import (
    CollectiveMismatch,
    CollectiveTimeout,
    DecodeError,
    GroupCoordError,
    PeerDiedError,
    PeerRejectedError,
    translate_backend_error,
)
from device_comms.fixed_reduce import reduce_views
from device_comms.reduce_op import ReduceOp
from device_comms.signatures.call_signature import (
    FAILED,
    REJECTED,
    SPLIT,
    decode_calls,
    encode_calls,
    group_id,
    settle,
    template,
)
from device_comms.signatures.envelopes import (
    INLINE_MAX,
    Envelopes,
    as_bytes,
    failure_header,
    reason_bytes,
)

__all__ = ["HierarchicalAllReduce", "LEADER_TAG"]

LEADER_TAG = 0x6763  # "gc": keeps leader traffic apart from user send/recv (tag 0)
#: Seconds a non-leader waits for its leader's verdict beyond the group's
#: timeout: a leader whose exchange with the other leaders timed out (at the
#: group's timeout) then still relays that, naming the other nodes' ranks.
VERDICT_GRACE_S = 1.0


class HierarchicalAllReduce:
    """All-reduce over several nodes: shared memory inside, gloo between leaders.

    Args:
        engine: This node's shared-memory engine (None when the node has one rank).
        cpu_group: The communicator's gloo group.
        nodes: Node index of every group rank (nodes numbered from 0 in order
            of their lowest rank; at least two nodes).
        rank_in_group: This rank.
        name: The group's unique name (for errors).

    Attributes:
        leaders: Group rank of every node's leader, in node order.
        node: This rank's node index.
        is_leader: Whether this rank leads its node.
        calls: Hierarchical all-reduces run.
        intra_node_shm_steps: Intra-node shared-memory collectives run (for tests).
    """

    def __init__(
        self,
        engine: ShmEngine | None,
        cpu_group: dist.ProcessGroup,
        nodes: Sequence[int],
        rank_in_group: int,
        name: str = "",
    ) -> None:
        n_nodes = max(nodes) + 1
        if n_nodes < 2:
            raise ValueError(f"nodes must name at least 2 nodes, got {list(nodes)}")
        self.engine = engine
        self.cpu_group = cpu_group
        self.nodes = list(nodes)
        self.name = name
        self.leaders = [self.nodes.index(j) for j in range(n_nodes)]
        self.node = self.nodes[rank_in_group]
        self.is_leader = self.leaders[self.node] == rank_in_group
        self.me = rank_in_group
        self.world_size = len(self.nodes)
        self.calls = 0
        self.intra_node_shm_steps = 0
        self.seq = 0  # leader exchanges so far (the same on every leader)
        #: The owning group's call counter (``number_calls``); None: headers carry ``seq``.
        self.number: Callable[[], int] | None = None
        self._word = 0  # what the current exchange's headers carry as their number
        self._env: Envelopes | None = None
        self._blank = template(group_id(name), "all_reduce", None, None, 0, 0, None)
        if self.is_leader:
            self._env = Envelopes(cpu_group, [r for r in self.leaders if r != rank_in_group],
                                  LEADER_TAG)

    # ------------------------------------------------------------------ agreement
    def agree(self, op: str, header: np.ndarray | None, reason: str | None = None) -> None:
        """Agree on a gloo collective with every rank, or tell them this rank rejected it.

        Args:
            op: The op this rank runs.
            header: Its call header (:mod:`device_comms.signatures.call_signature`); None
                when ``reason`` is given.
            reason: This rank rejected its arguments (its error message).

        Raises:
            PeerRejectedError: Another rank rejected its call.
            CollectiveMismatch: Some rank made another call.
        """
        eng = self.engine
        sig = (int(header[3]), int(header[4])) if header is not None else (0, 0)
        local_err: CollectiveMismatch | None = None
        if eng is not None:
            try:
                if reason is not None:
                    eng.sync.reject(op, reason)
                else:
                    eng.sync.step(op, sig[0], sig[1], True)
            except CollectiveMismatch as e:
                if not self.is_leader:
                    raise
                local_err = e
        if not self.is_leader:
            if reason is None and eng is not None:
                with self._awaiting_verdict():
                    eng.sync.step(op, sig[0], sig[1], True)  # the leader's verdict
            return
        with self._relaying_failures(op, reason is None and local_err is None):
            err = self._verdict(op, header, reason, local_err, None)
        if local_err is not None:  # this node's ranks already know
            raise local_err
        if eng is not None and reason is None:
            if err is None:
                eng.sync.step(op, sig[0], sig[1], True)
            else:
                eng.sync.relay(op, err)
        if err is not None:
            raise err

    @contextlib.contextmanager
    def _awaiting_verdict(self) -> Iterator[None]:
        """On a non-leader: wait for the leader's verdict up to :data:`VERDICT_GRACE_S`
        beyond the timeout (the engine runs one call at a time, so the
        synchroniser's timeout may be lengthened for this one step)."""
        sync = self.engine.sync  # type: ignore[union-attr]  # non-leaders have a node engine
        saved = sync.timeout
        if saved is not None:
            sync.timeout = saved + VERDICT_GRACE_S
        try:
            yield
        finally:
            sync.timeout = saved

    @contextlib.contextmanager
    def _relaying_failures(self, op: str, node_waits: bool) -> Iterator[None]:
        """On a leader: when the exchange with the other leaders fails (gloo's
        timeout or a closed connection), tell this node's ranks, which wait
        for the verdict (``node_waits``), then raise the same error here (it
        names the other nodes' ranks)."""
        try:
            yield
        except RuntimeError as e:
            if isinstance(e, GroupCoordError):
                raise
            remote = [r for r, j in enumerate(self.nodes) if j != self.node]
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            closed = isinstance(translate_backend_error(e, self.name), PeerDiedError)
            what = "closed its connections" if closed else "failed"
            text = (f"group {self.name!r}, op {op}: the exchange of this node's leader (rank "
                    f"{self.me}) with the other nodes' leaders {what} ({first}); rank(s) "
                    f"{remote} on the other nodes did not complete the call")
            lost: GroupCoordError
            if closed:
                lost = PeerDiedError(text, queue=self.name, peers=remote)
                lost.suspected = True  # type: ignore[attr-defined]  # an extra: suspected
            else:
                lost = CollectiveTimeout(text, queue=self.name, peers=remote)
            if node_waits and self.engine is not None:
                with contextlib.suppress(GroupCoordError):  # a local rank gone: it is reported
                    self.engine.sync.relay(op, lost)
            raise lost from e  # here too the error names the other nodes' ranks

    def reject(self, op: str, reason: str) -> None:
        """Take part in ``op`` (any collective) as a rank that rejected its arguments."""
        self.agree(op, None, reason)

    # ------------------------------------------------------------------ all-reduce
    def all_reduce(self, t: torch.Tensor, op: ReduceOp, header: np.ndarray) -> torch.Tensor:
        """All-reduce contiguous ``t`` over every rank of every node.

        ``header`` is the call's header; its words 3 and 4 sign the
        shared-memory steps, the leaders exchange it.
        """
        self.calls += 1
        inner = ReduceOp.SUM if op is ReduceOp.AVG else op
        signed = (int(header[3]), int(header[4]))
        eng = self.engine
        partial: torch.Tensor | None = t
        local_err: CollectiveMismatch | None = None
        if eng is not None:
            self.intra_node_shm_steps += 1
            try:
                partial = eng.reduce(t, 0, inner, signed=signed, name="all_reduce")
            except CollectiveMismatch as e:
                if not self.is_leader:
                    raise
                local_err = e
        if not self.is_leader:
            result = host_alloc.empty(t.shape, t.dtype)
            with self._awaiting_verdict():
                eng.broadcast(  # type: ignore[union-attr]  # non-leaders have a node engine
                    result, 0, signed=signed, name="all_reduce")
            self.intra_node_shm_steps += 1
        else:
            with self._relaying_failures("all_reduce", local_err is None):
                result = self._leader_all_reduce(t, partial, inner, header, local_err)
            if eng is not None:
                eng.broadcast(result, 0, signed=signed, name="all_reduce")
                self.intra_node_shm_steps += 1
        if op is ReduceOp.AVG:
            result.div_(self.world_size)
        return result

    def _leader_all_reduce(
        self,
        t: torch.Tensor,
        partial: torch.Tensor | None,
        op: ReduceOp,
        header: np.ndarray,
        local_err: CollectiveMismatch | None,
    ) -> torch.Tensor:
        """Stage 2 on a leader: agree with the other leaders, then reduce the partials."""
        small = t.nbytes <= INLINE_MAX
        send = as_bytes(partial) if small and partial is not None and local_err is None else None
        err = self._verdict("all_reduce", header, None, local_err, send)
        if local_err is not None:  # this node's ranks already know
            raise local_err
        if err is not None:
            if self.engine is not None:
                self.engine.sync.relay("all_reduce", err)  # stage 3 carries the error
            raise err
        if partial is None:  # stage 1 produces it whenever there is no local error
            raise RuntimeError("hierarchical all_reduce: stage 1 left no partial sum")
        if not small:
            return self._leaders_all_reduce(partial, op)
        env = self._env
        srcs = [
            partial if j == self.node else
            env.payload(r).view(t.dtype).view(t.shape)  # type: ignore[union-attr]  # a leader's
            for j, r in enumerate(self.leaders)
        ]
        return reduce_views(srcs, op)

    def _verdict(
        self,
        op: str,
        header: np.ndarray | None,
        reason: str | None,
        local_err: CollectiveMismatch | None,
        payload: torch.Tensor | None,
    ) -> CollectiveMismatch | None:
        """One envelope round among the leaders; the error every leader found, or None.

        This leader sends its node's header, a REJECTED/FAILED one naming the
        culprit, or, when its node's ranks disagree among themselves, a SPLIT
        one listing their calls; the returned error is what the other leaders
        sent or how the ranks' calls differ, counted rank by rank. Returns None
        as well when this node itself failed (``reason`` or ``local_err``: its
        ranks already know).
        """
        env = self._env
        if env is None:  # only leaders exchange envelopes
            raise RuntimeError(
                f"hierarchical {op}: a non-leader rank reached the leaders' exchange")
        self.seq += 1
        self._word = self.seq if self.number is None else self.number()
        split = getattr(local_err, "calls", None)  # a local mismatch (never with ``reason``)
        if split is not None:  # this node's ranks disagree: tell who called what
            h = failure_header(self._blank, SPLIT, -1)
            h[2] = self._word
            raw = encode_calls(split)
            env.exchange(h, torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        elif reason is not None or local_err is not None or header is None:
            h, text = self._failure(reason, local_err)
            env.exchange(h, reason_bytes(text))
        else:
            h = header
            h[2] = self._word
            env.exchange(h, payload)
        mine = h[:6].tobytes()
        if all(env.words[p][:6].tobytes() == mine for p in env.peers):
            return None  # every node made this call (the common case: no dicts, no classes)
        heads = {p: env.words[p] for p in env.peers}
        heads[self.me] = h
        try:
            settle(self.name, op, self.me, heads, env.reason, self._members,
                   lambda p: decode_calls(bytes(env.payload(p).numpy()), p,
                                          self._members(p), self.name))
        except CollectiveMismatch as e:
            if reason is None and local_err is None:
                return e
        except DecodeError as e:  # a leader's header or call list is not valid:
            if reason is None and local_err is None:  # no call can be matched with it
                return CollectiveMismatch(str(e), queue=self.name, peers=e.peers)
        return None

    def _failure(
        self, reason: str | None, local_err: CollectiveMismatch | None
    ) -> tuple[np.ndarray, str]:
        """The header and text this leader sends when its node failed."""
        if local_err is None:  # this leader rejected its own call
            status, culprit, text = REJECTED, self.me, reason or ""
        elif isinstance(local_err, PeerRejectedError):
            status, culprit, text = REJECTED, local_err.rank, local_err.reason
        else:
            who = local_err.peers[0] if local_err.peers else self.me
            rank: int = int(who)  # type: ignore[call-overload]  # peers hold ranks here
            status, culprit, text = FAILED, rank, str(local_err)
        h = failure_header(self._blank, status, culprit)
        h[2] = self._word
        return h, text

    def _members(self, leader: int) -> list[int]:
        """Group ranks of the node ``leader`` leads."""
        node = self.nodes[leader]
        return [r for r, j in enumerate(self.nodes) if j == node]

    def _leaders_all_reduce(self, x: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        """Reduce-scatter then all-gather of the partials among the leaders (large ones)."""
        k = len(self.leaders)
        me = self.node
        flat = x.reshape(-1)
        n = flat.numel()
        bounds = [n * j // k for j in range(k + 1)]
        lo, hi = bounds[me], bounds[me + 1]
        # Reduce-scatter: piece j of every leader's partial goes to leader j.
        recv = {j: torch.empty(hi - lo, dtype=x.dtype, device="cpu") for j in range(k)
                if j != me}
        works = []
        for j in range(k):
            if j == me:
                continue
            if bounds[j + 1] > bounds[j]:
                works.append(self._isend(flat[bounds[j] : bounds[j + 1]], j))
            if hi > lo:
                works.append(self._irecv(recv[j], j))
        for w in works:
            w.wait()
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
        for w in works:
            w.wait()
        return out.view(x.shape)

    def _isend(self, t: torch.Tensor, node: int) -> dist.Work:
        return self.cpu_group.send([_bytes(t)], self.leaders[node], LEADER_TAG)

    def _irecv(self, t: torch.Tensor, node: int) -> dist.Work:
        return self.cpu_group.recv([_bytes(t)], self.leaders[node], LEADER_TAG)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Contiguous ``t`` as flat bytes (gloo moves any dtype that way)."""
    return t.reshape(-1).view(torch.uint8)

"""``CpuCommunicator``: gloo for everything, shared memory for same-node ranks.

Construction (collective over ``cpu_group``) finds which ranks share a node
(:func:`shm_broadcast.ranks.topology.node_assignment`; ``GROUPCOORD_NODE_ID`` or the
``node_id`` argument override it) and maps one shared-memory workspace per
node. Then:

* **one node** (the usual case): ``all_reduce``, ``reduce``, ``all_gather``,
  ``all_gatherv``, ``reduce_scatter``, ``reduce_scatterv``, ``broadcast`` and
  ``gather`` run in the :class:`~device_comms.cpu_shm.engine.ShmEngine`; large
  messages go through the workspace in pieces;
* **several nodes**: ``all_reduce`` is hierarchical
  (:class:`~device_comms.cpu.hierarchical.HierarchicalAllReduce`: shared memory
  within nodes, gloo between one leader per node); other ops use gloo;
* **one rank per node**, shared memory disabled, or setup failed (e.g.
  ``/dev/shm`` full): everything goes to gloo, as in
  :class:`~device_comms.torch_dist.torch_communicator.TorchDistributedCommunicator`.

``all_to_allv`` runs in the engine too (one copy in, one copy out: see
:mod:`device_comms.cpu_shm.alltoallv`); ``scatter``, ``all_to_all``, ``send``
and ``recv`` always use gloo.

Every call is signed (op, dtype, shape, layout, root; the call number is the
step generation in shared memory, a counter on gloo), so a rejected, skipped
or mismatched call raises :class:`~device_comms.errors.PeerRejectedError` /
:class:`~device_comms.errors.CollectiveMismatch` on every rank within
milliseconds and the group stays usable:

* shared-memory ops compare their first step's signature
  (:mod:`device_comms.cpu_shm.sync`); a rank that rejects its arguments takes
  that step with a "rejected" signature;
* gloo ops exchange call headers first (:mod:`device_comms.torch_dist.torch_communicator`);
  with one node, ``scatter`` and ``all_to_all`` first take a shared-memory step
  with their signature, so a rank in one of them and a rank in a
  shared-memory op meet there instead of waiting for each other;
* with several nodes every collective first agrees through the node leaders
  (:meth:`HierarchicalAllReduce.agree`; the all-reduce carries its signature
  in its own steps and messages), which relay a node's rejection or mismatch
  to the other nodes.

``send``/``recv`` meet only their peer, so a rank in a send and its peer in
a collective wait for the timeout (a ``CollectiveTimeout``), as do ranks that
call collectives of different communicators.

One collective at a time: while a thread is in a collective, another
thread's collective on the same communicator raises
:class:`~device_comms.errors.ConcurrentCallError` before touching anything
(the engine's steps and slots are the rank's; two calls at once would mix
their data). ``send``/``recv`` may run on other threads meanwhile.

Configuration (arguments win over environment variables; the environment is
read at construction):

* ``workspace_bytes`` / ``GROUPCOORD_CPU_SHM_BYTES``: data bytes of a node's
  workspace, split into 2 x local-ranks slots (default: 8 MiB in all, slots
  of at most 2 MiB: 2 MiB for 2 ranks, 1 MiB for 4, 512 KiB for 8, so that a
  host's workspaces fit a small ``/dev/shm``); larger messages go through in
  slot-sized pieces;
* ``GROUPCOORD_CPU_SHM_THREADS``: the intra-op threads the engine's own
  copies and reductions use (default: the CPUs the node's ranks may run on,
  divided among them; see :mod:`device_comms.cpu_shm.engine_threads`), more or fewer
  than ``torch.get_num_threads()`` says; the caller's setting is restored
  after each collective;
* ``use_shm`` / ``GROUPCOORD_CPU_SHM=0``: disable the shared-memory path (if
  any rank disables it, all do);
* ``GROUPCOORD_CPU_SPREAD=0``: a waiting rank does not move off a CPU a peer
  waits on (:mod:`device_comms.cpu_shm.placement`);
* ``timeout`` / ``GROUPCOORD_CPU_SHM_TIMEOUT`` / ``GROUPCOORD_TIMEOUT``:
  seconds a shared-memory step may wait for a peer before
  :class:`~device_comms.errors.CollectiveTimeout` (``0`` polls once; default
  :data:`~shm_broadcast.timeouts.DEFAULT_TIMEOUT_S`, 300 s; the precedence is
  stated in :mod:`shm_broadcast.timeouts`). A ``GroupCoordinator`` given a
  timeout passes it here, so it bounds these steps as it bounds the gloo calls.
  A dead peer is reported as :class:`~device_comms.errors.PeerDiedError`
  within about 0.2 s anyway; a stopped (paused) one is waited for.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from device_comms import row_gather
from device_comms.cpu.config import (
    BYTES_ENV,
    ENABLE_ENV,
    TIMEOUT_ENV,
    positive_bytes,
    step_timeout,
    use_shm_enabled,
)
from device_comms.cpu.hierarchical import HierarchicalAllReduce
from device_comms.cpu.one_call import OneCall
from device_comms.cpu.repeat_calls import (
    KeptLayouts,
    LayoutPlan,
    LayoutPlans,
    plain,
    takes_out,
    writable,
)
from device_comms.cpu_shm import host_alloc
from device_comms.cpu_shm.context import shape_key as _step_shape_key
from device_comms.cpu_shm.context import signature as _step_signature
from device_comms.cpu_shm.engine import BY_ADDRESS_MAX_BYTES, ShmEngine
from device_comms.cpu_shm.engine_threads import env_threads
from device_comms.cpu_shm.placement import spread_enabled
from device_comms.cpu_shm.small import NotServed, SmallAllReduce
from device_comms.cpu_shm.sync import StepSync
from device_comms.cpu_shm.workspace import WorkspacePlan, open_workspace
from device_comms.errors import CollectiveMismatch, DeviceCommError, with_own_arguments
from device_comms.reduce_op import ReduceOp
from device_comms.torch_dist.torch_communicator import TorchDistributedCommunicator
from device_comms.validation import storage_covers
from shm_broadcast.errors import SegmentError
from shm_broadcast.ranks.group_adapter import object_group
from shm_broadcast.ranks.topology import node_assignment

__all__ = ["CpuCommunicator", "BYTES_ENV", "ENABLE_ENV", "TIMEOUT_ENV"]

_R = TypeVar("_R")  # what a guarded hook returns
#: Seconds :meth:`CpuCommunicator.destroy` waits for a collective of another thread to
#: leave the workspace before it unmaps it (a broken wait leaves within a health check).
DESTROY_WAIT_S = 5.0

logger = logging.getLogger(__name__)

# What all_reduce's check compares against on every call (a module constant: one
# lookup where torch's attribute takes two).
_PLAIN_TENSOR = torch.Tensor  # exactly this type: no subclass (Parameter, FakeTensor)
_STRIDED = torch.strided
_P2P_OPS = frozenset({"send", "recv"})  # not held by a collective (device_comms.cpu.one_call)
_SEQUENCES = (list, tuple)  # what a fast path takes as sizes (the checked path takes more)
_INTS = frozenset({int})  # the one type of a fast path's sizes
_SHM_OPS = (
    "all_reduce", "reduce", "all_gather", "all_gatherv", "reduce_scatter",
    "reduce_scatterv", "broadcast", "gather", "all_to_allv", "all_gatherv_rows",
)


class CpuCommunicator(TorchDistributedCommunicator):
    """CPU communicator: shared memory between same-node ranks, gloo otherwise.

    Args:
        cpu_group: Gloo group of the ranks (also carries the gloo fallbacks).
        device: A CPU device.
        device_group: Group for payloads (defaults to ``cpu_group``).
        unique_name: The owning group's unique name (in errors).
        workspace_bytes: Data bytes per node workspace (see module docstring).
        use_shm: False forces gloo; None reads ``GROUPCOORD_CPU_SHM``.
        timeout: Seconds a shared-memory step may wait; 0 polls once; None
            reads ``GROUPCOORD_CPU_SHM_TIMEOUT``, then ``GROUPCOORD_TIMEOUT``,
            else 300.
        node_id: This rank's node identity (then every rank must pass one);
            overrides the shared-memory probe, like ``GROUPCOORD_NODE_ID``.
        oneshot_bytes: Largest all-reduce done in one shot (tuning knob).

    Attributes:
        mode: ``"shm"`` (one node), ``"hierarchical"`` (several nodes) or ``"gloo"``.
        fallback_reason: Why ``mode`` is ``"gloo"`` (None otherwise).
        nodes: Node index of every group rank (empty when shm is disabled).
        shm_calls: Per op, how many calls the shared-memory engine served.
    """

    name = "cpu"
    device_types = frozenset({"cpu"})
    priority = 10

    def __init__(
        self,
        cpu_group: dist.ProcessGroup,
        device: torch.device,
        device_group: dist.ProcessGroup | None = None,
        unique_name: str = "",
        *,
        workspace_bytes: int | None = None,
        use_shm: bool | None = None,
        timeout: float | None = None,
        node_id: str | None = None,
        oneshot_bytes: int | None = None,
    ) -> None:
        wait_s = step_timeout(timeout)
        super().__init__(cpu_group, device, device_group, unique_name, timeout=wait_s)
        #: Held by the thread in a collective; another thread's collective meanwhile
        #: raises ConcurrentCallError.
        self._one_call = OneCall(
            f"group {self.unique_name!r} (rank {self.rank_in_group}/{self.world_size})")
        if self.device.type != "cpu":
            raise ValueError(f"device must be a CPU device for CpuCommunicator, got {self.device}")
        ws_bytes = positive_bytes(workspace_bytes, "workspace_bytes", BYTES_ENV)
        threads = env_threads()
        enabled = use_shm_enabled(use_shm)
        spread_enabled()  # a bad GROUPCOORD_CPU_SPREAD raises here, before anything is made
        if node_id is not None and not isinstance(node_id, str):
            raise TypeError(f"node_id must be a str or None, got {type(node_id).__name__}")
        if oneshot_bytes is not None:
            if not isinstance(oneshot_bytes, int) or isinstance(oneshot_bytes, bool):
                raise TypeError(f"oneshot_bytes must be an int, got {type(oneshot_bytes).__name__}")
            if oneshot_bytes < 0:
                raise ValueError(f"oneshot_bytes must be >= 0, got {oneshot_bytes!r}")
        self.mode = "gloo"
        self.fallback_reason: str | None = None
        self.nodes: list[int] = []
        self.shm_calls: dict[str, int] = dict.fromkeys(_SHM_OPS, 0)
        # dtype -> ops already validated for it; a list searched by identity, because
        # hashing a ReduceOp (Enum.__hash__, Python code) costs as much as the check.
        self._validated: dict[torch.dtype, list[ReduceOp]] = {}
        #: What the checked path concluded about the layouts of all_gather and
        #: reduce_scatter calls the engine served (their fast paths).
        self._plans = LayoutPlans()
        #: Step signatures of the broadcasts by address the checked path took, by
        #: (dtype, shape, src).
        self._broadcasts: KeptLayouts[tuple[torch.dtype, torch.Size, int], tuple[int, int]] = (
            KeptLayouts())
        #: Normalised dim and size key of the gathers the checked path took, by
        #: (dtype, shape, dst, dim as given).
        self._gathers: KeptLayouts[tuple[torch.dtype, torch.Size, int, int],
                                   tuple[int, int]] = KeptLayouts()
        #: Normalised dim and size key of the reduce_scatterv calls the checked path
        #: took, by (dtype, shape, dim as given, sizes, id of the op).
        self._scatterv: KeptLayouts[tuple[torch.dtype, torch.Size, int, tuple[int, ...], int],
                                    tuple[int, int]] = KeptLayouts()
        self._engine: ShmEngine | None = None
        self._flat: ShmEngine | None = None
        #: The one-step all_reduce of the engine (one node), for all_reduce's fast path.
        self._small: SmallAllReduce | None = None
        self._hier: HierarchicalAllReduce | None = None
        if self.world_size > 1:
            self._setup(enabled, node_id, ws_bytes, wait_s, oneshot_bytes, threads)

    # ------------------------------------------------------------------ setup
    def _setup(
        self,
        enabled: bool,
        node_id: str | None,
        ws_bytes: int | None,
        wait_s: float | None,
        oneshot: int | None,
        threads: int | None,
    ) -> None:
        og = object_group(self.cpu_group)
        votes = og.all_gather((enabled, node_id), op="CpuCommunicator set-up",
                              name=self.unique_name or None)
        if not all(e for e, _ in votes):
            off = [r for r, (e, _) in enumerate(votes) if not e]
            self.fallback_reason = (f"shared memory disabled on rank(s) {off} "
                                    f"({ENABLE_ENV}=0 or use_shm=False)")
            return
        ids = [n for _, n in votes]
        if any(i is not None for i in ids):
            if any(i is None for i in ids):
                missing = [r for r, i in enumerate(ids) if i is None]
                raise ValueError(
                    f"node_id was given on some ranks but not on rank(s) {missing}; "
                    f"pass it on every rank of group {self.unique_name!r} or on none"
                )
            order: dict[str, int] = {}
            self.nodes = [order.setdefault(i, len(order)) for i in ids]
        else:
            try:
                self.nodes = node_assignment(self.cpu_group, self.unique_name or None)
            except SegmentError as e:  # every rank raises it: every rank falls back alike
                self.fallback_reason = f"the node probe could not use shared memory: {e}"
                logger.warning("group %r falls back to gloo: %s", self.unique_name, e)
                return
        n_nodes = max(self.nodes) + 1
        if n_nodes == self.world_size:
            self.fallback_reason = "every rank is on a different node"
            return
        plan = WorkspacePlan.from_nodes(self.nodes, self.rank_in_group)
        ws, pids, err = open_workspace(self.cpu_group, plan, ws_bytes)
        if err is not None:
            self.fallback_reason = f"shared-memory workspace unavailable: {err}"
            logger.warning("group %r falls back to gloo: %s", self.unique_name, err)
            return
        if ws is not None:
            sync = StepSync(
                ws, self.unique_name, plan.local_ranks, [pids[r] for r in plan.local_ranks], wait_s
            )
            self._engine = ShmEngine(ws, sync, oneshot, threads)
        # Which two-rank scheme serves a size must agree between the ranks, and each
        # rank's thread count is its own (affinity mask, environment).
        all_threads = og.all_gather(self._engine.threads if self._engine is not None else 0,
                                    op="CpuCommunicator set-up", name=self.unique_name or None)
        if self._engine is not None:
            self._engine.agree_pair_one_step([t for t in all_threads if t])
        if n_nodes == 1:
            self._flat = self._engine
            self._small = self._engine.small if self._engine is not None else None
            self.mode = "shm"
            return
        self._hier = HierarchicalAllReduce(
            self._engine, self.cpu_group, self.nodes, self.rank_in_group, self.unique_name
        )
        self.mode = "hierarchical"

    def shares_memory_with(self, peer: int) -> bool:
        """Whether group rank ``peer`` opened this rank's node workspace."""
        if self._engine is None or not 0 <= peer < len(self.nodes):
            return False
        return self.nodes[peer] == self.nodes[self.rank_in_group]

    def number_calls(self, source: Any) -> None:
        """Number the collectives (see the base class); the shared-memory steps
        compare the numbers beside each call's signature."""
        super().number_calls(source)
        if self._engine is not None:
            self._engine.sync.number = source
        if self._hier is not None:
            self._hier.number = source

    def _interrupted(self, op: str, e: BaseException) -> None:
        """An exception other than a backend error (an interrupt, a signal
        handler's) stopped ``op`` partway: the engine's steps are out of line
        with the peers', so break it and tell them (they raise instead of
        taking this rank's next call for the rest of this one)."""
        if self._engine is not None:
            self._engine.sync.abandon(op, f"{type(e).__name__}: {e}")

    def _abort(self) -> None:
        """Break the engine (the peers raise instead of waiting for this rank's next
        step) and end a wait another thread of this rank is in (at its next health
        check, :mod:`device_comms.cpu_shm.sync`)."""
        eng = self._engine
        if eng is not None:
            why = self.broken
            eng.sync.abort(f"{type(why).__name__}: {why}")

    @property
    def hierarchical(self) -> HierarchicalAllReduce | None:
        """The hierarchical all-reduce (several nodes), else None."""
        return self._hier

    def kernel_threads(self) -> contextlib.AbstractContextManager[Any]:
        """A context in which torch's kernels run with the shared-memory engine's share
        of the node's CPUs (:mod:`device_comms.cpu_shm.engine_threads`), as the
        engine's own copies do; a no-op without the engine. For a caller's copies
        into and out of a collective's tensors: with torch's default threads on
        every rank of a node, each rank's OpenMP team would spin on the CPUs its
        peers need to finish their part."""
        eng = self._engine
        return eng.kernel_threads if eng is not None else contextlib.nullcontext()

    def describe(self) -> dict[str, Any]:
        """A summary for logs and bug reports."""
        eng = self._engine
        return {
            "mode": self.mode,
            "fallback_reason": self.fallback_reason,
            "nodes": list(self.nodes),
            "local_ranks": eng.size if eng is not None else 1,
            "slot_bytes": eng.ws.slot_bytes if eng is not None else 0,
            "oneshot_bytes": eng.oneshot_bytes if eng is not None else 0,
            "engine_threads": eng.threads if eng is not None else 0,
            "cpu_moves": eng.sync.spread.moves if eng is not None else 0,
            "shm_calls": dict(self.shm_calls),
        }

    def barrier(self) -> None:
        """Wait until every rank of the group calls this (shared memory when one node).

        Signed like the other collectives: a rank in a barrier while another is
        in some other collective raises ``CollectiveMismatch`` on every rank
        (an unsigned step let the barrier's rank pass alone).
        """
        self._check_open()
        if self.world_size == 1:
            return
        header = self._signed.header("barrier", None, None, 0, (), None)
        eng = self._flat
        if eng is not None:
            self._one_call.enter("barrier")
            try:
                eng.sync.step("barrier", int(header[3]), int(header[4]), True)
            except BaseException as e:
                self._engine_failed("barrier", e)
            finally:
                self._one_call.leave()
        else:
            self._guard("barrier", self._agreed_barrier, header)

    def _agreed_barrier(self, header: Any) -> None:
        """Several nodes: agree through the leaders (as every collective does), then
        gloo's barrier."""
        if self._hier is not None:
            self._hier.agree("barrier", header)
        dist.barrier(self.cpu_group)

    def destroy(self) -> None:
        """Unmap the workspace (peers waiting on this rank get an error). Idempotent.

        Safe from another thread while a collective runs: the engine's copies go
        by address into the workspace, so it is unmapped only once that call
        left. The call is told first (the workspace is marked broken, which its
        waits notice within a health check) and waited for at most
        :data:`DESTROY_WAIT_S`; a call still running then keeps the mapping,
        which goes with the call's last reference (the owner's name is
        unlinked then).
        """
        super().destroy()  # first: a call that starts meanwhile is refused at once
        eng, self._engine, self._flat, self._hier = self._engine, None, None, None
        self._small = None
        self._plans.clear()
        self._broadcasts.clear()
        self._gathers.clear()
        self._scatterv.clear()
        if eng is not None:
            eng.sync.leave("destroyed")
            if self._one_call.wait_idle(DESTROY_WAIT_S):
                eng.close()

    # ------------------------------------------------------------------ reductions
    def all_reduce(
        self,
        input_: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Reduce ``input_`` element-wise across ranks; ``out`` or a new tensor.

        Same contract as :meth:`DeviceCommunicator.all_reduce`, which checks
        every call. At 1 KiB those checks and the ``no_grad`` context cost as
        much as the collective itself, so a call of a kind the shared-memory
        engine took before skips them, in four steps:

        1. **check** what the engine reads by address: a plain, contiguous CPU
           tensor that does not require grad and whose bytes are its values
           (not a lazily negated view) and are still in its storage (not freed
           or shrunk under it), with no ``out`` but ``input_`` itself;
        2. **choose** the path: the engine's one-step entry when the op, dtype
           and shape are those of its last entry or of one it keeps (they passed
           the checks when it was made);
           else the engine's all_reduce when this (op, dtype) passed them before
           and the tensor has memory; else the checked path;
        3. **run** it holding the one-call token, with the errors of the base
           class's ``_guard`` (:meth:`_engine_failed`; a call the entry cannot
           serve takes the checked path instead);
        4. **finish**: count the call; the checked path remembers the (op,
           dtype) it validated.
        """
        small = self._small
        # 1. check (inline: it runs on every call)
        if (
            small is not None
            and not self._closed  # aborted: the checked path says why
            and type(input_) is _PLAIN_TENSOR
            and (out is None or (out is input_ and writable(input_)))
            and input_.is_cpu
            and input_.layout is _STRIDED  # before is_contiguous: sparse has none
            and not input_.requires_grad
            and input_.is_contiguous()
            and not input_.is_neg()  # a lazily negated view: its bytes are not its values
        ):
            # 2. choose
            entry = small.last
            dtype, shape = input_.dtype, input_.shape
            if op is not entry.op or dtype is not entry.dtype or shape != entry.shape:
                entry = small.find(op, dtype, shape)  # another kept layout, or none
            if (entry.plain
                    # its bytes are still there (not freed or shrunk under it): the
                    # entry copies by address
                    and input_.untyped_storage().nbytes()
                    >= input_.storage_offset() * entry.itemsize + entry.nbytes):
                # 3. run the one-step entry
                one_call = self._one_call
                if not one_call.take(False):
                    one_call.refuse("all_reduce")
                try:
                    if self._small is None:  # destroyed since it was read: the mapping may
                        self._check_open()  # be gone; raises CommunicatorClosed
                    result = small.run(input_, entry, out)
                except NotServed:  # no memory behind input_: the checked path says why
                    result = None
                except BaseException as e:
                    self._engine_failed("all_reduce", e, (input_, op))
                finally:
                    one_call.leave()
                # 4. finish
                if result is not None:
                    self.shm_calls["all_reduce"] += 1
                    return result
            elif (
                type(op) is ReduceOp
                and op in self._validated.get(dtype, ())
                and not input_._is_zerotensor()  # noqa: SLF001 - torch's own API, no public one
                and storage_covers(input_)  # not freed under it: the engine copies by address
            ):
                eng = self._flat
                if eng is not None:  # None: destroyed meanwhile (the checked path says so)
                    # 3. run the engine's all_reduce (4. counted first, as the hooks count)
                    self.shm_calls["all_reduce"] += 1
                    return self._engine_call("all_reduce", (input_, op), eng.all_reduce,
                                             input_, op, out)
        # The checked path. 4. finish: complex tensors can be lazy conjugate views,
        # which only the checked path resolves.
        result = super().all_reduce(input_, op, out=out)
        if small is not None and type(op) is ReduceOp:
            self._validated_op(input_.dtype, op)
        return result

    def _validated_op(self, dtype: torch.dtype, op: ReduceOp) -> None:
        """Remember that the checked path accepted reduction ``op`` on ``dtype``
        (complex dtypes excepted: their lazy conjugate views only the checked path
        resolves)."""
        if dtype.is_complex:
            return
        ops = self._validated.setdefault(dtype, [])
        if op not in ops:
            ops.append(op)

    def _engine_call(self, op: str, shown: tuple[Any, ...], fn: Callable[..., _R],
                     *args: Any) -> _R:
        """``fn(*args)`` (an engine call of collective ``op`` whose arguments a fast
        path checked) holding the one-call token, its errors raised as :meth:`_guard`
        raises them (:meth:`_engine_failed`; a mismatch names ``shown``, the
        arguments as the checked path's hook would have received them)."""
        self._one_call.enter(op)
        try:
            if self._flat is None:  # destroyed since the fast path read the engine, whose
                self._check_open()  # mapping may be gone: raises CommunicatorClosed
            return fn(*args)
        except BaseException as e:
            self._engine_failed(op, e, shown)
        finally:
            self._one_call.leave()

    def _engine_failed(self, op: str, e: BaseException, args: tuple[Any, ...] = ()) -> NoReturn:
        """Raise for ``e``, which escaped the engine during ``op`` on a path that
        skips :meth:`_guard`, as ``_guard`` does: the abort's error when the
        communicator was aborted meanwhile; this package's errors as they are (a
        mismatch naming this rank's ``args``); a backend's ``RuntimeError``
        translated; anything else (an interrupt partway through) after breaking
        the engine for the peers.

        ``e`` is dropped from this frame on the way out: the raised error's
        traceback holds the frame, and a frame that held the error would make a
        cycle keeping this communicator (and its process groups' sockets and
        threads) alive after ``destroy()`` until the garbage collector ran."""
        try:
            why = self.broken
            if why is not None:
                raise copy.copy(why) from e
            if isinstance(e, CollectiveMismatch):
                with_own_arguments(e, args)
                raise e
            if isinstance(e, DeviceCommError):
                raise e
            if isinstance(e, RuntimeError):
                raise self._translate(op, e) from e
            self._interrupted(op, e)
            raise e
        finally:
            del e

    def _all_reduce(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        eng = self._flat
        if eng is not None:
            self.shm_calls["all_reduce"] += 1
            return eng.all_reduce(t, op)
        if self._hier is not None:
            h = self._signed.header("all_reduce", t.dtype, op, 0, t.shape, t.shape)
            return self._hier.all_reduce(t, op, h)
        return super()._all_reduce(t, op)

    def _all_reduce_into(self, t: torch.Tensor, op: ReduceOp, out: torch.Tensor) -> torch.Tensor:
        eng = self._flat
        if eng is None:
            return super()._all_reduce_into(t, op, out)
        self.shm_calls["all_reduce"] += 1
        return eng.all_reduce(t, op, out=out)

    def _reduce(self, t: torch.Tensor, dst: int, op: ReduceOp) -> torch.Tensor | None:
        eng = self._flat
        if eng is None:
            return super()._reduce(t, dst, op)
        self.shm_calls["reduce"] += 1
        return eng.reduce(t, dst, op)

    def reduce_scatter(
        self, input_: torch.Tensor, dim: int = -1, op: ReduceOp = ReduceOp.SUM
    ) -> torch.Tensor:
        """Reduce across ranks, then give rank ``i`` the ``i``-th equal slice along ``dim``.

        Same contract as :meth:`DeviceCommunicator.reduce_scatter`. A call of a
        layout (dtype, shape, ``dim``) and op the engine took before skips the
        checks of the layout (:mod:`device_comms.cpu.repeat_calls`): **check**
        the tensor object, **look up** the layout's plan, **run** the engine's
        reduce-scatter; the checked path **keeps** a plan for the next call.
        """
        eng = self._flat
        # check
        if eng is not None and not self._closed and type(dim) is int and plain(input_):
            # look up
            plan = self._plans.get("reduce_scatter", input_, dim)
            if plan is not None and type(op) is ReduceOp and op in self._validated.get(
                    input_.dtype, ()):
                # run
                return self._engine_call("reduce_scatter", (input_, plan.dim, op),
                                         self._shm_reduce_scatter, eng, input_, plan.dim, op,
                                         plan.size_key)
        result = super().reduce_scatter(input_, dim, op)
        # keep
        if eng is not None and type(dim) is int and plain(input_) and type(op) is ReduceOp:
            d = dim % input_.dim()
            self._plans.keep("reduce_scatter", input_, dim,
                             LayoutPlan(d, _shape_key(input_.shape, d), result.shape))
            self._validated_op(input_.dtype, op)
        return result

    def _reduce_scatter(self, t: torch.Tensor, dim: int, op: ReduceOp) -> torch.Tensor:
        eng = self._flat
        if eng is None:
            return super()._reduce_scatter(t, dim, op)
        return self._shm_reduce_scatter(eng, t, dim, op, _shape_key(t.shape, dim))

    def _shm_reduce_scatter(self, eng: ShmEngine, t: torch.Tensor, dim: int, op: ReduceOp,
                            key: int) -> torch.Tensor:
        """Reduce-scatter in the engine; ``key`` signs the layout."""
        self.shm_calls["reduce_scatter"] += 1
        entry = eng.one_step_scatter(t, dim, op, key)
        if entry is not None:  # one step, this rank's part one block: no torch views
            try:
                return eng.small.run(t, entry)
            except NotServed:  # no memory behind t (before any step): the steps below
                pass
        n = self.world_size
        if t.dim() == 1:  # nothing to move or view: the engine's own kernels are threaded
            return eng.reduce_scatter(t, [t.numel() // n] * n, op, "reduce_scatter", key)
        with eng.kernel_threads:  # the transposing copies run under the engine's thread limit too
            x = _moved(t, dim, 0)
            k = x.numel() // n
            out = eng.reduce_scatter(x.view(-1), [k] * n, op, "reduce_scatter", key)
            return _moved(out.view((x.shape[0] // n,) + x.shape[1:]), 0, dim)

    def reduce_scatterv(
        self,
        input_: torch.Tensor,
        dim: int = -1,
        sizes: Sequence[int] | None = None,
        op: ReduceOp = ReduceOp.SUM,
    ) -> torch.Tensor:
        """Reduce-scatter where rank ``i`` receives ``sizes[i]`` entries along ``dim``.

        Same contract as :meth:`DeviceCommunicator.reduce_scatterv`. A call of a
        layout (dtype, shape, ``dim``, ``sizes``, op) the engine took before
        skips the checks: **check** the tensor object (:func:`plain`) and that
        ``sizes`` is a list or tuple of ints, **look up** the layout's normalised
        ``dim`` and size key, **run** the engine's reduce_scatterv; the checked
        path **keeps** them for the next call.
        """
        eng = self._flat
        # check
        if (eng is not None and not self._closed and type(dim) is int and type(op) is ReduceOp
                and type(sizes) in _SEQUENCES and plain(input_)):
            counts = tuple(sizes)  # type: ignore[arg-type]  # a list or a tuple: checked
            if _INTS.issuperset(map(type, counts)):
                # look up
                kept = self._scatterv.get((input_.dtype, input_.shape, dim, counts, id(op)))
                if kept is not None:
                    # run
                    return self._engine_call(
                        "reduce_scatterv", (input_, kept[0], list(counts), op),
                        self._shm_reduce_scatterv, eng, input_, kept[0], counts, op, kept[1])
        result = super().reduce_scatterv(input_, dim, sizes, op)
        # keep
        if (eng is not None and sizes is not None and type(dim) is int
                and type(op) is ReduceOp and type(sizes) in _SEQUENCES and plain(input_)):
            counts = tuple(sizes)
            if _INTS.issuperset(map(type, counts)):
                d = dim % input_.dim()
                rest = input_.shape[:d] + input_.shape[d + 1 :]
                self._scatterv.keep((input_.dtype, input_.shape, dim, counts, id(op)),
                                    (d, _size_key(counts, rest, d)))
        return result

    def _reduce_scatterv(
        self, t: torch.Tensor, dim: int, sizes: list[int], op: ReduceOp
    ) -> torch.Tensor:
        eng = self._flat
        if eng is None:
            return super()._reduce_scatterv(t, dim, sizes, op)
        rest = t.shape[:dim] + t.shape[dim + 1 :]  # the moved tensor's other dimensions
        return self._shm_reduce_scatterv(eng, t, dim, tuple(sizes), op,
                                         _size_key(sizes, rest, dim))

    def _shm_reduce_scatterv(self, eng: ShmEngine, t: torch.Tensor, dim: int,
                             sizes: tuple[int, ...], op: ReduceOp, key: int) -> torch.Tensor:
        """Reduce-scatterv in the engine; ``key`` signs the layout."""
        self.shm_calls["reduce_scatterv"] += 1
        entry = eng.one_step_scatter(t, dim, op, key, sizes)
        if entry is not None:  # one step, this rank's part one block: no torch views
            try:
                return eng.small.run(t, entry)
            except NotServed:  # no memory behind t (before any step): the steps below
                pass
        with eng.kernel_threads:
            x = _moved(t, dim, 0)
            inner = math.prod(x.shape[1:])
            out = eng.reduce_scatter(
                x.view(-1), [s * inner for s in sizes], op, "reduce_scatterv", key
            )
            mine = sizes[self.rank_in_group]
            return _moved(out.view((mine,) + x.shape[1:]), 0, dim)

    # ------------------------------------------------------------------ data movement
    def all_gather(self, input_: torch.Tensor, dim: int = -1, *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """Concatenate every rank's ``input_`` along ``dim``; ``out`` or a new tensor.

        Same contract as :meth:`DeviceCommunicator.all_gather`. A call of a
        layout (dtype, shape, ``dim``) the engine took before skips the checks
        of the layout (:mod:`device_comms.cpu.repeat_calls`): **check** the
        tensor objects, **look up** the layout's plan, **run** the engine's
        all-gather; the checked path **keeps** a plan for the next call.
        """
        eng = self._flat
        # check
        if eng is not None and not self._closed and type(dim) is int and plain(input_):
            # look up
            plan = self._plans.get("all_gather", input_, dim)
            if plan is not None and (out is None or takes_out(out, input_, plan.result_shape)):
                # run
                shown = (input_, plan.dim) if out is None else (input_, plan.dim, out)
                return self._engine_call("all_gather", shown, self._shm_all_gather, eng,
                                         input_, plan.dim, plan.size_key, out)
        result = super().all_gather(input_, dim, out=out)
        # keep
        if eng is not None and type(dim) is int and plain(input_):
            d = dim % input_.dim()
            self._plans.keep("all_gather", input_, dim,
                             LayoutPlan(d, _shape_key(input_.shape, d), result.shape))
        return result

    def _all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        eng = self._flat
        if eng is None:
            return super()._all_gather(t, dim)
        return self._shm_all_gather(eng, t, dim, _shape_key(t.shape, dim), None)

    def _all_gather_into(self, t: torch.Tensor, dim: int, out: torch.Tensor) -> torch.Tensor:
        eng = self._flat
        if eng is None:
            return super()._all_gather_into(t, dim, out)
        return self._shm_all_gather(eng, t, dim, _shape_key(t.shape, dim), out)

    def _shm_all_gather(self, eng: ShmEngine, t: torch.Tensor, dim: int, key: int,
                        out: torch.Tensor | None) -> torch.Tensor:
        """All-gather in the engine, into ``out`` (None: a new tensor); ``key`` signs
        the layout."""
        self.shm_calls["all_gather"] += 1
        if out is None:  # a small piece that is one block of the result: one step by address
            entry = eng.gathers.cat_entry(t, dim)
            if entry is not None:
                return eng.gathers.cat(t, entry, key)  # type: ignore[return-value]  # every rank
        if t.nbytes <= eng.ws.slot_bytes and t.nbytes * self.world_size < host_alloc.HUGE_MIN_BYTES:
            return eng.all_gather_cat(  # type: ignore[return-value]  # no dst: every rank gets it
                t, dim, size_key=key, out=out)
        sizes = [t.shape[dim]] * self.world_size
        if out is None:
            out = _gathered(t, dim, sizes)
        self._gather_rows(eng, t, dim, sizes, "all_gather", None, key, out)
        return out

    def _all_gatherv(self, t: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        eng = self._flat
        if eng is None:
            return super()._all_gatherv(t, dim, sizes)
        key = _size_key(sizes, t.shape[:dim] + t.shape[dim + 1 :], dim)
        return self._shm_gatherv(eng, t, dim, sizes, key)

    def _all_gatherv_rows(
        self, ts: list[torch.Tensor], sizes: list[int] | None
    ) -> tuple[list[torch.Tensor], list[int]]:
        # One engine step carries every rank's row count and, when every rank's
        # rows fit its slot, the rows themselves (ShmGathers.rows_exchange); else
        # the packed rows follow in a second call with the counts now known.
        eng = self._flat
        if eng is None:
            return super()._all_gatherv_rows(ts, sizes)
        self.shm_calls["all_gatherv_rows"] += 1
        widths = [row_gather.row_bytes(t) for t in ts]
        key = _size_key(widths, (row_gather.layout_key(ts),), 0)
        with eng.kernel_threads:
            counts, gathered = eng.gathers.rows_exchange(ts, widths, key, sizes)
            row_gather.check_counts_fit(counts, ts, self.unique_name)
            if gathered is not None:
                return gathered, counts
            return super()._all_gatherv_rows(ts, counts)

    def _all_gatherv_packed(self, packed: torch.Tensor, sizes: list[int],
                            layout: int) -> torch.Tensor:
        eng = self._flat
        if eng is None:
            return super()._all_gatherv_packed(packed, sizes, layout)
        key = _size_key(sizes, (packed.shape[1], layout), 0)
        return self._shm_gatherv(eng, packed, 0, sizes, key)

    def _shm_gatherv(self, eng: ShmEngine, t: torch.Tensor, dim: int, sizes: list[int],
                     key: int) -> torch.Tensor:
        """All-gather of uneven pieces in the engine; ``key`` signs the layout."""
        self.shm_calls["all_gatherv"] += 1
        inner = math.prod(t.shape[:dim]) * math.prod(t.shape[dim + 1 :])
        if max(sizes) * inner * t.element_size() <= eng.ws.slot_bytes and (
            sum(sizes) * inner * t.element_size() < host_alloc.HUGE_MIN_BYTES
        ):
            shapes = [torch.Size(t.shape[:dim] + (s,) + t.shape[dim + 1 :]) for s in sizes]
            return eng.gatherv_cat(t, shapes, dim, key)
        out = _gathered(t, dim, sizes)
        self._gather_rows(eng, t, dim, sizes, "all_gatherv", None, key, out)
        return out

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's ``input_`` along ``dim`` on ``dst``; None elsewhere.

        Same contract as :meth:`DeviceCommunicator.gather`. A call of a layout
        (dtype, shape, ``dst``, ``dim``) the engine took before skips the checks
        of the layout: **check** the tensor object (:func:`plain`), **look up**
        the layout's normalised ``dim`` and size key, **run** the engine's gather;
        the checked path **keeps** them for the next call.
        """
        eng = self._flat
        # check
        if (eng is not None and not self._closed and type(dst) is int and type(dim) is int
                and plain(input_)):
            # look up
            kept = self._gathers.get((input_.dtype, input_.shape, dst, dim))
            if kept is not None:
                # run
                return self._engine_call("gather", (input_, dst, kept[0]), self._shm_gather,
                                         eng, input_, dst, kept[0], kept[1])
        result = super().gather(input_, dst, dim)
        # keep
        if (eng is not None and type(dst) is int and type(dim) is int
                and 0 <= dst < self.world_size and plain(input_) and input_.dim() > 0):
            d = dim % input_.dim()
            self._gathers.keep((input_.dtype, input_.shape, dst, dim),
                               (d, _shape_key(input_.shape, d)))
        return result

    def _gather(self, t: torch.Tensor, dst: int, dim: int) -> torch.Tensor | None:
        eng = self._flat
        if eng is None:
            return super()._gather(t, dst, dim)
        return self._shm_gather(eng, t, dst, dim, _shape_key(t.shape, dim))

    def _shm_gather(self, eng: ShmEngine, t: torch.Tensor, dst: int, dim: int,
                    key: int) -> torch.Tensor | None:
        """Gather in the engine onto ``dst``; ``key`` signs the layout."""
        self.shm_calls["gather"] += 1
        entry = eng.gathers.cat_entry(t, dim, dst)  # a small piece that is one block: by address
        if entry is not None:
            return eng.gathers.cat(t, entry, key)
        if t.nbytes <= eng.ws.slot_bytes and t.nbytes * self.world_size < host_alloc.HUGE_MIN_BYTES:
            return eng.all_gather_cat(t, dim, "gather", dst, key)
        sizes = [t.shape[dim]] * self.world_size
        out = _gathered(t, dim, sizes) if dst == self.rank_in_group else None
        self._gather_rows(eng, t, dim, sizes, "gather", dst, key, out)
        return out

    def _gather_rows(
        self,
        eng: ShmEngine,
        t: torch.Tensor,
        dim: int,
        sizes: list[int],
        kind: str,
        dst: int | None,
        key: int,
        out: torch.Tensor | None,
    ) -> None:
        """Gather along ``dim`` straight into ``out``, the output in its final layout
        (:func:`_gathered`; None on a rank that gets nothing)."""
        rows = math.prod(t.shape[:dim])
        inner = math.prod(t.shape[dim + 1 :])
        widths = [s * inner for s in sizes]
        eng.gather_rows(
            t.view(rows, widths[self.rank_in_group]), widths,
            None if out is None else out.view(rows, sum(widths)), kind, key, dst,
        )

    def _all_to_allv(
        self, t: torch.Tensor, send: list[int], recv: list[int] | None
    ) -> torch.Tensor:
        eng = self._flat
        if eng is None or not self._in_shm("all_to_allv"):
            return super()._all_to_allv(t, send, recv)
        self.shm_calls["all_to_allv"] += 1
        return eng.all_to_allv(t, send, recv)

    def _in_shm(self, op: str) -> bool:
        """Whether ``op`` runs in the shared-memory engine (the same on every rank)."""
        eng = self._flat
        if eng is None or op not in _SHM_OPS:
            return False
        return op != "all_to_allv" or eng.alltoallv.fits

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Broadcast ``input_`` from ``src`` in place; receivers pass the buffer to fill.

        Same contract as :meth:`DeviceCommunicator.broadcast`. A call of a layout
        (dtype, shape, ``src``) that the checked path sent by address before
        (:meth:`ShmEngine.broadcast_by_address`: at most
        :data:`~device_comms.cpu_shm.engine.BY_ADDRESS_MAX_BYTES` and a slot)
        skips the checks: **check** the tensor object (:func:`plain`, and
        writable on a receiver), **look up** the layout's step signature, **run**
        the engine's broadcast by address; the checked path **keeps** the
        signature for the next call.
        """
        eng = self._flat
        # check
        if eng is not None and not self._closed and type(src) is int and plain(input_):
            # look up
            signed = self._broadcasts.get((input_.dtype, input_.shape, src))
            if signed is not None and (src == self.rank_in_group or writable(input_)):
                # run
                self.shm_calls["broadcast"] += 1
                return self._engine_call("broadcast", (input_, src), eng.broadcast_by_address,
                                         input_, src, signed)
        result = super().broadcast(input_, src)
        # keep
        if (eng is not None and type(src) is int and 0 <= src < self.world_size
                and plain(input_) and input_.nbytes <= min(BY_ADDRESS_MAX_BYTES,
                                                           eng.ws.slot_bytes)):
            self._broadcasts.keep((input_.dtype, input_.shape, src),
                                  (_step_signature("broadcast", input_.dtype, None, src),
                                   _step_shape_key(input_.shape)))
        return result

    def _broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        eng = self._flat
        if eng is None:
            return super()._broadcast(t, src)
        self.shm_calls["broadcast"] += 1
        return eng.broadcast(t, src)

    # ------------------------------------------------------------------ one call at a time
    def _guard(self, op: str, fn: Callable[..., _R], *args: Any) -> _R:
        """Run a hook as the base does, holding the communicator for a collective.

        Point-to-point calls are not held (:mod:`device_comms.cpu.one_call`).
        """
        if op in _P2P_OPS:
            return super()._guard(op, fn, *args)
        self._one_call.enter(op)
        try:
            return super()._guard(op, fn, *args)
        finally:
            self._one_call.leave()

    # ------------------------------------------------------------------ signatures
    def _prologue(self, op: str, header: Any, reason: str | None) -> bool:
        """Agree on a gloo-routed collective where the other ops meet, before its envelopes.

        One node: a shared-memory step with the call's signature (scatter,
        all_to_all), so a rank in one of them and a rank in a shared-memory
        op raise at once instead of waiting for each other. Several nodes:
        :meth:`HierarchicalAllReduce.agree` (every op but send/recv).
        Returns True when the peers were told of this rank's rejection.
        """
        eng = self._flat
        if eng is not None:
            if self._in_shm(op):
                return False
            if reason is not None:
                eng.sync.reject(op, reason)
                return True
            eng.sync.step(op, int(header[3]), int(header[4]), True)
            return False
        if self._hier is not None:
            self._hier.agree(op, header, reason)
            return reason is not None
        return False

    def _abort_collective(self, op: str, message: str, *meta: Any) -> None:
        """A rejected call is one shared-memory step with a "rejected" signature
        (any op the engine runs; see :mod:`device_comms.cpu_shm.sync`); otherwise gloo's
        (after :meth:`_prologue`, which tells the other ops' ranks)."""
        eng = self._flat
        if eng is not None and self._in_shm(op):
            self._guard(op, eng.sync.reject, op, message)
            return
        super()._abort_collective(op, message, *meta)

    def __repr__(self) -> str:
        return (
            f"CpuCommunicator({self.unique_name!r}, rank {self.rank_in_group}/{self.world_size}, "
            f"mode={self.mode})"
        )


def _gathered(t: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
    """A new tensor for every rank's ``t`` (``sizes[r]`` along ``dim``) concatenated along
    ``dim`` (large ones huge-page backed)."""
    shape = list(t.shape)
    shape[dim] = sum(sizes)
    return host_alloc.empty(shape, t.dtype)


def _moved(t: torch.Tensor, src: int, dst: int) -> torch.Tensor:
    """``t.movedim(src, dst)`` made contiguous (large copies huge-page backed)."""
    if src == dst:
        return t
    m = t.movedim(src, dst)
    if m.is_contiguous():
        return m
    out = host_alloc.empty(m.shape, t.dtype)
    out.copy_(m)
    return out


def _size_key(sizes: Sequence[int], others: Sequence[int], dim: int) -> int:
    """A deterministic int64 key of an uneven layout (same on every rank).

    Covers the per-rank sizes, the other dimensions and ``dim`` itself, so
    ranks that disagree on any of them raise instead of mixing layouts.
    """
    return hash((tuple(sizes), tuple(others), dim)) & 0x7FFF_FFFF_FFFF_FFFF


def _shape_key(shape: Sequence[int], dim: int) -> int:
    """A deterministic int64 key of an even layout: the full shape and ``dim``.

    The element count alone lets ranks with a (2, 3) and a (3, 2) input, or
    different ``dim`` arguments, exchange bytes silently into a wrong result.
    """
    return hash((tuple(shape), dim)) & 0x7FFF_FFFF_FFFF_FFFF

"""``CustomAllreduce``: one-node all-reduce that reads peers' buffers over CUDA IPC.

Life of a communicator (every step collective over the group's CPU side):

1. **Agree**: ranks all-gather ``(enabled, device, node)``, then (when every
   rank is enabled and on one node) each rank's answer on peer access between
   those devices (a device index that is not a device of a rank, or a probe
   that raises there, is that rank's "no", never an error that only it
   raises); the verdict (world size 2/4/6/8, one node, P2P between every pair
   of devices on every rank, not disabled by argument or
   ``GROUPCOORD_DISABLE_CUSTOM_ALLREDUCE`` on any rank) is computed from the
   gathered words only, so it is the same on every rank. A group that says no
   is ``disabled`` with a ``reason`` and its
   :meth:`CustomAllreduce.should_use` is always False.
2. **Allocate** one buffer per rank (signal | staging | tmp, see ``layout``),
   zeroed before any handle leaves the process.
3. **Exchange** IPC handles (72 bytes each, no pickle) and open the peers'.
   Every peer pointer is checked before it reaches a pointer table (see
   :mod:`~device_comms.cuda.custom_allreduce.handles`): its offset plus the
   bytes the kernels use through it (the whole buffer; a registered input's
   bytes) must lie inside the allocation the driver mapped, 16-byte aligned,
   and it must name an allocation of that peer alone. Then the ranks agree on
   the outcome (one all-gather of a word), so a handle one rank refuses makes
   every rank raise instead of leaving its peers launching kernels it will
   never join.
4. **Call**: an eager call copies its input into the staging area and launches
   one kernel on the current stream; a call captured inside :meth:`capture`
   launches on a fresh table entry that names the input itself, and the
   entries are filled when the capture context exits (the graph then replays
   without a copy).

Every launch is a single kernel on the caller's current stream: calls of one
communicator must be ordered on one stream (as a model's forward pass is).
A kernel that waits longer than ``timeout`` for a peer gives up and records
which peer in a host-mapped word; the next call raises
:class:`~device_comms.errors.CollectiveTimeout` naming it and the
communicator stays broken.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist

from device_comms.cuda.custom_allreduce import eligibility as elig
from device_comms.cuda.custom_allreduce import layout
from device_comms.cuda.custom_allreduce.device_memory import (
    DeviceBuffer,
    KernelFaultWords,
    decode_error,
)
from device_comms.cuda.custom_allreduce.handles import (
    CudaIpcBackend,
    HandleBook,
    IpcBackend,
    register_buffers,
)
from device_comms.cuda.custom_allreduce.kernels import choose_variant, kernel_set
from device_comms.cuda.custom_allreduce.table import RankTables
from device_comms.errors import (
    BrokenCommunicator,
    CollectiveTimeout,
    CommunicatorClosed,
    DecodeError,
)
from shm_broadcast.checks import check_int, check_timeout
from shm_broadcast.ranks.topology import in_the_same_node_as

__all__ = ["CustomAllreduce"]

_MAX_DEVICE_INDEX = 1 << 16  # far above any device count; a larger index is garbage
#: The least compute capability the kernels run on (their bfloat16 conversions need sm_80).
MIN_CAPABILITY = (8, 0)


@dataclasses.dataclass
class _Pending:
    """A captured call whose table entry is filled after the capture."""

    index: int
    ptr: int
    nbytes: int


class CustomAllreduce:
    """All-reduce (SUM) of float16/bfloat16/float32 over CUDA IPC within one node.

    Args:
        cpu_group: A gloo group over the ranks (setup exchanges only).
        device: This rank's CUDA device.
        max_size: Largest message in bytes (default 8 MiB); larger ones fall back.
        enabled: False disables it on this rank (and so on every rank).
        timeout: Seconds a kernel waits for a peer before giving up.
        max_blocks: Most thread blocks per launch (at most 64).
        max_graph_inputs: How many captured calls can be registered (an entry of
            192 bytes of device memory each; the default, 32,768, takes 6 MiB:
            80 layers x 2 all-reduces x vLLM's 67 graph sizes is about 10,700).
            Past it, captured calls go to NCCL (:meth:`should_use` says no).
        oneshot_limit: Bytes up to which the one-shot kernel is used (default
            per world size); larger messages use the two-shot kernel.
        ipc_backend: How handles are made and opened (default: CUDA IPC).
        unique_name: Group name for messages.
    """

    def __init__(
        self,
        cpu_group: dist.ProcessGroup,
        device: torch.device,
        max_size: int = elig.DEFAULT_MAX_SIZE,
        *,
        enabled: bool = True,
        timeout: float = 300.0,
        max_blocks: int = 36,
        max_graph_inputs: int = 32768,
        oneshot_limit: int | None = None,
        ipc_backend: IpcBackend | None = None,
        unique_name: str = "custom-allreduce",
    ) -> None:
        self.max_size = elig.check_max_size(max_size)
        self.max_blocks = layout.check_max_blocks(max_blocks)
        check_int(max_graph_inputs, "max_graph_inputs", minimum=0)
        wait_s = check_timeout(timeout, "timeout", positive=True)
        self.timeout_ns = int((300.0 if wait_s is None else wait_s) * 1e9)
        self.cpu_group, self.device = cpu_group, torch.device(device)
        self.unique_name = unique_name
        self.rank = dist.get_rank(cpu_group)
        self.world_size = dist.get_world_size(cpu_group)
        self.oneshot_limit = oneshot_limit
        self.disabled, self.reason = True, ""
        self._closed = self._capturing = False
        self._pending: list[_Pending] = []
        self._broken: str | None = None
        verdict = self._agree(enabled and not elig.disabled_by_env()
                              and not elig.disabled_in_process())
        if not verdict.ok:
            self.reason = verdict.reason
            return
        why_not = self._setup(ipc_backend or CudaIpcBackend(), max_graph_inputs)
        if why_not:
            self.reason = why_not
            return
        self.disabled = False

    # ------------------------------------------------------------------ setup
    def _agree(self, enabled: bool) -> elig.GroupVerdict:
        index = self.device.index
        if index is None:
            index = torch.cuda.current_device() if enabled else 0
        self.device_index = index
        facts = torch.tensor([int(enabled), index], dtype=torch.int64)
        rows = [torch.zeros_like(facts) for _ in range(self.world_size)]
        dist.all_gather(rows, facts, group=self.cpu_group)
        devices = [int(r[1]) for r in rows]
        everyone = all(int(r[0]) for r in rows)
        for r, row in enumerate(rows):
            flag, device = (int(v) for v in row)
            if flag not in (0, 1) or not 0 <= device < _MAX_DEVICE_INDEX:
                # Every rank sees the same rows: every rank raises.
                raise DecodeError(
                    f"custom all-reduce of {self.unique_name!r}: rank {r} sent (enabled "
                    f"{flag}, device {device}); expected 0 or 1 and a device index in "
                    f"[0, {_MAX_DEVICE_INDEX})", queue=self.unique_name,
                    side=f"rank {self.rank}", peers=(r,))
        same_node = all(in_the_same_node_as(self.cpu_group, 0))
        # Every rank sees the same rows, so every rank skips (or runs) the P2P step alike.
        p2p, why = self._agree_on_peer_access(devices) if everyone and same_node else (False, "")
        verdict = elig.group_verdict(self.world_size, same_node, p2p, everyone, p2p_reason=why)
        # The same verdict everywhere: every rank asks about the kernels, or none does.
        return self._agree_on_kernels(index) if verdict.ok else verdict

    def _agree_on_kernels(self, index: int) -> elig.GroupVerdict:
        """Whether the kernels run on every rank's device, gathered (collective): a
        rank where they do not (an older GPU, a compile failure) disables the group on
        every rank, instead of raising alone while its peers go on to the setup."""
        why = _kernels_ready(index)
        word = torch.tensor([int(not why)], dtype=torch.int64)
        rows = [torch.zeros_like(word) for _ in range(self.world_size)]
        dist.all_gather(rows, word, group=self.cpu_group)
        ready = [int(row[0]) for row in rows]
        for r, flag in enumerate(ready):
            if flag not in (0, 1):
                raise DecodeError(
                    f"custom all-reduce of {self.unique_name!r}: rank {r} sent kernels ready "
                    f"{flag}; expected 0 or 1", queue=self.unique_name,
                    side=f"rank {self.rank}", peers=(r,))
        not_ready = [r for r, flag in enumerate(ready) if not flag]
        if not_ready:
            return elig.GroupVerdict(False, f"the kernels cannot run on rank(s) {not_ready}"
                                            + (f" ({why})" if why else ""))
        return elig.GroupVerdict(True, "")

    def _agree_on_peer_access(self, devices: list[int]) -> tuple[bool, str]:
        """Every rank's peer-access answer, gathered; the verdict comes from the gathered
        words alone, so a rank whose driver answers otherwise (another device count,
        a probe that raises) cannot split the group (collective)."""
        count = _device_count()
        answer, detail = elig.local_peer_access(devices, count, _can_access_peer)
        word = torch.tensor([int(answer), count], dtype=torch.int64)
        rows = [torch.zeros_like(word) for _ in range(self.world_size)]
        dist.all_gather(rows, word, group=self.cpu_group)
        answers = [[int(v) for v in row] for row in rows]
        return elig.peer_access_verdict(answers, devices, group=self.unique_name, me=self.rank,
                                        detail=detail)

    def _setup(self, backend: IpcBackend, max_graph_inputs: int) -> str:
        """Allocate, then exchange the buffers' handles (collective).

        Returns:
            "" once set up; else why not (an allocation failed on some rank:
            every rank returns the same ranks, having freed what it made).
        """
        nbytes = layout.buffer_bytes(self.max_size)
        failure: Exception | None = None
        try:
            self._buffer = DeviceBuffer(nbytes, self.device_index)
            self._staging = self._buffer.tensor(layout.staging_offset(), self.max_size)
            self._errors = KernelFaultWords(1)
            self._tables = RankTables(self.device_index, max_graph_inputs + 1)
            self._book = HandleBook(backend, self.rank)
            self._backend = backend
            self._kernels = kernel_set(self.device_index)  # compiled in the agreement
            torch.cuda.synchronize(self.device)  # zeroed signals land before peers can see them
        except Exception as e:  # out of memory, a bad max_graph_inputs: the peers are told
            failure = e
        flags = torch.tensor([int(failure is not None)], dtype=torch.int64)
        rows = [torch.zeros_like(flags) for _ in range(self.world_size)]
        dist.all_gather(rows, flags, group=self.cpu_group)
        failed = [r for r, row in enumerate(rows) if int(row[0])]
        if failed:
            self._free()
            return (f"setting up failed on rank(s) {failed}"
                    + (f" ({type(failure).__name__}: {failure})" if failure is not None else ""))
        try:
            own = [(self._buffer.ptr, nbytes)]
            self._bases = self._exchange(own, "custom all-reduce buffers")[0]
        except BaseException:
            self._free()
            raise
        self._sig = list(self._bases)
        self._tmp = [b + layout.tmp_offset(self.max_size) for b in self._bases]
        staging = [b + layout.staging_offset() for b in self._bases]
        self._tables.fill(0, self._sig, staging, self._tmp)
        return ""

    # ------------------------------------------------------------------ calls
    def should_use(self, t: torch.Tensor) -> bool:
        """Whether :meth:`all_reduce` handles ``t`` (cheap; same answer on every rank
        for the same shape and dtype, and, inside :meth:`capture`, the same calls
        captured before: once the table of captured inputs is full, no)."""
        if self.disabled or self._closed:
            return False
        if self._capturing and self._tables.used >= self._tables.capacity:
            return False  # NCCL serves the rest of the capture
        return elig.call_eligible(t, self.max_size)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group; returns a new tensor (bitwise equal on every rank).

        ``t`` must satisfy :meth:`should_use`.

        Raises:
            CollectiveTimeout: An earlier kernel gave up waiting for a peer.
            CommunicatorClosed: After :meth:`close`.
        """
        self._check_usable()
        if isinstance(t, torch.Tensor) and (t.device.type != "cuda"
                                            or t.device.index != self.device_index):
            raise ValueError(
                f"input_ must be on the custom all-reduce's device cuda:{self.device_index} "
                f"({self.unique_name!r}), got a tensor on {t.device}")
        if not elig.call_eligible(t, self.max_size):
            raise ValueError(
                f"input_ is not eligible for the custom all-reduce of {self.unique_name!r} "
                f"(dtype {t.dtype}, {t.nbytes} bytes, contiguous={t.is_contiguous()}); it needs "
                f"float16/bfloat16/float32, contiguous, a multiple of 16 bytes up to "
                f"{self.max_size}"
            )
        out = torch.empty_like(t)
        stream = torch.cuda.current_stream(self.device)
        if self._capturing and torch.cuda.is_current_stream_capturing():
            if t.data_ptr() % layout.PACK_BYTES:  # kernels load 16-byte packs in place
                t = t.clone()
            index = self._tables.reserve()
            self._pending.append(_Pending(index, t.data_ptr(), t.nbytes))
        else:
            index = 0
            self._staging[: t.nbytes].copy_(t.reshape(-1).view(torch.uint8))
        self._kernels.launch(
            choose_variant(t.nbytes, self.world_size, self.oneshot_limit), t.dtype,
            self.world_size, table_ptr=self._tables.ptr(index), out_ptr=out.data_ptr(),
            nbytes=t.nbytes, rank=self.rank, timeout_ns=self.timeout_ns,
            err_ptr=self._errors.device_ptr, stream_ptr=stream.cuda_stream,
            max_blocks=self.max_blocks,
        )
        return out

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Register the inputs of calls captured inside; collective on exit.

        Every rank must capture the same sequence of all-reduces. On exit the
        ranks exchange the inputs' handles and fill their table entries; a
        replay then reads the inputs in place. If the body raises, nothing is
        registered (the captured graph must not be replayed).
        """
        if self.disabled:
            yield
            return
        self._capturing = True
        try:
            yield
        except BaseException:
            self._pending.clear()
            raise
        finally:
            self._capturing = False
        self.register_graph_buffers()

    def register_graph_buffers(self) -> None:
        """Exchange and register the inputs recorded during capture (collective).

        Whatever fails, on whichever rank, every rank raises and every rank's
        communicator is broken afterwards (later calls raise
        :class:`~device_comms.errors.BrokenCommunicator`): the captured graph
        must not be replayed, and no rank launches an eager kernel that a peer
        which gave up will never join.

        Raises:
            DecodeError: A peer's handle failed a check here.
            CollectiveMismatch: Another rank refused a handle or could not open
                one (:class:`~device_comms.errors.PeerRejectedError`: another
                rank could not make its handles).
            Exception: What making this rank's handles or opening a peer's
                raised here (the backend's error).
        """
        pending, self._pending = self._pending, []
        try:
            ptrs = self._exchange([(p.ptr, p.nbytes) for p in pending],
                                  "captured all-reduce inputs")
        except Exception as e:  # a backend's error breaks it as much as a peer's refusal
            self._broken = self._broken or (
                f"custom all-reduce of {self.unique_name!r}: registering captured inputs "
                f"failed ({type(e).__name__}: {e}); the captured graph must not be replayed")
            raise
        self._tables.fill_many([
            (p.index, layout.table_entry(self._sig, got, self._tmp))
            for p, got in zip(pending, ptrs, strict=True)
        ])

    def _exchange(self, buffers: list[tuple[int, int]], what: str) -> list[list[int]]:
        """Exchange and register ``(pointer, bytes used)`` buffers (every rank raises
        when any rank refused a peer's handle)."""
        return register_buffers(self.cpu_group, self._book, self._backend, buffers, what,
                                align=layout.PACK_BYTES, group_name=self.unique_name)

    # ------------------------------------------------------------------ state
    def check_error(self) -> None:
        """Raise if a kernel of this rank gave up waiting for a peer (no synchronisation)."""
        if self.disabled or self._closed:
            return
        code = self._errors.read()
        if code and self._broken is None:
            phase, peer, _ = decode_error(code)
            self._broken = (
                f"group {self.unique_name!r} (rank {self.rank}/{self.world_size}), op "
                f"all_reduce (custom): rank {peer} did not reach the {phase} barrier within "
                f"{self.timeout_ns / 1e9:g}s; the result of that call is invalid"
            )
            raise CollectiveTimeout(self._broken)

    def abort(self, reason: str) -> None:
        """Break this all-reduce because of ``reason`` (from any thread): later calls
        raise :class:`~device_comms.errors.BrokenCommunicator` saying it. A kernel in
        flight is not stopped; it ends by itself at its own timeout. The first
        reason is kept."""
        if self._broken is None:
            self._broken = (f"custom all-reduce of {self.unique_name!r} (rank {self.rank}/"
                            f"{self.world_size}) was aborted: {reason}")

    def _check_usable(self) -> None:
        if self._closed:
            raise CommunicatorClosed(f"custom all-reduce of {self.unique_name!r} was closed")
        self.check_error()
        if self._broken is not None:
            raise BrokenCommunicator(self._broken)

    def close(self) -> None:
        """Close peers' handles and free this rank's memory (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.disabled:
            return
        torch.cuda.synchronize(self.device)
        self._free()

    def _free(self) -> None:
        """Close peers' handles, free the tables and this rank's memory (idempotent;
        each part is released even when another fails or was never made, and the
        first failure is raised after)."""
        failures: list[Exception] = []
        for name in ("_book", "_tables", "_buffer", "_errors"):
            part = getattr(self, name, None)
            if part is None:
                continue
            try:
                part.close()
            except Exception as e:  # the others are still released
                failures.append(e)
        if failures:
            raise failures[0]

    def __enter__(self) -> CustomAllreduce:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"disabled: {self.reason}" if self.disabled else f"max_size={self.max_size}"
        return f"CustomAllreduce({self.unique_name!r}, rank {self.rank}/{self.world_size}, {state})"


def _kernels_ready(index: int) -> str:
    """Why the kernels cannot run on device ``index`` ("" when they can): its compute
    capability is below :data:`MIN_CAPABILITY`, or they do not compile (CuPy and
    NVRTC, cached per device: the setup uses the same set)."""
    try:
        capability = tuple(torch.cuda.get_device_capability(index))
        if capability < MIN_CAPABILITY:
            return (f"device {index} has compute capability {capability[0]}.{capability[1]}; "
                    f"the kernels need {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer")
        kernel_set(index)
    except Exception as e:  # CUDA, CuPy or NVRTC refused: this rank cannot run them
        return f"the kernels do not compile for device {index}: {type(e).__name__}: {e}"
    return ""


def _device_count() -> int:
    """How many CUDA devices this process sees (0 when CUDA cannot say)."""
    try:
        return int(torch.cuda.device_count())
    except Exception:  # no usable CUDA here: no device of the group is visible
        return 0


def _can_access_peer(a: int, b: int) -> bool:
    import cupy

    return bool(cupy.cuda.runtime.deviceCanAccessPeer(a, b))

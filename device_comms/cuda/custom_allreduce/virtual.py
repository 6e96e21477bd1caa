"""Virtual ranks: the custom all-reduce's kernels for N ranks inside one process.

On one GPU, NCCL refuses two ranks, but the kernels do not care whether a
peer's buffer was opened through CUDA IPC or allocated next door: rank ``r``'s
kernel only follows the pointers of its table entry. :class:`VirtualRanks`
gives N ranks N buffers on one device and launches each rank's kernel on its
own stream, concurrently, exactly as N processes would (same layout, same
signal protocol, same kernels). Tests and ``groupcoord bench collectives
--device cuda`` use it to check and time the kernels on a single GPU.

Every launch must fit on the GPU at once (N x blocks resident), or the
barrier waits time out: keep ``max_blocks`` small (the default 16 suits 8
ranks on any recent GPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from device_comms.cuda.custom_allreduce import eligibility as elig
from device_comms.cuda.custom_allreduce import layout
from device_comms.cuda.custom_allreduce.device_memory import (
    DeviceBuffer,
    KernelFaultWords,
    decode_error,
)
from device_comms.cuda.custom_allreduce.kernels import choose_variant, kernel_set
from device_comms.cuda.custom_allreduce.table import RankTables
from device_comms.errors import CollectiveTimeout
from shm_broadcast.checks import check_timeout

__all__ = ["VirtualRanks"]


class VirtualRanks:
    """N ranks' buffers on one device, driven from one process on N streams.

    Args:
        world_size: 2, 4, 6 or 8.
        device: The CUDA device.
        max_size: Largest message in bytes.
        max_blocks: Most blocks per rank's launch.
        timeout: Seconds a kernel waits for a peer before giving up.
        oneshot_limit: Bytes up to which the one-shot kernel runs.
        max_graph_inputs: Captured calls that can be registered.
    """

    def __init__(
        self,
        world_size: int,
        device: torch.device | str = "cuda",
        max_size: int = elig.DEFAULT_MAX_SIZE,
        *,
        max_blocks: int = 16,
        timeout: float = 10.0,
        oneshot_limit: int | None = None,
        max_graph_inputs: int = 256,
    ) -> None:
        if world_size not in elig.SUPPORTED_WORLD_SIZES:
            raise ValueError(
                f"world_size must be one of {elig.SUPPORTED_WORLD_SIZES}, got {world_size!r}"
            )
        self.world_size = world_size
        self.device = torch.device(device)
        self.device_index = self.device.index if self.device.index is not None else 0
        self.max_size = elig.check_max_size(max_size)
        self.max_blocks, self.oneshot_limit = layout.check_max_blocks(max_blocks), oneshot_limit
        wait_s = check_timeout(timeout, "timeout", positive=True)
        self.timeout_ns = int((10.0 if wait_s is None else wait_s) * 1e9)
        size = layout.buffer_bytes(self.max_size)
        self._buffers = [DeviceBuffer(size, self.device_index) for _ in range(world_size)]
        self._staging = [b.tensor(layout.staging_offset(), self.max_size) for b in self._buffers]
        self._errors = KernelFaultWords(world_size)
        self._tables = RankTables(self.device_index, max_graph_inputs + 1)
        self._sig = [b.ptr for b in self._buffers]
        self._tmp = [b.ptr + layout.tmp_offset(self.max_size) for b in self._buffers]
        self._tables.fill(0, self._sig, [b.ptr + layout.staging_offset() for b in self._buffers],
                          self._tmp)
        self._streams = [torch.cuda.Stream(self.device) for _ in range(world_size)]
        self._kernels = kernel_set(self.device_index)
        self._capturing = False
        self._pending: list[tuple[int, list[int]]] = []
        torch.cuda.synchronize(self.device)

    def all_reduce(
        self, inputs: Sequence[torch.Tensor], variant: str | None = None
    ) -> list[torch.Tensor]:
        """Every virtual rank's result of summing ``inputs`` (one tensor per rank).

        Args:
            inputs: ``world_size`` eligible tensors of one shape and dtype.
            variant: Force ``"oneshot"`` or ``"twoshot"`` (default: by size).
        """
        self._check_inputs(inputs)
        nbytes, dtype = inputs[0].nbytes, inputs[0].dtype
        variant = variant or choose_variant(nbytes, self.world_size, self.oneshot_limit)
        index = self._entry_for(inputs)
        outs = [torch.empty_like(x) for x in inputs]
        current = torch.cuda.current_stream(self.device)
        # Fork every rank's stream before any launch: torch's stream pool is
        # round-robin, so a rank's stream may be the caller's current stream,
        # and a rank stream waiting on it after that rank's launch would wait
        # for a kernel that itself waits for this rank (a deadlock).
        for stream in self._streams:
            stream.wait_stream(current)
        for r, stream in enumerate(self._streams):
            with torch.cuda.stream(stream):
                if index == 0:
                    self._staging[r][:nbytes].copy_(inputs[r].reshape(-1).view(torch.uint8))
                self._launch(variant, dtype, r, index, outs[r], nbytes, stream)
        capturing = torch.cuda.is_current_stream_capturing()
        for r, stream in enumerate(self._streams):
            current.wait_stream(stream)
            if not capturing:  # the side streams used them: keep them alive until done
                inputs[r].record_stream(stream)
                outs[r].record_stream(stream)
        return outs

    def _launch(self, variant: str, dtype: torch.dtype, rank: int, index: int,
                out: torch.Tensor, nbytes: int, stream: torch.cuda.Stream) -> None:
        self._kernels.launch(
            variant, dtype, self.world_size, table_ptr=self._tables.ptr(index),
            out_ptr=out.data_ptr(), nbytes=nbytes, rank=rank, timeout_ns=self.timeout_ns,
            err_ptr=self._errors.device_ptr + 4 * rank, stream_ptr=stream.cuda_stream,
            max_blocks=self.max_blocks,
        )

    def _entry_for(self, inputs: Sequence[torch.Tensor]) -> int:
        if not (self._capturing and torch.cuda.is_current_stream_capturing()):
            return 0
        if any(x.data_ptr() % layout.PACK_BYTES for x in inputs):
            raise ValueError("inputs captured in a graph must be 16-byte aligned (clone them)")
        index = self._tables.reserve()
        self._pending.append((index, [x.data_ptr() for x in inputs]))
        return index

    def _check_inputs(self, inputs: Sequence[torch.Tensor]) -> None:
        if not isinstance(inputs, (list, tuple)) or len(inputs) != self.world_size:
            raise ValueError(
                f"inputs must be a list of {self.world_size} tensors, got {inputs!r:.80}")
        first = inputs[0]
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor) or x.shape != first.shape or x.dtype != first.dtype:
                raise ValueError(f"inputs[{i}] must be a tensor like inputs[0] "
                                 f"({tuple(first.shape)}, {first.dtype})")
            if not elig.call_eligible(x, self.max_size) or x.device != self.device:
                raise ValueError(f"inputs[{i}] is not eligible (dtype {x.dtype}, {x.nbytes} bytes, "
                                 f"contiguous={x.is_contiguous()}, device {x.device})")

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Calls captured inside read their inputs in place once the context exits."""
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False
            pending, self._pending = self._pending, []
            self._tables.fill_many(
                [(i, layout.table_entry(self._sig, ptrs, self._tmp)) for i, ptrs in pending]
            )

    def check_errors(self) -> None:
        """Raise :class:`CollectiveTimeout` if some rank's kernel gave up waiting."""
        for r in range(self.world_size):
            code = self._errors.read(r)
            if code:
                phase, peer, _ = decode_error(code)
                raise CollectiveTimeout(
                    f"virtual rank {r}: rank {peer} did not reach the {phase} barrier within "
                    f"{self.timeout_ns / 1e9:g}s"
                )

    def close(self) -> None:
        """Free every buffer (idempotent)."""
        torch.cuda.synchronize(self.device)
        for b in self._buffers:
            b.close()
        self._tables.close()
        self._errors.close()

    def __enter__(self) -> VirtualRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

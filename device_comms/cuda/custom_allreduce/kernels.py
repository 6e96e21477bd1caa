"""The custom all-reduce kernels: their source, names, choice and launch.

``kernels.cu`` holds one-shot and two-shot kernels templated on the element
type (float32, float16, bfloat16) and the world size (2, 4, 6, 8). CuPy
compiles them with NVRTC on first use, once per device and process (CuPy also
caches the binary on disk); CI compiles the same source to PTX with
:mod:`device_comms.cuda.custom_allreduce.nvrtc`, without a GPU.

Nothing here imports CuPy at module load.

The signal protocol
-------------------
Rank ``r``'s block ``b`` runs this for every call, with ``e`` the block's
epoch for that call (``epoch[b] + 1``, stored back at once)::

    START  store e -> peer p's flags[START][b][r]     for every p   (release, sys)
           wait  own flags[START][b][p] == e          for every p   (acquire, sys)
      |      every rank's data for this call is in place
    REDUCE one-shot: every element, reading all ranks' data
           two-shot: own part only, into own tmp
      |
    MID    (two-shot) the same handshake on flags[MID]: every part is published
    GATHER (two-shot) copy each part from its owner's tmp
      |
    END    the same handshake on flags[END]: nobody reads my staging, tmp or
           input any more, so the next call may overwrite them

Why it is safe and reusable without ever resetting a flag:

* Single writers. Only peer ``p`` writes ``flags[*][b][p]`` of rank ``r``;
  only ``r`` writes its ``epoch[b]``, one kernel at a time (stream order).
* Epochs agree. Every rank makes the same calls with the same size, so the
  same variant and grid: block ``b`` has the same epoch on every rank for the
  same call.
* A waited-on flag holds ``e - 1`` or ``e``, never ``e + 1``: a peer reaches
  any phase of call ``e + 1`` only after leaving END of call ``e``, which
  needs ``r``'s END store, made after ``r`` finished waiting. So equality
  with ``e`` is exact, and it stays exact when the 32-bit epoch wraps.
* Visibility. Writes made before ``__syncthreads`` are published by the
  release store that follows it (release is cumulative); the acquire load
  plus the next ``__syncthreads`` make them visible to the whole block.
* Per-block barriers suffice: the element-to-thread mapping is the same on
  every rank, so block ``b`` reads only what block ``b`` of its peers wrote
  (two-shot tmp) or what the stream wrote before the launch (staging, inputs).
* Bounded. Waits stop at a ``%globaltimer`` deadline; the block leaves and
  the rank's host-mapped error word records the phase and the missing rank.
"""

from __future__ import annotations

import functools
import itertools
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from device_comms.cuda.custom_allreduce import layout

__all__ = [
    "KERNEL_FILE",
    "VARIANTS",
    "DTYPE_TAGS",
    "WORLD_SIZES",
    "COMPILE_OPTIONS",
    "kernel_source",
    "name_expression",
    "all_name_expressions",
    "choose_variant",
    "KernelSet",
    "kernel_set",
]

KERNEL_FILE = Path(__file__).with_name("kernels.cu")
VARIANTS = ("oneshot", "twoshot")
DTYPE_TAGS: dict[torch.dtype, str] = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
}
WORLD_SIZES = (2, 4, 6, 8)
COMPILE_OPTIONS = ("-std=c++17",)
# Largest message (bytes) for which one shot beats two shot: one shot reads
# world_size times the message per rank, two shot twice the message but with
# one more barrier. At two ranks both read the same amount: always one shot.
ONESHOT_LIMIT = {2: 1 << 62, 4: 512 << 10, 6: 256 << 10, 8: 256 << 10}


@functools.lru_cache(maxsize=1)
def kernel_source() -> str:
    """The CUDA C++ source of every kernel."""
    return KERNEL_FILE.read_text()


def name_expression(variant: str, dtype: torch.dtype, world_size: int) -> str:
    """The NVRTC name expression of one kernel instantiation."""
    return f"gc_{variant}<gc_{DTYPE_TAGS[dtype]}, {world_size}>"


def all_name_expressions() -> list[str]:
    """Name expressions of every instantiation (variants x dtypes x world sizes)."""
    return [
        name_expression(v, d, n)
        for v, d, n in itertools.product(VARIANTS, DTYPE_TAGS, WORLD_SIZES)
    ]


def choose_variant(nbytes: int, world_size: int, oneshot_limit: int | None = None) -> str:
    """``"oneshot"`` or ``"twoshot"`` for a message of ``nbytes`` (same on every rank)."""
    limit = ONESHOT_LIMIT[world_size] if oneshot_limit is None else oneshot_limit
    return "oneshot" if nbytes <= limit else "twoshot"


class KernelSet:
    """The compiled kernels of one device, loaded through CuPy.

    Args:
        device_index: CUDA device ordinal.
    """

    def __init__(self, device_index: int) -> None:
        import cupy

        self.device_index = device_index
        with cupy.cuda.Device(device_index):
            self._module = cupy.RawModule(
                code=kernel_source(),
                options=COMPILE_OPTIONS,
                name_expressions=all_name_expressions(),
            )
            self._module.compile()
        self._functions: dict[tuple[str, torch.dtype, int], Any] = {}
        self._streams: dict[int, Any] = {}

    def function(self, variant: str, dtype: torch.dtype, world_size: int) -> Any:
        """The CuPy kernel for one instantiation (cached)."""
        key = (variant, dtype, world_size)
        fn = self._functions.get(key)
        if fn is None:
            fn = self._module.get_function(name_expression(variant, dtype, world_size))
            self._functions[key] = fn
        return fn

    def launch(
        self,
        variant: str,
        dtype: torch.dtype,
        world_size: int,
        *,
        table_ptr: int,
        out_ptr: int,
        nbytes: int,
        rank: int,
        timeout_ns: int,
        err_ptr: int,
        stream_ptr: int,
        max_blocks: int,
    ) -> None:
        """Launch one rank's kernel on the CUDA stream ``stream_ptr``.

        Only a kernel launch reaches the driver, so the call can be captured
        in a CUDA graph.
        """
        fn = self.function(variant, dtype, world_size)
        npacks = nbytes // layout.PACK_BYTES
        blocks = layout.launch_blocks(npacks, max_blocks)
        args = (
            np.uint64(table_ptr), np.uint64(out_ptr), np.uint64(npacks),
            np.int32(rank), np.uint64(timeout_ns), np.uint64(err_ptr),
        )
        with self._stream(stream_ptr):
            fn((blocks,), (layout.THREADS,), args)

    def _stream(self, stream_ptr: int) -> Any:
        stream = self._streams.get(stream_ptr)
        if stream is None:
            stream = _cupy_stream(stream_ptr)
            self._streams[stream_ptr] = stream
        return stream


class _StreamRef:
    """A raw stream pointer in the CUDA stream protocol (``__cuda_stream__``)."""

    def __init__(self, ptr: int) -> None:
        self._ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._ptr)


def _cupy_stream(stream_ptr: int) -> Any:
    """A CuPy view of an existing CUDA stream (torch's), not owning it."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamRef(stream_ptr))
    return cupy.cuda.ExternalStream(stream_ptr)


class _KernelSets:
    """Process-wide cache: one :class:`KernelSet` per device (compiled once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sets: dict[int, KernelSet] = {}

    def get(self, device_index: int) -> KernelSet:
        with self._lock:
            ks = self._sets.get(device_index)
            if ks is None:
                ks = KernelSet(device_index)
                self._sets[device_index] = ks
            return ks


_KERNEL_SETS = _KernelSets()


def kernel_set(device_index: int) -> KernelSet:
    """The kernels of ``device_index``, compiled on first use."""
    return _KERNEL_SETS.get(device_index)

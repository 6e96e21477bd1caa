"""What the parts of the shared-memory engine share: one workspace and its steps.

:class:`~device_comms.cpu_shm.engine.ShmEngine` is composed of parts, each an
object that owns its own state and settings (the one-step all_reduce of
:mod:`device_comms.cpu_shm.small`, the two-rank all_reduce of
:mod:`device_comms.cpu_shm.pair`, the gathers of :mod:`device_comms.cpu_shm.gather`,
the all-to-all-v of :mod:`device_comms.cpu_shm.alltoallv`). What they have in
common is one :class:`EngineContext`: the mapped workspace, its step
synchroniser, the cap on torch's intra-op threads and every rank's slot viewed
as a tensor of a caller's shape. A part is built over a context alone, so it
can be built and tested without the engine.

Step signatures are pure functions of their arguments, cached here for every
part (:func:`signature`, :func:`shape_key`).
"""

from __future__ import annotations

import functools

import torch

from device_comms.cpu_shm.engine_threads import KernelThreads, engine_threads
from device_comms.cpu_shm.sync import StepSync
from device_comms.cpu_shm.workspace import ShmWorkspace
from device_comms.signatures import step_signature

__all__ = ["EngineContext", "signature", "shape_key"]

_CACHE_MAX = 512  # distinct shapes (or signatures) kept; a caller's shapes are few

#: :func:`device_comms.signatures.step_signature.signature`, cached (every call signs its
#: first step).
signature = functools.lru_cache(maxsize=_CACHE_MAX)(step_signature.signature)
#: :func:`device_comms.signatures.step_signature.shape_key`, cached: the size key of a
#: call on a tensor of this shape (the same on every rank).
shape_key = functools.lru_cache(maxsize=_CACHE_MAX)(step_signature.shape_key)


class EngineContext:
    """The workspace, step synchroniser, thread cap and slot views of one engine's parts.

    Args:
        ws: The mapped workspace.
        sync: The step synchroniser over ``ws``.
        threads: Most intra-op threads the parts' kernels use; None for
            :func:`~device_comms.cpu_shm.engine_threads.engine_threads` (the node's
            CPUs divided among its local ranks).

    Attributes:
        ws: The workspace.
        sync: The step synchroniser.
        size: Number of local ranks.
        me: This rank's local index.
        threads: The thread limit of the parts' kernels.
        kernel_threads: Context manager limiting torch's intra-op threads to
            :attr:`threads` inside (one object, so nesting is harmless).
        slot_addresses: ``slot_addresses[parity][rank]``: the address of every slot
            (valid until :meth:`close`).
    """

    def __init__(self, ws: ShmWorkspace, sync: StepSync, threads: int | None = None) -> None:
        self.ws = ws
        self.sync = sync
        self.size = ws.local_size
        self.me = ws.local_rank
        self.threads = engine_threads(sync.pids, self.me, threads)
        self.kernel_threads = KernelThreads(self.threads)
        self.slot_addresses = [
            [ws.slot_address(parity, rank) for rank in range(self.size)] for parity in (0, 1)
        ]
        self._shaped: dict[tuple[int, torch.dtype, torch.Size], list[torch.Tensor]] = {}

    def shaped(self, parity: int, like: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's slot of ``parity`` as a tensor of ``like``'s shape and dtype (cached).

        ``like`` must fit a slot.
        """
        key = (parity, like.dtype, like.shape)
        views = self._shaped.get(key)
        if views is None:
            if len(self._shaped) >= _CACHE_MAX:
                self._shaped.clear()
            numel = like.numel()
            views = [slot[:numel].view(like.shape) for slot in self.ws.slots(parity, like.dtype)]
            self._shaped[key] = views
        return views

    def close(self) -> None:
        """Drop the views, mark this rank closed for its peers and unmap. Idempotent."""
        self._shaped.clear()
        self.sync.close()
        self.ws.close()

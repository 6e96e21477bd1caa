"""Where :class:`~device_comms.cuda.pynccl.PyNcclCommunicator` enqueues its work.

An operation runs on ``torch.cuda.current_stream(device)``, or on the
``stream`` its caller passed, which is then also made current for the
operation so that temporaries and dtype conversions are ordered with the
NCCL kernels. Nothing here synchronises or copies: the capture rule of
:mod:`device_comms.cuda.pynccl.communicator` (work issued while a CUDA graph is
captured on that stream is recorded into it) depends on that. A CPU device
(only with an injected library, in tests) gets the NULL stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["current_stream", "current_torch_stream", "made_current", "on_stream",
           "device_context"]


def current_stream(device: torch.device) -> int | None:
    """The raw ``cudaStream_t`` of ``device``'s current stream (None: NULL, CPU only)."""
    if device.type != "cuda":
        return None  # only with an injected library (tests): NULL stream
    return torch.cuda.current_stream(device).cuda_stream


def current_torch_stream(device: torch.device) -> Any:
    """``device``'s current ``torch.cuda.Stream`` (None on a CPU device: tests only)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def made_current(stream: Any) -> Any:
    """A context that makes ``stream`` (from :func:`current_torch_stream`) current; one
    that does nothing for None."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


@contextlib.contextmanager
def on_stream(stream: Any, device: torch.device) -> Iterator[int | None]:
    """The raw ``cudaStream_t`` to enqueue on; a given stream is also made current
    inside, so temporaries and conversions are ordered with the NCCL kernels.

    Raises:
        TypeError: ``stream`` is neither None nor a ``torch.cuda.Stream``.
        ValueError: ``stream`` belongs to another device (NCCL failed on it).
    """
    if stream is None:
        yield current_stream(device)
        return
    if not hasattr(stream, "cuda_stream"):
        raise TypeError(
            f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}"
        )
    if getattr(stream, "device", device) != device:
        raise ValueError(f"stream must be a stream of this communicator's device {device}, "
                         f"got one of {stream.device}")
    with torch.cuda.stream(stream):
        yield stream.cuda_stream


def device_context(device: torch.device) -> Any:
    """``device`` made current inside (CUDA), or a context that does nothing (CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

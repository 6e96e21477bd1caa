"""When the custom all-reduce may run: per-group and per-call rules.

* Per group (once, at construction): :func:`group_verdict` from the world
  size, whether every rank is on one node, whether every pair of devices has
  peer access (:class:`P2PCache`) and whether it is enabled
  (:func:`disabled_by_env`).
* Per call (every all-reduce): :func:`call_eligible`, a handful of attribute
  reads with no exceptions.

:data:`P2P_CACHE` is the only process-wide state. Nothing here touches CUDA:
the peer-access probe is passed in.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "SUPPORTED_WORLD_SIZES",
    "SUPPORTED_DTYPES",
    "DEFAULT_MAX_SIZE",
    "ALIGNMENT",
    "ENV_DISABLE",
    "disabled_by_env",
    "check_max_size",
    "GroupVerdict",
    "group_verdict",
    "P2PCache",
    "P2P_CACHE",
    "call_eligible",
]

SUPPORTED_WORLD_SIZES = (2, 4, 6, 8)
SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset({torch.float16, torch.bfloat16, torch.float32})
DEFAULT_MAX_SIZE = 8 * 2**20
ALIGNMENT = 16
ENV_DISABLE = "GROUPCOORD_DISABLE_CUSTOM_ALLREDUCE"
_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})


def disabled_by_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``GROUPCOORD_DISABLE_CUSTOM_ALLREDUCE`` disables the custom all-reduce.

    Values ``1``, ``true``, ``yes`` and ``on`` (any case, surrounding blanks
    ignored) disable it; anything else, or no variable, leaves it enabled.

    Args:
        environ: The environment to read (default: ``os.environ``).
    """
    if environ is None:
        environ = os.environ
    return environ.get(ENV_DISABLE, "").strip().lower() in _TRUE_WORDS


def check_max_size(max_size: Any) -> int:
    """Validate the largest message size in bytes.

    Returns:
        ``max_size`` as an int.

    Raises:
        TypeError: ``max_size`` is not an integer.
        ValueError: It is not a positive multiple of 16.
    """
    if isinstance(max_size, bool):
        raise TypeError("max_size must be an int number of bytes, got bool")
    try:
        n = operator.index(max_size)
    except TypeError:
        raise TypeError(
            f"max_size must be an int number of bytes, got {type(max_size).__name__}"
        ) from None
    if n <= 0 or n % ALIGNMENT:
        raise ValueError(
            f"max_size must be a positive multiple of {ALIGNMENT} bytes, got {n}"
        )
    return n


@dataclasses.dataclass(frozen=True)
class GroupVerdict:
    """Whether a group may use the custom all-reduce, and why not.

    Attributes:
        ok: True when it may.
        reason: Why it may not (human-readable); empty when ``ok``.
    """

    ok: bool
    reason: str


def group_verdict(world_size: int, same_node: bool, p2p_ok: bool, enabled: bool) -> GroupVerdict:
    """Decide, from facts every rank agrees on, whether the group uses the custom all-reduce.

    Args:
        world_size: Number of ranks in the group.
        same_node: Whether every rank runs on one node.
        p2p_ok: Whether every pair of the ranks' devices has peer access.
        enabled: Whether every rank enabled it (argument and environment).

    Returns:
        The verdict; the first failing rule names the reason.

    Raises:
        TypeError: ``world_size`` is not an int.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
    if not enabled:
        return GroupVerdict(False, f"disabled on at least one rank (by argument or {ENV_DISABLE})")
    if world_size not in SUPPORTED_WORLD_SIZES:
        return GroupVerdict(
            False, f"world size {world_size} is not supported (supported: {SUPPORTED_WORLD_SIZES})"
        )
    if not same_node:
        return GroupVerdict(False, "the ranks span more than one node (CUDA IPC works within one)")
    if not p2p_ok:
        return GroupVerdict(
            False, "some pair of the group's GPUs has no peer-to-peer access (CUDA IPC needs it)"
        )
    return GroupVerdict(True, "")


def _check_devices(devices: Any) -> tuple[int, ...]:
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence):
        raise TypeError(
            f"devices must be a sequence of device indices, got {type(devices).__name__}"
        )
    if not devices:
        raise ValueError("devices must name at least one device, got an empty sequence")
    for i, d in enumerate(devices):
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"devices[{i}] must be a non-negative int device index, got {d!r}")
    return tuple(sorted(set(devices)))


class P2PCache:
    """Peer-access verdicts per set of devices, each probed once.

    Thread-safe: concurrent checks of one device set probe it once.
    """

    def __init__(self) -> None:
        self._verdicts: dict[tuple[int, ...], bool] = {}
        self._lock = threading.Lock()

    def check(self, devices: Sequence[int], can_access_peer: Callable[[int, int], bool]) -> bool:
        """Whether every ordered pair of distinct devices in ``devices`` has peer access.

        A device listed twice (several processes on one GPU) needs no access
        to itself. The first check of a device set calls ``can_access_peer``
        (stopping at the first pair without access); later checks of the same
        set, in any order, reuse the verdict. A probe that raises caches nothing.

        Args:
            devices: Device index of each rank.
            can_access_peer: ``can_access_peer(a, b)``: may device ``a`` read ``b``'s memory.

        Raises:
            TypeError, ValueError: ``devices`` is not a non-empty sequence of
                non-negative ints, or ``can_access_peer`` is not callable.
        """
        key = _check_devices(devices)
        if not callable(can_access_peer):
            raise TypeError(
                f"can_access_peer must be callable, got {type(can_access_peer).__name__}"
            )
        with self._lock:
            if key not in self._verdicts:
                self._verdicts[key] = all(
                    bool(can_access_peer(a, b)) for a in key for b in key if a != b
                )
            return self._verdicts[key]

    def clear(self) -> None:
        """Forget every verdict."""
        with self._lock:
            self._verdicts.clear()

    def __len__(self) -> int:
        return len(self._verdicts)


P2P_CACHE = P2PCache()


def call_eligible(t: torch.Tensor, max_size: int) -> bool:
    """Whether one all-reduce of ``t`` can use the custom kernel (hot path, never raises).

    ``t`` must be contiguous, float16/bfloat16/float32, and its size in bytes
    a positive multiple of 16 no larger than ``max_size``. The device is the
    caller's concern.
    """
    if t.__class__ is not torch.Tensor and not isinstance(t, torch.Tensor):
        return False
    if t.dtype not in SUPPORTED_DTYPES:
        return False
    n = t.nbytes
    return 0 < n <= max_size and not n % ALIGNMENT and t.is_contiguous()

"""When the custom all-reduce may run: per-group and per-call rules.

* Per group (once, at construction): :func:`group_verdict` from the world
  size, whether every rank is on one node, whether every pair of devices has
  peer access and whether it is enabled (:func:`disabled_by_env`).
* Peer access is a fact each rank finds out alone (its own driver, its own
  visible devices), so the ranks exchange their answers before deciding:
  :func:`local_peer_access` is one rank's :class:`PeerAccess` answer (probed
  once per device set through :class:`P2PCache`; a device index that is not a
  device of this process is never probed, and a probe that raises is an
  answer, not an error), and :func:`peer_access_verdict` turns every rank's
  gathered answer into the one verdict every rank reaches.
* Per call (every all-reduce): :func:`call_eligible`, a handful of attribute
  reads with no exceptions.

:data:`P2P_CACHE` is the only process-wide state. Nothing here touches CUDA:
the peer-access probe is passed in.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from device_comms.errors import DecodeError

__all__ = [
    "SUPPORTED_WORLD_SIZES",
    "SUPPORTED_DTYPES",
    "DEFAULT_MAX_SIZE",
    "ALIGNMENT",
    "ENV_DISABLE",
    "disabled_by_env",
    "set_enabled",
    "disabled_in_process",
    "check_max_size",
    "GroupVerdict",
    "group_verdict",
    "P2PCache",
    "P2P_CACHE",
    "PeerAccess",
    "local_peer_access",
    "peer_access_verdict",
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


class _ProcessSwitch:
    """The process-wide on/off switch of :func:`set_enabled` (on until turned off)."""

    def __init__(self) -> None:
        self.enabled = True


_SWITCH = _ProcessSwitch()


def set_enabled(enable: bool) -> None:
    """Turn the custom all-reduce on or off for groups built from now on in this process.

    A group that is already built keeps what it agreed at construction. Off
    here, like :data:`ENV_DISABLE`, disables it whatever a communicator's
    ``use_custom_allreduce`` says; a group's ranks agree, so off on one rank is
    off for the group.

    Raises:
        TypeError: ``enable`` is not a bool.
    """
    if not isinstance(enable, bool):
        raise TypeError(f"enable must be a bool, got {type(enable).__name__} {enable!r:.40}")
    _SWITCH.enabled = enable


def disabled_in_process() -> bool:
    """Whether :func:`set_enabled` turned the custom all-reduce off in this process."""
    return not _SWITCH.enabled


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


def group_verdict(world_size: int, same_node: bool, p2p_ok: bool, enabled: bool, *,
                  p2p_reason: str = "") -> GroupVerdict:
    """Decide, from facts every rank agrees on, whether the group uses the custom all-reduce.

    Args:
        world_size: Number of ranks in the group.
        same_node: Whether every rank runs on one node.
        p2p_ok: Whether every pair of the ranks' devices has peer access.
        enabled: Whether every rank enabled it (argument and environment).
        p2p_reason: Why there is no peer access, when known (see
            :func:`peer_access_verdict`); the reason of a verdict that fails
            on peer access.

    Returns:
        The verdict; the first failing rule names the reason.

    Raises:
        TypeError: ``world_size`` is not an int.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
    if not enabled:
        return GroupVerdict(False, f"disabled on at least one rank (by argument, {ENV_DISABLE} "
                                   f"or set_custom_all_reduce(False))")
    if world_size not in SUPPORTED_WORLD_SIZES:
        return GroupVerdict(
            False, f"world size {world_size} is not supported (supported: {SUPPORTED_WORLD_SIZES})"
        )
    if not same_node:
        return GroupVerdict(False, "the ranks span more than one node (CUDA IPC works within one)")
    if not p2p_ok:
        return GroupVerdict(False, p2p_reason or (
            "some pair of the group's GPUs has no peer-to-peer access (CUDA IPC needs it)"))
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


class PeerAccess(enum.IntEnum):
    """One rank's answer on peer access between the group's devices (a word on the wire)."""

    YES = 0  #: every pair of distinct devices has peer access
    NO = 1  #: some pair has none
    NOT_VISIBLE = 2  #: some rank's device index is not a device of this process
    PROBE_FAILED = 3  #: the driver's probe raised (the error stays on that rank)


def local_peer_access(
    devices: Sequence[int], device_count: int, can_access_peer: Callable[[int, int], bool],
    cache: P2PCache | None = None,
) -> tuple[PeerAccess, str]:
    """This process's answer on peer access between ``devices``; never raises for
    what the driver says.

    An index that is not below ``device_count`` is not a device of this
    process: the answer is :attr:`PeerAccess.NOT_VISIBLE`, with no probe (the
    driver would raise for it). Otherwise ``cache`` probes the set once; a
    probe that raises (any exception: the binding's own error type is not
    this project's) is :attr:`PeerAccess.PROBE_FAILED`.

    Args:
        devices: Device index of each rank (as gathered; already range-checked).
        device_count: How many devices this process sees.
        can_access_peer: The driver's probe, ``can_access_peer(a, b)``.
        cache: Verdicts per device set (default :data:`P2P_CACHE`).

    Returns:
        ``(answer, detail)``: ``detail`` says what went wrong here ("" for
        :attr:`PeerAccess.YES`).

    Raises:
        ValueError, TypeError: ``devices`` is not a non-empty sequence of
            non-negative ints.
    """
    key = _check_devices(devices)
    unseen = [d for d in key if d >= device_count]
    if unseen:
        return PeerAccess.NOT_VISIBLE, (
            f"device {unseen[0]} is not a device of this process (it sees {device_count})")
    try:
        ok = (P2P_CACHE if cache is None else cache).check(key, can_access_peer)
    except Exception as e:  # the driver's answer, whatever its type: reported, not raised
        return PeerAccess.PROBE_FAILED, f"the peer-access probe raised {type(e).__name__}: {e}"
    return (PeerAccess.YES, "") if ok else (PeerAccess.NO, "")


def peer_access_verdict(
    answers: Sequence[Sequence[int]], devices: Sequence[int], *, group: str = "custom-allreduce",
    me: int = -1, detail: str = "",
) -> tuple[bool, str]:
    """The group's peer-access verdict from every rank's gathered answer.

    Computed from gathered words only, so every rank that passes the same
    ``answers`` and ``devices`` reaches the same verdict (the reason differs
    only by ``detail``, this rank's own account of its answer).

    Args:
        answers: ``answers[r] = (PeerAccess value, device count of rank r)``.
        devices: Device index of each rank.
        group: The group's name, for messages.
        me: This process's rank (its ``detail`` is added to a reason naming it).
        detail: What :func:`local_peer_access` said here.

    Returns:
        ``(ok, reason)``: ``ok`` when every rank answered
        :attr:`PeerAccess.YES`; else the reason names the first rank that did not.

    Raises:
        DecodeError: A rank's answer is not a :class:`PeerAccess` value (on
            every rank alike, naming it).
    """
    codes = []
    for r, (code, _) in enumerate(answers):
        try:
            codes.append(PeerAccess(code))
        except ValueError:
            raise DecodeError(
                f"custom all-reduce of {group!r}: rank {r} sent peer-access answer {code}; "
                f"expected one of {[int(a) for a in PeerAccess]}", queue=group,
                side=f"rank {me}", peers=(r,)) from None
    for r, (code, (_, count)) in enumerate(zip(codes, answers, strict=True)):
        if code is PeerAccess.YES:
            continue
        if code is PeerAccess.NOT_VISIBLE:
            why = (f"rank {r} sees {count} CUDA devices, and the group's device indices "
                   f"{sorted(set(devices))} are not all among them")
        elif code is PeerAccess.PROBE_FAILED:
            why = f"rank {r} could not probe peer access between the group's devices"
        else:
            why = (f"rank {r} found a pair of the group's GPUs without peer-to-peer access "
                   f"(CUDA IPC needs it)")
        return False, why + (f" ({detail})" if r == me and detail else "")
    return True, ""


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

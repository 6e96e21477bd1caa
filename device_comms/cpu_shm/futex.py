"""Linux futexes on shared memory, through ``ctypes`` (no compiled code).

A waiting rank can sleep in the kernel on a peer's generation word
(``FUTEX_WAIT``: sleep while the 32-bit word still holds the value it saw) and
the peer wakes it after publishing (``FUTEX_WAKE``). Shared (not
``FUTEX_PRIVATE``) futexes key on the physical page, so this works across
processes mapping the same segment. The kernel compares the word and queues
the sleeper atomically, so a wake-up between the waiter's last check and its
sleep cannot be lost: the value has changed and ``FUTEX_WAIT`` returns at once.

:data:`AVAILABLE` is False off Linux or on an unknown architecture; callers
then simply keep polling.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["AVAILABLE", "futex_wait", "futex_wake", "address_of"]

# The futex syscall's number on this architecture (0: unknown here, no futexes).
_MACHINE = os.uname().machine if hasattr(os, "uname") else ""
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98}.get(_MACHINE, 0)
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_INT_MAX = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_syscall = None
if sys.platform.startswith("linux") and _SYS_FUTEX:
    try:
        _syscall = ctypes.CDLL(None, use_errno=True).syscall
        _syscall.restype = ctypes.c_long
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        _syscall = None

AVAILABLE = _syscall is not None


def address_of(buf: memoryview) -> int:
    """Address of the first byte of writable ``buf`` (valid while its memory is mapped)."""
    first = ctypes.c_char.from_buffer(buf)
    address = ctypes.addressof(first)
    del first  # drop the export at once so the memoryview can be released later
    return address


def futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at ``addr`` equals ``expected`` (at most ``timeout_s``).

    Returns on a wake-up, a changed value, a signal or the timeout alike; the
    caller re-checks its condition.
    """
    if _syscall is None:
        return
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    val = expected & 0xFFFFFFFF
    if val > _INT_MAX:
        val -= 1 << 32
    _syscall(
        ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAIT),
        ctypes.c_int(val), ctypes.byref(ts), None, ctypes.c_int(0),
    )


def futex_wake(addr: int) -> None:
    """Wake every process sleeping on the word at ``addr``."""
    if _syscall is None:
        return
    _syscall(
        ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAKE),
        ctypes.c_int(_INT_MAX), None, None, ctypes.c_int(0),
    )

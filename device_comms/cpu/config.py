"""Where a :class:`~device_comms.cpu.communicator.CpuCommunicator` takes its settings.

Arguments win over environment variables, which are read once, at
construction: ``GROUPCOORD_CPU_SHM`` (0 turns the shared-memory engine off),
``GROUPCOORD_CPU_SHM_BYTES`` (the workspace size) and
``GROUPCOORD_CPU_SHM_TIMEOUT`` (a step's wait, before ``GROUPCOORD_TIMEOUT``).
Bad values raise ``TypeError``/``ValueError`` naming the argument or variable.
"""

from __future__ import annotations

import os
from typing import Any

from shm_broadcast.checks import check_timeout, env_flag
from shm_broadcast.timeouts import DEFAULT_TIMEOUT_S, default_timeout, env_timeout

__all__ = ["BYTES_ENV", "ENABLE_ENV", "TIMEOUT_ENV", "DEFAULT_TIMEOUT", "positive_bytes",
           "use_shm_enabled", "step_timeout"]

BYTES_ENV = "GROUPCOORD_CPU_SHM_BYTES"
ENABLE_ENV = "GROUPCOORD_CPU_SHM"
TIMEOUT_ENV = "GROUPCOORD_CPU_SHM_TIMEOUT"
#: Seconds a step waits when neither an argument nor the environment chose.
DEFAULT_TIMEOUT = DEFAULT_TIMEOUT_S


def _from_env(env: str, convert: Any, what: str) -> Any:
    """The environment variable ``env`` converted, or None when unset or empty."""
    raw = os.environ.get(env)
    if raw is None or raw == "":
        return None
    try:
        return convert(raw)
    except ValueError:
        raise ValueError(f"{env} must be {what}, got {raw!r}") from None


def positive_bytes(value: int | None, arg: str, env: str) -> int | None:
    """``value``, else the environment variable ``env``, as a positive int of bytes (None: neither).

    Raises:
        TypeError: ``value`` is not an int.
        ValueError: It is not positive, or ``env`` holds no positive int.
    """
    if value is None:
        value, arg = _from_env(env, int, "a positive int (bytes)"), env
        if value is None:
            return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{arg} must be a positive int (bytes), got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{arg} must be a positive int (bytes), got {value!r}")
    return value


def use_shm_enabled(use_shm: bool | None) -> bool:
    """``use_shm``, else ``GROUPCOORD_CPU_SHM`` (default on).

    Raises:
        TypeError: ``use_shm`` is not a bool or None.
        ValueError: The variable is not a recognised on/off word.
    """
    if use_shm is not None:
        if not isinstance(use_shm, bool):
            raise TypeError(f"use_shm must be a bool or None, got {type(use_shm).__name__}")
        return use_shm
    return env_flag(ENABLE_ENV, True)


def step_timeout(timeout: float | None) -> float:
    """The step timeout: ``timeout``, else ``GROUPCOORD_CPU_SHM_TIMEOUT``, else
    ``GROUPCOORD_TIMEOUT``, else 300 s (see :mod:`shm_broadcast.timeouts`)."""
    if timeout is not None:
        seconds = check_timeout(timeout)
    else:
        seconds = env_timeout(TIMEOUT_ENV, positive=False)
    return default_timeout() if seconds is None else seconds

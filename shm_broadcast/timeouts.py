"""The project's one default timeout, and the environment variables that override it.

Every wait inside a group is bounded by one number of seconds, chosen in this
order (the first that applies wins):

1. the ``timeout`` argument of the call itself, where the call has one
   (``GroupCoordinator.barrier(timeout=...)``, ``MessageQueue.dequeue(timeout=...)``);
2. the group's timeout, when one was given to ``init_distributed_environment``,
   ``initialize_model_parallel`` (inherited from the world group) or
   ``GroupCoordinator`` -- it reaches the gloo groups, the shared-memory
   collectives, the group's message queues, barriers and point-to-point calls;
3. an environment variable: ``GROUPCOORD_CPU_SHM_TIMEOUT`` for the CPU
   shared-memory collectives only, then ``GROUPCOORD_TIMEOUT`` for everything;
4. :data:`DEFAULT_TIMEOUT_S` (300 s).

So the environment overrides the built-in default, never a timeout the
program passed. Values follow :func:`shm_broadcast.checks.check_timeout`
(seconds, finite); a group's timeout must be ``> 0``.
"""

from __future__ import annotations

import os

from shm_broadcast.checks import check_timeout

__all__ = ["DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "default_timeout", "env_timeout"]

#: Seconds any wait of a group lasts when neither the program nor the
#: environment chose (torch.distributed's own default is 30 minutes: far too
#: long for a serving engine to notice a stuck rank).
DEFAULT_TIMEOUT_S = 300.0

#: Environment variable overriding :data:`DEFAULT_TIMEOUT_S` (seconds, > 0).
TIMEOUT_ENV = "GROUPCOORD_TIMEOUT"


def env_timeout(env: str, *, positive: bool = True) -> float | None:
    """The timeout in seconds set by environment variable ``env``, or None when unset.

    Raises:
        ValueError: The variable is set but is not a finite number of seconds
            (``> 0`` with ``positive``, else ``>= 0``); the message names it.
    """
    raw = os.environ.get(env)
    if raw is None or not raw.strip():
        return None
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{env} must be a number of seconds, got {raw!r}") from None
    return check_timeout(seconds, env, positive=positive)


def default_timeout() -> float:
    """Seconds a group's waits last when the program gave no timeout.

    ``GROUPCOORD_TIMEOUT`` if set, else :data:`DEFAULT_TIMEOUT_S`; read at each
    call (groups read it once, at construction).
    """
    seconds = env_timeout(TIMEOUT_ENV)
    return DEFAULT_TIMEOUT_S if seconds is None else seconds

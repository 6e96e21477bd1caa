"""``groupcoord demo --launcher env``: the demo's ranks started by another launcher.

``torchrun`` (or any launcher that sets the ``env://`` variables) starts
``tp * pp`` processes, on one host or several, each running the same
``groupcoord demo --launcher env ...`` command. Each process joins the world
group from ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``
(``LOCAL_RANK`` when set), runs its part of
:func:`~coordinator.engine.demo.engine.engine_rank` and leaves the groups
again. Global rank 0 is the driver; the caller reports and verifies on it,
exactly as with the default launcher, which starts the ranks itself.

Nothing here tells the ranks which host they are on: the library finds out
(shared-memory probe), so ranks on one host talk over shared memory and ranks
on different hosts over TCP and gloo.

Every wait of every rank is bounded by ``timeout`` (the groups' timeout).
"""

from __future__ import annotations

import os
import time
from typing import Any

__all__ = ["ENV_VARS", "missing_env", "run_this_rank"]

#: What ``env://`` needs; a launcher sets them in every rank's environment.
ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def missing_env() -> list[str]:
    """The variables of :data:`ENV_VARS` that are unset or empty here."""
    return [v for v in ENV_VARS if not os.environ.get(v)]


def _world_size(cfg: Any) -> int:
    missing = missing_env()
    if missing:
        raise ValueError(
            f"--launcher env: this process was not started by a launcher such as torchrun: "
            f"{', '.join(missing)} not set (expected {', '.join(ENV_VARS)})")
    raw = os.environ["WORLD_SIZE"]
    try:
        world = int(raw)
    except ValueError:
        raise ValueError(f"--launcher env: WORLD_SIZE must be an int, got {raw!r}") from None
    if world != cfg.tp * cfg.pp:
        raise ValueError(
            f"--launcher env: --tp {cfg.tp} x --pp {cfg.pp} needs {cfg.tp * cfg.pp} ranks, "
            f"but the launcher started WORLD_SIZE={world}")
    return world


def run_this_rank(cfg: Any, timeout: float) -> tuple[dict[str, Any] | None, Any, float]:
    """Run this process's rank of the demo engine.

    Args:
        cfg: The :class:`~coordinator.engine.demo.engine.EngineConfig`.
        timeout: Seconds every wait of the groups may last.

    Returns:
        On global rank 0: ``(driver results, every worker's report (arrival
        latencies, waiting CPU) by rank, seconds from joining the world to the
        end)``; on every other rank ``(None, None, seconds)``.

    Raises:
        ValueError: Not started by a launcher, or its world size is not
            ``tp * pp``.
    """
    from coordinator import parallel_state as ps
    from coordinator.engine.demo.engine import engine_rank

    world_size = _world_size(cfg)
    t0 = time.perf_counter()
    world = ps.init_distributed_environment(timeout=timeout)
    try:
        rank = world.rank
        out = engine_rank(rank, world_size, cfg)
        ps.destroy_model_parallel()
        # Every worker's report goes to the driver, as with spawn (msgpack, never pickle).
        workers = [world.broadcast_object(out if rank == r else None, src=r)
                   for r in range(1, world_size)]
        wall = time.perf_counter() - t0
        return (out, workers, wall) if rank == 0 else (None, None, wall)
    finally:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()

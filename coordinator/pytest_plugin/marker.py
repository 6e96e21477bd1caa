"""The ``distributed`` marker: its options, checked, and the rank layout they ask for.

``@pytest.mark.distributed(world_size=4, timeout=60, tp=2, pp=2, hosts=2, env={...})``;
``world_size`` may also come as the one positional argument. A ``distributed``
marker with neither is another project's (:func:`is_ours`). A :class:`Layout` is
everything that is fixed when a rank process starts (and so keys the pool of rank
processes that can run the test); the timeout belongs to each test alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shm_broadcast.ranks.topology import NODE_ID_ENV

__all__ = ["MARKER", "MARKER_HELP", "DEFAULT_TIMEOUT", "MAX_TIMEOUT", "Layout",
           "MarkerOptions", "is_ours", "parse_marker"]

MARKER = "distributed"
MARKER_HELP = (
    "distributed(world_size, timeout=60, tp=None, pp=None, dp=None, hosts=1, env=None): "
    "run the test's body on world_size rank processes with the world group initialised "
    "(coordinator.pytest_plugin)"
)

#: Seconds a test's body may run on the ranks before every rank is killed.
DEFAULT_TIMEOUT = 60.0
#: The longest timeout a marker may give (seconds, about 11.6 days): finite, so
#: that every wait on the ranks ends.
MAX_TIMEOUT = 1e6

_OPTIONS = ("world_size", "timeout", "tp", "pp", "dp", "hosts", "env")


@dataclass(frozen=True)
class Layout:
    """What a rank process is started with: the key of a pool of rank processes.

    Attributes:
        world_size: Number of ranks.
        tp: Tensor-parallel size, or None for no model-parallel groups.
        pp: Pipeline-parallel size (None: as ``tp``'s absence says).
        dp: Data-parallel size.
        hosts: Simulated hosts: ranks ``[h * n, (h + 1) * n)`` get
            ``GROUPCOORD_NODE_ID=host<h>`` (``n = world_size // hosts``) and local
            ranks from 0 on each host; 1 leaves the node probe to shared memory.
        env: Extra environment variables of every rank, as sorted pairs.
    """

    world_size: int
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    hosts: int = 1
    env: tuple[tuple[str, str], ...] = ()

    @property
    def model_parallel(self) -> bool:
        """Whether the ranks initialise model-parallel groups."""
        return any(v is not None for v in (self.tp, self.pp, self.dp))

    def model_parallel_sizes(self) -> tuple[int, int, int]:
        """``(tp, pp, dp)`` with 1 for the sizes not given."""
        return (self.tp or 1, self.pp or 1, self.dp or 1)

    def ranks_per_host(self) -> int:
        """Ranks on each simulated host."""
        return self.world_size // self.hosts

    def rank_env(self, rank: int) -> dict[str, str]:
        """The extra environment of ``rank``: ``env`` and its simulated host's node id."""
        out = dict(self.env)
        if self.hosts > 1:
            out[NODE_ID_ENV] = f"host{rank // self.ranks_per_host()}"
        return out

    def local_rank(self, rank: int) -> int:
        """``rank``'s position on its (simulated) host."""
        return rank % self.ranks_per_host()

    def describe(self) -> str:
        """``world_size=4, tp=2, pp=2`` (the options that differ from the defaults)."""
        parts = [f"world_size={self.world_size}"]
        parts += [f"{k}={v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("dp", self.dp))
                  if v is not None]
        if self.hosts > 1:
            parts.append(f"hosts={self.hosts}")
        if self.env:
            parts.append(f"env={dict(self.env)}")
        return ", ".join(parts)


@dataclass(frozen=True)
class MarkerOptions:
    """A test's ``distributed`` marker, checked.

    Attributes:
        layout: The ranks it runs on.
        timeout: Seconds its body may run on the ranks.
    """

    layout: Layout
    timeout: float


def _positive_int(value: Any, name: str, *, optional: bool = False) -> Any:
    if optional and value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        want = "an int >= 1 or None" if optional else "an int >= 1"
        raise ValueError(f"distributed marker: {name} must be {want}, got {value!r}")
    return value


def is_ours(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether ``@pytest.mark.distributed(*args, **kwargs)`` asks for this plugin.

    Other projects use a ``distributed`` marker of their own, e.g. vLLM's
    ``distributed(num_gpus=2)`` (a CI shard selector) or a bare
    ``@pytest.mark.distributed`` label: a marker with no positional argument and
    none of this marker's options is theirs, and its test runs as usual.
    """
    return bool(args) or any(k in _OPTIONS for k in kwargs)


def parse_marker(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> MarkerOptions:
    """The options of ``@pytest.mark.distributed(*args, **kwargs)``.

    Raises:
        ValueError: An unknown option, a missing or repeated ``world_size``, or a
            value of the wrong type or range (the message names the option);
            ``timeout`` must be finite, > 0 and at most :data:`MAX_TIMEOUT`.
    """
    unknown = sorted(set(kwargs) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"distributed marker: unknown option(s) {unknown}; "
                         f"the options are {list(_OPTIONS)}")
    if len(args) > 1:
        raise ValueError(f"distributed marker: at most one positional argument "
                         f"(world_size), got {len(args)}: {args!r}")
    if args and "world_size" in kwargs:
        raise ValueError("distributed marker: world_size given both as the positional "
                         "argument and as a keyword")
    if not args and "world_size" not in kwargs:
        raise ValueError("distributed marker: world_size is required, e.g. "
                         "@pytest.mark.distributed(world_size=2)")
    world_size = _positive_int(args[0] if args else kwargs["world_size"], "world_size")
    timeout = kwargs.get("timeout", DEFAULT_TIMEOUT)
    # Finite and at most MAX_TIMEOUT: the pool adds it to a monotonic clock and
    # waits on it, where inf or 1e300 overflow (OverflowError) mid-test.
    if (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
            or not (math.isfinite(timeout) and 0 < timeout <= MAX_TIMEOUT)):
        raise ValueError(f"distributed marker: timeout must be a number of seconds > 0 and "
                         f"<= {MAX_TIMEOUT:g}, got {timeout!r}")
    tp, pp, dp = (_positive_int(kwargs.get(k), k, optional=True) for k in ("tp", "pp", "dp"))
    hosts = _positive_int(kwargs.get("hosts", 1), "hosts")
    if world_size % hosts:
        raise ValueError(f"distributed marker: hosts={hosts} must divide "
                         f"world_size={world_size}")
    product = (tp or 1) * (pp or 1) * (dp or 1)
    if world_size % product:
        raise ValueError(f"distributed marker: tp * pp * dp = {product} must divide "
                         f"world_size={world_size}")
    env = _env_pairs(kwargs.get("env"))
    if hosts > 1 and any(k == NODE_ID_ENV for k, _ in env):
        raise ValueError(f"distributed marker: env sets {NODE_ID_ENV}, which hosts={hosts} "
                         f"sets per rank; give one or the other")
    return MarkerOptions(Layout(world_size, tp, pp, dp, hosts, env), float(timeout))


def _env_pairs(env: Any) -> tuple[tuple[str, str], ...]:
    if env is None:
        return ()
    if not isinstance(env, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError(f"distributed marker: env must be a mapping of str to str, "
                         f"got {env!r}")
    return tuple(sorted(env.items()))

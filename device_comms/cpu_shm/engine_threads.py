"""How many intra-op threads the shared-memory engine's own copies and reductions use.

Why this exists. torch runs an element-wise kernel (``copy_``, ``add``,
``cat``) over more than :data:`GRAIN` elements as an OpenMP parallel region
over ``torch.get_num_threads()`` threads, and an engine that computes with
every core leaves that at the number of cores. Every rank of a node then runs
such a team for each piece of a collective, so ``L`` ranks bring ``L x
cores`` threads onto ``cores`` CPUs. A parallel region ends only when *all* of
its threads have run, and libgomp's workers busy-wait for their next region
(``GOMP_SPINCOUNT``, by default hundreds of thousands of pauses) before they
sleep: each rank's team spins on the CPUs its peers need to finish their
part, and a collective takes many times as long (the spinning is the cause:
with ``GOMP_SPINCOUNT=0`` the time comes back; measured in docs/performance.md).

The rule. The engine runs its kernels with exactly :func:`engine_threads`
threads: the CPUs the node's local ranks may run on (the union of their
affinity masks), divided by the number of local ranks, at least one, and never
more than this rank's own mask: on 2 CPUs with 2 or 4 ranks that is one
thread per rank, on 16 cores with 4 ranks it is four. This is the engine's
share of the node whatever torch's own setting is: with one torch thread per
rank on a many-core host, a large collective's copies and reductions (several
times the message's bytes per rank) would run on one core per rank and leave
the node's memory bandwidth idle, while gloo's socket transfers run in its own
threads and the kernel, on the idle cores. Ranks pinned
to one CPU each (``taskset``, ``VLLM_CPU_OMP_THREADS_BIND``) get one thread.
``GROUPCOORD_CPU_SHM_THREADS`` (a positive int) replaces the rule; set it to
1 to keep the engine on each rank's calling thread. The user's own setting is
restored after every collective (:class:`KernelThreads`), and kernels over at
most :data:`GRAIN` elements run serially in torch anyway, so small collectives
do not touch the setting at all. Only torch's OpenMP backend (every Linux and
macOS wheel) is sized: the native thread-pool backend cannot change its size
once it has run (torch warns instead) and its idle workers block rather than
spin, so there the setting does nothing.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import torch

__all__ = [
    "threaded",
    "GRAIN", "THREADS_ENV", "cores_per_rank", "engine_threads", "env_threads", "openmp_backend",
    "KernelThreads",
]

#: torch's intra-op grain (``at::internal::GRAIN_SIZE``): element-wise kernels
#: over at most this many elements never start a parallel region.
GRAIN = 32768
THREADS_ENV = "GROUPCOORD_CPU_SHM_THREADS"


def _affinity(pid: int) -> set[int] | None:
    """The CPUs ``pid`` may run on, or None when that cannot be read."""
    try:
        return set(os.sched_getaffinity(pid))
    except (AttributeError, OSError):  # non-Linux, other pid namespace, gone
        return None


def cores_per_rank(pids: Sequence[int], me: int) -> int:
    """CPUs per local rank: the union of the ranks' affinity masks over their number.

    Args:
        pids: Process id of every local rank (this rank's included).
        me: This rank's index in ``pids``.

    Returns:
        At least 1 and at most the size of this rank's own mask. Ranks whose
        mask cannot be read (another pid namespace) count as sharing this
        rank's mask.
    """
    own = _affinity(0) or set(range(os.cpu_count() or 1))
    union = set(own)
    for rank, pid in enumerate(pids):
        if rank != me:
            union |= _affinity(pid) or own
    return max(1, min(len(own), len(union) // max(1, len(pids))))


def env_threads() -> int | None:
    """``GROUPCOORD_CPU_SHM_THREADS`` as a positive int, or None when unset or empty.

    Raises:
        ValueError: It is set to anything but a positive int.
    """
    raw = os.environ.get(THREADS_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{THREADS_ENV} must be a positive int (threads), got {raw!r}")
    return value


def engine_threads(pids: Sequence[int], me: int, override: int | None = None) -> int:
    """The engine's thread limit for this rank: ``override``, else :func:`cores_per_rank`."""
    return override if override is not None else cores_per_rank(pids, me)


@functools.lru_cache(maxsize=1)
def openmp_backend() -> bool:
    """Whether torch's intra-op parallelism is OpenMP (where the setting applies)."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


class KernelThreads:
    """Context manager: torch's intra-op threads are ``limit`` inside, restored after.

    Lowers a larger setting (torch's default on a busy node) and raises a
    smaller one (one thread per rank on a many-core node) alike. Not for
    concurrent use from several threads (one collective at a time per
    communicator); nesting on one thread is harmless: only the outermost block
    changes and restores the setting.

    Args:
        limit: The threads kernels use inside the block (>= 1).
    """

    __slots__ = ("limit", "_active", "_saved", "_depth")

    def __init__(self, limit: int) -> None:
        if not isinstance(limit, int) or isinstance(limit, bool):
            raise TypeError(f"limit must be a positive int, got {type(limit).__name__}")
        if limit < 1:
            raise ValueError(f"limit must be a positive int, got {limit!r}")
        self.limit = limit
        self._active = openmp_backend()
        self._saved = 0  # torch's setting to restore on leaving (0: nothing to restore)
        self._depth = 0

    def __enter__(self) -> KernelThreads:
        if not self._active:
            return self
        self._depth += 1
        if self._depth == 1:
            current = torch.get_num_threads()
            if current != self.limit:
                torch.set_num_threads(self.limit)
                self._saved = current
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._active:
            return
        self._depth -= 1
        if self._depth == 0 and self._saved:
            torch.set_num_threads(self._saved)
            self._saved = 0


_F = TypeVar("_F", bound=Callable[..., Any])


def threaded(elems: Callable[..., int]) -> Callable[[_F], _F]:
    """Run the decorated method under its object's ``kernel_threads`` when it
    touches more than :data:`GRAIN` elements (``elems(self, *args)`` says how
    many); smaller kernels run serially in torch anyway."""

    def wrap(method: _F) -> _F:
        @functools.wraps(method)
        def run(self: Any, *args: Any, **kw: Any) -> Any:
            if elems(self, *args) <= GRAIN:
                return method(self, *args, **kw)
            with self.kernel_threads:
                return method(self, *args, **kw)

        return run  # type: ignore[return-value]  # run has the method's signature

    return wrap

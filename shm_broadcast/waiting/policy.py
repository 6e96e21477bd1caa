"""How a blocked queue side waits: spin, then yield, then park; never forever.

A side that finds nothing to do (a reader with no new message, a writer with a
full ring) waits in three phases, driven by :class:`Backoff`::

      start
        |
        v
    +--------+  spin_s elapsed   +---------+  yield_s elapsed   +----------+
    |  SPIN  | ----------------> |  YIELD  | -----------------> |   PARK   |
    | (poll  |                   | (poll + |                    | (poll(2) |
    |  flag) |                   |  sched_ |                    | doorbell,|
    +--------+                   |  yield) |                    | <= park_ |
        |                        +---------+                    | poll_s)  |
        |                            |                          +----------+
        |  condition true            |                              |
        +----------------------------+------------------------------+--> done

* **SPIN** re-reads the shared flag in a tight loop for ``spin_s`` (default
  5 us): a peer answering on another core is seen at its next store. Keep it
  short: where the peer shares this core (an oversubscribed machine), every
  microsecond spent spinning is one the peer cannot run in, so longer spins
  make round trips slower, not faster (docs/performance.md).
* **YIELD** keeps polling but calls ``sched_yield()`` between polls, so an
  oversubscribed machine gives the core to whoever needs it (with nothing else
  runnable the call returns at once, and polling goes on at the speed of one
  system call per poll).
  It lasts ``yield_s`` (default 2 ms): back-to-back messages never leave this
  phase, while a reader waiting for the next engine step (tens of ms) parks
  instead of burning a core -- the 100%-CPU readers of polling-only queues are
  exactly what this avoids. Raise it if you prefer CPU to wake-up latency.
* **PARK** declares itself parked in shared memory and blocks in ``poll(2)``
  on its doorbell (:mod:`shm_broadcast.waiting.doorbell`), which the peer rings only
  when it sees the parked flag; an idle side uses no CPU and wakes with a
  single kernel wake-up. That wake-up has a platform floor the queue cannot
  beat: ``groupcoord bench mq`` measures it in the same run (a bare process
  sleeping in ``poll(2)``), next to the queue's own. Engines that cannot
  afford it between steps raise ``yield_s`` to cover their step time, trading
  CPU for latency.

A reader of step-periodic traffic (an engine's metadata queue) can do better
than either polling or parking the whole gap: with ``WaitPolicy(predict=
PredictivePolicy())`` (:mod:`shm_broadcast.waiting.predictive`) it learns when the
next message is due, sleeps parked (the doorbell still wakes it) until just
before that, and polls only around the expected time. :class:`Backoff` runs
such a plan as one more phase, **SLEEP**, before SPIN; when the window passes
without a message it continues with YIELD and PARK as above.

Whatever the phase, :meth:`Backoff.step` runs the checks every ``liveness_s``
(default 0.2 s) and at the deadline: the caller's timeout
(:class:`~shm_broadcast.errors.QueueTimeout`), a ``shutdown()``
(:class:`~shm_broadcast.errors.QueueClosedError`) and whether the peer process
still lives (:class:`~shm_broadcast.waiting.peer_watch.PeerWatch`,
:class:`~shm_broadcast.errors.PeerDiedError`). That is why no wait can hang
silently: without a timeout, a dead peer is noticed within ``liveness_s``
plus one park poll; a paused peer is waited for, up to the timeout
(:mod:`shm_broadcast.waiting.peer_watch`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shm_broadcast.waiting.predictive import PredictivePolicy, WaitPlan

__all__ = ["WaitPolicy", "Backoff", "SPIN", "YIELD", "PARK", "SLEEP"]

SPIN = 0
YIELD = 1
PARK = 2
#: A planned sleep (parked, timed): see :mod:`shm_broadcast.waiting.predictive`.
SLEEP = 3

_monotonic = time.monotonic
_sched_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


@dataclass(frozen=True)
class WaitPolicy:
    """Timing knobs of the spin -> yield -> park waiting strategy.

    Attributes:
        spin_s: Seconds of pure busy polling before yielding (the spin window).
            Keep it short: it burns a core. 0 disables spinning.
        yield_s: Further seconds of polling with ``sched_yield()`` in between
            before parking. A reader that waits longer parks.
        park_poll_s: Upper bound of one parked ``zmq.poll``; the side re-checks
            the flag, its deadline and the peer's liveness after each.
        liveness_s: How often (seconds) a waiting side checks that its peer
            process is alive.
        predict: Shared-memory readers learn when messages are due and sleep
            until shortly before (:class:`~shm_broadcast.waiting.predictive.PredictivePolicy`
            holds the knobs); None (default): plain spin -> yield -> park.
            :meth:`predictive` gives the policy of group broadcasters.
    """

    spin_s: float = 5e-6
    yield_s: float = 0.002
    park_poll_s: float = 0.1
    liveness_s: float = 0.2
    predict: PredictivePolicy | None = None

    @classmethod
    def predictive(cls, **knobs: Any) -> WaitPolicy:
        """The default timings with predictive waiting on (what a
        ``GroupCoordinator``'s broadcaster readers use).

        Args:
            **knobs: :class:`~shm_broadcast.waiting.predictive.PredictivePolicy` fields.
        """
        return cls(predict=PredictivePolicy(**knobs))

    def __post_init__(self) -> None:
        if self.predict is not None and not isinstance(self.predict, PredictivePolicy):
            raise TypeError(f"WaitPolicy.predict must be a PredictivePolicy or None, got "
                            f"{type(self.predict).__name__}")
        for field in ("spin_s", "yield_s", "park_poll_s", "liveness_s"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(
                    f"WaitPolicy.{field} must be a number >= 0 (seconds), got {value!r}")
        if self.park_poll_s <= 0 or self.liveness_s <= 0:
            raise ValueError(
                "WaitPolicy.park_poll_s and liveness_s must be > 0, got "
                f"{self.park_poll_s!r} and {self.liveness_s!r}"
            )


class Backoff:
    """One wait: phases by elapsed time plus periodic checks.

    Usage (the condition itself is checked by the caller, inline, for speed)::

        b.start(deadline)
        while not ready():
            if b.step() == PARK:
                park()

    Args:
        policy: The timing knobs.
        check: Called at most every ``policy.liveness_s`` seconds and at the
            deadline with ``expired`` telling whether the deadline has passed;
            it raises to end the wait (timeout, dead peer, shutdown).
    """

    __slots__ = ("_policy", "_check", "_deadline", "_sleep_until", "_spin_until",
                 "_yield_until", "_next_check", "_contended_s", "contended")

    def __init__(self, policy: WaitPolicy, check: Callable[[bool], None]) -> None:
        self._policy = policy
        self._check = check
        self._deadline: float | None = None
        self._sleep_until = 0.0
        self._spin_until = 0.0
        self._yield_until = 0.0
        self._next_check = 0.0
        self._contended_s = 0.0
        #: Planned polls cut short because a yield showed the CPU contended.
        self.contended = 0

    def start(self, deadline: float | None, plan: WaitPlan | None = None,
              now: float | None = None) -> None:
        """Begin a new wait that ends at ``deadline`` (monotonic) or never.

        Args:
            deadline: When the wait times out (monotonic seconds), or None.
            plan: From :meth:`~shm_broadcast.waiting.predictive.ArrivalPredictor.plan`:
                SLEEP until ``sleep_until``, poll until ``poll_until``, then
                YIELD for ``fallback_yield_s`` more (``< 0``: ``yield_s``) and
                PARK; polling stops early (PARK) when one ``sched_yield``
                returned only after ``yield_contended_s`` (0: never). None:
                SPIN -> YIELD -> PARK from now.
            now: The current monotonic time, if the caller just read it.
        """
        if now is None:
            now = _monotonic()
        p = self._policy
        self._deadline = deadline
        if plan is None:
            self._sleep_until = 0.0
            self._spin_until = now + p.spin_s
            self._yield_until = self._spin_until + p.yield_s
            self._contended_s = 0.0
        else:
            self._sleep_until = plan.sleep_until
            self._spin_until = max(now, plan.sleep_until) + p.spin_s
            self._yield_until = max(self._spin_until, plan.poll_until) + (
                p.yield_s if plan.fallback_yield_s < 0 else plan.fallback_yield_s)
            self._contended_s = plan.yield_contended_s
        nxt = now + p.liveness_s
        self._next_check = nxt if deadline is None or deadline > nxt else deadline

    def step(self) -> int:
        """Advance the wait by one poll; returns the phase to wait in.

        Returns:
            :data:`SLEEP` (the caller should sleep parked for
            :meth:`park_timeout` seconds: a planned sleep), :data:`SPIN` (poll
            again now), :data:`YIELD` (after having yielded the CPU once) or
            :data:`PARK` (the caller should block on its doorbell for
            :meth:`park_timeout` seconds).
        """
        now = _monotonic()
        if now >= self._next_check:
            self._run_check(now)
        if now < self._sleep_until:
            return SLEEP
        if now < self._spin_until:
            return SPIN
        if now < self._yield_until:
            _sched_yield()
            if self._contended_s and _monotonic() - now > self._contended_s:
                # Another task held this CPU: polling here would wait out its
                # time slices; parked, the writer's bell wakes us (with the
                # scheduler's wake-up preemption) instead.
                self._yield_until = now
                self.contended += 1
                return PARK
            return YIELD
        return PARK

    @property
    def sleep_until(self) -> float:
        """End of the planned sleep (0.0 when none is planned or it was cut short)."""
        return self._sleep_until

    def rearm(self) -> None:
        """Restart the spin and yield phases (keeping deadline, checks and the
        contention limit).

        Called after a doorbell woke a parked (or planned-sleeping) side: the
        bell announces a message that may still be in the making, so poll
        actively again.
        """
        now = _monotonic()
        self._sleep_until = 0.0
        self._spin_until = now + self._policy.spin_s
        self._yield_until = self._spin_until + self._policy.yield_s

    def park_timeout(self) -> float:
        """Seconds the caller may block (parked or sleeping) before calling :meth:`step` again."""
        now = _monotonic()
        t = min(self._policy.park_poll_s, self._next_check - now)
        if self._sleep_until > now:
            t = min(t, self._sleep_until - now)
        return t if t > 0 else 0.0

    def _run_check(self, now: float) -> None:
        deadline = self._deadline
        expired = deadline is not None and now >= deadline
        self._check(expired)
        nxt = now + self._policy.liveness_s
        self._next_check = nxt if deadline is None or deadline > nxt or expired else deadline

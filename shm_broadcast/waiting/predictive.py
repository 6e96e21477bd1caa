"""Predictive waiting: sleep until just before the next step's message, then poll.

An engine's driver broadcasts one metadata message per step, and steps are
periodic (every ~10 ms, say). A reader that waits with the plain
:class:`~shm_broadcast.waiting.policy.Backoff` either polls the whole gap (a core
burnt: what spinning queues do) or parks and pays a kernel wake-up on every
step, after the message is there. A reader with a :class:`PredictivePolicy`
learns *when* the next message will be published and plans each wait::

             dequeue(): no message yet
                        |
                plan() -- no (too few samples,  --> SPIN -> YIELD -> PARK
                  |          message overdue)     (today's Backoff, unchanged)
                  | yes
                  v
    +---------------------------------+
    | SLEEP: parked on the doorbell,  |  bell (message early, or the
    | timed (select) until the window | ----------------------------+
    | opens, minus the timer's        |   writer saw us parked)     |
    | learned oversleep               |                             v
    +---------------------------------+                      SPIN -> YIELD (rearm)
                  | timer                                           |
                  v                                                 |
    +---------------------------------+                             |
    | POLL: SPIN, then YIELD until    |  message ------------------>+--> done
    | the window closes   (poll mode) |                             |
    | -- or PARK at once  (park mode) |                             |
    +---------------------------------+                             |
                  | window over, no message (pattern broke)         |
                  v                                                 |
    YIELD for fallback_yield_s -> PARK  (today's fallback) ---------+

The window brackets the next publish time. Three models each predict it:

* **grid**: the writer runs on a clock -- publish ``k`` due at ``t0 + k*T``
  (``T``: the median recent interval). An early publish pulls the grid in, a
  slightly late one moves it along, a much later one (a descheduled writer)
  moves it by 2% of ``T`` only, so a late step does not make the next
  prediction late too;
* **interval**: the last publish plus ``T`` (a writer whose period drifts);
* **gap**: the wait's start plus the median recent wait-to-publish gap (an
  engine in lock-step: the next step comes a steady time after this rank
  finished its part of the last one, however long the step was).

Each model's recent errors (actual - predicted) calibrate it: its window is
``[prediction + q(low_quantile), prediction + q(high_quantile)]`` of those
errors, widened by ``lead_s`` on each side; the model with the narrowest
window wins. Messages beyond ``high_quantile`` (a writer descheduled for
milliseconds on a busy machine) fall to the fallback, so its cost is bounded
by the quantile, not by the tail. A window wider than ``max_window_s`` (a
long tail, or irregular steps) is cut to its first ``max_window_s`` (where a
late-skewed distribution has its mass) and followed by a park, not by more
yielding: such a wait polls no longer than the plain policy's initial yield
(2 ms by default), only later, when the message is likelier to come. So no
traffic costs more CPU than with the plain policy plus, on a miss of a narrow
window, the window itself.

The predictor also learns *how* to spend the window. Polling finds the
message within microseconds -- when the reader has a CPU of its own. When the
writer wakes on the reader's CPU (a busy machine: nothing else idle), it
preempts the polling reader, which then sees the message only once the writer
blocks; a *parked* reader, woken by the writer's bell at the start of
``enqueue``, is instead placed on a CPU that is free. So each window is spent
in one of two modes, **poll** or **park** (the reader parks right after its
sleep and the bell wakes it), and the predictor keeps the recent *detection
lag* (publish stamp -> the reader saw it) of each: the mode with the lower
median lag (park's plus ``park_penalty_s``, the writer's cost of ringing) is
used, the other one every ``explore_every``-th window so its estimate stays
current. Within poll mode, a ``sched_yield`` that returns only after
``yield_contended_s`` (another task held the CPU) ends the polling too: the
reader parks for the rest of the window. That other task is most often the
writer itself: the two sleep between steps and the kernel wakes them on one
CPU. So after such a window the reader moves to another CPU before its next
sleep (``leave_shared_cpu``, :mod:`shm_broadcast.waiting.thread_cpu`).

Publish times are exact: the writer stamps every ring chunk with
``time.monotonic()`` just before publishing it (:data:`STAMP` at
:data:`STAMP_OFFSET` in the chunk header, after the ``WIRE`` fields; the same
clock system-wide on Linux), so a message found late (after a park) teaches
the right time, not the time of our wake-up. The sleep ends early by the
timer's recent oversleep (a high quantile of ``wake - requested``), so the
reader is running when its window opens. Learning runs off the message's
path: the reader hands a message's stamp to :meth:`ArrivalPredictor.observe`
at its *next* ``dequeue`` (sorting happens in :meth:`ArrivalPredictor.plan`,
at the start of a wait), when it is idle anyway.

Safety (no lost wake-up, nothing slower than the fallback):

* SLEEP *is* a park: the reader drains its doorbell, stores ``parked := 1``,
  runs a full fence, re-checks the chunk, and only then blocks -- the same
  Dekker handshake as every park (:mod:`shm_broadcast.queue.local_reader`,
  :mod:`shm_broadcast.queue.ring_buffer`). A writer publishing while the reader
  sleeps sees the flag (it stores ``W := 1``, fences, loads ``parked``) and
  rings, so a message earlier than predicted costs one kernel wake-up -- what
  a parked reader pays today -- never the rest of the sleep. The writer also
  rings at the *start* of ``enqueue`` when it sees a sleeper, overlapping the
  wake-up with encoding.
* Every sleep is bounded by ``park_poll_s`` and by the next liveness /
  deadline check (:meth:`~shm_broadcast.waiting.policy.Backoff.park_timeout`):
  timeouts, shutdown and a dead writer are noticed exactly as in any wait.
  Even a lost bell would cost at most the rest of one bounded sleep.
* A prediction decides only *where* the reader is when the message comes:
  asleep (woken by the bell), polling (found within microseconds) or in the
  fallback (yield, then park: woken by the bell). Each path is one the queue
  already had, so a wrong or hostile prediction (stamps are the writer's; the
  reader drops non-finite and absurd samples) costs latency or CPU within
  those bounds, never a message or a hang.

Only shared-memory readers predict (remote readers block in zmq); the writer
waiting for a free chunk and ``wait_until_ready`` keep the plain policy.
"""

from __future__ import annotations

import collections
import math
import struct
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["PredictivePolicy", "ArrivalPredictor", "WaitPlan", "STAMP", "STAMP_OFFSET"]

#: The writer's publish time (``time.monotonic()``, float64) in a ring chunk.
STAMP = struct.Struct("<d")
#: Where :data:`STAMP` sits in a chunk: right after the 24-byte WIRE header
#: (``CHUNK_HEADER`` reserves 32 bytes).
STAMP_OFFSET = 24

#: Samples beyond this (seconds) are not step traffic (or not a sane stamp).
_MAX_SAMPLE_S = 60.0
#: How much later than due (share of the period) the grid follows a message.
_GRID_FOLLOW = 0.02


@dataclass(frozen=True)
class PredictivePolicy:
    """Knobs of predictive waiting (``WaitPolicy(predict=PredictivePolicy())``).

    Attributes:
        history: Recent samples each model keeps (intervals, gaps, errors).
        min_samples: Errors a model needs before it predicts.
        low_quantile: The window opens at this quantile of the model's recent
            errors (earlier messages wake the reader through its doorbell).
        high_quantile: The window closes at this quantile (later messages are
            found by the fallback). Higher: fewer misses, wider windows.
        lead_s: Seconds added on both sides of the window (the reader's own
            reaction time; the timer's oversleep is learned on top).
        max_window_s: Widest window polled. A wider calibrated window (a long
            tail, irregular steps) is cut to its first ``max_window_s``, and
            the reader then parks at once (no fallback yield).
        min_sleep_s: A planned sleep shorter than this is not taken (the
            reader polls instead): waking costs about as much.
        fallback_yield_s: Seconds of yielding after a window closed without
            its message, before parking; None: ``WaitPolicy.yield_s``.
        yield_contended_s: While polling, a ``sched_yield`` that returns only
            after this long means another runnable task shares the CPU; the
            reader then parks for the rest of the window (0: never). Polling
            on a shared CPU waits out the other task's time slices, while a
            parked reader is woken by the writer's bell -- rung when
            ``enqueue`` *starts*, so the wake-up overlaps encoding -- with the
            scheduler's wake-up preemption.
        explore_every: Every this many planned windows use the mode (poll or
            park) whose recent detection lag is worse, to keep measuring it;
            0 never switches modes (always poll).
        park_penalty_s: Added to park mode's lag when the modes are compared:
            what the writer's bell costs it (a ``sendto`` that wakes a
            sleeper), which the reader cannot see; the default is about what
            docs/performance.md measured for that ``sendto``.
    """

    history: int = 16
    min_samples: int = 4
    low_quantile: float = 0.05
    high_quantile: float = 0.9
    lead_s: float = 100e-6
    max_window_s: float = 2e-3
    min_sleep_s: float = 300e-6
    fallback_yield_s: float | None = None
    yield_contended_s: float = 50e-6
    leave_shared_cpu: bool = True
    explore_every: int = 16
    park_penalty_s: float = 20e-6

    def __post_init__(self) -> None:
        if not isinstance(self.leave_shared_cpu, bool):
            raise TypeError(f"PredictivePolicy.leave_shared_cpu must be a bool, got "
                            f"{type(self.leave_shared_cpu).__name__}")
        for name in ("history", "min_samples", "explore_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"PredictivePolicy.{name} must be an int, got "
                                f"{type(value).__name__}")
        for name in ("low_quantile", "high_quantile", "lead_s", "max_window_s", "min_sleep_s",
                     "fallback_yield_s", "yield_contended_s", "park_penalty_s"):
            value = getattr(self, name)
            if value is None and name == "fallback_yield_s":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value >= 0):
                raise ValueError(f"PredictivePolicy.{name} must be a finite number >= 0, "
                                 f"got {value!r}")
        if self.history < 2:
            raise ValueError(f"PredictivePolicy.history must be >= 2, got {self.history}")
        if not 1 <= self.min_samples <= self.history:
            raise ValueError(f"PredictivePolicy.min_samples must be in [1, history="
                             f"{self.history}], got {self.min_samples}")
        if not self.low_quantile <= self.high_quantile <= 1.0:
            raise ValueError(f"PredictivePolicy quantiles must satisfy 0 <= low_quantile <= "
                             f"high_quantile <= 1, got {self.low_quantile!r} and "
                             f"{self.high_quantile!r}")
        if self.explore_every < 0:
            raise ValueError(f"PredictivePolicy.explore_every must be >= 0, got "
                             f"{self.explore_every}")
        if self.max_window_s <= 0:
            raise ValueError(f"PredictivePolicy.max_window_s must be > 0, got "
                             f"{self.max_window_s!r}")


class WaitPlan(NamedTuple):
    """One planned wait (see :meth:`ArrivalPredictor.plan`); monotonic seconds."""

    sleep_until: float
    poll_until: float
    fallback_yield_s: float
    yield_contended_s: float


def _quantile(sorted_values: list[float], q: float) -> float:
    """Quantile ``q`` of a non-empty sorted list, rounded toward the median: the
    rank is rounded up below the median and down above it, so with few samples
    one outlier does not become the window's edge."""
    pos = q * (len(sorted_values) - 1)
    return sorted_values[math.ceil(pos) if q < 0.5 else math.floor(pos)]


_GRID, _INTERVAL, _GAP = 0, 1, 2
_MODELS = ("grid", "interval", "gap")
#: How a window is spent (see the module docstring).
POLL, PARK_MODE = 0, 1
_MODES = ("poll", "park")
#: Lag samples each mode needs before the modes are compared.
_MIN_LAGS = 3


class ArrivalPredictor:
    """What one reader learned about when its messages are published.

    The reader calls :meth:`plan` when a wait begins, :meth:`overslept` after
    a planned sleep ended by its timer, and :meth:`observe` with every
    message's stamp. Times are ``time.monotonic()`` seconds.

    Attributes:
        stats: Counters: ``planned`` (waits with a window), ``unplanned``
            (plain waits), ``early`` (published before the window: found after a
            bell), ``on_time`` (inside it), ``late`` (after it: the fallback),
            ``ready`` (there when ``dequeue`` was called: no wait at all),
            ``model_grid``/``model_interval``/``model_gap`` (which model
            planned) and ``mode_poll``/``mode_park`` (how windows were spent).
    """

    __slots__ = ("policy", "stats", "_intervals", "_gaps", "_errors", "_oversleep",
                 "_last_pub", "_grid", "_period", "_preds", "_window", "_lags", "_mode")

    def __init__(self, policy: PredictivePolicy) -> None:
        self.policy = policy
        n = policy.history
        self._intervals: collections.deque[float] = collections.deque(maxlen=n)
        self._gaps: collections.deque[float] = collections.deque(maxlen=n)
        self._errors: tuple[collections.deque[float], ...] = tuple(
            collections.deque(maxlen=n) for _ in _MODELS)
        self._oversleep: collections.deque[float] = collections.deque(maxlen=n)
        self._last_pub: float | None = None
        self._grid: float | None = None  # grid point of the last message
        self._period: float | None = None  # median interval, as of the last plan
        self._preds: list[float | None] = [None, None, None]
        self._window: tuple[float, float] | None = None
        #: Recent detection lags (publish -> seen) of windows spent polling / parked.
        self._lags: tuple[collections.deque[float], collections.deque[float]] = (
            collections.deque(maxlen=8), collections.deque(maxlen=8))
        self._mode: int | None = None  # the mode of the current window
        self.stats = {"planned": 0, "unplanned": 0, "early": 0, "on_time": 0, "late": 0,
                      "ready": 0, "model_grid": 0, "model_interval": 0, "model_gap": 0,
                      "mode_poll": 0, "mode_park": 0}

    @property
    def period(self) -> float | None:
        """The median recent interval between publishes (seconds), once known."""
        return self._period

    def plan(self, now: float) -> WaitPlan | None:
        """Plan a wait that starts ``now``.

        Returns:
            The plan: sleep (parked) until ``sleep_until``, poll until
            ``poll_until``, then yield ``fallback_yield_s`` (``< 0``: the wait
            policy's ``yield_s``) and park; ``sleep_until <= now`` means poll
            at once. ``None``: wait the plain way.
        """
        p = self.policy
        self._predict(now)
        best: tuple[float, float, int] | None = None
        for m, pred in enumerate(self._preds):
            errs = self._errors[m]
            if pred is None or len(errs) < p.min_samples:
                continue
            s = sorted(errs)
            lo, hi = pred + _quantile(s, p.low_quantile), pred + _quantile(s, p.high_quantile)
            if best is None or hi - lo < best[1] - best[0]:
                best = (lo, hi, m)
        stats = self.stats
        if best is None or best[1] + p.lead_s <= now:
            self._unplanned()  # nothing learned yet, or the message is overdue
            return None
        opens, closes = best[0] - p.lead_s, best[1] + p.lead_s
        fallback = -1.0 if p.fallback_yield_s is None else p.fallback_yield_s
        if closes - opens > p.max_window_s:
            # A long tail (a busy machine) or irregular steps: poll the window's
            # first max_window_s, then park at once -- never more CPU than the
            # plain policy's initial yield, spent where messages are likelier.
            closes, fallback = opens + p.max_window_s, 0.0
        sleep_until = opens - self._oversleep_s()
        if sleep_until - now < p.min_sleep_s:
            sleep_until = now
        self._window = (opens, closes)
        stats["planned"] += 1
        stats["model_" + _MODELS[best[2]]] += 1
        mode = self._mode = self._choose_mode()
        stats["mode_" + _MODES[mode]] += 1
        if mode == PARK_MODE:  # sleep, then park at once: the bell wakes us
            return WaitPlan(sleep_until, max(now, sleep_until), 0.0, p.yield_contended_s)
        return WaitPlan(sleep_until, closes, fallback, p.yield_contended_s)

    def _choose_mode(self) -> int:
        """Poll or park this window: the lower recent median lag, exploring the other."""
        every = self.policy.explore_every
        if not every:
            return POLL
        poll, park = self._lags
        if len(poll) < _MIN_LAGS:
            return POLL
        if len(park) < _MIN_LAGS:
            return PARK_MODE
        penalty = self.policy.park_penalty_s
        best = POLL if sorted(poll)[len(poll) // 2] <= sorted(park)[len(park) // 2] + penalty \
            else PARK_MODE
        if self.stats["planned"] % every == 0:
            return 1 - best
        return best

    def _unplanned(self) -> None:
        """No plan for this wait: it runs the plain way."""
        self._window = None
        self._mode = None
        self.stats["unplanned"] += 1

    def _predict(self, now: float) -> None:
        """Each model's point prediction of the next publish (None: not yet)."""
        if len(self._intervals) >= 2:
            s = sorted(self._intervals)
            self._period = s[len(s) // 2]
        period, preds = self._period, self._preds
        preds[_GRID] = None if period is None or self._grid is None else self._grid + period
        preds[_INTERVAL] = None if period is None or self._last_pub is None \
            else self._last_pub + period
        if len(self._gaps) >= 2:
            s = sorted(self._gaps)
            preds[_GAP] = now + s[len(s) // 2]
        else:
            preds[_GAP] = None

    def overslept(self, seconds: float) -> None:
        """Record how late a planned sleep's timer returned (``wake - requested``)."""
        if 0.0 <= seconds < self.policy.max_window_s:
            self._oversleep.append(seconds)

    def _oversleep_s(self) -> float:
        if not self._oversleep:
            return 0.0
        return _quantile(sorted(self._oversleep), self.policy.high_quantile)

    def observe(self, published: float, wait_start: float | None,
                seen: float | None = None) -> None:
        """Learn from one message.

        Args:
            published: The writer's stamp (monotonic seconds).
            wait_start: When this reader began waiting for it, or ``None`` when
                it was already there (then no plan was made for it).
            seen: When the reader's wait saw it (monotonic), for the lag of
                the window's mode; ``None``: not measured.
        """
        last = self._last_pub
        if not math.isfinite(published) or (last is not None and not
                                             0.0 <= published - last < _MAX_SAMPLE_S):
            self._reset(published if math.isfinite(published) else None)
            return
        stats, preds, errors = self.stats, self._preds, self._errors
        if wait_start is None:
            stats["ready"] += 1
            period = self._period
            if period is not None and last is not None:  # no plan made: predict now
                preds[_INTERVAL] = last + period
                preds[_GRID] = None if self._grid is None else self._grid + period
            preds[_GAP] = None
        else:
            gap = published - wait_start
            self._gaps.append(gap if gap > 0.0 else 0.0)
            win = self._window
            if win is not None:
                where = "early" if published < win[0] else "late" if published > win[1] \
                    else "on_time"
                stats[where] += 1
                lag = None if seen is None else seen - published
                if where == "on_time" and self._mode is not None and lag is not None \
                        and 0.0 <= lag < 1.0:
                    self._lags[self._mode].append(lag)
        for m in (_GRID, _INTERVAL, _GAP):
            pred = preds[m]
            if pred is not None:
                errors[m].append(published - pred)
                preds[m] = None
        if last is not None:
            self._intervals.append(published - last)
        self._advance_grid(published)
        self._last_pub = published
        self._window = None
        self._mode = None

    def _advance_grid(self, published: float) -> None:
        """The grid point of this message.

        Early (before the grid's due time): the grid moves in to it. Late by a
        little (up to ``_GRID_FOLLOW`` of a period): the grid follows, so an
        estimated period a little off does not drift the grid away. Late by
        more: the grid advances by the period plus that much only -- one
        descheduled step does not shift it -- unless the message is half a
        period off (a new phase): then it re-anchors there.
        """
        period, grid = self._period, self._grid
        if period is None or grid is None:
            self._grid = published
            return
        due = grid + period
        late = published - due
        if late <= _GRID_FOLLOW * period or late > 0.5 * period:
            self._grid = published
        else:
            self._grid = due + _GRID_FOLLOW * period

    def _reset(self, published: float | None) -> None:
        """Forget everything (a stamp that makes no sense: a new writer, a bad clock)."""
        self._intervals.clear()
        self._gaps.clear()
        for e in self._errors:
            e.clear()
        self._last_pub = self._grid = published
        self._period = None
        self._preds = [None, None, None]
        self._window = None
        self._mode = None
        for lags in self._lags:
            lags.clear()

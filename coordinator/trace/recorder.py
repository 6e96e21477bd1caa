"""The flight recorder: a fixed-size ring of every group call this process made.

One :class:`FlightRecorder` per process (:func:`recorder`) keeps the last
``capacity`` calls of every :class:`~coordinator.GroupCoordinator` in this
process; each coordinator writes through its own :class:`GroupTrace`, which
holds the group's identity (name, description, member ranks) and its
sequence numbers' meaning.

An entry is a Python list laid out by the index constants below (``RID``,
``OP``, ...), created when a call begins and updated in place as it moves on:

* **begin** (:meth:`GroupTrace.begin`): record id, group, op, the group's
  collective and point-to-point sequence numbers, the peer of a
  point-to-point call, the input's shape and dtype (never its data), the
  monotonic creation time, the calling thread, and the Python stack when
  ``GROUPCOORD_TRACE_STACKS=1``; the call's ``dim`` (``DIM``), root
  (``ROOT``: a broadcast's or scatter's ``src``, a reduce's or gather's
  ``dst``) and reduce op (``REDUCE_OP``) where it has them. The output shape
  of a call whose output differs from its input by a rule (``all_gather``:
  ``dim`` times the group's size; ``reduce_scatter``: divided by it; a
  ``gather``'s root) follows from the input's shape, ``DIM`` and the group:
  the dump derives it (:mod:`coordinator.trace.dump`), so a call that fails,
  or has not completed yet, shows the output it would produce while the hot
  calls compute nothing for it;
* **completion**: the caller stores ``monotonic_ns()`` at ``DONE`` (and the
  output's shape and dtype at ``OUT_SIZES``/``OUT_DTYPES`` when they differ
  from the input's);
* **failure** (:meth:`GroupTrace.fail`): the error's class name at ``ERROR``.

A call that picks its transport itself (a broadcast through the group's
message queue) names it at ``TRANSPORT``; otherwise the group's
``transport_of`` names it when a dump is written, so the hot calls pay nothing
for it.

Calls on CPU transports run synchronously, so an entry is *started* when
created. A device call hands its entry a :class:`DeviceMarks` (CUDA events
recorded around the kernel, read lazily: never a synchronisation on the hot
path); its state is then what the events say when someone looks.

The ring is a :class:`collections.deque` bounded at ``capacity``: an append
(atomic under the GIL) drops the oldest entry. Entries are plain lists: a
writer appends the list it created and later stores into it, so a call that
outlives ``capacity`` newer calls updates an entry no longer in the ring,
which is harmless. Record ids come from :func:`itertools.count`, whose
``next`` is atomic under the GIL, so threads never share an id; two threads
may append in the other order than their ids, so readers sort by id.

Configuration (read when the process's recorder is first created):

* ``GROUPCOORD_TRACE_BUFFER``: ring entries (default 4096; ``0`` turns the
  recorder off: :meth:`GroupTrace.begin` is then never called);
* ``GROUPCOORD_TRACE_STACKS=1``: record each call's Python stack;
* ``GROUPCOORD_TRACE_DUMP``: prefix of dump files, ``<prefix><global rank>``
  (default ``<tempdir>/groupcoord-trace-<uid>/rank_``: a directory of this
  user's own, mode 0700, which holds nothing but dumps);
* ``GROUPCOORD_TRACE_SIGNAL``: see :mod:`coordinator.trace.signals`.

The dump format is described in :mod:`coordinator.trace.dump`.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import threading
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from threading import get_ident
from time import monotonic_ns
from typing import Any, Protocol

import torch

from shm_broadcast.checks import env_flag

__all__ = [
    "DEFAULT_CAPACITY",
    "DeviceMarks",
    "FlightRecorder",
    "GroupTrace",
    "StartOnly",
    "recorder",
    "reset_recorder",
    "RID", "GROUP", "OP", "SEQ", "P2P_SEQ", "PEER", "IN_SIZES", "IN_DTYPES",
    "OUT_SIZES", "OUT_DTYPES", "CREATED", "DONE", "ERROR", "FRAMES", "DEVICE", "TRANSPORT",
    "DIM", "THREAD", "ROOT", "REDUCE_OP", "ENTRY_LEN", "shapes_of",
]

#: Ring entries unless ``GROUPCOORD_TRACE_BUFFER`` says otherwise.
DEFAULT_CAPACITY = 4096
#: Deepest Python stack recorded with ``GROUPCOORD_TRACE_STACKS=1``.
_STACK_LIMIT = 32

# The layout of an entry (a list, so that completion is one item store).
RID = 0  # record id, increasing per process
GROUP = 1  # the GroupTrace
OP = 2  # the public method, e.g. "all_reduce"
SEQ = 3  # the group's collective calls so far, this one included if collective
P2P_SEQ = 4  # the group's point-to-point calls so far, this one included if p2p
PEER = 5  # group rank of a point-to-point call's peer, else -1
IN_SIZES = 6  # a torch.Size, a list of them, or None (objects)
IN_DTYPES = 7  # a torch.dtype, a list of them, or None
OUT_SIZES = 8  # as IN_SIZES; None: as the input
OUT_DTYPES = 9  # as IN_DTYPES; None: as the input
CREATED = 10  # monotonic_ns() at begin
DONE = 11  # monotonic_ns() at completion, 0 until then
ERROR = 12  # the error's class name, None unless the call failed
FRAMES = 13  # [{"name", "filename", "line"}] or None
DEVICE = 14  # DeviceMarks of a device call, else None
TRANSPORT = 15  # the transport when the call named it (queue broadcasts), else None
DIM = 16  # the call's dim as given (a variable-size call's rows differ along it); None: its default
THREAD = 17  # threading.get_ident() of the thread that made the call
ROOT = 18  # group rank of a rooted call's root (broadcast/scatter src, reduce/gather dst)
REDUCE_OP = 19  # the reduce op of a reducing call (a ReduceOp), else None
ENTRY_LEN = 20


class DeviceMarks(Protocol):
    """When a device call started and completed, as its CUDA events tell (lazily)."""

    def started_ns(self) -> int | None:
        """Monotonic ns when the call was first seen started, None if not yet."""

    def completed_ns(self) -> int | None:
        """Monotonic ns when the call was first seen completed, None if not yet."""

    def replays(self) -> int | None:
        """How often a captured call ran in graph replays, None if not captured."""


class FlightRecorder:
    """The process's ring of group calls (see the module docstring).

    Args:
        capacity: Ring entries; ``0`` records nothing.
        stacks: Record each call's Python stack.
        dump_prefix: Prefix of this process's dump file names.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY, stacks: bool = False,
                 dump_prefix: str | None = None) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self.stacks = bool(stacks)
        self.dump_prefix = dump_prefix if dump_prefix is not None else default_dump_prefix()
        #: The ring: the last ``capacity`` entries, in the order they were appended.
        self.ring: deque[list[Any]] = deque(maxlen=capacity)
        #: Record ids (``next`` is atomic under the GIL).
        self.ids = itertools.count()
        self._groups: list[GroupTrace] = []
        self._pg_ids = itertools.count()  # pg_id of each group made, never reused
        # Guards _groups, not the ring; reentrant because a signal handler that dumps
        # runs on the main thread, possibly while that thread holds it.
        self._lock = threading.RLock()

    @property
    def enabled(self) -> bool:
        """Whether calls are recorded (``capacity > 0``)."""
        return self.capacity > 0

    def group(self, name: str, desc: str, ranks: Sequence[int], rank_in_group: int,
              transport_of: Callable[[str, list[Any]], str] | None = None,
              timeout: float | None = None) -> GroupTrace | None:
        """The :class:`GroupTrace` a new group writes through; None when disabled.

        Args:
            name: The group's unique name (``tp:0``).
            desc: What the group is for (its base name, ``tp``).
            ranks: Its members' global ranks.
            rank_in_group: This process's rank in it.
            transport_of: Names the transport of an entry (``op``, entry), read
                at dump time; None: ``"gloo"``.
            timeout: Seconds that bound the group's calls (dumped as each
                entry's ``timeout_ms``); None: not known.
        """
        if not self.enabled:
            return None
        kind = StackedGroupTrace if self.stacks else GroupTrace
        trace = kind(self, -1, name, desc, list(ranks), rank_in_group, transport_of)
        if timeout is not None:
            trace.timeout_ms = round(timeout * 1000)
        with self._lock:
            self._prune()
            trace.pg_id = next(self._pg_ids)
            self._groups.append(trace)
        return trace

    def groups(self) -> list[GroupTrace]:
        """The groups recorded, in creation order: the live ones, and the closed ones
        that still have entries in the ring (the others are forgotten here, and at
        the next group's creation, so that the list stays bounded)."""
        with self._lock:
            self._prune()
            return list(self._groups)

    def _prune(self) -> None:
        """Forget the closed groups without entries left in the ring (lock held)."""
        if not any(g.closed for g in self._groups):
            return
        present = {id(e[GROUP]) for e in self._snapshot()}
        self._groups = [g for g in self._groups if not g.closed or id(g) in present]

    def entries(self) -> list[list[Any]]:
        """The entries in the ring, oldest first (the lists themselves, not copies)."""
        live = self._snapshot()
        live.sort(key=lambda e: e[RID])
        return live

    def _snapshot(self) -> list[list[Any]]:
        """The ring's entries now. Copying a deque runs no Python code, so no other
        thread appends meanwhile under the GIL; a runtime without one may report
        the deque changed during the copy, which a retry outlasts."""
        for _ in range(100):
            try:
                return list(self.ring)
            except RuntimeError:  # appended during the copy
                continue
        return list(self.ring)


class GroupTrace:
    """One group's writer into the process's :class:`FlightRecorder`.

    Attributes:
        name: The group's unique name.
        desc: Its description (base name).
        ranks: Its members' global ranks.
        rank_in_group: This process's rank in it.
        pg_id: Its number among the recorder's groups, in creation order (never reused).
        transport_of: Names an entry's transport at dump time.
        timeout_ms: Milliseconds that bound the group's calls; None: not known.
        closed: Set when the group is destroyed.
    """

    __slots__ = ("recorder", "pg_id", "name", "desc", "ranks", "rank_in_group",
                 "transport_of", "timeout_ms", "closed", "_append", "_ids")

    def __init__(self, rec: FlightRecorder, pg_id: int, name: str, desc: str, ranks: list[int],
                 rank_in_group: int,
                 transport_of: Callable[[str, list[Any]], str] | None) -> None:
        self.recorder = rec
        self.pg_id = pg_id
        self.name = name
        self.desc = desc
        self.ranks = ranks
        self.rank_in_group = rank_in_group
        self.transport_of = transport_of
        self.timeout_ms: int | None = None
        self.closed = False
        self._append = rec.ring.append
        self._ids = rec.ids

    def begin(self, op: str, seq: int, p2p_seq: int, sizes: Any = None, dtypes: Any = None,
              peer: int = -1) -> list[Any]:
        """Record that call ``op`` begins; returns its entry (see the module docstring).

        Args:
            op: The public method.
            seq: The group's collective calls so far (this one included if collective).
            p2p_seq: Its point-to-point calls so far (this one included if p2p).
            sizes: The input's shape(s): a ``torch.Size`` or a list of them; None
                for calls without tensors.
            dtypes: The input's dtype(s), matching ``sizes``.
            peer: The group rank of a point-to-point call's peer.
        """
        entry = [next(self._ids), self, op, seq, p2p_seq, peer, sizes, dtypes, None, None,
                 monotonic_ns(), 0, None, None, None, None, None, get_ident(), None, None]
        self._append(entry)
        return entry

    def begin_tensor(self, op: str, seq: int, p2p_seq: int, tensor: Any,
                     peer: int = -1, dim: Any = None, root: Any = None,
                     reduce_op: Any = None) -> list[Any]:
        """:meth:`begin` for a call on one tensor: keeps its shape and dtype (never
        the tensor). Anything without them records none: the call's own checks
        then say what is wrong with it. The hot calls' form, one call layer only:
        ``dim``, ``root`` and ``reduce_op`` (the call's arguments, as given: the
        dump checks them) go into the entry as it is built.
        """
        try:
            sizes, dtypes = tensor.shape, tensor.dtype
        except AttributeError:
            sizes = dtypes = None
        entry = [next(self._ids), self, op, seq, p2p_seq, peer, sizes, dtypes, None, None,
                 monotonic_ns(), 0, None, None, None, None, dim, get_ident(), root, reduce_op]
        self._append(entry)
        return entry

    @staticmethod
    def fail(entry: list[Any], error: BaseException) -> None:
        """Mark ``entry``'s call failed with ``error`` (its class name is kept)."""
        if entry[ERROR] is None:
            entry[ERROR] = type(error).__name__

    @staticmethod
    def complete(entry: list[Any], sizes: Any = None, dtypes: Any = None) -> None:
        """Mark ``entry``'s call completed, with its output's shape(s) and dtype(s)
        when they differ from the input's."""
        if sizes is not None:
            entry[OUT_SIZES] = sizes
            entry[OUT_DTYPES] = dtypes
        entry[DONE] = monotonic_ns()


def shapes_of(data: Any) -> tuple[Any, Any]:
    """``(sizes, dtypes)`` of a call's tensors as an entry keeps them (never the data).

    A tensor gives its ``torch.Size`` and dtype; a list or tuple gives the lists
    of the tensors in it, one level of nesting included (``all_gatherv_rows``
    returns ``(tensors, counts)``); anything else (objects, dicts, None) gives
    ``(None, None)``.
    """
    if isinstance(data, torch.Tensor):
        return data.shape, data.dtype
    if not isinstance(data, (list, tuple)):
        return None, None
    found = [t for x in data
             for t in (x if isinstance(x, (list, tuple)) else (x,))
             if isinstance(t, torch.Tensor)]
    if not found:
        return None, None
    return [t.shape for t in found], [t.dtype for t in found]



class StackedGroupTrace(GroupTrace):
    """A :class:`GroupTrace` that also keeps each call's Python stack
    (``GROUPCOORD_TRACE_STACKS=1``); a class of its own so that the plain one
    tests nothing for it per call."""

    __slots__ = ()

    def begin(self, op: str, seq: int, p2p_seq: int, sizes: Any = None, dtypes: Any = None,
              peer: int = -1) -> list[Any]:
        """:meth:`GroupTrace.begin`, with the caller's stack in ``FRAMES``."""
        entry = super().begin(op, seq, p2p_seq, sizes, dtypes, peer)
        entry[FRAMES] = _frames()
        return entry

    def begin_tensor(self, op: str, seq: int, p2p_seq: int, tensor: Any,
                     peer: int = -1, dim: Any = None, root: Any = None,
                     reduce_op: Any = None) -> list[Any]:
        """:meth:`GroupTrace.begin_tensor`, with the caller's stack in ``FRAMES``."""
        entry = super().begin_tensor(op, seq, p2p_seq, tensor, peer, dim, root, reduce_op)
        entry[FRAMES] = _frames()
        return entry

class StartOnly:
    """What a group's busiest calls begin their entry with when the recorder is off
    but the group's device calls are marked (its watchdog follows them): an entry
    in no ring, holding only what the call's own bookkeeping reads: the call's
    start (``CREATED``), which explains a failed wait (a peer that closed its
    connections after most of the timeout gave up at its own timeout), and the
    slots the call stores into. Same call form as :meth:`GroupTrace.begin_tensor`,
    so those calls test nothing more for it."""

    __slots__ = ()

    @staticmethod
    def begin_tensor(op: str, seq: int, p2p_seq: int, tensor: Any,
                     peer: int = -1, dim: Any = None, root: Any = None,
                     reduce_op: Any = None) -> list[Any]:
        """An unrecorded entry of call ``op`` that begins now (``tensor`` and the
        call's arguments unread)."""
        return [-1, None, op, seq, p2p_seq, peer, None, None, None, None, monotonic_ns(),
                0, None, None, None, None, None, None, None, None]


def _frames() -> list[dict[str, Any]]:
    """The caller's Python stack, innermost last, without the recorder's own frames."""
    stack = traceback.extract_stack(limit=_STACK_LIMIT)[:-2]
    return [{"name": f.name, "filename": f.filename, "line": f.lineno or 0} for f in stack]


#: The default dump directory's name in the temp directory (``{uid}``: the user's).
DEFAULT_DUMP_DIR = "groupcoord-trace-{uid}"


def default_dump_prefix() -> str:
    """``GROUPCOORD_TRACE_DUMP``, else ``<tempdir>/groupcoord-trace-<uid>/rank_``."""
    env = os.environ.get("GROUPCOORD_TRACE_DUMP")
    if env:
        return env
    return os.path.join(tempfile.gettempdir(), DEFAULT_DUMP_DIR.format(uid=os.geteuid()),
                        "rank_")


def _capacity_from_env() -> int:
    raw = os.environ.get("GROUPCOORD_TRACE_BUFFER")
    if raw is None or raw.strip() == "":
        return DEFAULT_CAPACITY
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"GROUPCOORD_TRACE_BUFFER must be an int >= 0 (ring entries; "
                         f"0 turns the recorder off), got {raw!r}") from None
    if value < 0:
        raise ValueError(f"GROUPCOORD_TRACE_BUFFER must be an int >= 0 (ring entries; "
                         f"0 turns the recorder off), got {raw!r}")
    return value


def _stacks_from_env() -> bool:
    return env_flag("GROUPCOORD_TRACE_STACKS", False)


_RECORDER: FlightRecorder | None = None
# Reentrant: a signal handler that dumps (coordinator.trace.signals) runs on the
# main thread, possibly while that thread holds it.
_RECORDER_LOCK = threading.RLock()


def recorder() -> FlightRecorder:
    """The process's recorder, created from the environment on first use."""
    global _RECORDER
    rec = _RECORDER
    if rec is None:
        with _RECORDER_LOCK:
            if _RECORDER is None:
                _RECORDER = FlightRecorder(_capacity_from_env(), _stacks_from_env())
            rec = _RECORDER
    return rec


def reset_recorder(rec: FlightRecorder | None = None) -> FlightRecorder | None:
    """Replace the process's recorder (None: the next :func:`recorder` call reads the
    environment again); returns the previous one. For tests and benchmarks: groups
    created before keep writing to the recorder they were created with."""
    global _RECORDER
    with _RECORDER_LOCK:
        old, _RECORDER = _RECORDER, rec
    return old

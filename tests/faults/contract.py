"""What every rank must do in a fault case: the contract the matrix checks.

Words: the *culprit* injects the fault; its *partners* are the ranks in the
op under test with it (every other rank for a collective, its pair for a
point-to-point op); *bystanders* are the other ranks of a point-to-point
op, which complete it and meet the culprit only in the follow-up all-reduce
of the step. Every rank's step is ``[op, follow-up]`` and ends at its first
error.

Always, on every case:

* no rank returns a wrong result (the step and the recovery step);
* every rank that is not stopped or killed finishes its step (returns or
  raises) within ``timeout + 2 s`` of the fault;
* every error is one of the family (:class:`GroupCoordError`), its message
  names the op the rank was in (``op <name>``), and ``peers`` names ranks;
* nothing remains: processes, ``/dev/shm`` segments, owner records, channel
  directories, exit reapers of the dead (checked by the rig and tests/conftest.py).

Per fault (``who`` below is the set the error's ``peers`` must equal):

* ``kill`` / ``raise`` (the culprit's process is gone: an uncaught exception
  ends it like any Python program, exit status 1): every survivor raises
  :class:`PeerDiedError`, in the op or in the follow-up, ``who = {culprit}``.
  An exiting interpreter takes a while to be gone (~0.4 s here, seconds on a
  loaded machine) and death is declared only from evidence: a survivor that
  raised before the rig saw the culprit's process end may instead raise
  :class:`CommTimeout` or :class:`ClosedError` naming the culprit among its
  ``peers``.
  Survivors that wait on the culprit directly see it at once (shared memory:
  the pid check, ~0.25 s; gloo: the closed connection, then the exit); a
  gloo rank that waits only on other survivors learns it at the group's
  timeout, from the side check of the peers' processes.
* ``stop`` (``SIGSTOP``; alive, so no death is declared): every other rank
  raises :class:`CommTimeout`, ``who = {culprit}`` (its state is shown as
  stopped).
* ``skip`` / ``other-op`` / ``dtype`` / ``shape``, by the route of the op:

  * signed routes (the communicator's collectives, and object broadcasts,
    which travel through it): every rank raises :class:`CollectiveMismatch`
    in its first call, promptly; partners name the culprit (two ranks that
    disagree cannot tell who is wrong: each names the other); the group then
    completes a recovery step with right answers;
  * the TP broadcaster (one-way: the writer returns before its readers read),
    culprit a reader: the writer and the other readers complete the
    broadcast. ``skip``: the culprit is now one collective call behind the
    group, so its follow-up (its call ``#n``) meets theirs (``#n+1``): every
    rank raises :class:`CollectiveMismatch` there (partners name the culprit),
    and the culprit's next broadcast raises too instead of returning the
    skipped call's message; ``other-op``: the culprit's other op meets their
    follow-up, every rank raises :class:`CollectiveMismatch` there, and the
    culprit's next broadcast raises too. Culprit the writer: the readers time
    out waiting for it (``who = {writer}``), the writer times out in its
    other call;
  * gloo's monitored barrier (unsigned: it carries no data): every rank
    raises :class:`CommTimeout` naming the culprit among the ranks missing
    (rank 0 knows exactly; the others only that rank 0 did not release them,
    and name the ranks the side check cannot clear);
  * point to point: the partner raises (:class:`CollectiveMismatch` when the
    pair's headers differ, :class:`CommTimeout` naming the culprit when the
    culprit is in a collective instead: a send/recv and a collective do not
    meet); bystanders complete the op and time out in the follow-up naming
    the pair's ranks that did not come;
  * ``broadcast_object_list`` with a receiver's list of another length: only
    that receiver can tell; it raises :class:`CollectiveMismatch` naming the
    source, the others complete the broadcast and time out in the follow-up
    naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.faults.ops import OPS

__all__ = ["Expect", "DESTRUCTIVE", "expect", "check_case"]

#: Faults after which the culprit does not come back (``exit-late``: see
#: :mod:`tests.faults.rank_side`; not in the matrix, a test of its own).
DESTRUCTIVE = ("kill", "stop", "raise", "exit-late")
GRACE_S = 2.0


@dataclass(frozen=True)
class Expect:
    """What one rank must do.

    Attributes:
        raises: Name of the class it must raise in its step (None: it must
            finish the step without error).
        who: The ``peers`` its error must name exactly (None: not checked exactly).
        must_name: Ranks its error's ``peers`` must include (any one of them).
        recovery_raises: The class it must raise at its first recovery call.
    """

    raises: str | None
    who: frozenset[int] | None = None
    must_name: frozenset[int] | None = None
    recovery_raises: str | None = None


def _role(op_name: str, rank: int, culprit: int) -> str:
    op = OPS[op_name]
    if rank == culprit:
        return "culprit"
    if op.paired and op.partner(rank, 0) != culprit:
        return "bystander"
    return "partner"


def expect(spec: dict[str, Any], rank: int) -> Expect:
    """The contract of ``rank`` in case ``spec`` (see the module docstring)."""
    op, fault, culprit = OPS[spec["op"]], spec["fault"], spec["culprit"]
    role = _role(spec["op"], rank, culprit)
    c = frozenset({culprit})
    if fault in ("kill", "raise", "exit-late"):
        return Expect("PeerDiedError", who=c)
    if fault == "stop":
        return Expect("CommTimeout", who=c)
    partner = op.partner(culprit, 0)
    pair = frozenset({culprit} | ({partner} if partner is not None else set()))
    if role == "culprit":
        if op.route == "mq" and fault == "skip" and culprit != 0:
            return Expect("CollectiveMismatch", recovery_raises="CollectiveMismatch")
        return Expect("GroupCoordError",
                      recovery_raises="CollectiveMismatch" if op.route == "mq" and culprit != 0
                      else None)
    if op.paired:
        if role == "bystander":
            return Expect("CommTimeout", must_name=pair)
        mismatch = fault in ("dtype", "shape")
        return Expect("CollectiveMismatch" if mismatch else "CommTimeout", who=c)
    if op.route == "mq":
        if culprit == op_writer(op):
            return Expect("CommTimeout", who=c)
        return Expect("CollectiveMismatch", who=c)
    if op.route == "barrier":
        return Expect("CommTimeout", must_name=c, who=c if rank == 0 else None)
    if op.name == "broadcast_object_list" and fault == "shape":
        return Expect("CommTimeout", must_name=c)
    return Expect("CollectiveMismatch", who=c)


def op_writer(op: Any) -> int:
    """Group rank of the writer of the TP broadcaster (always 0)."""
    return 0


# ---------------------------------------------------------------------- checking
def _first_error(calls: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((c for c in calls if not c["ok"]), None)


def _names_op(call: dict[str, Any]) -> bool:
    from tests.faults.ops import FOLLOW_UP, other_op

    methods = set(OPS[call["op"]].methods) if call["op"] in OPS else set()
    if call["call"] == FOLLOW_UP.name:
        methods = set(FOLLOW_UP.methods)
    elif call["call"].endswith("(other op)"):
        methods = set(other_op(OPS[call["op"]]).methods)
    return any(f"op {m}" in call["text"] for m in methods)


def check_case(run: Any, world_size: int) -> list[str]:
    """Every way ``run`` (a :class:`~tests.faults.rig.CaseRun`) breaks the contract."""
    spec = run.spec
    timeout, culprit, fault = float(spec["timeout"]), spec["culprit"], spec["fault"]
    bad: list[str] = list(run.problems)
    if run.fault_t is None:
        return bad + ["the culprit never reported its fault"]
    for rank in range(world_size):
        rec = run.records[rank]
        if fault in DESTRUCTIVE and rank == culprit:
            if rec is not None:
                bad.append(f"culprit rank {rank} finished a step it should not have")
            continue
        if rec is None:
            bad.append(f"rank {rank} did not finish its step")
            continue
        bad += _check_rank(spec, rank, rec, run, timeout)
    return bad


def _check_rank(spec: dict[str, Any], rank: int, rec: dict[str, Any], run: Any,
                timeout: float) -> list[str]:
    want = expect(spec, rank)
    where = f"rank {rank}"
    err = _first_error(rec["calls"])
    culprit = spec["culprit"]
    if (spec["fault"] == "raise" and err is not None
            and err["t"] < run.exit_t.get(culprit, float("inf"))
            and err["error"] in ("CommTimeout", "ClosedError")):
        want = Expect(err["error"], must_name=frozenset({culprit}))  # still exiting
    bad = []
    for call in rec["calls"]:
        call["op"] = spec["op"]
        if call["ok"] and not call["right"]:
            bad.append(f"{where}: {call['call']} returned a WRONG result")
        late = call["t"] - run.fault_t
        if late > timeout + GRACE_S:
            bad.append(f"{where}: {call['call']} finished {late:.2f}s after the fault "
                       f"(> timeout {timeout:g} + {GRACE_S:g})")
    if want.raises is None:
        if err is not None:
            bad.append(f"{where}: raised {err['error']} in {err['call']} where no error was "
                       f"due: {err['text'][:300]}")
    elif err is None:
        bad.append(f"{where}: finished its step without the {want.raises} due")
    else:
        bad += _check_error(where, err, want)
    bad += _check_recovery(spec, rank, run, want)
    return bad


def _check_error(where: str, err: dict[str, Any], want: Expect) -> list[str]:
    bad = []
    text = f"{err['error']} in {err['call']}: {err['text'][:400]}"
    if "GroupCoordError" not in err["classes"]:
        bad.append(f"{where}: raised {text}, not an error of the family")
    if want.raises not in err["classes"]:
        bad.append(f"{where}: raised {text}; expected {want.raises}")
    if not _names_op(err):
        bad.append(f"{where}: its error does not name its op: {text}")
    peers = {p for p in err["peers"] if isinstance(p, int)}
    if not peers:
        bad.append(f"{where}: its error names no rank: {text}")
    if want.who is not None and peers != set(want.who):
        bad.append(f"{where}: its error names {sorted(peers)}, expected {sorted(want.who)}: "
                   f"{text}")
    if want.must_name is not None and not peers & want.must_name:
        bad.append(f"{where}: its error names {sorted(peers)}, none of {sorted(want.must_name)}: "
                   f"{text}")
    return bad


def _check_recovery(spec: dict[str, Any], rank: int, run: Any, want: Expect) -> list[str]:
    """After faults that leave the group usable, the recovery step: right answers,
    or (the skipping reader of the broadcaster) a mismatch instead of stale data."""
    if run.recovered is None:
        if want.recovery_raises is not None or _recovers(spec, run):
            return [f"rank {rank}: the recovery step did not run"]
        return []
    rec = run.recovered[rank]
    if rec is None:
        return [f"rank {rank}: no recovery report"]
    bad = [f"rank {rank}: recovery {c['call']} returned a WRONG result"
           for c in rec["calls"] if c["ok"] and not c["right"]]
    err = _first_error(rec["calls"])
    if want.recovery_raises is not None:
        if err is None or want.recovery_raises not in err["classes"]:
            bad.append(f"rank {rank}: its next broadcast should raise {want.recovery_raises}, "
                       f"got {err and err['error']}")
        elif 0 not in err["peers"]:
            bad.append(f"rank {rank}: its recovery error does not name the writer: {err['text']}")
    elif err is not None and not (
            OPS[spec["op"]].route == "mq" and spec["culprit"] != 0 and spec["fault"] in (
                "skip", "other-op")):
        bad.append(f"rank {rank}: recovery {err['call']} raised {err['error']}: "
                   f"{err['text'][:300]}")
    return bad


def _recovers(spec: dict[str, Any], run: Any) -> bool:
    """Whether the case must end with a usable group (every error a mismatch)."""
    op = OPS[spec["op"]]
    if spec["fault"] in DESTRUCTIVE or op.paired or op.route == "barrier":
        return False
    if op.route == "mq" and spec["culprit"] == 0:
        return False
    return not (op.name == "broadcast_object_list" and spec["fault"] == "shape")

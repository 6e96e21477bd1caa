"""The errors of the shared-memory engine's steps (:mod:`device_comms.cpu_shm.sync`).

Each function builds the exception a rank raises when a step goes wrong: the
ranks' calls differ (:func:`mismatch`), they are out of step (:func:`out_of_step`),
a wait gave up (:func:`timeout`), or a node leader relayed an error found
elsewhere (:func:`relayed`). Messages name the group, the op and the ranks.
"""

from __future__ import annotations

import msgspec

from device_comms.errors import (
    CollectiveMismatch,
    CollectiveTimeout,
    DecodeError,
    GroupCoordError,
    PeerDiedError,
    PeerRejectedError,
)
from device_comms.signatures.step_signature import describe_signature

__all__ = ["mismatch", "out_of_step", "relayed", "timeout"]


def mismatch(name: str, op: str, me: int, other: int, mine: tuple[int, int],
             theirs: tuple[int, int],
             calls: list[tuple[int, int, list[int]]]) -> CollectiveMismatch:
    """Rank ``other`` signed the step ``theirs`` where this rank (``me``) signed ``mine``;
    ``calls`` (every local rank's call) goes with the error as ``error.calls``, for a
    node leader to pass on."""
    error = CollectiveMismatch(
        f"group {name!r}, op {op}: rank {me} called {describe_signature(*mine)} but rank "
        f"{other} called {describe_signature(*theirs)} at the same point; every rank must "
        f"call the same collective with the same dtype, size, op and root",
        queue=name, peers=(other,),
    )
    error.calls = calls  # type: ignore[attr-defined]  # an extra the leaders read
    return error


def out_of_step(name: str, op: str, me: int, call: int,
                others: list[tuple[int, int]]) -> CollectiveMismatch:
    """The same call, made as the group's call ``call`` here and as other numbers by
    ``others`` (``(their number, their rank)`` pairs)."""
    return CollectiveMismatch(
        f"group {name!r}, op {op}: this rank (rank {me}) made it as the group's call #{call} "
        f"but " + ", ".join(f"rank {rank} as call #{number}" for number, rank in others)
        + "; the ranks are out of step (a rank skipped or added a collective call, or an "
        "earlier call failed on some ranks only)",
        queue=name, peers=tuple(rank for _, rank in others),
    )


def timeout(name: str, op: str, step: int, me: int, seconds: float | None, missing: list[int],
            quit_: list[int]) -> CollectiveTimeout:
    """This rank gives up on step ``step``: ``missing`` never came, ``quit_`` gave up
    before it (their timeout ran out, or their call was interrupted)."""
    wait = "" if seconds is None else f" within {seconds:.1f}s"
    parts = []
    if missing:
        parts.append(f"rank(s) {missing} did not reach step {step}{wait}")
    if quit_:
        parts.append(f"rank(s) {quit_} gave up on this call (step {step}): their timeout ran out "
                     f"waiting for ranks that had not arrived, or their call was interrupted")
    return CollectiveTimeout(
        f"group {name!r}, op {op}: {'; '.join(parts)} (this is rank {me}); check that every "
        f"rank calls the same collectives in the same order, each within the group's timeout",
        queue=name, peers=missing or quit_,
    )


def relayed(name: str, op: str, sender: int, raw: bytes) -> GroupCoordError:
    """The error rank ``sender`` relayed (``StepSync.relay``: msgpack ``(kind, culprit,
    message, peers)``), to raise here."""
    try:
        kind, culprit, text, peers = msgspec.msgpack.decode(
            raw, type=tuple[str, int, str, list[int]])
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        return DecodeError(
            f"group {name!r}, op {op}: rank {sender} relayed an error that does not decode "
            f"({err})", queue=name, peers=(sender,))
    if kind == "rejected":
        return PeerRejectedError(name, op, culprit, text)
    if kind == "timeout":
        return CollectiveTimeout(text, queue=name, peers=peers)
    if kind == "closed":  # a connection closed: death suspected, not seen
        died = PeerDiedError(text, queue=name, peers=peers)
        died.suspected = True  # type: ignore[attr-defined]  # an extra: suspected, not seen
        return died
    return CollectiveMismatch(text, queue=name, peers=tuple(peers) or (culprit,))

"""Call signatures: what the ranks of one call must agree on, as a 160-byte header.

Every call of a CPU communicator that moves data over gloo starts with a
*header* from each rank (see :mod:`device_comms.signatures.envelopes`). The header is 20
int64 words (a multiple of 16 bytes, so a payload after it is aligned for any dtype):

======  ================================================================
word    field
======  ================================================================
0       :data:`MAGIC` (protocol and version)
1       group id: a stable hash of the communicator's unique name
2       sequence number of the call (per communicator; per peer for p2p)
3       kind | dtype | reduce op | root, packed by :func:`step_signature.signature`
4       layout key: a hash of the shape and the layout arguments
        (``dim``, ``sizes``, ``scatter_dim``/``gather_dim``)
5       status: :data:`OK`, :data:`REJECTED`, :data:`FAILED` or :data:`SPLIT`
6       culprit: group rank that rejected or mismatched (REJECTED/FAILED); -1
        otherwise
7       bytes after the header (inline payload, reason text, or a SPLIT
        header's call list); -1: none
8       dtype code of this rank's data (0: not known to this rank)
9       ndim of this rank's data (-1: not known to this rank)
10      an op's extra argument checked after the exchange (scatter: ``dim``)
11-19   the first nine sizes of that shape
======  ================================================================

Words 0-4 must be equal on every rank of a call whose status is OK (words 3-4
of a SPLIT header mean nothing: its call list says who signed what);
words 8-19 describe the data for error messages and tell scatter's receivers
the source's shape and dtype. Hashes of tuples of ints are the same in every
process (Python randomises only ``str``/``bytes`` hashes), and the group id
uses CRC-32 of the name for the same reason.

:func:`settle` turns the headers every participant sees into a verdict: a
rejection (the lowest rejecting rank is named), a mismatch (the ranks outside
the largest agreeing class are named, with what they called), or agreement.
Classes are counted in ranks: a participant that speaks for several ranks
(a node leader of the hierarchical communicator) counts as its node's ranks.
Every participant whose own call was valid reaches the same verdict, except
whom a mismatch names when the largest classes tie (two ranks that disagree,
two hosts of equal size): nobody can tell which side is wrong, so each names
the ranks outside its own class (its peers in the other class, never
itself), as the shared-memory engine does.

A node leader whose own ranks disagree among themselves sends a
:data:`SPLIT` header: its payload lists every call its ranks made and who
made it (:func:`encode_calls`; :func:`decode_calls` checks it). Its node's
ranks raise their local error; the other leaders count the listed ranks
with everyone else's, so where the node alone saw a 1-1 tie the largest
class across the group is still clear.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence

import msgspec
import numpy as np
import torch

from device_comms.errors import CollectiveMismatch, DecodeError, PeerRejectedError
from device_comms.reduce_op import ReduceOp
from device_comms.signatures.step_signature import (
    KIND_NAMES,
    SHAPE_KEYED_KINDS,
    dtype_code,
    dtype_of,
    op_of,
    shape_key,
    shape_of_key,
    signature,
)

__all__ = [
    "HDR_BYTES", "HDR_WORDS", "MAGIC", "OK", "REJECTED", "FAILED", "SPLIT",
    "group_id", "layout_key", "template", "describe", "settle", "encode_calls", "decode_calls",
]

HDR_WORDS = 20
HDR_BYTES = 8 * HDR_WORDS
MAGIC = 0x4743_5347_0001  # "GCSG", version 1
OK, REJECTED, FAILED, SPLIT = 0, 1, 2, 3
_LIST_MAX = 64  # ranks a refused SPLIT payload's error message lists
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
#: One call of a SPLIT payload: (word 3, word 4, the group ranks that made it).
Call = tuple[int, int, list[int]]
_DIMS = 9  # sizes of the shape a header spells out
_DIM0 = 11  # word of the first size
_AGREE = slice(0, 5)  # the words every rank must share
_ROOT_KINDS = frozenset({"broadcast", "gather", "reduce", "scatter", "send/recv"})


def group_id(name: str) -> int:
    """A stable 32-bit id of a communicator's unique name, without its process counter.

    A GroupCoordinator's unique name is ``<base>:<n>``, ``n`` counting the
    groups of that base this *process* created: a process that destroyed and
    re-created its groups has ``tp:1`` where a freshly started peer (a
    replacement rank) has ``tp:0`` for the same group. The id is meant to tell
    apart communicators sharing one gloo group, which have different bases,
    so the counter is left out.
    """
    base, sep, counter = name.rpartition(":")
    if sep and counter.isdigit():
        name = base
    return zlib.crc32(name.encode("utf-8", "replace"))


def layout_key(layout: object) -> int:
    """A non-negative int64 of a layout (the same in every process).

    A plain shape (a tuple of ints) gets :func:`step_signature.shape_key`, the key
    the shared-memory engine signs its steps with; any other layout (a tuple
    holding the shape and ``dim``, ``sizes``...) a hash of it.
    """
    if layout is None:  # hash(None) is its address before Python 3.12: not the same
        return 0          # in every process
    if isinstance(layout, tuple) and all(type(x) is int for x in layout):
        return shape_key(layout)
    return hash(layout) & 0x7FFF_FFFF_FFFF_FFFF


def template(
    gid: int,
    kind: str,
    dtype: torch.dtype | None,
    op: ReduceOp | None,
    root: int,
    key: int,
    shape: Sequence[int] | None,
    data_dtype: torch.dtype | None = None,
    extra: int = 0,
) -> np.ndarray:
    """The header of a call with an OK status, sequence 0 and no payload.

    Args:
        gid: :func:`group_id` of the communicator.
        kind: An op kind of :data:`step_signature.KIND_NAMES`.
        dtype: The dtype every rank must share (None: not every rank knows it).
        op: The reduce op, if any.
        root: Root / source / destination group rank (0 when none).
        key: :func:`layout_key` of the shape and layout arguments.
        shape: This rank's data shape, for messages (None: unknown here).
        data_dtype: This rank's data dtype when ``dtype`` is None (scatter's source).
        extra: Word 10 (an argument the op checks after the exchange).
    """
    w = np.zeros(HDR_WORDS, dtype=np.int64)
    w[0], w[1], w[2] = MAGIC, gid, 0
    w[3] = signature(kind, dtype, op, root)
    w[4], w[5], w[6], w[7] = key, OK, -1, -1
    real = dtype if dtype is not None else data_dtype
    w[8] = dtype_code(real) if real is not None else 0
    w[10] = extra
    if shape is None:
        w[9] = -1
    else:
        w[9] = len(shape)
        for i, s in enumerate(list(shape)[:_DIMS]):
            w[_DIM0 + i] = s
    return w


def data_shape(words: np.ndarray) -> tuple[list[int] | None, torch.dtype | None]:
    """The shape and dtype a header describes (None where unknown or truncated)."""
    n = int(words[9])
    shape = [int(x) for x in words[_DIM0 : _DIM0 + n]] if 0 <= n <= _DIMS else None
    return shape, dtype_of(int(words[8]))


def describe(words: np.ndarray) -> str:
    """``all_reduce(dtype=torch.float32, shape=(4, 2), op=SUM) #7``: a header for humans."""
    sig = int(words[3])
    kind = KIND_NAMES.get(sig & 0xFF, f"op#{sig & 0xFF}")
    dtype = dtype_of(int(words[8]))
    parts = [f"dtype={dtype}" if dtype is not None else "dtype=?"]
    n = int(words[9])
    if n >= 0:
        dims = [str(int(x)) for x in words[_DIM0 : _DIM0 + min(n, _DIMS)]]
        more = ", ..." if n > _DIMS else ("," if n == 1 else "")
        parts.append(f"shape=({', '.join(dims)}{more})")
    op = op_of((sig >> 16) & 0xFF)
    if op is not None:
        parts.append(f"op={op.name}")
    if kind in _ROOT_KINDS:
        parts.append(f"{'src' if kind in ('scatter', 'send/recv') else 'root'}={sig >> 24}")
    return f"{kind}({', '.join(parts)}) #{int(words[2])}"


def encode_calls(calls: Sequence[Call]) -> bytes:
    """The payload of a :data:`SPLIT` header: every call a participant's ranks made."""
    return msgspec.msgpack.encode([[int(a), int(b), [int(r) for r in ranks]]
                                   for a, b, ranks in calls])


def decode_calls(raw: bytes, who: int, members: Sequence[int], name: str) -> list[Call]:
    """The calls of the :data:`SPLIT` payload that participant ``who`` sent for ``members``.

    A valid list names at least two different calls, every rank of ``members``
    exactly once, and signatures that fit in int64 (the header's words).

    Raises:
        DecodeError: Anything else (the payload is at most an envelope's
            inline size, so decoding allocates little).
    """
    def refuse(why: str) -> DecodeError:
        return DecodeError(f"group {name!r}: rank {who} sent a split-call list that {why}",
                           queue=name, peers=(who,))

    try:
        calls = msgspec.msgpack.decode(raw, type=list[tuple[int, int, list[int]]])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise refuse(f"does not decode ({e})") from None
    ranks = sorted(r for _, _, rs in calls for r in rs)
    if ranks != sorted(members):
        raise refuse(f"names ranks {ranks[:_LIST_MAX]}, not its node's {sorted(members)} "
                     f"each once")
    sigs = {(a, b) for a, b, _ in calls}
    if len(sigs) != len(calls) or len(calls) < 2:
        raise refuse(f"lists {len(calls)} calls, {len(sigs)} of them different (at least 2 "
                     f"different calls, none twice, expected)")
    if any(not _INT64_MIN <= x <= _INT64_MAX for sig in sigs for x in sig):
        raise refuse("holds a signature outside int64")
    return [(a, b, sorted(rs)) for a, b, rs in calls]


def settle(
    name: str,
    op: str,
    me: int,
    headers: Mapping[int, np.ndarray],
    text: Callable[[int], str],
    members: Callable[[int], Sequence[int]] | None = None,
    calls: Callable[[int], list[Call]] | None = None,
) -> bool:
    """Decide a call from every participant's header (the same on every rank, but
    for whom a tied mismatch names: see the module docstring).

    Args:
        name: The group's unique name (for messages).
        op: The op this rank is running.
        me: This rank's key in ``headers``.
        headers: Header words of every participant (this rank's included),
            keyed by group rank (or by node leader's group rank).
        text: The text a REJECTED/FAILED participant sent (its reason).
        members: The group ranks a participant speaks for (a node leader:
            its node's ranks); default: itself.
        calls: The calls of a :data:`SPLIT` participant's ranks (its decoded
            payload); needed only where SPLIT headers can occur.

    Returns:
        True when this participant's own status is not OK (it rejected its
        call, or its node failed or split: it raises its own error), False
        when every participant agrees.

    Raises:
        DecodeError: A header is not one of this protocol, a SPLIT header
            came where ``calls`` is None, or ``calls`` refused a call list.
        PeerRejectedError: A peer rejected its arguments.
        CollectiveMismatch: The headers disagree (op, dtype, shape, root,
            layout, sequence or group), or a peer relays such an error.
    """
    for r, w in headers.items():
        if int(w[0]) != MAGIC:
            raise DecodeError(
                f"group {name!r}, op {op}: rank {r} sent a header of another protocol "
                f"({int(w[0]):#x}); two different communicators share this gloo group's tags?",
                queue=name, peers=(r,),
            )
    failed = [r for r in sorted(headers) if int(headers[r][5]) not in (OK, SPLIT)]
    if int(headers[me][5]) != OK:
        return True
    if failed:
        r = failed[0]
        culprit = int(headers[r][6])
        if int(headers[r][5]) == REJECTED:
            raise PeerRejectedError(name, op, culprit, text(r))
        raise CollectiveMismatch(text(r), queue=name, peers=(culprit,))
    who = members or (lambda r: [r])
    classes: dict[tuple[int, ...], tuple[np.ndarray, list[int]]] = {}
    # OK headers first: a class is described by its first header, and a real one
    # knows the shape and dtype of the data, a SPLIT-derived one only its signature.
    for r in sorted(headers, key=lambda r: (int(headers[r][5]) == SPLIT, r)):
        for head, ranks in _calls_of(r, headers[r], who, calls):
            key = tuple(int(x) for x in head[_AGREE])
            classes.setdefault(key, (head, []))[1].extend(ranks)
    if len(classes) > 1:
        raise _mismatch(name, op, set(who(me)), list(classes.values()))
    return False  # one class: no SPLIT header (its calls are at least two classes)


def _calls_of(
    r: int,
    head: np.ndarray,
    who: Callable[[int], Sequence[int]],
    calls: Callable[[int], list[Call]] | None,
) -> list[tuple[np.ndarray, list[int]]]:
    """Participant ``r``'s calls as (a header describing the call, its group ranks)."""
    if int(head[5]) != SPLIT:
        return [(head, list(who(r)))]
    if calls is None:  # only node leaders send SPLIT, and only to leaders
        raise DecodeError(f"rank {r} sent a SPLIT header where no participant speaks for "
                          f"other ranks", peers=(r,))
    return [(_call_header(head, a, b), ranks) for a, b, ranks in calls(r)]


def _call_header(head: np.ndarray, a: int, b: int) -> np.ndarray:
    """A header describing the call signed ``(a, b)`` (words 3-4 of a shared-memory
    step): the dtype comes from the signature, the shape from a shape key."""
    h: np.ndarray = head.copy()
    h[3], h[4], h[5], h[6], h[7] = a, b, OK, -1, -1
    h[8], h[9] = (a >> 8) & 0xFF, -1
    shape = shape_of_key(b) if KIND_NAMES.get(a & 0xFF) in SHAPE_KEYED_KINDS else None
    if shape is not None and len(shape) <= _DIMS:
        h[9] = len(shape)
        h[_DIM0 : _DIM0 + len(shape)] = shape
    return h


def _mismatch(
    name: str,
    op: str,
    mine: set[int],
    classes: list[tuple[np.ndarray, list[int]]],
) -> CollectiveMismatch:
    """The error naming who called what, the largest agreeing class last (ties:
    this rank's class if it is among the largest, else the lowest rank's)."""
    classes = [(h, sorted(ranks)) for h, ranks in classes]
    classes.sort(key=lambda c: (-len(c[1]), not mine & set(c[1]), c[1][0]))
    lines = []
    for head, ranks in classes:
        label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        lines.append(f"{label} called {describe(head)}")
    culprits = sorted(x for _, ranks in classes[1:] for x in ranks)
    hint = _hint(classes[0][0], classes[1][0])
    return CollectiveMismatch(
        f"group {name!r}, op {op}: the ranks' calls do not match: {'; '.join(lines[1:])}; "
        f"but {lines[0]}{hint}. Every rank must make the same calls in the same order "
        f"with the same op, dtype, shape, layout and root. Nothing was exchanged and the "
        f"group stays usable.",
        queue=name, peers=culprits,
    )


def _hint(a: np.ndarray, b: np.ndarray) -> str:
    """What differs between two headers when their descriptions look alike."""
    if int(a[1]) != int(b[1]):
        return " (on a different communicator of the same gloo group)"
    if int(a[2]) != int(b[2]):
        return (" (at a different call number: a call failed on some rank without reaching "
                "its peers)")
    if (int(a[3]) == int(b[3]) and int(a[4]) != int(b[4]) and int(a[9]) >= 0
            and int(b[9]) >= 0 and describe(a) == describe(b)):
        return " (same shape, different layout arguments: dim, sizes or split dims)"
    return ""

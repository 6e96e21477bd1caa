"""Reading a directory of flight-recorder dumps: who fell behind, where the ranks
first disagreed, and which ranks did not do what the others did.

This is what ``groupcoord trace DIR`` prints (:mod:`coordinator.trace.cli`).
The dumps are those of :mod:`coordinator.trace.dump` (PyTorch's flight-recorder
format plus groupcoord's fields); PyTorch's own gloo and NCCL dumps load too.

Loading
-------
:func:`find_dumps` picks the files ``<prefix><rank>`` of a directory (its top
level; hidden files, such as the ``.groupcoord_trace.*`` temporaries of a dump
being written, are skipped). Without a prefix it is inferred as PyTorch's
loader does: the name before the trailing digits, which every candidate file
must share.

A dump is a pickle, and a pickle can run code. :func:`load_dump` reads one
with :class:`PlainDataUnpickler`: the pure-Python unpickler restricted to the
opcodes that build plain data (None, bool, int, float, str, bytes, list, tuple,
dict, memo references). Every opcode that imports, calls or builds an object
(``GLOBAL``/``STACK_GLOBAL`` reach :meth:`~PlainDataUnpickler.find_class`,
which refuses every global; ``REDUCE``, ``BUILD``, ``INST``, ``OBJ``,
``NEWOBJ``, extensions, persistent ids, sets and out-of-band buffers are
refused outright) raises :class:`~shm_broadcast.errors.DecodeError` before it
acts, so nothing in a dump runs. Dict keys must be strings, whose hashes are
randomised, so keys chosen to collide cannot make reading quadratic. The file
size is checked against ``max_bytes`` before anything is read, and a length
declared inside the pickle never allocates more than the bytes present.
The result is then checked field by field (:class:`_Fields`): every field the
analysis reads must have its type, and the walk over the data is bounded by a
budget proportional to the file size, so shared references cannot turn a
small file into an unbounded walk. Every refusal is a ``DecodeError`` naming
the file and the field.

Analysis
--------
Calls are grouped by process group, keyed by the group's name *and* its
member ranks (two processes' ``tp:0`` groups are different groups when their
members differ). Per group, :func:`analyze_dumps` reports:

* **progress**: each rank's window of collective sequence numbers (the ring
  keeps only the newest calls, so the oldest sequence number held differs
  between ranks), its last call and that call's state; the ranks **behind**
  the furthest one, by how much, and whether a rank dumped before the others
  even created its next call (then it may just have dumped early);
* **first mismatch**: the lowest sequence number, among those every rank still
  holds, at which ranks' calls differ in op, sizes, dtypes, root (``root``:
  a broadcast's or scatter's ``src``, a reduce's or gather's ``dst``) or
  reduce op (``reduce_op``), or at which the calls recorded agree but a rank's
  failed with ``CollectiveMismatch`` (the ranks disagree on something the
  dumps do not hold: a ``broadcast_object``'s source, say). Sizes are the
  true ones (``true_input_sizes``), except on the side of a call whose rows
  legitimately differ by rank (``rows_vary``; in a dump without it, any call
  that shows negative rows) and on a side some rank's call at that number
  has no true sizes for (a variable-size call still running has no output
  yet): there PyTorch's view, rows as a negative count, is compared; rooted
  calls compare only what all ranks share (``scatter``: the output,
  ``gather``: the input). The **culprits** are the ranks whose call
  differs from the most common one; on a tie there is no majority and every
  rank at that sequence number is named (``tie``); when the calls recorded
  agree (``undetermined``) the ranks whose call raised ``CollectiveMismatch``
  are named. A rank without a call at that sequence number stopped earlier:
  it is behind, never a culprit;
* **latency** per op: count, p50, p90, p99 and max of ``duration_ms`` over
  completed calls (nearest-rank percentiles), all ranks together;
* **in flight**: per rank, calls started or scheduled but not completed when
  the dump was taken, the oldest with its age at dump time (what a hang looks
  like);
* **point-to-point**: sends and receives paired per (source, destination) in
  their order; the unmatched ones, and pairs whose sizes or dtypes differ.
  Pairs are aligned only when neither side's ring dropped calls.

A group is ``ok`` with no mismatch, nobody behind and no point-to-point pair
that disagrees.

Result
------
:func:`analyze` returns plain data (JSON-able, string keys only)::

    {"directory": str, "prefix": str, "ok": bool, "warnings": [str],
     "dumps": [{"rank", "path", "version", "reason", "host", "pid", "entries",
                "wrapped", "first_record_id", "monotonic_ns", "wall_ns"}],
     "groups": [{
        "name": str, "desc": str, "ranks": [int], "ranks_known": bool,
        "ok": bool, "missing_dumps": [int], "max_seq": int | None,
        "dump_spread_ms": float | None,
        "progress": [{"rank", "first_seq", "last_seq", "last_op", "last_state",
                      "calls", "wrapped"}],
        "behind": [{"rank", "last_seq", "by", "dumped_early"}],
        "first_mismatch": None | {
            "seq": int, "culprits": [int], "tie": bool, "undetermined": bool,
            "majority": None | {"op", "input_sizes", "input_dtypes",
                                "output_sizes", "output_dtypes", "root",
                                "reduce_op"},
            "calls": [{"rank", "op", "input_sizes", "input_dtypes",
                       "output_sizes", "output_dtypes", "root", "reduce_op",
                       "state", "error", "transport", "coalesced"}],
            "behind": [int], "absent": [int]},
        "latency": [{"op", "count", "p50_ms", "p90_ms", "p99_ms", "max_ms"}],
        "in_flight": [{"rank", "count", "oldest": {"op", "seq", "p2p_seq", "state",
                       "peer", "record_id", "age_ms"}}],
        "p2p": [{"src", "dst", "sends", "recvs", "aligned", "matched",
                 "unmatched_sends": [{"p2p_seq", "op", "state"}],
                 "unmatched_recvs": [...], "mismatches": [{"send_p2p_seq",
                 "recv_p2p_seq", "send_sizes", "recv_sizes", "send_dtypes",
                 "recv_dtypes"}]}]}]}

Ranks are global ranks (the number in a dump's file name). In the mismatch,
sizes and dtypes are the values compared (None: not compared for that op);
``root`` (a group rank) and ``reduce_op`` are None for calls without them
and in dumps that do not record them (PyTorch's).
"""

from __future__ import annotations

import io
import math
import os
import pickle
import pickletools
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NoReturn

from shm_broadcast.errors import DecodeError

#: The largest int a float holds without overflowing (``sys.float_info.max``, as an int).
_FLOAT_INT_MAX = int(sys.float_info.max)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "Call",
    "Dump",
    "PlainDataUnpickler",
    "analyze",
    "analyze_dumps",
    "find_dumps",
    "load_dir",
    "load_dump",
]

#: Largest dump file read (256 MiB); ``max_bytes`` / ``--max-mib`` change it.
DEFAULT_MAX_BYTES = 256 << 20

#: Elements the field check may visit per byte of the file (shared references
#: let a pickle name one list many times; a real dump visits each about once).
_BUDGET_PER_BYTE = 16
#: Longest string a field may hold.
_MAX_STR = 4096
#: Ints outside [-2**63, 2**63) are refused (every field is a C++ int64).
_INT_LIMIT = 1 << 63

Sizes = tuple[tuple[int, ...], ...]


# --------------------------------------------------------------------------
# Plain-data unpickling


def _refuser(code: int) -> Callable[[Any], None]:
    name = _OPCODE_NAMES.get(code, f"0x{code:02x}")

    def refuse(self: Any) -> None:
        raise DecodeError(f"trace dump {self.path}: pickle opcode {name} refused: a dump "
                          "holds only plain data (it would build or call an object)")

    return refuse


def _load_setitem(self: Any) -> None:
    stack = self.stack
    value = stack.pop()
    key = stack.pop()
    self.check_key(key)
    stack[-1][key] = value


def _load_setitems(self: Any) -> None:
    items = self.pop_mark()
    target = self.stack[-1]
    for i in range(0, len(items), 2):
        self.check_key(items[i])
        target[items[i]] = items[i + 1]


def _load_dict(self: Any) -> None:
    items = self.pop_mark()
    d = {}
    for i in range(0, len(items), 2):
        self.check_key(items[i])
        d[items[i]] = items[i + 1]
    self.append(d)


_OPCODE_NAMES = {ord(op.code): op.name for op in pickletools.opcodes}
_PLAIN_OPCODES = (
    pickle.PROTO, pickle.FRAME, pickle.STOP, pickle.MARK, pickle.POP, pickle.POP_MARK,
    pickle.DUP, pickle.NONE, pickle.NEWTRUE, pickle.NEWFALSE, pickle.INT, pickle.BININT,
    pickle.BININT1, pickle.BININT2, pickle.LONG, pickle.LONG1, pickle.LONG4, pickle.FLOAT,
    pickle.BINFLOAT, pickle.STRING, pickle.BINSTRING, pickle.SHORT_BINSTRING, pickle.UNICODE,
    pickle.BINUNICODE, pickle.SHORT_BINUNICODE, pickle.BINUNICODE8, pickle.BINBYTES,
    pickle.SHORT_BINBYTES, pickle.BINBYTES8, pickle.EMPTY_LIST, pickle.APPEND, pickle.APPENDS,
    pickle.LIST, pickle.EMPTY_TUPLE, pickle.TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3,
    pickle.EMPTY_DICT, pickle.GET, pickle.BINGET, pickle.LONG_BINGET, pickle.PUT,
    pickle.BINPUT, pickle.LONG_BINPUT, pickle.MEMOIZE,
    # These two name a global: they reach find_class, which refuses it by name.
    pickle.GLOBAL, pickle.STACK_GLOBAL,
)


def _plain_dispatch() -> dict[int, Callable[[Any], None]]:
    base = pickle._Unpickler.dispatch  # noqa: SLF001 - the pure-Python unpickler's opcode table
    table: dict[int, Callable[[Any], None]] = {code: _refuser(code) for code in range(256)}
    for op in _PLAIN_OPCODES:
        table[op[0]] = base[op[0]]
    table[pickle.SETITEM[0]] = _load_setitem
    table[pickle.SETITEMS[0]] = _load_setitems
    table[pickle.DICT[0]] = _load_dict
    return table


class PlainDataUnpickler(pickle._Unpickler):  # noqa: SLF001 - its opcode table is restricted
    """An unpickler that builds plain data only (see the module docstring).

    Args:
        data: The pickle's bytes.
        path: The file they came from, named in every error.
    """

    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = _plain_dispatch()

    def __init__(self, data: bytes, path: str) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self.path = path

    def find_class(self, module: str, name: str) -> NoReturn:
        """Refuse every global: a dump never names a class or a function."""
        raise DecodeError(f"trace dump {self.path}: pickle refers to the global "
                          f"{_short(f'{module}.{name}')}: refused (a dump holds only plain "
                          "data, never a class or a function)")

    def persistent_load(self, pid: Any) -> NoReturn:
        """Refuse persistent ids (never reached: their opcodes are refused)."""
        raise DecodeError(f"trace dump {self.path}: pickle persistent id refused")

    def check_key(self, key: Any) -> None:
        """Dict keys must be str (see the module docstring)."""
        if not isinstance(key, str):
            raise DecodeError(f"trace dump {self.path}: a dict key is {_describe(key)}; a dump's "
                              "dict keys are strings")

    @classmethod
    def loads(cls, data: bytes, path: str) -> Any:
        """Unpickle ``data``; any malformed or refused input raises DecodeError."""
        try:
            return cls(data, path).load()
        except DecodeError:
            raise
        except Exception as e:  # every way a malformed pickle fails reads as one error
            raise DecodeError(f"trace dump {path}: not a readable pickle: "
                              f"{type(e).__name__}: {_short(str(e))}") from None


# --------------------------------------------------------------------------
# The dumps, checked field by field


@dataclass(frozen=True)
class Call:
    """One recorded call of one rank, as the analysis reads it.

    ``input_sizes``/``output_sizes`` are PyTorch's view (negative rows for
    variable-size calls); ``true_*`` are groupcoord's real sizes (None in
    PyTorch's own dumps). ``peer`` is the group rank of a point-to-point call's
    peer (None when unknown).
    """

    group: str
    desc: str
    record_id: int
    seq: int
    p2p_seq: int
    is_p2p: bool
    kind: str
    op: str
    peer: int | None
    input_sizes: Sizes
    input_dtypes: tuple[str, ...]
    output_sizes: Sizes
    output_dtypes: tuple[str, ...]
    true_input_sizes: Sizes | None
    true_output_sizes: Sizes | None
    rows_vary: tuple[bool, bool] | None
    state: str
    retired: bool | None
    error: str | None
    transport: str | None
    duration_ms: float | None
    created_wall_ns: int | None
    created_monotonic_ns: int | None
    has_op: bool
    root: int | None = None
    reduce_op: str | None = None


@dataclass
class Dump:
    """One rank's dump: its groups (name -> (desc, member ranks or None)) and calls."""

    rank: int
    path: str
    version: str
    groups: dict[str, tuple[str, tuple[int, ...] | None]]
    calls: list[Call]
    reason: str | None = None
    host: str | None = None
    pid: int | None = None
    claimed_rank: int | None = None
    monotonic_ns: int | None = None
    wall_ns: int | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def wrapped(self) -> bool:
        """Whether the ring dropped calls (record ids start at 0 in every process)."""
        return bool(self.calls) and self.calls[0].record_id > 0


class _Fields:
    """Checks one dump's unpickled data, naming the file and the field in every error."""

    def __init__(self, path: str, budget: int) -> None:
        self.path = path
        self.budget = budget

    def fail(self, where: str, expected: str, value: Any) -> NoReturn:
        raise DecodeError(f"trace dump {self.path}: {where}: expected {expected}, "
                          f"got {_describe(value)}")

    def missing(self, where: str) -> NoReturn:
        raise DecodeError(f"trace dump {self.path}: {where}: missing (every dump has it)")

    def spend(self, n: int, where: str) -> None:
        self.budget -= n
        if self.budget < 0:
            raise DecodeError(f"trace dump {self.path}: {where}: more data than the file's size "
                              "allows (a pickle naming the same objects over and over?)")

    def dict_(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(where, "a dict", value)
        self.spend(len(value) + 1, where)
        return value

    def list_(self, value: Any, where: str) -> list[Any] | tuple[Any, ...]:
        if not isinstance(value, list | tuple):
            self.fail(where, "a list", value)
        self.spend(len(value) + 1, where)
        return value

    def str_(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or len(value) > _MAX_STR:
            self.fail(where, f"a str of at most {_MAX_STR} characters", value)
        return value

    def opt_str(self, value: Any, where: str) -> str | None:
        return None if value is None else self.str_(value, where)

    def int_(self, value: Any, where: str) -> int:
        if (not isinstance(value, int) or isinstance(value, bool)
                or not -_INT_LIMIT <= value < _INT_LIMIT):
            self.fail(where, "an int64", value)
        return value

    def opt_int(self, value: Any, where: str) -> int | None:
        return None if value is None else self.int_(value, where)

    def opt_bool(self, value: Any, where: str) -> bool | None:
        if value is not None and not isinstance(value, bool):
            self.fail(where, "a bool", value)
        return value

    def opt_float(self, value: Any, where: str) -> float | None:
        if value is None:
            return None
        if not isinstance(value, int | float) or isinstance(value, bool):
            self.fail(where, "a finite number", value)
        if isinstance(value, int) and not -_FLOAT_INT_MAX <= value <= _FLOAT_INT_MAX:
            self.fail(where, "a finite number", value)  # float() of it would overflow
        if not math.isfinite(value):
            self.fail(where, "a finite number", value)
        return float(value)

    def sizes(self, value: Any, where: str) -> Sizes:
        shapes = self.list_(value, where)
        out = []
        for i, shape in enumerate(shapes):
            dims = self.list_(shape, f"{where}[{i}]")
            if not all(type(d) is int and -_INT_LIMIT <= d < _INT_LIMIT for d in dims):
                for d in dims:  # name the offending dimension
                    self.int_(d, f"{where}[{i}]")
            out.append(tuple(dims))
        return tuple(out)

    def opt_sizes(self, value: Any, where: str) -> Sizes | None:
        return None if value is None else self.sizes(value, where)

    def dtypes(self, value: Any, where: str) -> tuple[str, ...]:
        items = self.list_(value, where)
        if not all(type(d) is str and len(d) <= _MAX_STR for d in items):
            for i, d in enumerate(items):  # name the offending one
                self.str_(d, f"{where}[{i}]")
        return tuple(items)

    def ranks(self, value: Any, where: str) -> tuple[int, ...]:
        """A member list: PyTorch writes ``"[0, 1]"``; a list of ints is taken too."""
        if isinstance(value, str):
            if not _RANKS_LITERAL.fullmatch(value):
                self.fail(where, "a list literal of ranks such as '[0, 1]'", value)
            self.spend(len(value), where)
            inner = value.strip()[1:-1].strip()
            ranks = tuple(int(r) for r in inner.split(",")) if inner else ()
        else:
            ranks = tuple(self.int_(r, where) for r in self.list_(value, where))
        if any(r < 0 for r in ranks) or len(set(ranks)) != len(ranks):
            self.fail(where, "distinct ranks >= 0", value)
        return ranks


_DIGITS = "0123456789"
_RANKS_LITERAL = re.compile(r"\s*\[\s*(?:\d{1,18}\s*(?:,\s*\d{1,18}\s*)*)?\]\s*")
_P2P_NAME = re.compile(r"(\d{1,18})(->|<-)(\d{1,18})")


def _parse(path: str, rank: int, raw: Any, budget: int) -> Dump:
    """Check ``raw`` (an unpickled dump) and read it into a :class:`Dump`."""
    f = _Fields(path, budget)
    top = f.dict_(raw, "the dump")
    if "version" not in top:
        f.missing("version")
    version = f.str_(top["version"], "version")
    dump = Dump(rank=rank, path=path, version=version, groups={}, calls=[])
    if not version.startswith("2."):
        dump.warnings.append(f"{path}: dump format version {version!r}; this reader knows 2.x")
    pg_config = f.dict_(top.get("pg_config", {}), "pg_config")
    for name, cfg in pg_config.items():
        where = f"pg_config[{_short(name)!r}]"
        f.str_(name, f"{where} (its name)")
        cfg = f.dict_(cfg, where)
        desc = f.str_(cfg.get("desc", ""), f"{where}.desc")
        members = f.ranks(cfg.get("ranks", "[]"), f"{where}.ranks")
        dump.groups[name] = (desc, members or None)
    for i, e in enumerate(f.list_(top.get("entries", []), "entries")):
        dump.calls.append(_call(f, f.dict_(e, f"entries[{i}]"), f"entries[{i}]"))
    dump.calls.sort(key=lambda c: c.record_id)
    meta = top.get("groupcoord")
    if meta is not None:
        meta = f.dict_(meta, "groupcoord")
        dump.reason = f.opt_str(meta.get("reason"), "groupcoord.reason")
        dump.host = f.opt_str(meta.get("host"), "groupcoord.host")
        dump.pid = f.opt_int(meta.get("pid"), "groupcoord.pid")
        dump.claimed_rank = f.opt_int(meta.get("rank"), "groupcoord.rank")
        dump.monotonic_ns = f.opt_int(meta.get("monotonic_ns"), "groupcoord.monotonic_ns")
        dump.wall_ns = f.opt_int(meta.get("wall_ns"), "groupcoord.wall_ns")
        if dump.claimed_rank is not None and dump.claimed_rank != rank:
            dump.warnings.append(f"{path}: the file name says rank {rank}, the dump says "
                                 f"{dump.claimed_rank}; the file name is used")
    return dump


_REQUIRED = ("record_id", "process_group", "collective_seq_id", "profiling_name", "state")


def _call(f: _Fields, e: dict[str, Any], where: str) -> Call:
    """One entry (PyTorch's fields, groupcoord's when present) as a :class:`Call`."""
    for key in _REQUIRED:
        if key not in e:
            f.missing(f"{where}.{key}")
    pg = f.list_(e["process_group"], f"{where}.process_group")
    if len(pg) != 2:
        f.fail(f"{where}.process_group", "(name, desc)", pg)
    group = f.str_(pg[0], f"{where}.process_group[0]")
    desc = f.str_(pg[1], f"{where}.process_group[1]")
    profiling = f.str_(e["profiling_name"], f"{where}.profiling_name")
    _backend, _, rest = profiling.partition(":")
    kind, _, meta = (rest or profiling).partition(" ")
    is_p2p = f.opt_bool(e.get("is_p2p"), f"{where}.is_p2p")
    if is_p2p is None:
        is_p2p = kind in ("send", "recv")
    op = f.opt_str(e.get("op"), f"{where}.op")
    m = _P2P_NAME.fullmatch(meta)  # "send me->peer", "recv me<-peer" (group ranks)
    peer: int | None
    if m is not None:
        peer = int(m.group(3))
    else:
        peer = f.opt_int(e.get("peer"), f"{where}.peer") if is_p2p else None
    return Call(
        group=group, desc=desc,
        record_id=f.int_(e["record_id"], f"{where}.record_id"),
        seq=f.int_(e["collective_seq_id"], f"{where}.collective_seq_id"),
        p2p_seq=f.int_(e.get("p2p_seq_id", 0), f"{where}.p2p_seq_id"),
        is_p2p=is_p2p, kind=kind, op=op or kind, peer=peer,
        input_sizes=f.sizes(e.get("input_sizes", []), f"{where}.input_sizes"),
        input_dtypes=f.dtypes(e.get("input_dtypes", []), f"{where}.input_dtypes"),
        output_sizes=f.sizes(e.get("output_sizes", []), f"{where}.output_sizes"),
        output_dtypes=f.dtypes(e.get("output_dtypes", []), f"{where}.output_dtypes"),
        true_input_sizes=f.opt_sizes(e.get("true_input_sizes"), f"{where}.true_input_sizes"),
        true_output_sizes=f.opt_sizes(e.get("true_output_sizes"),
                                      f"{where}.true_output_sizes"),
        rows_vary=_rows_vary(f, e.get("rows_vary"), f"{where}.rows_vary"),
        state=f.str_(e["state"], f"{where}.state"),
        retired=f.opt_bool(e.get("retired"), f"{where}.retired"),
        error=f.opt_str(e.get("error"), f"{where}.error"),
        transport=f.opt_str(e.get("transport"), f"{where}.transport"),
        duration_ms=f.opt_float(e.get("duration_ms"), f"{where}.duration_ms"),
        created_wall_ns=f.opt_int(e.get("time_created_ns"), f"{where}.time_created_ns"),
        created_monotonic_ns=f.opt_int(e.get("time_created_monotonic_ns"),
                                       f"{where}.time_created_monotonic_ns"),
        has_op=op is not None,
        root=f.opt_int(e.get("root"), f"{where}.root"),
        reduce_op=f.opt_str(e.get("reduce_op"), f"{where}.reduce_op"),
    )


def _rows_vary(f: _Fields, value: Any, where: str) -> tuple[bool, bool] | None:
    """``rows_vary``: ``[input, output]`` bools, or None where a dump has none."""
    if value is None:
        return None
    pair = f.list_(value, where)
    if len(pair) != 2 or not all(isinstance(v, bool) for v in pair):
        f.fail(where, "[bool, bool]", value)
    return bool(pair[0]), bool(pair[1])


def load_dump(path: str, rank: int, max_bytes: int = DEFAULT_MAX_BYTES) -> Dump:
    """Read and check one dump file (see the module docstring).

    Args:
        path: The file.
        rank: The global rank it belongs to (the number in its name).
        max_bytes: Larger files are refused before reading.

    Raises:
        DecodeError: The file is too large, not a plain-data pickle, or not a dump.
        OSError: It cannot be read.
    """
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be an int > 0, got {max_bytes!r}")
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > max_bytes:
            raise DecodeError(f"trace dump {path}: {size} bytes, more than the {max_bytes} "
                              "allowed (raise the limit with --max-mib)")
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise DecodeError(f"trace dump {path}: more than the {max_bytes} bytes allowed "
                          "(raise the limit with --max-mib)")
    raw = PlainDataUnpickler.loads(data, path)
    return _parse(path, rank, raw, _BUDGET_PER_BYTE * len(data) + 4096)


def find_dumps(directory: str, prefix: str | None = None) -> tuple[str, dict[int, str]]:
    """The dump files of ``directory``: (prefix, {global rank: path}).

    Args:
        directory: The directory (its top level only).
        prefix: The file names' prefix; None: inferred (see the module docstring).
            A path is reduced to its last component.

    Raises:
        FileNotFoundError: ``directory`` is not a directory.
        ValueError: No dump files, a prefix that cannot be inferred, or two files of
            one rank.
    """
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"trace directory {directory!r} is not a directory")
    names = sorted(e.name for e in os.scandir(directory)
                   if not e.name.startswith(".") and e.is_file())
    if prefix is not None:
        prefix = os.path.basename(prefix)
    else:
        candidates = {n.rstrip(_DIGITS) for n in names if n[-1:] and n[-1] in _DIGITS}
        if len(candidates) != 1:
            found = ", ".join(repr(c) for c in sorted(candidates)[:8]) or "none"
            raise ValueError(f"cannot infer the dump files' prefix in {directory!r} (names "
                             f"ending in a rank: {found}); pass --prefix")
        prefix = candidates.pop()
    files: dict[int, str] = {}
    for n in names:
        digits = n[len(prefix):]
        if not n.startswith(prefix) or not digits or digits.strip(_DIGITS):
            continue
        rank = int(digits)
        path = os.path.join(directory, n)
        if rank in files:
            raise ValueError(f"two dump files for rank {rank}: {files[rank]!r} and {path!r}")
        files[rank] = path
    if not files:
        raise ValueError(f"no dump files {prefix!r}<rank> in {directory!r}")
    return prefix, files


def load_dir(directory: str, prefix: str | None = None,
             max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[str, list[Dump]]:
    """Every dump of ``directory`` (:func:`find_dumps`, :func:`load_dump`), by rank."""
    prefix, files = find_dumps(directory, prefix)
    return prefix, [load_dump(files[r], r, max_bytes) for r in sorted(files)]


# --------------------------------------------------------------------------
# Analysis


def analyze(directory: str, prefix: str | None = None,
            max_bytes: int = DEFAULT_MAX_BYTES) -> dict[str, Any]:
    """Load ``directory``'s dumps and analyse them (see the module docstring).

    Raises:
        DecodeError: A dump is unreadable (the message names the file).
        FileNotFoundError, ValueError: See :func:`find_dumps`.
    """
    prefix, dumps = load_dir(directory, prefix, max_bytes)
    result = analyze_dumps(dumps)
    return {"directory": directory, "prefix": prefix, **result}


@dataclass
class _Group:
    name: str
    desc: str
    ranks: tuple[int, ...] | None
    calls: dict[int, list[Call]] = field(default_factory=dict)


def analyze_dumps(dumps: Sequence[Dump]) -> dict[str, Any]:
    """Analyse loaded dumps; the result is :func:`analyze`'s without the directory."""
    by_rank = {d.rank: d for d in dumps}
    warnings = [w for d in dumps for w in d.warnings]
    versions = sorted({d.version for d in dumps})
    if len(versions) > 1:
        warnings.append(f"dumps of different format versions: {versions}")
    groups = _collect_groups(dumps)
    reports = [_group_report(g, by_rank) for g in groups]
    for g in groups:
        if g.ranks is None:
            warnings.append(f"group {g.name!r}: no dump lists its members; taken as the "
                            "ranks that recorded calls in it")
    return {
        "ok": all(r["ok"] for r in reports),
        "warnings": warnings,
        "dumps": [_dump_report(d) for d in sorted(dumps, key=lambda d: d.rank)],
        "groups": reports,
    }


def _dump_report(d: Dump) -> dict[str, Any]:
    return {"rank": d.rank, "path": d.path, "version": d.version, "reason": d.reason,
            "host": d.host, "pid": d.pid, "entries": len(d.calls), "wrapped": d.wrapped,
            "first_record_id": d.calls[0].record_id if d.calls else None,
            "monotonic_ns": d.monotonic_ns, "wall_ns": d.wall_ns}


def _collect_groups(dumps: Iterable[Dump]) -> list[_Group]:
    """The groups of all dumps, keyed by name and members, each rank's calls in it."""
    groups: dict[tuple[str, tuple[int, ...] | None], _Group] = {}

    def group_of(d: Dump, name: str, desc: str) -> _Group:
        config_desc, members = d.groups.get(name, (desc, None))
        g = groups.get((name, members))
        if g is None:
            g = groups[(name, members)] = _Group(name, config_desc or desc, members)
        return g

    for d in dumps:
        for name, (desc, members) in d.groups.items():
            if members is not None and d.rank in members:
                group_of(d, name, desc).calls.setdefault(d.rank, [])
        for c in d.calls:
            group_of(d, c.group, c.desc).calls.setdefault(d.rank, []).append(c)
    ranks_with_dumps = {d.rank for d in dumps}
    for g in groups.values():  # a member that dumped holds the group, if only empty
        for r in g.ranks or ():
            if r in ranks_with_dumps:
                g.calls.setdefault(r, [])
    return sorted(groups.values(), key=lambda g: (g.name, g.ranks or ()))


def _group_report(g: _Group, by_rank: Mapping[int, Dump]) -> dict[str, Any]:
    members = list(g.ranks) if g.ranks is not None else sorted(g.calls)
    collectives: dict[int, dict[int, list[Call]]] = {}
    for r in sorted(g.calls):
        per_seq: dict[int, list[Call]] = {}
        for c in g.calls[r]:
            if not c.is_p2p:
                per_seq.setdefault(c.seq, []).append(c)
        collectives[r] = per_seq
    progress = [_progress(r, collectives[r], by_rank[r]) for r in sorted(collectives)]
    reached = [p["last_seq"] for p in progress if p["last_seq"] is not None]
    max_seq = max(reached) if reached else None
    behind = _behind(progress, max_seq, collectives, by_rank)
    mismatch = _first_mismatch(collectives, progress)
    p2p = _p2p(g, members, by_rank)
    walls = [w for r in g.calls if (w := by_rank[r].wall_ns) is not None]
    return {
        "name": g.name,
        "desc": g.desc,
        "ranks": members,
        "ranks_known": g.ranks is not None,
        "ok": mismatch is None and not behind and not any(p["mismatches"] for p in p2p),
        "missing_dumps": [r for r in members if r not in by_rank],
        "max_seq": max_seq,
        "dump_spread_ms": (max(walls) - min(walls)) / 1e6 if len(walls) > 1 else None,
        "progress": progress,
        "behind": behind,
        "first_mismatch": mismatch,
        "latency": _latency(c for calls in g.calls.values() for c in calls),
        "in_flight": _in_flight(g, by_rank),
        "p2p": p2p,
    }


def _progress(rank: int, per_seq: Mapping[int, list[Call]], dump: Dump) -> dict[str, Any]:
    if per_seq:
        last = max(per_seq)
        call = per_seq[last][-1]
        return {"rank": rank, "first_seq": min(per_seq), "last_seq": last, "last_op": call.op,
                "last_state": call.state, "calls": sum(map(len, per_seq.values())),
                "wrapped": dump.wrapped}
    # No collective held: none made, unless the ring dropped them.
    return {"rank": rank, "first_seq": None, "last_seq": None if dump.wrapped else 0,
            "last_op": None, "last_state": None, "calls": 0, "wrapped": dump.wrapped}


def _behind(progress: list[dict[str, Any]], max_seq: int | None,
            collectives: Mapping[int, Mapping[int, list[Call]]],
            by_rank: Mapping[int, Dump]) -> list[dict[str, Any]]:
    out = []
    for p in progress:
        last = p["last_seq"]
        if max_seq is None or last is None or last >= max_seq:
            continue
        # Did this rank dump before any other rank created its next call?
        nxt = [c.created_wall_ns for r, per_seq in collectives.items() if r != p["rank"]
               for c in per_seq.get(last + 1, ()) if c.created_wall_ns is not None]
        wall = by_rank[p["rank"]].wall_ns
        early = bool(nxt) and wall is not None and wall < min(nxt)
        out.append({"rank": p["rank"], "last_seq": last, "by": max_seq - last,
                    "dumped_early": early})
    return out


def _compared(call: Call, view_in: bool = False, view_out: bool = False) -> tuple[Any, ...]:
    """What must agree between ranks at one sequence number (see the module docstring);
    ``view_in``/``view_out``: compare PyTorch's view of that side, not the true
    sizes (a call at the same number lacks them)."""
    if call.rows_vary is not None:  # groupcoord says which side's rows differ by rank
        vary_in, vary_out = call.rows_vary
    else:
        vary_in = vary_out = any(d < 0 for s in call.input_sizes + call.output_sizes
                                 for d in s)
    in_sizes: Sizes | None = call.input_sizes
    out_sizes: Sizes | None = call.output_sizes
    if not (vary_in or view_in) and call.true_input_sizes is not None:
        in_sizes = call.true_input_sizes
    if not (vary_out or view_out) and call.true_output_sizes is not None:
        out_sizes = call.true_output_sizes
    in_dtypes: tuple[str, ...] | None = call.input_dtypes
    out_dtypes: tuple[str, ...] | None = call.output_dtypes
    if call.kind == "scatter" or (call.kind == "all_to_all" and not call.has_op):
        in_sizes = in_dtypes = None  # the source's alone (PyTorch's all_to_all: any split)
    if call.kind == "gather" or (call.kind == "all_to_all" and not call.has_op):
        out_sizes = out_dtypes = None  # the root's alone
    return call.op, in_sizes, in_dtypes, out_sizes, out_dtypes, call.root, call.reduce_op


def _signature_dict(sig: tuple[Any, ...]) -> dict[str, Any]:
    op, in_sizes, in_dtypes, out_sizes, out_dtypes, root, reduce_op = sig
    return {"op": op, "input_sizes": _lists(in_sizes), "input_dtypes": _lists(in_dtypes),
            "output_sizes": _lists(out_sizes), "output_dtypes": _lists(out_dtypes),
            "root": root, "reduce_op": reduce_op}


#: The error of a call whose ranks disagreed (the class name dumps record).
_MISMATCH_ERROR = "CollectiveMismatch"


def _lists(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_lists(v) for v in value]
    return value


def _first_mismatch(collectives: Mapping[int, Mapping[int, list[Call]]],
                    progress: list[dict[str, Any]]) -> dict[str, Any] | None:
    active = {r: per_seq for r, per_seq in collectives.items() if per_seq}
    if len(active) < 2:
        return None
    start = max(min(per_seq) for per_seq in active.values())  # every rank still holds it
    seqs = sorted({s for per_seq in active.values() for s in per_seq if s >= start})
    last = {p["rank"]: p["last_seq"] for p in progress}
    for s in seqs:
        present = {r: per_seq[s] for r, per_seq in active.items() if s in per_seq}
        if len(present) < 2:
            continue
        held = [c for calls in present.values() for c in calls]
        view_in = any(c.true_input_sizes is None for c in held)  # in flight, or PyTorch's
        view_out = any(c.true_output_sizes is None for c in held)
        sigs = {r: tuple(_compared(c, view_in, view_out) for c in calls)
                for r, calls in present.items()}
        counts = Counter(sigs.values())
        undetermined = False
        if len(counts) == 1:
            # Alike as recorded: a mismatch all the same when ranks raised one (they
            # disagree on what the dumps do not hold); those ranks are named.
            raised = sorted(r for r, calls in present.items()
                            if any(c.error == _MISMATCH_ERROR for c in calls))
            if not raised:
                continue
            undetermined = True
        top = max(counts.values())
        winners = [sig for sig, n in counts.items() if n == top]
        tie = len(winners) > 1
        majority = None if tie else winners[0]
        if undetermined:
            culprits = raised
        elif tie:
            culprits = sorted(present)
        else:
            culprits = sorted(r for r in present if sigs[r] != majority)
        return {
            "seq": s,
            "culprits": culprits,
            "tie": tie,
            "undetermined": undetermined,
            "majority": None if majority is None else _signature_dict(majority[0]),
            "calls": [{"rank": r, **_signature_dict(sigs[r][0]), "state": calls[0].state,
                       "error": next((c.error for c in calls if c.error), None),
                       "transport": calls[0].transport, "coalesced": len(calls)}
                      for r, calls in sorted(present.items())],
            "behind": sorted(r for r, v in last.items() if v is not None and v < s),
            "absent": sorted(r for r in collectives if r not in present
                             and (last[r] is None or last[r] >= s)),
        }
    return None


def _percentile(ordered: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of sorted, non-empty ``ordered``."""
    k = max(0, math.ceil(p / 100 * len(ordered)) - 1)
    return ordered[k]


def _latency(calls: Iterable[Call]) -> list[dict[str, Any]]:
    per_op: dict[str, list[float]] = {}
    for c in calls:
        if c.state == "completed" and c.duration_ms is not None and c.duration_ms >= 0:
            per_op.setdefault(c.op, []).append(c.duration_ms)
    out = []
    for op in sorted(per_op):
        ms = sorted(per_op[op])
        out.append({"op": op, "count": len(ms), "p50_ms": round(_percentile(ms, 50), 6),
                    "p90_ms": round(_percentile(ms, 90), 6),
                    "p99_ms": round(_percentile(ms, 99), 6), "max_ms": round(ms[-1], 6)})
    return out


def _in_flight(g: _Group, by_rank: Mapping[int, Dump]) -> list[dict[str, Any]]:
    out = []
    for r in sorted(g.calls):
        pending = [c for c in g.calls[r]
                   if c.state in ("scheduled", "started") and c.retired is not True]
        if not pending:
            continue
        oldest = min(pending, key=lambda c: c.record_id)
        dump = by_rank[r]
        age = None
        if dump.monotonic_ns is not None and oldest.created_monotonic_ns is not None:
            age = (dump.monotonic_ns - oldest.created_monotonic_ns) / 1e6
        elif dump.wall_ns is not None and oldest.created_wall_ns is not None:
            age = (dump.wall_ns - oldest.created_wall_ns) / 1e6
        out.append({"rank": r, "count": len(pending), "oldest": {
            "op": oldest.op, "seq": None if oldest.is_p2p else oldest.seq,
            "p2p_seq": oldest.p2p_seq if oldest.is_p2p else None, "state": oldest.state,
            "peer": oldest.peer if oldest.is_p2p else None, "record_id": oldest.record_id,
            "age_ms": age}})
    return out


def _p2p(g: _Group, members: Sequence[int],
         by_rank: Mapping[int, Dump]) -> list[dict[str, Any]]:
    """Sends and receives paired per (source, destination), global ranks."""
    def global_of(group_rank: int | None) -> int | None:
        if group_rank is None:
            return None
        if g.ranks is None:  # members unknown: group ranks are all we have
            return group_rank
        return g.ranks[group_rank] if 0 <= group_rank < len(g.ranks) else None

    sends: dict[tuple[int, int], list[Call]] = {}
    recvs: dict[tuple[int, int], list[Call]] = {}
    for r, calls in g.calls.items():
        for c in calls:
            if not c.is_p2p or c.kind not in ("send", "recv"):
                continue
            peer = global_of(c.peer)
            if peer is None:
                continue
            if c.kind == "send":
                sends.setdefault((r, peer), []).append(c)
            else:
                recvs.setdefault((peer, r), []).append(c)
    out = []
    for src, dst in sorted(set(sends) | set(recvs)):
        s = sorted(sends.get((src, dst), []), key=lambda c: (c.p2p_seq, c.record_id))
        v = sorted(recvs.get((src, dst), []), key=lambda c: (c.p2p_seq, c.record_id))
        both = src in by_rank and dst in by_rank
        aligned = both and not by_rank[src].wrapped and not by_rank[dst].wrapped
        matched = min(len(s), len(v))
        mismatches = []
        if aligned:
            for a, b in zip(s, v, strict=False):
                a_sizes = a.true_input_sizes if a.true_input_sizes is not None else a.input_sizes
                b_sizes = (b.true_output_sizes if b.true_output_sizes is not None
                           else b.output_sizes)
                sizes_differ = bool(a_sizes and b_sizes and a_sizes != b_sizes)
                dtypes_differ = bool(a.input_dtypes and b.output_dtypes
                                     and a.input_dtypes != b.output_dtypes)
                if sizes_differ or dtypes_differ:
                    mismatches.append({
                        "send_p2p_seq": a.p2p_seq, "recv_p2p_seq": b.p2p_seq,
                        "send_sizes": _lists(a_sizes), "recv_sizes": _lists(b_sizes),
                        "send_dtypes": list(a.input_dtypes), "recv_dtypes": list(b.output_dtypes),
                    })
        out.append({
            "src": src, "dst": dst, "sends": len(s), "recvs": len(v), "aligned": aligned,
            "matched": matched if aligned else None,
            "unmatched_sends": [_p2p_call(c) for c in s[matched:]] if aligned else [],
            "unmatched_recvs": [_p2p_call(c) for c in v[matched:]] if aligned else [],
            "mismatches": mismatches,
        })
    return out


def _p2p_call(c: Call) -> dict[str, Any]:
    return {"p2p_seq": c.p2p_seq, "op": c.op, "state": c.state}


# --------------------------------------------------------------------------
# Describing refused values without trusting them


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _describe(value: Any) -> str:
    """A short description of ``value`` (never a full repr: it may be huge or cyclic)."""
    if value is None:
        return "None"
    if isinstance(value, bool | float):
        return f"{type(value).__name__} {value!r}"
    if isinstance(value, int):
        return f"int {value}" if abs(value) < 1 << 64 else "an int beyond int64"
    if isinstance(value, str | bytes):
        return f"{type(value).__name__} {_short(repr(value[:100]))}"
    if isinstance(value, list | tuple | dict):
        return f"{type(value).__name__} of {len(value)} items"
    return type(value).__name__

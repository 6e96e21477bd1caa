"""``groupcoord trace DIR``: read a directory of flight-recorder dumps and say who
fell behind and where the ranks first disagreed.

Prints a table per group (each rank's sequence numbers, its last call, how far
it is behind, the first mismatch with its culprit ranks, latency percentiles,
calls still in flight, point-to-point pairs); ``--json`` prints
:func:`coordinator.trace.analysis.analyze`'s result instead.

Exit status: 0 when no group shows a disagreement and nobody is behind, 1 when
one does, 2 when the input cannot be read (the message names the file).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from coordinator.trace.analysis import DEFAULT_MAX_BYTES, analyze_dumps, load_dir

__all__ = ["add_args", "run", "render"]


#: The largest ``--max-mib``: 8 TiB, beyond any dump file and any read a process can make.
_MAX_MIB = 1 << 23


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int > 0, got {text!r}") from None
    if not 0 < value <= _MAX_MIB:
        raise argparse.ArgumentTypeError(f"expected an int in [1, {_MAX_MIB}], got {text!r}")
    return value


def add_args(p: argparse.ArgumentParser) -> None:
    """Add ``DIR``, ``--prefix``, ``--group``, ``--json`` and ``--max-mib``."""
    p.add_argument("dir", metavar="DIR", help="directory holding the dumps <prefix><rank>")
    p.add_argument("--prefix", default=None,
                   help="dump file name prefix (default: inferred, the name before the rank)")
    p.add_argument("--group", default=None, metavar="NAME",
                   help="only the groups with this name or description (e.g. tp:0 or tp)")
    p.add_argument("--json", action="store_true", help="print the analysis as JSON")
    p.add_argument("--max-mib", type=_positive_int, default=DEFAULT_MAX_BYTES >> 20,
                   help="refuse dump files larger than this (MiB, default %(default)s)")


def run(args: argparse.Namespace) -> int:
    """Analyse ``args.dir``; returns the exit status (see the module docstring)."""
    try:
        prefix, dumps = load_dir(args.dir, args.prefix, args.max_mib << 20)
    except (OSError, ValueError, OverflowError) as e:  # DecodeError is a ValueError
        print(f"groupcoord trace: error: {e}", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"directory": args.dir, "prefix": prefix, **analyze_dumps(dumps)}
    if args.group is not None:
        groups = [g for g in result["groups"] if args.group in (g["name"], g["desc"])]
        if not groups:
            names = sorted({g["name"] for g in result["groups"]})
            print(f"groupcoord trace: error: no group named {args.group!r} in the dumps "
                  f"(groups: {', '.join(names) or 'none'})", file=sys.stderr)
            return 2
        result["groups"] = groups
        result["ok"] = all(g["ok"] for g in groups)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(render(result))
    return 0 if result["ok"] else 1


# --------------------------------------------------------------------------
# The text report


def render(result: dict[str, Any]) -> str:
    """The text report of an :func:`~coordinator.trace.analysis.analyze` result."""
    lines = [f"groupcoord trace: {_clean(result['directory'])} (prefix "
             f"{_clean(result['prefix'])!r}, {len(result['dumps'])} dumps, ranks "
             f"{_ranks([d['rank'] for d in result['dumps']])})"]
    lines += [f"warning: {_clean(w)}" for w in result["warnings"]]
    for g in result["groups"]:
        lines.append("")
        lines += _group(g)
    lines.append("")
    lines.append("ok: no disagreement, nobody behind" if result["ok"]
                 else "NOT OK: see the groups above")
    return "\n".join(lines)


def _group(g: dict[str, Any]) -> list[str]:
    members = _ranks(g["ranks"]) + ("" if g["ranks_known"] else " (members not recorded)")
    status = []
    mm = g["first_mismatch"]
    if mm is not None:
        status.append(f"MISMATCH at seq {mm['seq']}, culprits {_ranks(mm['culprits'])}"
                      + (" (tie)" if mm["tie"] else "")
                      + (" (raised CollectiveMismatch; the calls recorded agree)"
                         if mm["undetermined"] else ""))
    if g["behind"]:
        status.append(f"BEHIND: {_ranks([b['rank'] for b in g['behind']])}")
    if any(p["mismatches"] for p in g["p2p"]):
        status.append("P2P MISMATCH")
    lines = [f"group {_clean(g['name'])} ({_clean(g['desc'])}) ranks {members}: "
             + ("; ".join(status) or "ok")]
    if g["missing_dumps"]:
        lines.append(f"  no dump from ranks {_ranks(g['missing_dumps'])}")
    if g["dump_spread_ms"] is not None and g["dump_spread_ms"] >= 1000:
        lines.append(f"  dumps taken {g['dump_spread_ms'] / 1000:.1f} s apart: a rank that "
                     "dumped earlier may look behind")
    behind = {b["rank"]: b for b in g["behind"]}
    flying = {f["rank"]: f for f in g["in_flight"]}
    rows = []
    for p in g["progress"]:
        r = p["rank"]
        window = "-" if p["first_seq"] is None else f"{p['first_seq']}-{p['last_seq']}"
        b = behind.get(r)
        lag = "-" if b is None else f"{b['by']}" + (" (dumped early)" if b["dumped_early"] else "")
        f = flying.get(r)
        oldest = "-" if f is None else _flight(f)
        rows.append([str(r), window + (" wrapped" if p["wrapped"] else ""),
                     _opt(p["last_seq"]), _clean(p["last_op"] or "-"),
                     _clean(p["last_state"] or "-"), lag, oldest])
    lines += _table(["rank", "seqs held", "last seq", "last op", "state", "behind",
                     "in flight (oldest)"], rows)
    if mm is not None:
        lines += _mismatch(mm)
    if g["latency"]:
        lines.append("  latency of completed calls (ms, all ranks):")
        lines += _table(["op", "count", "p50", "p90", "p99", "max"],
                        [[_clean(x["op"]), str(x["count"]), _ms(x["p50_ms"]), _ms(x["p90_ms"]),
                          _ms(x["p99_ms"]), _ms(x["max_ms"])] for x in g["latency"]],
                        indent="    ")
    for p in g["p2p"]:
        lines.append(_pair(p))
    return lines


def _mismatch(mm: dict[str, Any]) -> list[str]:
    present = len(mm["calls"])
    if mm["undetermined"]:
        head = (f"rank(s) {_ranks(mm['culprits'])} raised CollectiveMismatch at seq "
                f"{mm['seq']}, but the calls recorded agree: they differ in something the "
                "dumps do not hold (an object broadcast's source, say)")
    elif mm["tie"]:
        head = f"no majority among the {present} ranks at seq {mm['seq']} (tie)"
    else:
        head = (f"rank(s) {_ranks(mm['culprits'])} differ from the other "
                f"{present - len(mm['culprits'])} of {present} ranks at seq {mm['seq']}")
    lines = [f"  first mismatch: {head}"]
    culprits = set(mm["culprits"])
    rows = []
    for c in mm["calls"]:
        mark = ("<- culprit" if c["rank"] in culprits and not mm["tie"]
                and not mm["undetermined"] else "")
        rows.append([str(c["rank"]), _clean(c["op"]),
                     _sizes(c["input_sizes"], c["input_dtypes"]),
                     _sizes(c["output_sizes"], c["output_dtypes"]), _args(c),
                     _clean(c["state"]), _clean(c["error"] or "-"), mark])
    lines += _table(["rank", "op", "input", "output", "root/op", "state", "error", ""], rows,
                    indent="    ")
    if mm["behind"]:
        lines.append(f"    stopped before seq {mm['seq']} (behind, not culprits): "
                     f"{_ranks(mm['behind'])}")
    if mm["absent"]:
        lines.append(f"    no call recorded at seq {mm['seq']}: {_ranks(mm['absent'])}")
    return lines


def _args(c: dict[str, Any]) -> str:
    """A call's root and reduce op as the table shows them (``-``: neither)."""
    parts = []
    if c["root"] is not None:
        parts.append(f"root {c['root']}")
    if c["reduce_op"] is not None:
        parts.append(f"op {_clean(c['reduce_op'])}")
    return ", ".join(parts) or "-"


def _pair(p: dict[str, Any]) -> str:
    text = f"  p2p {p['src']}->{p['dst']}: {p['sends']} sends, {p['recvs']} recvs"
    if not p["aligned"]:
        return text + " (not paired: a side's ring dropped calls or has no dump)"
    text += f", {p['matched']} paired"
    if p["unmatched_sends"]:
        text += ", unmatched sends p2p_seq " + ", ".join(
            f"{u['p2p_seq']} ({_clean(u['state'])})" for u in p["unmatched_sends"])
    if p["unmatched_recvs"]:
        text += ", unmatched recvs p2p_seq " + ", ".join(
            f"{u['p2p_seq']} ({_clean(u['state'])})" for u in p["unmatched_recvs"])
    for m in p["mismatches"]:
        text += (f"\n    MISMATCH: send p2p_seq {m['send_p2p_seq']} "
                 f"{_sizes(m['send_sizes'], m['send_dtypes'])} vs recv p2p_seq "
                 f"{m['recv_p2p_seq']} {_sizes(m['recv_sizes'], m['recv_dtypes'])}")
    return text


def _flight(f: dict[str, Any]) -> str:
    o = f["oldest"]
    where = f"seq {o['seq']}" if o["seq"] is not None else f"p2p_seq {o['p2p_seq']}"
    age = "" if o["age_ms"] is None else f", {_ms(o['age_ms'])} ms old"
    more = f" (+{f['count'] - 1} more)" if f["count"] > 1 else ""
    return f"{_clean(o['op'])} {where} {_clean(o['state'])}{age}{more}"


def _table(headers: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    out = []
    for row in [headers, *rows]:
        out.append(indent + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
                   .rstrip())
    return out


def _sizes(sizes: Any, dtypes: Any) -> str:
    if sizes is None and dtypes is None:
        return "(not compared)"
    text = "[]" if not sizes else ",".join("[" + ",".join(map(str, s)) + "]" for s in sizes)
    if dtypes:
        text += " " + ",".join(_clean(d) for d in dtypes)
    return text


def _ranks(ranks: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, ranks)) + "]"


def _opt(value: Any) -> str:
    return "?" if value is None else str(value)


def _ms(value: float) -> str:
    return f"{value:.3f}"


def _clean(text: str) -> str:
    """``text`` from a dump, its control characters escaped (never sent raw to a terminal)."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                   for ch in str(text))

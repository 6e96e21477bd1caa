"""Tabulate the fault matrix's detection times (for docs/reliability.md).

Usage::

    GROUPCOORD_FAULT_TIMES=/tmp/times.jsonl \
        python -m pytest -m slow tests/faults/test_fault_matrix.py

    python -m tests.faults.times /tmp/times.jsonl

Each line of the file is one case: its spec and, per rank that raised in its
step, the seconds from the fault (the culprit's report, on the machine-wide
monotonic clock) to that rank's error. The table gives, per fault and
transport, the median and the maximum of those times, and per fault the
largest time beyond the group's timeout (negative: every error came before
the timeout; the contract allows up to 2 s).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict

FAULTS = ("kill", "stop", "raise", "skip", "other-op", "dtype", "shape")
TRANSPORTS = ("shm", "gloo", "hier")


def table(lines: list[str]) -> str:
    """The markdown table of the cases in ``lines`` (JSON, one case each)."""
    times: dict[tuple[str, str], list[float]] = defaultdict(list)
    beyond: dict[str, list[float]] = defaultdict(list)
    cases: dict[str, int] = defaultdict(int)
    for line in lines:
        case = json.loads(line)
        fault = case["fault"]
        cases[fault] += 1
        for t in case["detect_s"].values():
            times[(fault, case["transport"])].append(float(t))
            beyond[fault].append(float(t) - float(case["timeout"]))
    out = ["| fault | cases | errors | " + " | ".join(
               f"{t}: median / max (s)" for t in TRANSPORTS) + " | max beyond timeout (s) |",
           "|---|---:|---:|" + "---:|" * len(TRANSPORTS) + "---:|"]
    for fault in FAULTS:
        if not cases.get(fault):
            continue
        cells = []
        for t in TRANSPORTS:
            xs = times.get((fault, t), [])
            cells.append(f"{statistics.median(xs):.2f} / {max(xs):.2f}" if xs else "-")
        worst = max(beyond[fault]) if beyond[fault] else float("nan")
        out.append(f"| {fault} | {cases[fault]} | {len(beyond[fault])} | " + " | ".join(cells)
                   + f" | {worst:+.2f} |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    """Print the table of the file named in ``argv``."""
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        print(table([line for line in f if line.strip()]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

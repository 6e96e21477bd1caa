"""Tabulate the fault matrix's detection times (for docs/reliability.md).

Usage::

    GROUPCOORD_FAULT_TIMES=/tmp/times.jsonl python -m pytest -m "slow or not slow" tests/faults/test_fault_matrix.py
    python -m tests.faults.times /tmp/times.jsonl

Each line of the file is one case: its spec and, per rank that raised in its
step, the seconds from the fault (the culprit's report, on the machine-wide
monotonic clock) to that rank's error. The table gives, per fault and
transport, the number of such errors, their median and their maximum.
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
    cases: dict[tuple[str, str], int] = defaultdict(int)
    for line in lines:
        case = json.loads(line)
        key = (case["fault"], case["transport"])
        cases[key] += 1
        times[key].extend(float(t) for t in case["detect_s"].values())
    out = ["| fault | " + " | ".join(TRANSPORTS) + " |",
           "|---|" + "---|" * len(TRANSPORTS)]
    for fault in FAULTS:
        cells = []
        for t in TRANSPORTS:
            xs = times.get((fault, t), [])
            if not xs:
                cells.append("-")
                continue
            cells.append(f"{statistics.median(xs):.2f} / {max(xs):.2f} "
                         f"({len(xs)} errors, {cases[(fault, t)]} cases)")
        out.append(f"| {fault} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        print(table([line for line in f if line.strip()]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

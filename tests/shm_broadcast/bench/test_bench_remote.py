"""``groupcoord bench mq-remote`` runs end to end (no timing is asserted: numbers are noisy)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow  # CI time: `bench mq` covers the bench CLI, test_mq_processes remote readers
@pytest.mark.timeout(150)
def test_remote_bench_cli_measures_queue_and_baselines(tmp_path) -> None:
    out = tmp_path / "remote.json"
    res = subprocess.run([sys.executable, "-m", "coordinator", "bench", "mq-remote",
                          "--payloads", "256B", "4KB", "--iters", "40", "--threads", "1",
                          "--json", str(out)], capture_output=True, text=True, timeout=140)
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["results"]
    assert [(r["payload"], r["method"]) for r in rows] == [
        (p, m) for p in ("256B", "4KB")
        for m in ("groupcoord queue (CURVE)", "pickle + zmq TCP", "raw bytes zmq TCP")]
    assert all(0 < r["rt_p50_us"] <= r["rt_p99_us"] and r["rt_iters"] >= 40 for r in rows), rows
    assert all(r["x_vs_mq"] == 1.0 for r in rows if r["method"].startswith("groupcoord"))


def test_remote_bench_cli_rejects_bad_options(run_cli) -> None:
    code, out, _ = run_cli(["bench", "mq-remote", "--iters", "2"])
    assert code == 2 and "--iters" in out

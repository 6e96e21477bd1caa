"""`groupcoord bench mq` runs end to end (tiny settings) and its report is consistent."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shm_broadcast.bench.wake import bare_wake_latencies, wake_gaps

pytestmark = pytest.mark.timeout(240)


@pytest.mark.slow  # a 15 s CLI run; the queue's paths are covered by tests/shm_broadcast/queue
def test_bench_mq_cli_writes_a_consistent_report(tmp_path):

    out = tmp_path / "mq.json"
    proc = subprocess.run(
        [sys.executable, "-m", "coordinator", "bench", "mq", "--readers", "1",
         "--payloads", "256B", "4KB", "--seconds", "0.05", "--max-iters", "40",
         "--idle", "0.3", "--wake-samples", "3", "--json", str(out)],
        capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    methods = {r["method"] for r in report["results"]}
    assert len(methods) == 3, methods  # the queue and both baselines, same run
    for r in report["results"]:
        assert 5 <= r["rt_iters"] <= 40 and 0 < r["rt_p50_us"] <= r["rt_p99_us"]
        assert r["stream_msgs"] <= 40  # --max-iters caps every measurement
        assert r["msgs_per_s"] > 0
        if r["method"] != "shm_broadcast MessageQueue":
            assert r["x_vs_mq"] > 0
    (idle,) = report["idle"]
    assert 0 <= idle["idle_cpu_percent_max"] < 100
    assert idle["wake_samples"] == 4 and idle["wake_p50_us"] > 0
    assert idle["floor_wake_p50_us"] > 0 and idle["wake_x_floor"] > 0
    assert "wake-up floor" in proc.stdout and "p50 vs mq" in proc.stdout


def test_wake_floor_measures_every_gap():
    import multiprocessing as mp

    gaps = wake_gaps(4, 0.02, seed=3)
    assert gaps == wake_gaps(4, 0.02, seed=3) and all(0.016 <= g <= 0.024 for g in gaps)
    lat = bare_wake_latencies(mp.get_context("spawn"), gaps)
    assert len(lat) == 4 and lat == sorted(lat)
    assert all(0 < x < 1.0 for x in lat)

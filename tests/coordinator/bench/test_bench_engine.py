"""``groupcoord bench engine`` end to end: short runs through the real CLI (no
timing asserts), its report's structure, and its option errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.bench.report import distribution, summarize

_SHORT = ["--steps", "12", "--warmup-steps", "4", "--step-ms", "3", "--layers", "2",
          "--allreduce-bytes", "4K", "--meta-bytes", "600"]


def _bench(*args: str, timeout: float = 200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator", "bench", "engine", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,policies,load,plot", [
    pytest.param(2, ["predictive", "plain"], "process", True, marks=pytest.mark.slow),
    pytest.param(3, ["predictive", "spin"], "thread", False, marks=pytest.mark.slow),
], ids=["tp2-predictive-plain-process-load-plot", "tp3-predictive-spin-thread-load"])
def test_bench_engine_reports_every_rank_and_policy(tmp_path: Path, tp: int, policies: list[str],
                                                    load: str, plot: bool) -> None:
    out, png = tmp_path / "engine.json", tmp_path / "engine.png"
    extra = ["--plot", str(png)] if plot else []
    if plot:
        pytest.importorskip("matplotlib")
    proc = _bench(*_SHORT, "--tp", str(tp), "--policies", *policies, "--rounds", "2",
                  "--load", load, "--load-size", "64", "--json", str(out), *extra)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [(r["policy"], r["rank"]) for r in rows] == [
        (p, r) for p in policies for r in range(tp)]
    for r in rows:
        assert r["steps"] == 2 * 12  # two rounds of 12 recorded steps
        assert r["allreduce_us"]["n"] == 2 * 12 * 2  # two layers per step
        assert r["rank_cpu_percent"] >= 0
        if r["rank"] == 0:
            assert r["enqueue_us"]["n"] == 24 and r["arrival_us"]["n"] == 0
        else:
            a = r["arrival_us"]
            assert a["n"] == 24 and 0 < a["p50"] <= a["p90"] <= a["p99"] <= a["max"]
            assert 0 <= r["wait_cpu_percent"] <= 100
            if r["policy"] == "predictive":
                assert "planned" in r["queue_wait_stats"]
    assert report["meta"]["config"]["load"] == load
    assert "arrival p50/p90/p99" in proc.stdout and "wait CPU" in proc.stdout
    if plot:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"wrote {png}" in proc.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,needle", [
    (["--tp", "1"], "--tp must be >= 2"),
    (["--tp", "0"], "--tp"),
    (["--step-ms", "-1"], "--step-ms"),
    (["--allreduce-bytes", "lots"], "--allreduce-bytes"),
    (["--threads", "0"], "--threads"),
    (["--policies", "fastest"], "--policies"),
    (["--load", "gpu"], "--load"),
    (["--warmup-steps", "-3"], "--warmup-steps"),
    (["--threads", "1025"], "argument --threads: expected 'default' or an int from 1 to 1024"),
    (["--threads", "99999999999999999999"], "argument --threads"),
], ids=["tp-1", "tp-0", "negative-step", "bad-size", "zero-threads", "bad-policy", "bad-load",
        "negative-warmup", "threads-1025", "threads-20-digits"])
def test_bench_engine_rejects_bad_options(capsys: pytest.CaptureFixture, args: list[str],
                                          needle: str) -> None:
    from coordinator.cli import main

    try:
        code = main(["bench", "engine", *args])
    except SystemExit as e:  # argparse's own option errors
        code = e.code
    assert code == 2
    assert needle in capsys.readouterr().err


def test_summaries_pool_blocks_per_policy_and_rank() -> None:
    def block(policy: str, arrival: list[int], enq: list[int]) -> dict:
        return {"policy": policy, "arrival_ns": arrival, "enqueue_ns": enq,
                "allreduce_ns": [1000, 3000], "wait_cpu_ns": 500 * len(arrival),
                "wait_wall_ns": 10_000 * len(arrival), "late_starts": 0, "cpu_s": 0.1,
                "wall_s": 1.0, "queue_stats": {"parks": 1}}
    per_rank = [
        {"rank": 0, "blocks": [block("a", [], [5000, 7000]), block("b", [], [1000]),
                               block("a", [], [6000])]},
        {"rank": 1, "blocks": [block("a", [2000, 4000], []), block("b", [9000], []),
                               block("a", [3000], [])]},
    ]
    rows = summarize(per_rank)
    assert [(r["policy"], r["rank"]) for r in rows] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    a1 = rows[1]
    assert a1["arrival_us"] == distribution([2000, 4000, 3000]) and a1["steps"] == 3
    assert a1["arrival_us"]["p50"] == 3.0 and a1["arrival_us"]["max"] == 4.0
    assert a1["wait_cpu_us_per_step"] == 0.5 and a1["wait_cpu_percent"] == 5.0
    assert a1["queue_wait_stats"] == {"parks": 2} and a1["rank_cpu_percent"] == pytest.approx(10.0)
    assert rows[0]["enqueue_us"]["n"] == 3 and rows[0]["steps"] == 3

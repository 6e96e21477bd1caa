"""``groupcoord bench mq-remote`` runs end to end (no timing is asserted: numbers are noisy)."""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys
import time

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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,needle", [
    (["--iters", "2"], "argument --iters: expected an int >= 4"),
    (["--threads", "-1"], "argument --threads: expected an int >= 0 and <= 1024"),
    (["--threads", "1025"], "argument --threads: expected an int >= 0 and <= 1024"),
    (["--threads", "99999999999999999999"], "argument --threads"),
], ids=["iters-2", "threads-negative", "threads-1025", "threads-20-digits"])
def test_remote_bench_cli_rejects_bad_options(run_cli, args: list[str], needle: str) -> None:
    """An option error on stderr, exit 2, before any echo process starts."""
    code, out, err = run_cli(["bench", "mq-remote", *args])
    assert code == 2 and out == "" and needle in err, (code, out, err)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("echo", [
    "queue", "zmq-pickle",
    # the same ZmqEcho start and wait as zmq-pickle (only the payload codec differs)
    pytest.param("zmq-raw", marks=pytest.mark.slow)])
def test_an_echo_process_that_dies_is_reported_at_once(echo: str) -> None:
    """An echo process that dies before it answers (here: torch refuses its thread
    count) is reported with its exit status, without waiting out the 60 s start."""
    from shm_broadcast.bench.remote import QueueEcho, ZmqEcho

    ctx = mp.get_context("spawn")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"echo process exited \(exit status 1\)"):
        if echo == "queue":
            QueueEcho(ctx, 10**20)
        else:
            ZmqEcho(ctx, 10**20, use_pickle=echo == "zmq-pickle")
    assert time.monotonic() - t0 < 40

"""``groupcoord bench p2p`` end to end through the real CLI (no timing asserts):
every call kind, size and thread setting reported for each of its transports,
and option errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow  # an 11 s run of the CLI: CI time on the 2-core VM
@pytest.mark.timeout(240)
def test_bench_p2p_reports_every_transport_per_call_and_size(tmp_path: Path) -> None:
    out = tmp_path / "p2p.json"
    proc = subprocess.run(
        [sys.executable, "-m", "coordinator", "bench", "p2p", "--sizes", "4K", "3M", "4K",
         "--threads", "2", "--iters", "3", "--rounds", "2", "--dtype", "float32",
         "--calls", "tensor", "dict", "--json", str(out)],
        capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["call"], r["threads"], r["size"]) for r in rows] == [
        (c, 2, s) for c in ("tensor", "dict") for s in (4096, 3 << 20)]
    for r in rows:
        transports = ("link", "cpu-group", "gloo") if r["call"] == "tensor" else ("link",
                                                                                  "cpu-group")
        for t in transports:
            assert r[t]["n"] == 6 and 0 < r[t]["p50"] <= r[t]["p99"], r
        assert r["speedup"] > 0
        assert (r["vs_gloo"] > 0) if r["call"] == "tensor" else ("gloo" not in r), r
    assert "link vs gloo" in proc.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,needle", [
    (["--iters", "0"], "--iters"),
    (["--rounds", "-2"], "--rounds"),
    (["--sizes", "0"], "--sizes"),
    (["--threads", "zero"], "--threads"),
    (["--dtype", "int3"], "--dtype"),
    (["--calls", "object"], "--calls"),
    (["--threads", "1", "1025"], "argument --threads: expected 'default' or an int from 1 to 1024"),
    (["--threads", "99999999999999999999"], "argument --threads"),
], ids=["iters-zero", "rounds-negative", "size-zero", "threads-word", "dtype-unknown",
        "calls-unknown", "threads-1025", "threads-20-digits"])
def test_bench_p2p_rejects_bad_options(capsys: pytest.CaptureFixture, args: list[str],
                                       needle: str) -> None:
    from coordinator.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "p2p", *args])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err

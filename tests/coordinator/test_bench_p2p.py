"""``groupcoord bench p2p`` end to end through the real CLI (no timing asserts):
every size and thread setting reported for both transports, and option errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(240)
def test_bench_p2p_reports_both_transports_per_size(tmp_path: Path) -> None:
    out = tmp_path / "p2p.json"
    proc = subprocess.run(
        [sys.executable, "-m", "coordinator", "bench", "p2p", "--sizes", "4K", "3M",
         "--threads", "2", "--iters", "3", "--rounds", "2", "--dtype", "float32",
         "--json", str(out)],
        capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["threads"], r["size"]) for r in rows] == [(2, 4096), (2, 3 << 20)]
    for r in rows:
        for t in ("link", "cpu-group"):
            assert r[t]["n"] == 6 and 0 < r[t]["p50"] <= r[t]["p99"], r
        assert r["speedup"] > 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,needle", [
    (["--iters", "0"], "--iters"),
    (["--rounds", "-2"], "--rounds"),
    (["--sizes", "0"], "--sizes"),
    (["--threads", "zero"], "--threads"),
    (["--dtype", "int3"], "--dtype"),
], ids=["iters-zero", "rounds-negative", "size-zero", "threads-word", "dtype-unknown"])
def test_bench_p2p_rejects_bad_options(capsys: pytest.CaptureFixture, args: list[str],
                                       needle: str) -> None:
    from coordinator.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "p2p", *args])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err

"""``groupcoord bench trace`` through the real CLI (no timing asserts): every case
reported for both recorder settings, the JSON written, and option errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow  # a few seconds of ranks per thread setting: CI time on the 2-core VM
@pytest.mark.timeout(240)
@pytest.mark.parametrize("control", [False, True], ids=["on-vs-off", "control"])
def test_bench_trace_reports_each_case_on_and_off(tmp_path: Path, control: bool) -> None:
    out = tmp_path / "trace.json"
    proc = subprocess.run(
        [sys.executable, "-m", "coordinator", "bench", "trace", "--sizes", "1K",
         "--rounds", "2", "--blocks", "2", "--block", "5", "--threads", "1",
         "--json", str(out), *(["--control"] if control else [])],
        capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["records"]
    assert [r["case"] for r in rows] == ["all_reduce 1 KiB", "queue round trip 4 KiB"]
    for r in rows:
        assert r["on_recorded"] is not control, r  # --control: neither copy records
        assert r["threads"] == 1 and r["rounds"] == 2 and r["samples_per_setting"] == 20
        assert 0 < r["off_median_us"] <= r["off_p99_us"], r
        assert 0 < r["on_median_us"] <= r["on_p99_us"], r
        assert len(r["on_round_medians_us"]) == len(r["off_round_medians_us"]) == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,needle", [
    (["--rounds", "0"], "--rounds"),
    (["--world-size", "1"], "--world-size"),
    (["--sizes", "0"], "--sizes"),
], ids=["rounds-zero", "world-size-one", "size-zero"])
def test_bench_trace_rejects_bad_options(capsys: pytest.CaptureFixture, args: list[str],
                                         needle: str) -> None:
    from coordinator.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "trace", *args])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("threads", [
    ["zero"], ["\u00b2"], ["default", "1025"], ["99999999999999999999"],
], ids=["word", "superscript-two", "1025", "20-digits"])
def test_bench_trace_rejects_bad_threads(capsys: pytest.CaptureFixture,
                                         threads: list[str]) -> None:
    """Refused as an option error before any rank starts (``²`` passes
    ``str.isdigit`` but not ``int``; a count torch refuses failed in the ranks)."""
    from coordinator.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "trace", "--threads", *threads])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --threads: expected 'default' or an int from 1 to 1024" in err, err

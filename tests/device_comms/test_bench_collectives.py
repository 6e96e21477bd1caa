"""The collectives benchmark runs end to end (no timing is asserted: numbers are noisy)."""

from __future__ import annotations

import argparse
import json

import pytest

from device_comms.bench import collectives as bench
from device_comms.bench.report import format_markdown, human_bytes


def test_parse_size() -> None:
    assert bench._parse_size("1K") == 1024
    assert bench._parse_size("64KiB") == 64 << 10
    assert bench._parse_size("16M") == 16 << 20
    assert bench._parse_size("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError, match="64K"):
        bench._parse_size("lots")
    assert human_bytes(1 << 20) == "1 MiB" and human_bytes(1000) == "1000 B"


def test_parse_threads() -> None:
    assert bench._parse_threads("default") == "default"
    assert bench._parse_threads(" 1 ") == 1 and bench._parse_threads("6") == 6
    for bad in ("0", "-1", "all", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="1, default or a positive int"):
            bench._parse_threads(bad)
    assert bench.threads_for("default", 2) is None
    assert bench.threads_for(3, 2) == 3
    assert bench.threads_for(None, 2) >= 1


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--world-sizes", "1"]) == 2
    assert "world size" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_small_run_writes_json_and_plot(tmp_path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = bench.main([
        "--world-sizes", "2", "--dtypes", "bfloat16", "--sizes", "4K", "96K",
        "--min-iters", "2", "--max-iters", "3", "--json", str(out), "--plot", str(png),
        "--threads", "1", "3",
    ])
    assert rc == 0
    data = json.loads(out.read_text())
    recs = data["results"]
    assert data["meta"]["threads"] == ["1", "3"]
    assert sorted((r["op"], r["dtype"], r["bytes"], r["threads_setting"]) for r in recs) == sorted(
        (op, dt, b, t) for op in ("all_reduce", "all_gather", "reduce_scatter")
        for dt in ("bfloat16",) for b in (4096, 96 << 10) for t in ("1", "3")
    )
    for r in recs:
        assert r["results_match"] and r["mode"] == "shm" and r["world_size"] == 2
        assert r["shm_p50_us"] > 0 and r["gloo_p50_us"] > 0
        assert r["threads"] == int(r["threads_setting"]) and r["engine_threads"] >= 1
    assert png.stat().st_size > 1000
    md = format_markdown(recs)
    assert "| 4 KiB |" in md
    assert "torch threads per rank: 1 (--threads 1)" in md and "(--threads 3)" in md

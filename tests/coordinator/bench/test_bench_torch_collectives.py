"""``groupcoord bench collectives --via torch`` through the real CLI (no timing asserts):
every op, size and thread setting reported with the three variants, the JSON
written; option errors; and the default path still being device_comms' benchmark."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

#: The backend the CLI run compares with gloo.
UNDER_TEST = "groupcoord"


@pytest.mark.slow  # two ranks start and build three groups: seconds of CI time on 2 cores
@pytest.mark.timeout(240)
def test_bench_via_torch_reports_every_point(tmp_path: Path) -> None:
    out = tmp_path / "torch.json"
    proc = subprocess.run(
        [sys.executable, "-m", "coordinator", "bench", "collectives", "--via", "torch",
         "--backend", UNDER_TEST, "--world-sizes", "2", "--sizes", "1K", "4K",
         "--threads", "1", "default", "--rounds", "2", "--block", "3", "--json", str(out)],
        capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["meta"]["backend"] == UNDER_TEST
    rows = data["records"]
    points = {(r["op"], r["bytes"], r["threads_setting"]) for r in rows}
    assert points == {(op, b, t) for op in ("all_reduce", "all_gather", "reduce_scatter")
                      for b in (1024, 4096) for t in ("1", "default")}
    for r in rows:
        assert r["world_size"] == 2 and r["dtype"] == "float32" and r["results_match"], r
        for v in ("ours", "gloo", "direct"):
            assert 0 < r[f"{v}_median_us"] <= r[f"{v}_p99_us"], r
            assert len(r[f"{v}_round_medians_us"]) == 2
        assert r["pg_overhead_us"] == r["ours_median_us"] - r["direct_median_us"]
    assert "gloo/ours" in proc.stdout and "pg ovh us" in proc.stdout


@pytest.mark.parametrize("args,needle", [
    (["--ops", "all_to_allv"], "--ops"),
    (["--device", "cuda"], "--device cpu"),
    (["--world-sizes", "1"], "--world-sizes"),
], ids=["op-not-offered", "cuda", "world-size-one"])
def test_bench_via_torch_rejects_bad_options(run_cli: Any, args: list[str],
                                             needle: str) -> None:
    code, _, err = run_cli(["bench", "collectives", "--via", "torch", *args])
    assert code == 2
    assert needle in err


def test_bench_collectives_default_path_is_device_comms(
        run_cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import device_comms.bench.collectives as direct

    seen: list[Any] = []
    monkeypatch.setattr(direct, "run_bench", lambda args: seen.append(args) or 0)
    code, _, _ = run_cli(["bench", "collectives", "--world-sizes", "2", "--sizes", "1K"])
    assert code == 0 and len(seen) == 1
    assert seen[0].via == "direct" and seen[0].sizes == [1024] and seen[0].world_sizes == [2]


def test_bench_via_is_rejected_unless_direct_or_torch(run_cli: Any) -> None:
    code, _, err = run_cli(["bench", "collectives", "--via", "nccl"])
    assert code == 2 and "--via" in err


@pytest.mark.parametrize("args,dtypes,sizes", [
    ([], ["float32"], [1 << s for s in range(10, 25, 2)]),
    (["--dtypes", "float32", "bfloat16"], ["float32", "bfloat16"], None),
    (["--dtypes", "bfloat16", "--decode"], ["bfloat16"], "decode"),
    (["--decode", "--max-bytes", "64K"], ["float32"], "decode<=64K"),
], ids=["defaults", "explicit-two-dtypes", "decode-bfloat16", "decode-capped"])
def test_bench_via_torch_runs_the_dtypes_and_sizes_asked_for(
        run_cli: Any, monkeypatch: pytest.MonkeyPatch, args: list[str], dtypes: list[str],
        sizes: Any) -> None:
    import coordinator.testing as testing
    from device_comms.bench.collectives import DECODE_SIZES

    seen: list[dict[str, Any]] = []

    def capture(fn: Any, world_size: int, cfg: dict[str, Any], **kw: Any) -> list[Any]:
        seen.append(cfg)
        return [[] for _ in range(world_size)]

    monkeypatch.setattr(testing, "run_distributed", capture)
    code, _, err = run_cli(["bench", "collectives", "--via", "torch", "--world-sizes", "2",
                            *args])
    assert code == 0, err
    assert len(seen) == 1 and seen[0]["dtypes"] == dtypes
    want = {"decode": DECODE_SIZES, "decode<=64K": [s for s in DECODE_SIZES if s <= 64 << 10]}
    if sizes is not None:
        assert seen[0]["sizes"] == (want[sizes] if isinstance(sizes, str) else sizes)


def test_bench_via_torch_refuses_an_empty_size_range(run_cli: Any) -> None:
    code, _, err = run_cli(["bench", "collectives", "--via", "torch", "--min-bytes", "1M",
                            "--max-bytes", "4K"])
    assert code == 2 and "--min-bytes" in err

"""``groupcoord bench mq-hotpath`` runs end to end (no timing is asserted: numbers are noisy)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(120)
def test_hotpath_cli_writes_every_payload(tmp_path) -> None:
    out = tmp_path / "hot.json"
    res = subprocess.run([sys.executable, "-m", "coordinator", "bench", "mq-hotpath",
                          "--rounds", "20", "--repeats", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=100)
    assert res.returncode == 0, res.stderr
    got = json.loads(out.read_text())
    assert set(got) == {"step-dict", "tensor-4KB", "bytes-64KB"}
    assert all(0 < v["p50_us"] <= v["p99_us"] for v in got.values()), got


@pytest.mark.parametrize("args,words", [(["--rounds", "3"], ("--rounds", ">= 16", "'3'")),
                                        (["--repeats", "0"], ("--repeats", ">= 1", "'0'"))],
                         ids=["rounds", "repeats"])
def test_hotpath_cli_rejects_too_few_rounds(run_cli, args, words) -> None:
    """On stderr with the usage, as every other bad argument (it used to print on stdout)."""
    code, out, err = run_cli(["bench", "mq-hotpath", *args])
    assert code == 2 and not out and "usage:" in err
    assert all(w in err for w in words), err

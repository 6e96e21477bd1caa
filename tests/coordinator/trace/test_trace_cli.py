"""``groupcoord trace DIR``: its report, ``--json``, ``--group`` and exit status.

The command runs in-process (:func:`coordinator.trace.cli.run`, and once through
:func:`coordinator.cli.main`); one test runs ``python -m coordinator trace``.
"""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.cli import main
from coordinator.trace.cli import add_args, run
from tests.child_env import child_env
from tests.coordinator.trace.test_analysis import (
    MIXED,
    PREFIX,
    Rank,
    dump_all,
    skipped_all_reduce,
    world,
)

_ROOT = Path(__file__).resolve().parents[3]


def trace(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_args(parser)
    return run(parser.parse_args(list(argv)))


def clean_run(directory: Path) -> Path:
    ranks = world(2)
    for r in ranks:
        for op, shape, out in MIXED:
            r.call("tp:0", op, shape, out=out)
    return dump_all(ranks, directory)


def test_a_clean_run_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert trace(str(clean_run(tmp_path))) == 0
    out = capsys.readouterr().out
    assert "group tp:0 (tp) ranks [0, 1]: ok" in out
    assert "all_reduce" in out and "ok: no disagreement, nobody behind" in out
    assert main(["trace", str(tmp_path), "--group", "tp"]) == 0


def test_a_mismatch_exits_1_and_names_the_culprit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert trace(str(skipped_all_reduce(tmp_path, (3, 2, 1, 0)))) == 1
    out = capsys.readouterr().out
    assert "MISMATCH at seq 4, culprits [2]" in out
    assert "rank(s) [2] differ from the other 3 of 4 ranks at seq 4" in out
    culprit_lines = [line for line in out.splitlines() if "<- culprit" in line]
    assert len(culprit_lines) == 1 and culprit_lines[0].split()[0] == "2"
    assert trace(str(tmp_path), "--json") == 1
    result = json.loads(capsys.readouterr().out)
    assert result["groups"][0]["first_mismatch"]["culprits"] == [2]


def test_a_laggard_exits_1_and_shows_the_call_in_flight(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ranks = world(3)
    for r in ranks:
        r.call("tp:0", "all_reduce")
        if r.rank != 1:
            r.call("tp:0", "all_gather", (2, 8), done=False)
    assert trace(str(dump_all(ranks, tmp_path))) == 1
    out = capsys.readouterr().out
    assert "BEHIND: [1]" in out and "all_gather seq 2 started" in out


def test_group_filter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ranks = [Rank(r).group("tp:0", [0, 1]).group("pp:0", [0, 1]) for r in range(2)]
    for r in ranks:
        r.call("tp:0", "all_reduce")
        if r.rank == 0:
            r.call("pp:0", "barrier", None)
    dump_all(ranks, tmp_path)
    assert trace(str(tmp_path), "--group", "tp:0", "--json") == 0
    assert [g["name"] for g in json.loads(capsys.readouterr().out)["groups"]] == ["tp:0"]
    assert trace(str(tmp_path), "--group", "pp") == 1
    assert trace(str(tmp_path), "--group", "dp") == 2
    assert "no group named 'dp'" in capsys.readouterr().err


def test_unreadable_input_exits_2_naming_the_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clean_run(tmp_path)
    bad = tmp_path / f"{PREFIX}1"
    bad.write_bytes(pickle.dumps({"version": "2.10", "entries": "nope"}))
    assert trace(str(tmp_path)) == 2
    assert f"{bad}: entries: expected a list" in capsys.readouterr().err
    assert trace(str(tmp_path / "nowhere")) == 2
    assert "not a directory" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert trace(str(empty)) == 2
    assert "--prefix" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse refuses a limit of 0
        trace(str(tmp_path), "--max-mib", "0")


def test_control_characters_from_a_dump_are_escaped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = Rank(0).group("tp:\x1b[2J0", [0])
    r.call("tp:\x1b[2J0", "all_reduce")
    assert trace(str(dump_all([r], tmp_path))) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "tp:\\x1b[2J0" in out


def test_python_m_coordinator_trace(tmp_path: Path) -> None:
    directory = skipped_all_reduce(tmp_path / "dumps", (0, 1, 2, 3))
    done = subprocess.run([sys.executable, "-m", "coordinator", "trace", str(directory),
                           "--json"], cwd=_ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    result = json.loads(done.stdout)
    assert result["prefix"] == PREFIX and not result["ok"]
    assert [g["first_mismatch"]["culprits"] for g in result["groups"]] == [[2]]

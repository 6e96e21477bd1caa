"""Option values every ``groupcoord`` subcommand refuses with a usage error (exit 2),
never a traceback or a run with a value that means nothing (nan, inf)."""

from __future__ import annotations

import argparse

import pytest

from shm_broadcast.cli_args import number, output_path, size_bytes

BAD_OPTIONS = {
    "mq-readers-0": (["bench", "mq", "--readers", "0"], "--readers"),
    "mq-seconds-nan": (["bench", "mq", "--seconds", "nan"], "--seconds"),
    "mq-idle-inf": (["bench", "mq", "--idle", "inf"], "--idle"),
    "mq-max-iters-1": (["bench", "mq", "--max-iters", "1"], "--max-iters"),
    "mq-wake-samples-0": (["bench", "mq", "--wake-samples", "0"], "--wake-samples"),
    "mq-chunk-bytes-5": (["bench", "mq", "--chunk-bytes", "5"], "--chunk-bytes"),
    "mq-chunk-bytes-huge": (["bench", "mq", "--chunk-bytes", "99999999999999999999"],
                            "--chunk-bytes"),
    "mq-chunks-0": (["bench", "mq", "--chunks", "0"], "--chunks"),
    "collectives-timeout-negative": (["bench", "collectives", "--timeout", "-1"], "--timeout"),
    "collectives-timeout-nan": (["bench", "collectives", "--timeout", "nan"], "--timeout"),
    "collectives-budget-nan": (["bench", "collectives", "--budget-mb", "nan"], "--budget-mb"),
    "collectives-budget-negative": (["bench", "collectives", "--budget-mb", "-1"], "--budget-mb"),
    "engine-step-inf": (["bench", "engine", "--step-ms", "inf"], "--step-ms"),
    "engine-step-nan": (["bench", "engine", "--step-ms", "nan"], "--step-ms"),
    "engine-timeout-nan": (["bench", "engine", "--timeout", "nan"], "--timeout"),
    "engine-bytes-inf": (["bench", "engine", "--allreduce-bytes", "inf"], "--allreduce-bytes"),
    "p2p-timeout-nan": (["bench", "p2p", "--timeout", "nan"], "--timeout"),
    "demo-timeout-nan": (["demo", "--timeout", "nan"], "--timeout"),
}


@pytest.mark.parametrize("case", sorted(BAD_OPTIONS))
def test_a_bad_option_value_is_a_usage_error(run_cli, case: str) -> None:
    argv, option = BAD_OPTIONS[case]
    code, _, err = run_cli(argv)
    assert code == 2, err
    assert f"argument {option}" in err and "Traceback" not in err, err


def test_a_failure_the_project_names_ends_the_command_without_a_traceback(run_cli) -> None:
    # A ring no /dev/shm holds: ShmSpaceError, reported as an error line, status 1.
    code, _, err = run_cli(["bench", "mq", "--chunk-bytes", str(1 << 30), "--chunks", "65536",
                            "--readers", "1", "--payloads", "256B", "--seconds", "0.1",
                            "--idle", "0", "--no-baselines"])
    assert code == 1 and "groupcoord: error: ShmSpaceError" in err, err


@pytest.mark.parametrize("text,want", [("3", 3.0), ("0.5", 0.5), ("1e3", 1000.0)])
def test_number_accepts_finite_values_in_range(text: str, want: float) -> None:
    assert number(float, above=0)(text) == want


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "0", "-2", "x", ""])
def test_number_refuses_what_is_not_a_finite_value_above_its_bound(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected a finite number > 0"):
        number(float, above=0)(text)


def test_number_of_ints_keeps_both_bounds() -> None:
    parse = number(int, minimum=2, maximum=4)
    assert [parse(t) for t in ("2", "4")] == [2, 4]
    for text in ("1", "5", "2.5", "nan", "1" + "0" * 400):
        with pytest.raises(argparse.ArgumentTypeError, match="an int >= 2 and <= 4"):
            parse(text)


@pytest.mark.parametrize("text,want", [("4096", 4096), ("64K", 64 << 10), ("1.5M", 3 << 19),
                                       ("1GiB", 1 << 30)])
def test_sizes_in_binary_units(text: str, want: int) -> None:
    assert size_bytes(text) == want


@pytest.mark.parametrize("text", ["0", "-4K", "inf", "nanK", "1Q", "0.5"])
def test_sizes_that_are_not_whole_positive_byte_counts(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="size"):
        size_bytes(text)


def test_an_output_path_is_checked_before_anything_runs(tmp_path) -> None:
    assert output_path(str(tmp_path / "out.json")) == str(tmp_path / "out.json")
    for text, why in ((str(tmp_path / "missing" / "out.json"), "does not exist"),
                      (str(tmp_path), "is a directory")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            output_path(text)

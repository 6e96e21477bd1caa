"""The ``groupcoord`` command line's own parsing: a command line that names no
runnable command fails with the usage of the level it stopped at, on stderr."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.mark.parametrize("argv,usage,missing", [
    ([], "usage: groupcoord [-h] COMMAND", "name a COMMAND"),
    (["bench"], "usage: groupcoord bench [-h] BENCH", "name a BENCH"),
], ids=["no-command", "bench-without-name"])
def test_a_missing_command_is_an_error_with_that_level_s_usage(
        run_cli: Any, argv: list[str], usage: str, missing: str) -> None:
    code, out, err = run_cli(argv)
    assert code == 2
    assert out == ""
    assert err.startswith(usage) and missing in err


def test_bench_names_are_listed_in_bench_help(run_cli: Any) -> None:
    code, out, _ = run_cli(["bench", "--help"])
    assert code == 0
    for name in ("mq", "mq-hotpath", "mq-remote", "collectives", "engine", "trace", "p2p"):
        assert name in out

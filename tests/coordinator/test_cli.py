"""The ``groupcoord`` command line's own parsing: a command line that names no
runnable command fails with the usage of the level it stopped at, on stderr."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.child_env import child_env


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


_INTERRUPTED_COMMAND = """
import faulthandler, signal, sys
from coordinator.cli import main
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's view of a hang
print("entering main", flush=True)
sys.exit(main(["bench", "mq-hotpath", "--repeats", "1000"]))
"""


@pytest.mark.timeout(120)
def test_ctrl_c_ends_a_command_with_status_130_and_no_traceback() -> None:
    """SIGINT to the command's process group (what Ctrl-C in a terminal does) while
    a bench runs: a one-line message and the shell's status for SIGINT."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _INTERRUPTED_COMMAND], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=child_env(), start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "entering main\n"
        time.sleep(1.0)  # in main: importing the bench, or running it
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # say where it hangs: its stacks, then fail
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            proc.kill()
            out, err = proc.communicate(timeout=10)
            stacks = err[-6000:]
            raise AssertionError(f"running 60 s after SIGINT; its stacks:\n{stacks}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and "groupcoord: interrupted" in err, err[-2000:]

"""PyTorch's flight-recorder analyzer as the trace tests run it on their dumps."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys

#: The dump files' prefix in the tests' dump directories.
PREFIX = "rank_"


def analyzer_order(directory: str) -> list[int]:
    """The ranks in the order PyTorch's loader reads their files (``read_dir``)."""
    return [int(f[len(PREFIX):]) for _, _, files in os.walk(directory) for f in files
            if f.startswith(PREFIX)]


def torchfrtrace(directory: str, *, subprocess_run: bool = False) -> str:
    """``torchfrtrace DIRECTORY``'s output; it must exit 0.

    By default the console script's ``main`` runs in this process (already
    holding torch: a ``torchfrtrace`` process would import it again, ~2.5 s of
    CPU each on the 2-core CI machine), its output taken from its logger and
    stdout; a raised exception or a non-zero ``sys.exit`` is the failing exit
    status. ``subprocess_run``: the installed command itself, as a user runs it
    (test_mismatch_dump keeps that path covered).
    """
    if not subprocess_run:
        return _torchfrtrace_here(directory)
    script = os.path.join(os.path.dirname(sys.executable), "torchfrtrace")
    cmd = [script] if os.path.exists(script) else [
        sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace"]
    done = subprocess.run([*cmd, directory], capture_output=True, text=True, timeout=60)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    return out


def _torchfrtrace_here(directory: str) -> str:
    """What the ``torchfrtrace`` script does (``sys.exit(main())``), in this process."""
    from torch.distributed.flight_recorder.fr_trace import main

    # The analyzer writes through the logger "Flight Recorder" (its handler holds
    # the stderr of its first use) and, for a few messages, print().
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(logging.Formatter("%(message)s"))
    fr_logger = logging.getLogger("Flight Recorder")
    fr_logger.addHandler(handler)
    try:
        with contextlib.redirect_stdout(buf):
            try:
                status = main([directory])
            except SystemExit as e:  # the script's exit status
                status = e.code
    finally:
        fr_logger.removeHandler(handler)
    out = buf.getvalue()
    assert status in (None, 0), f"exit status {status!r}\n{out[-3000:]}"
    return out

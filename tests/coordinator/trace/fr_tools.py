"""PyTorch's flight-recorder analyzer as the trace tests run it on their dumps."""

from __future__ import annotations

import os
import subprocess
import sys

#: The dump files' prefix in the tests' dump directories.
PREFIX = "rank_"


def analyzer_order(directory: str) -> list[int]:
    """The ranks in the order PyTorch's loader reads their files (``read_dir``)."""
    return [int(f[len(PREFIX):]) for _, _, files in os.walk(directory) for f in files
            if f.startswith(PREFIX)]


def torchfrtrace(directory: str) -> str:
    """``torchfrtrace DIRECTORY``'s output; it must exit 0."""
    script = os.path.join(os.path.dirname(sys.executable), "torchfrtrace")
    cmd = [script] if os.path.exists(script) else [
        sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace"]
    done = subprocess.run([*cmd, directory], capture_output=True, text=True, timeout=60)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    return out

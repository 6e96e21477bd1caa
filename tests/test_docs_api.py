"""``docs/api.md`` is what ``docs/gen_api.py`` renders from the code today."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _render() -> str:
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.render()


def test_api_reference_is_current() -> None:
    current = (ROOT / "docs" / "api.md").read_text()
    assert _render() == current, (
        "docs/api.md is stale: regenerate it with `python docs/gen_api.py > docs/api.md`"
    )


def test_generator_runs_from_a_checkout_and_is_deterministic() -> None:
    run = [sys.executable, str(ROOT / "docs" / "gen_api.py")]
    first = subprocess.run(run, cwd=ROOT / "docs", capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr[-2000:]
    assert " at 0x" not in first.stdout
    assert first.stdout == _render()

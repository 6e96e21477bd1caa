"""Every example in examples/ runs as documented and reports success.

Each example is started exactly as its docstring says (``python
examples/<name>.py`` from the repository root) in a fresh interpreter; it
must exit with status 0 and print its success line. The examples check their
own results (sharded vs unsharded, sent vs received), so a wrong result fails
here through the exit status.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

# example -> (a line its stdout must contain, whether it is slow)
CASES: dict[str, tuple[str, bool]] = {
    "tp_mlp.py": ("tp_mlp: PASS", False),
    "broadcast_metadata.py": ("dicts intact: PASS", False),
    "pipeline_send_recv.py": ("pipeline_send_recv: PASS", True),  # 4 ranks; links tested apart
    "results_to_driver.py": ("dot products match: PASS", True),  # a driver + 2 workers loop
    "stateless_group.py": ("stateless_group: PASS", True),  # authenticated store: slow start
    "compile_collectives.py": ("compile_collectives: PASS", True),  # compiling: most CPU
}


def _params() -> list[object]:
    return [
        pytest.param(
            name, line, id=name.removesuffix(".py"), marks=[pytest.mark.slow] if slow else []
        )
        for name, (line, slow) in CASES.items()
    ]


def test_every_example_is_covered_and_documented() -> None:
    found = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert found == sorted(CASES), f"examples/ holds {found}; CASES lists {sorted(CASES)}"
    readme = (EXAMPLES / "README.md").read_text()
    for name in found:
        tree = ast.parse((EXAMPLES / name).read_text())
        doc = ast.get_docstring(tree) or ""
        assert "Run:" in doc and f"examples/{name}" in doc, f"{name}: docstring lacks how to run it"
        guards = [
            n for n in tree.body
            if isinstance(n, ast.If) and ast.unparse(n.test) in (
                "__name__ == '__main__'", "__name__ == \"__main__\""
            )
        ]
        assert guards, f"{name}: no `if __name__ == \"__main__\":` guard"
        assert f"examples/{name}" in readme, f"examples/README.md does not explain {name}"


def _readme_slow_column() -> dict[str, bool]:
    """example -> the README table's "`slow` in the tests" column (yes/no)."""
    out = {}
    for line in (EXAMPLES / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("[`") and cells[3] in ("yes", "no"):
            out[cells[0][2:cells[0].index("`", 2)]] = cells[3] == "yes"
    return out


@pytest.mark.parametrize("name", sorted(CASES), ids=lambda n: n.removesuffix(".py"))
def test_readme_says_which_examples_are_slow(name: str) -> None:
    """examples/README.md's table says, per example, whether CASES marks it slow."""
    column = _readme_slow_column()
    assert name in column, f"examples/README.md's table has no `slow` column entry for {name}"
    assert column[name] == CASES[name][1], (name, column[name])


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name, expected", _params())
def test_example_runs(name: str, expected: str) -> None:
    proc = subprocess.run(
        [sys.executable, f"examples/{name}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}\n{out}"
    assert expected in proc.stdout, f"{name} did not print {expected!r}\n{out}"

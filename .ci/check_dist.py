#!/usr/bin/env python3
"""Build the sdist and the wheel, install the wheel into a fresh venv, and import it there.

An editable install reads the source tree, so it hides packaging mistakes: a
sub-package missing from the wheel, package data left out (the custom
all-reduce's ``kernels.cu``, ``py.typed``). This script checks the built
artifacts instead:

1. ``python -m build`` writes ``groupcoord-<version>.tar.gz`` and the wheel;
2. every Python module and data file of the three packages in the source tree
   is in both;
3. a fresh venv gets the wheel (``--no-deps``; the dependencies come from the
   calling environment through ``PYTHONPATH``), and a process started outside
   the checkout imports the three packages from that venv, finds the package
   data through ``importlib.resources``, and runs ``groupcoord doctor``.

Usage: ``python .ci/check_dist.py`` from the repository root. Exit status 0
when every check holds.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import venv
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("shm_broadcast", "device_comms", "coordinator")
DATA_SUFFIXES = (".py", ".cu", ".typed")

_IMPORT_CHECK = r"""
import importlib, importlib.resources, pathlib, sys
venv_site = pathlib.Path(sys.argv[1]).resolve()
for name in ("shm_broadcast", "device_comms", "coordinator"):
    mod = importlib.import_module(name)
    where = pathlib.Path(mod.__file__).resolve()
    if venv_site not in where.parents:
        sys.exit(f"{name} imported from {where}, not from the wheel's venv {venv_site}")
    if not (importlib.resources.files(name) / "py.typed").is_file():
        sys.exit(f"{name}: py.typed is missing from the installed wheel")
kernels = importlib.resources.files("device_comms.cuda.custom_allreduce") / "kernels.cu"
if not kernels.is_file() or "__global__" not in kernels.read_text():
    sys.exit("device_comms/cuda/custom_allreduce/kernels.cu is missing from the installed wheel")
from coordinator import GroupCoordinator, init_distributed_environment  # noqa: F401
from shm_broadcast import MessageQueue  # noqa: F401
print("wheel imports:", ", ".join(sorted(m for m in sys.modules if m.split(".")[0] in
      ("shm_broadcast", "device_comms", "coordinator")))[:200], "...")
"""


def source_files() -> set[str]:
    """Paths (relative to the root) of the packages' modules and data files."""
    found = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*"):
            if path.is_file() and path.suffix in DATA_SUFFIXES and "__pycache__" not in path.parts:
                found.add(path.relative_to(ROOT).as_posix())
    return found


def build(out: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """The sdist and the wheel built from the checkout into ``out``."""
    # no --sdist/--wheel: the wheel is built from the sdist, as an installer from PyPI would
    subprocess.run([sys.executable, "-m", "build", "--outdir", str(out),
                    str(ROOT)], check=True, stdout=subprocess.DEVNULL)
    sdist = next(out.glob("groupcoord-*.tar.gz"))
    wheel = next(out.glob("groupcoord-*.whl"))
    return sdist, wheel


def missing_from(archive_names: set[str], wanted: set[str], strip_first: bool) -> set[str]:
    """Files of ``wanted`` that the archive lacks (sdist paths carry a top directory)."""
    names = {n.split("/", 1)[1] if strip_first and "/" in n else n for n in archive_names}
    return wanted - names


def main() -> int:
    wanted = source_files()
    with tempfile.TemporaryDirectory(prefix="groupcoord-dist-") as tmp:
        work = pathlib.Path(tmp)
        sdist, wheel = build(work / "dist")
        with tarfile.open(sdist) as tar:
            lost = missing_from(set(tar.getnames()), wanted, strip_first=True)
        if lost:
            print(f"sdist {sdist.name} lacks: {sorted(lost)}", file=sys.stderr)
            return 1
        with zipfile.ZipFile(wheel) as whl:
            lost = missing_from(set(whl.namelist()), wanted, strip_first=False)
        if lost:
            print(f"wheel {wheel.name} lacks: {sorted(lost)}", file=sys.stderr)
            return 1
        env_dir = work / "venv"
        venv.EnvBuilder(with_pip=True).create(env_dir)
        py = env_dir / "bin" / "python"
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                       check=True)
        venv_site = subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True).stdout.strip()
        # The dependencies (torch, pyzmq, ...) come from this environment; .pth
        # files on PYTHONPATH are not run, so its editable groupcoord stays out.
        env = {"PYTHONPATH": sysconfig.get_paths()["purelib"], "PATH": "/usr/bin:/bin",
               "HOME": str(work)}
        subprocess.run([str(py), "-c", _IMPORT_CHECK, venv_site], check=True, cwd=work, env=env)
        subprocess.run([str(env_dir / "bin" / "groupcoord"), "doctor"], check=True, cwd=work,
                       env=env, stdout=subprocess.DEVNULL)
        print(f"dist: {sdist.name} and {wheel.name} hold all {len(wanted)} package files; "
              f"the wheel imports and runs from a fresh venv")
    return 0


if __name__ == "__main__":
    sys.exit(main())

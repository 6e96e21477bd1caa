"""Arguments and entry of ``groupcoord demo``."""

from __future__ import annotations

import argparse

__all__ = ["add_args", "run"]


def add_args(p: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``p``."""
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    p.add_argument("--mlp", action="store_true", help="run the minimal tensor-parallel MLP demo")


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit code 0 when the sharded result matches the reference."""
    from coordinator.demo.tp_mlp import run_tp_mlp

    return 0 if run_tp_mlp(tp=args.tp) else 1

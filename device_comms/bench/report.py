"""Tables, JSON and plots for ``groupcoord bench collectives`` results.

A record is one (world size, op, dtype, size) point with the median and p99
latency in microseconds of our communicator (``shm_*``) and of raw gloo
(``gloo_*``), as produced by :mod:`device_comms.bench.collectives`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["format_table", "format_markdown", "write_json", "write_plot", "human_bytes"]


def human_bytes(n: int) -> str:
    """``1024`` -> ``"1 KiB"``, ``16 << 20`` -> ``"16 MiB"``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _us(x: float) -> str:
    return f"{x:,.1f}" if x < 1000 else f"{x:,.0f}"


def _threads(r: dict[str, Any]) -> str:
    """``"torch threads per rank: 2 (--threads default)"``; empty for older records."""
    if "threads" not in r:
        return ""
    return f"  torch threads per rank: {r['threads']} (--threads {r.get('threads_setting', '?')})"


def _groups(
    records: Sequence[dict[str, Any]],
) -> Iterable[tuple[tuple[Any, ...], list[dict[str, Any]]]]:
    """Records by (world size, op, dtype, thread setting), in order of first appearance."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in records:
        key = (r["world_size"], r["op"], r["dtype"], r.get("threads_setting"))
        groups.setdefault(key, []).append(r)
    for k, grp in groups.items():
        yield k[:3], sorted(grp, key=lambda r: r["bytes"])


def format_table(records: Sequence[dict[str, Any]]) -> str:
    """Plain-text tables, one per (world size, op, dtype)."""
    lines = []
    for (ws, op, dtype), grp in _groups(records):
        lines.append(f"\nworld_size={ws}  op={op}  dtype={dtype}{_threads(grp[0])}"
                     "  (latency in us; speedup = gloo p50 / shm p50)")
        lines.append(f"{'size':>9} {'shm p50':>10} {'shm p99':>10} {'gloo p50':>10} "
                     f"{'gloo p99':>10} {'speedup':>8} {'iters':>6} {'ok':>3}")
        for r in grp:
            ratio = r["gloo_p50_us"] / r["shm_p50_us"]
            lines.append(
                f"{human_bytes(r['bytes']):>9} {_us(r['shm_p50_us']):>10} "
                f"{_us(r['shm_p99_us']):>10} {_us(r['gloo_p50_us']):>10} "
                f"{_us(r['gloo_p99_us']):>10} {ratio:>7.1f}x "
                f"{r['iters']:>6} {'yes' if r['results_match'] else 'NO':>3}"
            )
    return "\n".join(lines)


def format_markdown(records: Sequence[dict[str, Any]]) -> str:
    """Markdown tables, one per (world size, op, dtype)."""
    out = []
    for (ws, op, dtype), grp in _groups(records):
        out.append(f"\n**world size {ws}, {op}, {dtype}** (microseconds){_threads(grp[0])}\n")
        out.append("| size | shm p50 | shm p99 | gloo p50 | gloo p99 | speedup (p50) |")
        out.append("|---:|---:|---:|---:|---:|---:|")
        for r in grp:
            ratio = r["gloo_p50_us"] / r["shm_p50_us"]
            out.append(
                f"| {human_bytes(r['bytes'])} | {_us(r['shm_p50_us'])} | {_us(r['shm_p99_us'])} | "
                f"{_us(r['gloo_p50_us'])} | {_us(r['gloo_p99_us'])} | {ratio:.1f}x |"
            )
    return "\n".join(out)


def write_json(path: str, records: Sequence[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Write ``{"meta": ..., "results": [...]}`` to ``path``."""
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": list(records)}, f, indent=1)


def write_plot(path: str, records: Sequence[dict[str, Any]]) -> None:
    """Latency against size (log-log), one panel per world size and op.

    Raises:
        ImportError: matplotlib is not installed (``pip install groupcoord[plot]``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world_size"] for r in records})
    ops = list(dict.fromkeys(r["op"] for r in records))
    fig, axes = plt.subplots(
        len(worlds), len(ops), figsize=(4.2 * len(ops), 3.4 * len(worlds)), squeeze=False
    )
    for i, ws in enumerate(worlds):
        for j, op in enumerate(ops):
            ax = axes[i][j]
            settings = list(dict.fromkeys(r.get("threads_setting") for r in records))
            for (w, o, dtype), pts in _groups(records):
                if (w, o) != (ws, op):
                    continue
                xs = [r["bytes"] for r in pts]
                tag = dtype
                if len(settings) > 1:
                    tag += f", {pts[0]['threads']} thr"
                ax.plot(xs, [r["shm_p50_us"] for r in pts], "o-", label=f"shm {tag}")
                ax.plot(xs, [r["gloo_p50_us"] for r in pts], "s--", label=f"gloo {tag}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{op}, world size {ws}")
            ax.set_xlabel("bytes")
            ax.set_ylabel("median latency (us)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

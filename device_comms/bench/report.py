"""Tables, JSON and plots for ``groupcoord bench collectives`` results.

A record is one (world size, op, dtype, size) point with the median and p99
latency in microseconds of our communicator (``shm_*``) and of raw gloo
(``gloo_*``), as produced by :mod:`device_comms.bench.collectives`;
``dispatch_combine`` records add the token all-to-all path (``a2a_*``), the
token count and the layer shape (:mod:`device_comms.bench.dispatch_combine`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["format_table", "format_markdown", "write_json", "write_plot", "human_bytes",
           "load_average"]


def load_average() -> list[float] | None:
    """The machine's 1, 5 and 15 minute load averages, rounded (None where the
    platform has none): what benchmark reports record beside their numbers."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not available
        return None


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


def _baselines(r: dict[str, Any]) -> list[str]:
    """The variants a record compares ours (``shm``) with: ``gloo``, and ``a2a`` first
    for ``dispatch_combine``."""
    return [name for name in ("a2a", "gloo") if f"{name}_p50_us" in r]


def _moe_note(r: dict[str, Any]) -> list[str]:
    """The layer shape and what each variant runs (``dispatch_combine`` records)."""
    return [f"hidden={r['hidden']} experts={r['experts']} topk={r['topk']}",
            "shm: all_gatherv_rows([hidden, logits]) + reduce_scatterv; a2a: counts "
            "all_gather + all_to_allv there and back; gloo: padded all_gather x2 + "
            "reduce_scatter"]


def _ratio_names(bases: list[str]) -> list[str]:
    return ["speedup"] if bases == ["gloo"] else [f"vs {b}" for b in bases]


def format_table(records: Sequence[dict[str, Any]]) -> str:
    """Plain-text tables, one per (world size, op, dtype)."""
    lines = []
    for (ws, op, dtype), grp in _groups(records):
        bases = _baselines(grp[0])
        moe = "tokens" in grp[0]
        ratios = _ratio_names(bases)
        what = ", ".join(f"{n} = {b} p50 / shm p50" for n, b in zip(ratios, bases, strict=True))
        lines.append(f"\nworld_size={ws}  op={op}  dtype={dtype}{_threads(grp[0])}"
                     f"  (latency in us; {what})")
        if moe:
            lines.extend("  " + note for note in _moe_note(grp[0]))
        head = f"{'size':>9} " + (f"{'tokens':>6} " if moe else "")
        for name in ("shm", *bases):
            head += f"{name + ' p50':>10} {name + ' p99':>10} "
        head += " ".join(f"{n:>8}" for n in ratios)
        head += f" {'iters':>6} {'ok':>3}" + ("  tokens per rank" if moe else "")
        lines.append(head)
        for r in grp:
            row = f"{human_bytes(r['bytes']):>9} " + (f"{r['tokens']:>6} " if moe else "")
            for name in ("shm", *bases):
                row += f"{_us(r[name + '_p50_us']):>10} {_us(r[name + '_p99_us']):>10} "
            row += " ".join(f"{r[b + '_p50_us'] / r['shm_p50_us']:>7.1f}x" for b in bases)
            row += f" {r['iters']:>6} {'yes' if r['results_match'] else 'NO':>3}"
            if moe:
                row += "  " + "/".join(str(c) for c in r["token_counts"])
            lines.append(row)
    return "\n".join(lines)


def format_markdown(records: Sequence[dict[str, Any]]) -> str:
    """Markdown tables, one per (world size, op, dtype)."""
    out = []
    for (ws, op, dtype), grp in _groups(records):
        bases = _baselines(grp[0])
        moe = "tokens" in grp[0]
        out.append(f"\n**world size {ws}, {op}, {dtype}** (microseconds){_threads(grp[0])}\n")
        if moe:
            out.append("; ".join(_moe_note(grp[0])) + "\n")
        cols = ["size", *(["tokens"] if moe else [])]
        for name in ("shm", *bases):
            cols += [f"{name} p50", f"{name} p99"]
        cols += [f"{n} (p50)" for n in _ratio_names(bases)]
        cols += ["tokens per rank"] if moe else []
        out.append("| " + " | ".join(cols) + " |")
        out.append("|" + "---:|" * len(cols))
        for r in grp:
            cells = [human_bytes(r["bytes"]), *([str(r["tokens"])] if moe else [])]
            for name in ("shm", *bases):
                cells += [_us(r[name + "_p50_us"]), _us(r[name + "_p99_us"])]
            cells += [f"{r[b + '_p50_us'] / r['shm_p50_us']:.1f}x" for b in bases]
            cells += ["/".join(str(c) for c in r["token_counts"])] if moe else []
            out.append("| " + " | ".join(cells) + " |")
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
                for name, style in (("a2a", "^-."), ("gloo", "s--")):
                    if f"{name}_p50_us" in pts[0]:
                        ax.plot(xs, [r[f"{name}_p50_us"] for r in pts], style,
                                label=f"{name} {tag}")
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

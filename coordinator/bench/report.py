"""Statistics, table and plot of ``groupcoord bench engine`` results.

:func:`summarize` pools every rank's blocks per (policy, rank) into one row:
latency distributions in microseconds (``p50``, ``p90``, ``p99``, ``max``,
``mean``, ``n``) of metadata arrival (workers), the driver's enqueue and every
``all_reduce``; the waiting thread's CPU in ``dequeue`` (per step and as a
share of the time waited); the rank's process CPU over the blocks' wall time
(a ``--load thread`` counts there too); and the wait counters of the reader's
queue (:meth:`shm_broadcast.MessageQueue.park_stats`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

__all__ = ["summarize", "format_table", "write_json", "write_plot", "distribution"]


def distribution(samples_ns: Sequence[int]) -> dict[str, float]:
    """``p50``/``p90``/``p99``/``max``/``mean`` in microseconds and ``n``."""
    if not samples_ns:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0, "mean": 0.0, "n": 0}
    s = sorted(samples_ns)
    n = len(s)

    def q(p: float) -> float:
        return s[min(n - 1, int(p * (n - 1) + 0.5))] / 1e3

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": s[-1] / 1e3,
            "mean": sum(s) / n / 1e3, "n": n}


def _merge_counts(blocks: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for b in blocks:
        for k, v in b.get("queue_stats", {}).items():
            out[k] = out.get(k, 0) + v
    return out


def summarize(per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (policy, rank), policies in the order they first ran."""
    rows = []
    policies = list(dict.fromkeys(b["policy"] for r in per_rank for b in r["blocks"]))
    for policy in policies:
        for r in per_rank:
            blocks = [b for b in r["blocks"] if b["policy"] == policy]
            steps = sum(len(b["arrival_ns"]) or len(b["enqueue_ns"]) for b in blocks)
            wait_cpu = sum(b["wait_cpu_ns"] for b in blocks)
            wait_wall = sum(b["wait_wall_ns"] for b in blocks)
            wall = sum(b["wall_s"] for b in blocks)
            rows.append({
                "policy": policy, "rank": r["rank"], "role": "driver" if r["rank"] == 0
                else "worker", "steps": steps,
                "arrival_us": distribution([x for b in blocks for x in b["arrival_ns"]]),
                "enqueue_us": distribution([x for b in blocks for x in b["enqueue_ns"]]),
                "allreduce_us": distribution([x for b in blocks for x in b["allreduce_ns"]]),
                "wait_cpu_us_per_step": wait_cpu / 1e3 / steps if steps else 0.0,
                "wait_cpu_percent": 100.0 * wait_cpu / wait_wall if wait_wall else 0.0,
                "rank_cpu_percent": 100.0 * sum(b["cpu_s"] for b in blocks) / wall if wall else 0.0,
                "late_starts": sum(b["late_starts"] for b in blocks),
                "queue_wait_stats": _merge_counts(blocks),
            })
    return rows


def _d(d: dict[str, float]) -> str:
    return f"{d['p50']:.0f} / {d['p90']:.0f} / {d['p99']:.0f}" if d["n"] else "-"


def format_table(rows: list[dict[str, Any]]) -> str:
    """Fixed-width text: one line per (policy, rank)."""
    head = (f"{'policy':<11} {'rank':>4}  {'arrival p50/p90/p99 us':>23}  {'enqueue p50':>11}  "
            f"{'all_reduce p50/p90/p99 us':>26}  {'wait CPU':>14}  {'rank CPU':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        wait = (f"{r['wait_cpu_us_per_step']:.0f} us {r['wait_cpu_percent']:4.1f}%"
                if r["role"] == "worker" else "-")
        enq = f"{r['enqueue_us']['p50']:.0f} us" if r["enqueue_us"]["n"] else "-"
        lines.append(f"{r['policy']:<11} {r['rank']:>4}  {_d(r['arrival_us']):>23}  {enq:>11}  "
                     f"{_d(r['allreduce_us']):>26}  {wait:>14}  {r['rank_cpu_percent']:7.1f}%")
    lines.append("arrival: driver's clock read before enqueue -> worker's dequeue returned; "
                 "wait CPU: the waiting thread's CPU in dequeue per step, and as a share of the "
                 "time it waited; rank CPU: the whole process over the run")
    return "\n".join(lines)


def write_json(path: str, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Write ``{"meta": ..., "results": rows}``."""
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)


def write_plot(path: str, per_rank: list[dict[str, Any]]) -> None:
    """Distributions (CDFs) of arrival and ``all_reduce`` latency, and CPU per rank.

    Raises:
        ImportError: matplotlib is missing (``pip install 'groupcoord[plot]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    policies = list(dict.fromkeys(b["policy"] for r in per_rank for b in r["blocks"]))
    for policy in policies:
        for r in per_rank:
            blocks = [b for b in r["blocks"] if b["policy"] == policy]
            for ax, key in ((axes[0], "arrival_ns"), (axes[1], "allreduce_ns")):
                xs = sorted(x / 1e3 for b in blocks for x in b[key])
                if xs:
                    ys = [(i + 1) / len(xs) for i in range(len(xs))]
                    ax.plot(xs, ys, label=f"{policy} rank {r['rank']}")
    for ax, title in ((axes[0], "metadata arrival at workers"), (axes[1], "all_reduce")):
        ax.set_xscale("log")
        ax.set_xlabel("latency (us)")
        ax.set_ylabel("fraction of steps")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    rows = summarize(per_rank)
    labels = [f"{r['policy']}\nr{r['rank']}" for r in rows]
    axes[2].bar(range(len(rows)), [r["rank_cpu_percent"] for r in rows], label="rank CPU %")
    axes[2].bar(range(len(rows)), [r["wait_cpu_percent"] for r in rows], width=0.5,
                label="wait CPU % (while waiting)")
    axes[2].set_xticks(range(len(rows)), labels, fontsize=7)
    axes[2].set_ylabel("% of a core")
    axes[2].set_title("CPU per rank")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

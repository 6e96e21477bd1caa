"""Two independent StatelessProcessGroups in the same processes, without torch.distributed.

What it shows:
    ``StatelessProcessGroup`` is an object-level group over a TCP store. It
    keeps no process-wide state, so one process can be a member of several
    groups at once, each with its own members, ranks and store, and none of
    them needs ``torch.distributed.init_process_group``. Engines use such
    groups for setup and control traffic that must not disturb the model's
    groups (a data-parallel coordinator, a KV-cache transfer channel...).

    Three processes are started with plain ``multiprocessing`` (spawn):

    * group ``control``: processes 0, 1, 2 as ranks 0, 1, 2 (process 0 hosts its store);
    * group ``kv``: processes 1, 2 as ranks 0, 1 (process 1 hosts its store).

    Calls on the two groups interleave freely: ``broadcast_obj``,
    ``all_gather_obj``, ``send_obj`` / ``recv_obj`` and ``barrier``. Each
    process reports what it received to this (parent) process, which checks
    it. A group's rank 0 hosts the group's store and must outlive the other
    members' use of it, so every process waits for the parent's go-ahead
    before closing its groups. Blocking calls take a timeout and raise
    ``CommTimeout`` naming the group, the operation and the silent peer.

Run:
    python examples/stateless_group.py

Expected output (pids vary):
    stateless_group: 3 processes; torch.distributed initialised in any of them: False
    stateless_group: control (3 ranks) gathered pids [41001, 41002, 41003]
    stateless_group: kv (2 ranks): rank 1 received 3 blocks of layer 5, rank 0 got ack 'kv-ok'
    stateless_group: PASS

Exits with status 1 if any process fails or reports something unexpected.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from typing import Any

TIMEOUT = 60.0
CONFIG = {"model": "tiny-llama", "max_batch": 32, "kv_layers": [0, 5, 9]}


def process_main(proc: int, ports: dict[str, int], results: Any, release: Any) -> None:
    """One process: join both groups, exchange objects, report to the parent.

    A group's rank 0 hosts its store, so it must stay up until the other
    ranks are done with the group: every process waits for the parent's
    ``release`` (set once all have reported) before closing its groups.
    """
    try:
        import torch.distributed as dist

        from coordinator import StatelessProcessGroup

        control = StatelessProcessGroup.create(
            "127.0.0.1", ports["control"], rank=proc, world_size=3, timeout=TIMEOUT, name="control"
        )
        kv = None
        if proc in (1, 2):
            kv = StatelessProcessGroup.create(
                "127.0.0.1", ports["kv"], rank=proc - 1, world_size=2, timeout=TIMEOUT, name="kv"
            )
        report: dict[str, Any] = {"proc": proc, "dist_initialized": dist.is_initialized()}

        # control: the coordinator (rank 0) broadcasts the configuration
        report["config"] = control.broadcast_obj(CONFIG if proc == 0 else None, src=0)

        # kv: a point-to-point exchange between processes 1 and 2 while process 0
        # is already waiting in control.all_gather_obj below
        if kv is not None and kv.rank == 0:
            kv.send_obj({"layer": 5, "blocks": [17, 18, 42]}, dst=1)
            report["ack"] = kv.recv_obj(src=1)
        elif kv is not None:
            report["kv_msg"] = kv.recv_obj(src=0)
            kv.send_obj("kv-ok", dst=0)

        report["pids"] = control.all_gather_obj(os.getpid())
        if kv is not None:
            report["kv_ranks"] = kv.all_gather_obj(kv.rank)
            kv.barrier()
        control.barrier()
        results.put(("ok", proc, report))
        release.wait(TIMEOUT)  # keep the stores up until everyone is done with them
        if kv is not None:
            kv.close()
        control.close()
    except BaseException:
        results.put(("err", proc, traceback.format_exc()))


def check(reports: dict[int, dict[str, Any]], pids: list[int]) -> list[str]:
    """Everything that is not as expected (empty list: all good)."""
    problems = []
    for p, r in reports.items():
        if r["dist_initialized"]:
            problems.append(f"process {p}: torch.distributed got initialised")
        if r["config"] != CONFIG:
            problems.append(f"process {p}: config {r['config']!r}")
        if r["pids"] != pids:
            problems.append(f"process {p}: gathered pids {r['pids']} != {pids}")
    if reports[1].get("ack") != "kv-ok" or reports[1].get("kv_ranks") != [0, 1]:
        problems.append(f"process 1: kv results {reports[1]}")
    if reports[2].get("kv_msg") != {"layer": 5, "blocks": [17, 18, 42]}:
        problems.append(f"process 2: kv message {reports[2].get('kv_msg')!r}")
    if "ack" in reports[0] or "kv_msg" in reports[0]:
        problems.append("process 0 took part in the kv group")
    return problems


def main() -> int:
    from coordinator.testing import free_port

    ctx = mp.get_context("spawn")
    results, release = ctx.Queue(), ctx.Event()
    ports = {"control": free_port(), "kv": free_port()}
    procs = [
        ctx.Process(target=process_main, args=(i, ports, results, release), daemon=True)
        for i in range(3)
    ]
    for p in procs:
        p.start()
    reports: dict[int, dict[str, Any]] = {}
    errors: list[str] = []
    deadline = time.monotonic() + TIMEOUT + 30
    try:
        while len(reports) + len(errors) < len(procs):
            try:
                kind, proc, body = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                errors.append(f"no answer from processes {sorted(set(range(3)) - set(reports))}")
                break
            if kind == "ok":
                reports[proc] = body
            else:
                errors.append(f"process {proc} failed:\n{body}")
    finally:
        release.set()
        for p in procs:
            p.join(10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
    if not errors:
        errors = check(reports, [p.pid for p in procs])
    if reports:
        any_dist = any(r["dist_initialized"] for r in reports.values())
        print(f"stateless_group: {len(procs)} processes; torch.distributed initialised in any of "
              f"them: {any_dist}")
    if 0 in reports:
        print(f"stateless_group: control (3 ranks) gathered pids {reports[0]['pids']}")
    if 1 in reports and 2 in reports:
        msg = reports[2].get("kv_msg") or {}
        print(f"stateless_group: kv (2 ranks): rank 1 received {len(msg.get('blocks', []))} blocks "
              f"of layer {msg.get('layer')}, rank 0 got ack {reports[1].get('ack')!r}")
    for e in errors:
        print(f"stateless_group: {e}", file=sys.stderr)
    print(f"stateless_group: {'FAIL' if errors else 'PASS'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

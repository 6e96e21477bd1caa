"""Custom groups (init_model_parallel_group, init_world_group), the model groups
listed and prepared, and the node count, on pool ranks."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from coordinator import parallel_state as ps
from coordinator.group.registry import get_group_by_name
from coordinator.testing import run_distributed


def run_custom_groups(rank: int, world_size: int, allow_pickle: bool) -> dict[str, Any]:
    """Every rank builds the same split of the world into pairs (odd world: one
    single), all_reduces over its pair and broadcasts a dict on the pair's queue."""
    from coordinator.parallel.model_groups import init_model_parallel_group

    pairs = [list(range(i, min(i + 2, world_size))) for i in range(0, world_size, 2)]
    g = init_model_parallel_group(pairs, rank, "gloo", use_message_queue_broadcaster=True,
                                  group_name="draft", allow_pickle=allow_pickle)
    try:
        mine = next(p for p in pairs if rank in p)
        total = g.all_reduce(torch.full((5,), float(rank + 1)))
        sent = {"step": rank // 2, "ids": torch.arange(3) + rank // 2 * 10}
        got = g.broadcast_tensor_dict(sent if g.rank_in_group == 0 else None, src=0)
        return {"ranks": g.ranks, "mine": mine, "sum": total.tolist(),
                "got": {"step": got["step"], "ids": got["ids"].tolist()},
                "found": get_group_by_name(g.unique_name) is g, "name": g.unique_name,
                "timeout": g.timeout == ps.get_world_group().timeout,
                "pickle": g.allow_pickle, "mq": g.mq_broadcaster is not None or len(mine) == 1}
    finally:
        g.destroy()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,allow_pickle", [
    pytest.param(2, False, id="ws2-no-pickle"),
    pytest.param(3, True, id="ws3-pickle", marks=pytest.mark.slow)])
def test_init_model_parallel_group(dist_pool, world_size: int, allow_pickle: bool) -> None:
    outs = dist_pool(world_size).run(run_custom_groups, allow_pickle, timeout=90)
    for rank, out in enumerate(outs):
        mine = out["mine"]
        assert out["ranks"] == mine, out
        assert out["sum"] == [float(sum(r + 1 for r in mine))] * 5, out
        assert out["got"] == {"step": rank // 2, "ids": [rank // 2 * 10 + i for i in range(3)]}
        assert out["found"] and out["name"].startswith("draft") and out["timeout"], out
        assert out["pickle"] is allow_pickle and out["mq"], out


def run_world_and_model_groups(rank: int, world_size: int) -> dict[str, Any]:
    """init_world_group, get_all_model_groups, prepare_communication_buffer_for_model,
    get_node_count, and a group building GROUPCOORD_NODE_ID's two simulated nodes."""
    from coordinator.parallel.model_groups import count_nodes, init_world_group

    out: dict[str, Any] = {"nodes": ps.get_node_count(), "groups_before": ps.get_all_model_groups()}
    ps.initialize_model_parallel(2, world_size // 2)
    groups = ps.get_all_model_groups()
    out["groups"] = [g.unique_name.split(":")[0] for g in groups]
    out["same"] = [a is b for a, b in zip(groups, (ps.get_tp_group(), ps.get_pp_group(),
                                                   ps.get_dp_group(), ps.get_pcp_group(),
                                                   ps.get_dcp_group()), strict=True)]
    ps.prepare_communication_buffer_for_model(torch.nn.Linear(4, 4))
    whole = init_world_group(list(range(world_size)), rank, "gloo")
    try:
        out["whole"] = whole.all_reduce(torch.ones(2)).tolist()
        out["whole_comm"] = whole.device_communicator is None  # vLLM's: torch.distributed
    finally:
        whole.destroy()
    os.environ["GROUPCOORD_NODE_ID"] = f"node{rank // 2}"
    try:  # the CPU communicator numbers the simulated nodes as it is built
        split = init_world_group(range(world_size), rank, "gloo", use_device_communicator=True)
    finally:
        del os.environ["GROUPCOORD_NODE_ID"]
    try:
        out["split_nodes"] = count_nodes(split)
    finally:
        split.destroy()
    return out


@pytest.mark.timeout(120)
def test_world_and_model_groups(dist_pool) -> None:
    outs = dist_pool(4).run(run_world_and_model_groups, timeout=90)
    for out in outs:
        assert out["nodes"] == 1 and out["groups_before"] == [], out
        assert out["groups"] == ["tp", "pp", "dp", "pcp", "dcp"] and all(out["same"]), out
        assert out["whole"] == [4.0, 4.0] and out["whole_comm"], out
        assert out["split_nodes"] == 2, out


def run_bad_groups(rank: int, world_size: int) -> list[str]:
    from coordinator.parallel.model_groups import init_model_parallel_group, init_world_group

    seen = []
    for call in (lambda: init_model_parallel_group([[0, 1], [1]], rank, "gloo"),
                 lambda: init_model_parallel_group([[0], [1]], rank, "carrier-pigeon"),
                 lambda: init_world_group("01", rank, "gloo")):
        try:
            call()
        except (TypeError, ValueError) as e:
            seen.append(type(e).__name__)
    return seen


@pytest.mark.timeout(120)
def test_bad_group_arguments_raise_before_any_wait(dist_pool) -> None:
    outs = dist_pool(2).run(run_bad_groups, timeout=60)
    assert outs == [["ValueError", "ValueError", "TypeError"]] * 2, outs


def test_node_count_without_torch_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("this process belongs to a group")
    assert ps.get_node_count() == 1


def _gloo_threads() -> list[int]:
    """The ids of this process's threads named by gloo's TCP transport (one event loop
    per gloo group): ids, not a count, so that a thread of an earlier run of this
    pool rank ending meanwhile is not taken for one of this run's."""
    tasks = f"/proc/{os.getpid()}/task"
    found = []
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                if f.read().strip() == "gloo_tcp_loop":
                    found.append(int(tid))
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return sorted(found)


#: Seconds a released gloo group's event-loop thread may stay listed. torch
#: releases the loop from the thread that drops the group's last reference, yet
#: the thread can still show in /proc a few milliseconds later: with plain
#: torch (five gloo groups made, used, destroyed and dropped, repeated) one of
#: about 1,500 rounds on an oversubscribed 2-core VM still listed a thread right
#: after, and none 0.2 s later. A group that a reference cycle keeps alive keeps
#: its thread for good (the collector is off), which this grace does not hide.
EXIT_GRACE_S = 2.0


def _gloo_threads_left(known: set[int]) -> tuple[list[int], list[int]]:
    """The gloo threads not in ``known`` right now, and those still there once
    every one has ended or :data:`EXIT_GRACE_S` passed."""
    import time

    first = [t for t in _gloo_threads() if t not in known]
    left, deadline = first, time.monotonic() + EXIT_GRACE_S
    while left and time.monotonic() < deadline:
        time.sleep(0.01)
        left = [t for t in _gloo_threads() if t not in known]
    return first, left


def _process_groups_in_cycles() -> int:
    """Torch process groups that only the cyclic garbage collector would free
    (held by objects in reference cycles); the collection runs here."""
    import gc

    import torch.distributed as dist

    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds stays in gc.garbage
    try:
        gc.collect()
        return sum(isinstance(r, dist.ProcessGroup)
                   for o in gc.garbage for r in gc.get_referents(o))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def _use(g: Any) -> None:
    """Calls that build what a group makes lazily (plans, envelopes, p2p links)."""
    g.all_reduce(torch.ones(3))
    g.all_gather(torch.ones(2))
    g.broadcast_object({"step": 1}, src=0)
    g.broadcast_tensor_dict({"ids": torch.arange(3)} if g.rank_in_group == 0 else None, src=0)
    g.barrier()
    if g.world_size > 1 and g.rank_in_group < 2:
        if g.rank_in_group == 0:
            g.send(torch.arange(4), dst=1)
        else:
            g.recv((4,), torch.int64, src=0)


def run_destroy_ends_threads(rank: int, world_size: int, tp: int, pp: int, how: str,
                             transport: str) -> dict[str, Any]:
    """Make and use groups, destroy them with the cyclic collector off (so only
    the destroy call may end the groups' threads), count gloo threads, then
    count the process groups that reference cycles still hold.

    ``how``: ``model`` (destroy_model_parallel, with an EP group too),
    ``whole`` (destroy_distributed_environment) or ``one`` (pairs of ranks made
    by init_model_parallel_group with a message queue, and their ``destroy()``).
    ``transport``: ``shm`` (the shared-memory engine), ``gloo`` (the engine
    off) or ``hier`` (two pretend hosts: hierarchical groups).
    """
    import gc

    from coordinator.parallel.model_groups import init_model_parallel_group

    saved = {k: os.environ.get(k) for k in ("GROUPCOORD_CPU_SHM", "GROUPCOORD_NODE_ID")}
    os.environ["GROUPCOORD_CPU_SHM"] = "0" if transport == "gloo" else "1"
    os.environ.pop("GROUPCOORD_NODE_ID", None)
    if transport == "hier":
        os.environ["GROUPCOORD_NODE_ID"] = f"host{rank * 2 // world_size}"
    gc.collect()  # what earlier runs on this pool rank left is not this run's to count
    before = _gloo_threads()
    was_on = gc.isenabled()
    gc.disable()
    try:
        if how == "one":
            pairs = [list(range(i, min(i + 2, world_size))) for i in range(0, world_size, 2)]
            groups = [init_model_parallel_group(pairs, rank, "gloo", group_name="own",
                                                use_message_queue_broadcaster=True)]
        else:
            ps.initialize_model_parallel(tp, pp, enable_expert_parallel=True)
            groups = ps.get_all_model_groups()
        for g in groups:
            _use(g)
        during = _gloo_threads()
        own = groups[0]
        del g, groups  # a caller's references to destroyed groups pin nothing: kept in own
        if how == "whole":
            ps.destroy_distributed_environment()
        elif how == "model":
            ps.destroy_model_parallel()
        else:
            own.destroy()
        # The world's own threads count as left when the world went too.
        at_once, after = _gloo_threads_left(set() if how == "whole" else set(before))
        return {"before": before, "during": during, "at_once": at_once, "after": after,
                "in_cycles": _process_groups_in_cycles()}
    finally:
        if was_on:
            gc.enable()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.timeout(120)
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.parametrize("world_size,tp,pp,how,transport", [
    pytest.param(2, 2, 1, "model", "shm", id="ws2-tp2-shm"),
    pytest.param(4, 2, 2, "model", "gloo", id="ws4-tp2-pp2-gloo"),
    pytest.param(4, 4, 1, "model", "hier", id="ws4-tp4-two-hosts"),
    pytest.param(3, 1, 3, "whole", "shm", id="ws3-pp3-whole-environment"),
    pytest.param(3, 1, 1, "one", "shm", id="ws3-pairs-with-queues")])
def test_destroy_ends_the_groups_threads(dist_pool, world_size: int, tp: int, pp: int,
                                         how: str, transport: str) -> None:
    """Destroying a group releases its process groups at once, so their gloo
    threads end: nothing of the group keeps them in a reference cycle until a
    garbage collection (which a process may not run for a long time)."""
    args = (tp, pp, how, transport)
    if how == "whole":  # the world group goes too: ranks of their own, not the shared pool's
        outs = run_distributed(run_destroy_ends_threads, world_size, *args, timeout=90)
    else:
        outs = dist_pool(world_size).run(run_destroy_ends_threads, *args, timeout=90)
    for out in outs:
        assert set(out["during"]) - set(out["before"]), out  # the groups had threads to end
        assert not out["after"], out  # and they ended (at once, or within EXIT_GRACE_S)
        assert out["in_cycles"] == 0, out

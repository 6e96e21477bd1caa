"""Call patterns of vLLM's own distributed tests and workers, run as written there
(the names and argument forms an engine ported from vLLM uses)."""

from __future__ import annotations

from typing import Any

import pytest
import torch


@pytest.mark.timeout(120)
def test_vllm_worker_patterns(dist_pool) -> None:
    outs = dist_pool(2).run(vllm_patterns, timeout=90)
    assert outs[1]["recv_int_size"] == [64, 1.0], outs
    assert outs[1]["dequeued"] == {"step": 7} and outs[0]["wrote"], outs
    assert outs[1]["dequeued_positional"] == {"step": 8}, outs


def vllm_patterns(rank: int, world_size: int) -> dict[str, Any]:
    from coordinator import parallel_state as ps
    from shm_broadcast import MessageQueue

    g = ps.get_world_group()
    out: dict[str, Any] = {}
    # tests/distributed/test_comm_ops.py: recv(size=64, dtype=...) with an int size.
    if rank == 0:
        g.send(torch.ones(64), 1)
    else:
        got = g.recv(64, dtype=torch.float32)
        out["recv_int_size"] = [got.numel(), float(got.mean())]
    # vLLM's executor: a queue created without waiting (blocking=False), readied
    # later, and a worker's busy loop that waits for its next request indefinitely.
    mq = MessageQueue.create_from_process_group(g.cpu_group, 1 << 16, 4, writer_rank=0,
                                                blocking=False)
    with mq:
        mq.wait_until_ready(30)
        if rank == 0:
            mq.enqueue({"step": 7})
            mq.enqueue({"step": 8})
            out["wrote"] = True
        else:
            out["dequeued"] = mq.dequeue(indefinite=True)
            out["dequeued_positional"] = mq.dequeue(None, True)  # vLLM's (timeout, indefinite)
        g.barrier()
    return out


class _LazyIntermediate:
    """What vLLM's worker builds from ``irecv_tensor_dict``'s triple: the tensors
    are read only after every handle was waited and every postprocess step run."""

    def __init__(self, tensors: Any, handles: list[Any], postprocess: list[Any]) -> None:
        self._tensors, self._handles, self._postprocess = tensors, handles, postprocess
        self._synced = False

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        if not self._synced:
            for h in self._handles:
                h.wait()
            for fn in self._postprocess:
                fn()
            self._synced = True
        return self._tensors


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2), (1, 3)], ids=["tp1-pp2", "tp2-pp2", "tp1-pp3"])
def test_vllm_pipeline_step_forms(dist_pool, tp: int, pp: int) -> None:
    """vLLM 0.33's worker step, as written there: ``handles = isend_tensor_dict(...)``
    with ``handles[1:]`` waited before the next step, and ``tensor_dict, handles,
    postprocess = irecv_tensor_dict(...)`` read lazily."""
    outs = dist_pool(tp * pp).run(vllm_pipeline_steps, tp, timeout=150)
    for rank, got in enumerate(outs):
        stage = rank // tp
        if stage == 0:
            assert got == [], (rank, got)
        else:
            want = [[float(step * 100 + (stage - 1) * 10)] * 4 for step in range(3)]
            assert got == want, (rank, got)


def vllm_pipeline_steps(rank: int, world_size: int, tp_size: int) -> list[Any]:
    from coordinator import parallel_state as ps

    ps.initialize_model_parallel(tp_size, world_size // tp_size)
    try:
        pp, tp = ps.get_pp_group(), ps.get_tp_group()
        pending: list[Any] = []
        seen = []
        for step in range(3):
            for handle in pending:  # the previous step's sends, before buffers are reused
                handle.wait()
            pending = []
            hidden = torch.full((4,), float(step * 100 + pp.rank_in_group * 10))
            if not pp.is_first_rank:
                tensor_dict, handles, postprocess = pp.irecv_tensor_dict(all_gather_group=tp)
                assert tensor_dict is not None
                received = _LazyIntermediate(tensor_dict, handles, postprocess)
                seen.append(received.tensors["hidden"].tolist())
            if not pp.is_last_rank:
                handles = pp.isend_tensor_dict({"hidden": hidden}, all_gather_group=tp)
                pending = handles[1:]
                assert pending, "handles[1:] must cover the send"
        for handle in pending:
            handle.wait()
        # A group of one rank, as vLLM's: nothing to receive.
        alone = ps.get_world_group() if world_size == 1 else None
        if alone is None:
            from coordinator import GroupCoordinator

            alone = GroupCoordinator([[r] for r in range(world_size)], rank, "gloo",
                                     False, group_name="vllm-forms-alone")
            try:
                tensor_dict, handles, postprocess = alone.irecv_tensor_dict()
                assert tensor_dict is None and alone.irecv_tensor_dict().wait() is None
                alone.isend_tensor_dict({"x": torch.ones(1)}).wait()
            finally:
                alone.destroy()
        pp.barrier()
        return seen
    finally:
        ps.destroy_model_parallel()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_cpu_all_reduce_in_place(dist_pool, world_size: int) -> None:
    """``cpu_all_reduce_``, vLLM's per-step data-parallel sync: sums in place and
    returns the tensor it was given, on every layout."""
    outs = dist_pool(world_size).run(cpu_all_reduce_calls, timeout=90)
    total = sum(range(world_size))
    for got in outs:
        assert got["float"] == [float(total + world_size)] * 3, got
        assert got["int64"] == [[total, 2 * total]], got
        assert got["non_contiguous"] == [[total * 10, total], [total * 10 + world_size, total]]
        assert got["same_object"] == [True, True, True], got
        assert got["refused"] == ["TypeError"] * 2, got


def cpu_all_reduce_calls(rank: int, world_size: int) -> dict[str, Any]:
    from coordinator import parallel_state as ps

    g = ps.get_world_group()
    out: dict[str, Any] = {"same_object": [], "refused": []}
    for key, t in (("float", torch.full((3,), rank + 1.0)),
                   ("int64", torch.tensor([[rank, 2 * rank]], dtype=torch.int64)),
                   ("non_contiguous",
                    torch.tensor([[rank * 10, rank * 10 + 1], [rank, rank]]).t())):
        got = g.cpu_all_reduce_(t)
        out["same_object"].append(got is t)
        out[key] = t.tolist()
    for bad in ("x", [1.0]):
        try:
            g.cpu_all_reduce_(bad)
        except TypeError as e:
            assert str(e).startswith("tensor must be a torch.Tensor"), e
            out["refused"].append("TypeError")
    g.barrier()
    return out


def test_optional_groups_probed_as_vllm_does() -> None:
    """vLLM probes optional groups with ``except AssertionError`` and asks
    ``get_dcp_world_size_and_rank``; both work before the groups exist."""
    from coordinator import parallel_state as ps

    assert not ps.model_parallel_is_initialized()
    try:  # vLLM's block_table.py, as written there
        dcp_size = ps.get_dcp_group().world_size
    except AssertionError:
        dcp_size = 1
    assert dcp_size == 1
    assert ps.get_dcp_world_size_and_rank() == (1, 0)
    assert ps.get_dcp_world_size_and_rank(enabled=False) == (1, 0)


@pytest.mark.timeout(120)
def test_dcp_world_size_and_rank_of_a_live_group(dist_pool) -> None:
    outs = dist_pool(2).run(dcp_size_and_rank, timeout=90)
    assert outs == [[(2, 0), (1, 0)], [(2, 1), (1, 0)]], outs


def dcp_size_and_rank(rank: int, world_size: int) -> list[tuple[int, int]]:
    from coordinator import parallel_state as ps

    ps.initialize_model_parallel(2, decode_context_model_parallel_size=2)
    try:
        return [ps.get_dcp_world_size_and_rank(), ps.get_dcp_world_size_and_rank(False)]
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("value,want", [
    ("5,3", [(0, 5), (5, 8)]),
    ("0,8", [(0, 0), (0, 8)]),
    (" 2,6 ", [(0, 2), (2, 8)]),
    ("", [(0, 4), (4, 8)]),
], ids=["5-3", "empty-first", "spaces", "unset"])
def test_pp_layer_partition_from_the_environment(monkeypatch, value: str, want: Any) -> None:
    from coordinator import get_pp_indices

    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", value)
    assert [get_pp_indices(8, r, 2) for r in range(2)] == want


@pytest.mark.parametrize("value", ["5,2", "4,4,0", "a,b", "9,-1", "8"],
                         ids=["wrong-sum", "too-many", "not-ints", "negative", "too-few"])
def test_bad_pp_layer_partition_is_refused(monkeypatch, value: str) -> None:
    from coordinator import get_pp_indices

    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", value)
    with pytest.raises(ValueError, match="VLLM_PP_LAYER_PARTITION"):
        get_pp_indices(8, 0, 2)


def test_queue_takes_vllms_constructor_form_and_handle_fields() -> None:
    from shm_broadcast import MessageQueue

    mq = MessageQueue(1, 1, max_chunk_bytes=1 << 16, connect_ip=None,
                      enable_shm_tensor_arena=True)
    try:
        handle = mq.export_handle()
        assert handle.remote_subscribe_addr == handle.remote_pub
        with pytest.raises(TypeError, match="enable_shm_tensor_arena"):
            MessageQueue(1, 1, enable_shm_tensor_arena="yes")  # type: ignore[arg-type]
    finally:
        mq.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_into_output_forms(dist_pool, world_size: int) -> None:
    """``reduce_scatterv_into_output`` and ``combine_into_output`` (vLLM's MoE
    forms) write what ``reduce_scatterv``/``combine`` return into ``output``,
    and refuse an output of another shape or dtype after the call, untouched."""
    outs = dist_pool(world_size).run(into_output_calls, timeout=90)
    for got in outs:
        assert got["rsv"] and got["rsv_even"] and got["combine"], got
        assert got["refused"] == ["ValueError", "ValueError", "TypeError"], got
        assert got["untouched"] and got["no_buffer"], got


def into_output_calls(rank: int, world_size: int) -> dict[str, Any]:
    from coordinator import parallel_state as ps

    ps.initialize_model_parallel(1, 1, world_size, enable_expert_parallel=True)
    try:
        ep = ps.get_ep_group()
        out: dict[str, Any] = {"refused": []}
        sizes = [1 + r % 2 for r in range(world_size)]
        x = torch.arange(float(sum(sizes) * 3)).view(-1, 3) * (rank + 1)
        want = ep.reduce_scatterv(x, 0, sizes)
        into = torch.empty_like(want)
        got = ep.reduce_scatterv_into_output(x, into, dim=0, sizes=sizes)
        out["rsv"] = got is into and torch.equal(into, want)
        even = torch.ones(2 * world_size, 2)
        into_even = torch.empty(2, 2)
        ep.reduce_scatterv_into_output(even, into_even, 0)
        out["rsv_even"] = into_even.tolist() == [[float(world_size)] * 2] * 2
        hidden = torch.full((2, 4), float(rank))
        logits = torch.zeros(2, 8)
        gathered, _ = ep.dispatch(hidden, logits)
        want_c = ep.combine(gathered)
        gathered, _ = ep.dispatch(hidden, logits)
        into_c = torch.empty_like(want_c)
        out["combine"] = (ep.combine_into_output(gathered, into_c) is into_c
                          and torch.equal(into_c, want_c))
        out["no_buffer"] = ep.allocate_combine_input((2, 4), torch.float32,
                                                     torch.device("cpu")) is None
        wrong = torch.zeros(5, 3)
        for call in (lambda: ep.reduce_scatterv_into_output(x, wrong, 0, sizes),
                     lambda: ep.reduce_scatterv_into_output(
                         x, torch.zeros_like(want, dtype=torch.float64), 0, sizes),
                     lambda: ep.reduce_scatterv_into_output(x, [0.0], 0, sizes)):
            try:
                call()
            except (TypeError, ValueError) as e:
                out["refused"].append(type(e).__name__)
        out["untouched"] = not wrong.any().item()
        ep.barrier()
        return out
    finally:
        ps.destroy_model_parallel()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_vllms_positional_context_sizes_are_refused_by_name(dist_pool, world_size: int) -> None:
    """vLLM's worker calls ``ensure_model_parallel_initialized(tp, pp, pcp, dcp)``;
    here the third and fourth places are the DP size and the backend, so such a
    call raises on every rank (before the groups exist, and when checking them)
    instead of building or accepting another layout."""
    outs = dist_pool(world_size).run(vllm_positional_sizes, timeout=90)
    for out in outs:
        assert len(out) == 3 and all("decode_context_model_parallel_size=" in m
                                     for m in out[:2]), out
        assert out[2] == world_size, out


def vllm_positional_sizes(rank: int, world_size: int) -> list[Any]:
    from coordinator import parallel_state as ps

    seen: list[Any] = []
    for call in (ps.initialize_model_parallel, ps.ensure_model_parallel_initialized):
        try:
            call(world_size, 1, 1, 1)
            seen.append("no error")
        except TypeError as e:
            seen.append(str(e))
    ps.initialize_model_parallel(world_size, 1, prefill_context_model_parallel_size=1,
                                 decode_context_model_parallel_size=1)
    try:
        try:  # checking live groups refuses it too
            ps.ensure_model_parallel_initialized(world_size, 1, 1, 1)
            seen[1] = "no error when checking"
        except TypeError as e:
            seen[1] = str(e)
        seen.append(ps.get_tp_group().world_size)
    finally:
        ps.destroy_model_parallel()
    return seen


@pytest.mark.parametrize("value", [0, 1, None, "False"], ids=repr)
def test_set_custom_all_reduce_takes_a_bool(value: Any) -> None:
    from coordinator import parallel_state as ps

    with pytest.raises(TypeError, match="enable must be a bool"):
        ps.set_custom_all_reduce(value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_set_custom_all_reduce_false_on_one_rank_disables_it_for_the_group(
        dist_pool, world_size: int) -> None:
    """vLLM's worker calls ``set_custom_all_reduce(enable)`` before building groups.
    Its off switch reaches the custom all-reduce's agreement (which needs no GPU
    when it ends disabled) on every rank; turned back on, the verdict is another."""
    outs = dist_pool(world_size).run(custom_all_reduce_switch, timeout=90)
    for off, *on in outs:
        assert off[0] and "set_custom_all_reduce(False)" in off[1], off
        for disabled, reason in on:  # no GPU: off for another reason (peer access)
            assert disabled and reason and "set_custom_all_reduce" not in reason, on


def custom_all_reduce_switch(rank: int, world_size: int) -> list[tuple[bool, str]]:
    from coordinator import parallel_state as ps
    from device_comms.cuda.custom_allreduce.communicator import CustomAllreduce

    group = ps.get_world_group().cpu_group
    seen = []
    # Without a GPU the agreement touches no device (switched on, it ends at peer
    # access); with one, the switched-on half would build buffers: it is left out.
    for enable in (False,) if torch.cuda.is_available() else (False, True):
        if rank == 0:
            ps.set_custom_all_reduce(enable)
        try:
            car = CustomAllreduce(group, torch.device("cuda", 0), 1 << 20, timeout=30.0)
            try:
                seen.append((car.disabled, car.reason))
            finally:
                car.close()
        finally:
            ps.set_custom_all_reduce(True)
    return seen

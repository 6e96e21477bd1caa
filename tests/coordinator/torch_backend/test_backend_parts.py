"""The backend's parts alone: argument translation and works (no processes)."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from coordinator.errors import CommTimeout
from coordinator.torch_backend import BACKEND_NAME, GroupcoordWork
from coordinator.torch_backend.translate import (
    copy_pieces,
    same_dtype,
    single,
    split_sizes,
    tensor_list,
    to_reduce_op,
)
from device_comms.reduce_op import ReduceOp


def test_registered_on_import() -> None:
    import coordinator  # noqa: F401

    assert BACKEND_NAME in dist.Backend.backend_list
    assert dist.Backend.backend_capability[BACKEND_NAME] == ["cpu"]
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"  # gloo stays the default


@pytest.mark.parametrize("name", [op.name for op in ReduceOp])
def test_reduce_ops_translate(name: str) -> None:
    torch_op = getattr(dist.ReduceOp, name)
    assert to_reduce_op(torch_op) is ReduceOp[name]
    assert to_reduce_op(dist.ReduceOp(torch_op)) is ReduceOp[name]


def test_premul_sum_and_junk_are_refused() -> None:
    with pytest.raises(TypeError, match="PREMUL_SUM"):
        to_reduce_op(dist._make_nccl_premul_sum(2.0))
    with pytest.raises(TypeError, match="op must be a torch.distributed.ReduceOp"):
        to_reduce_op("sum")


def test_tensor_lists() -> None:
    t = torch.ones(2)
    assert single([t], "tensors") is t
    with pytest.raises(ValueError, match="tensors must hold exactly one tensor"):
        single([t, t], "tensors")
    with pytest.raises(TypeError, match="tensors must be a list of torch.Tensor"):
        single(t, "tensors")
    with pytest.raises(TypeError, match=r"xs\[1\] must be a torch.Tensor"):
        tensor_list([t, 3], "xs")
    with pytest.raises(ValueError, match="xs must hold 3 tensors"):
        tensor_list([t], "xs", 3)
    with pytest.raises(TypeError, match=r"xs\[1\] must have dtype torch.float32"):
        same_dtype([t, t.int()], torch.float32, "xs")


def test_split_sizes() -> None:
    assert split_sizes([], 6, 3, "s") == [2, 2, 2]
    assert split_sizes([1, 0, 5], 6, 3, "s") == [1, 0, 5]
    with pytest.raises(ValueError, match="must divide by the group size 4"):
        split_sizes(None, 6, 4, "s")
    with pytest.raises(ValueError, match="s sums to 5"):
        split_sizes([1, 4, 0], 6, 3, "s")
    with pytest.raises(ValueError, match="s must have 3 entries"):
        split_sizes([6], 6, 3, "s")
    with pytest.raises(ValueError, match=r"s\[0\] must be >= 0"):
        split_sizes([-1, 7, 0], 6, 3, "s")
    with pytest.raises(TypeError, match=r"s\[1\] must be an int"):
        split_sizes([1, 2.0, 3], 6, 3, "s")


def test_copy_pieces_fills_any_layout() -> None:
    a, b = torch.zeros(2, 3).t(), torch.zeros(0)
    c = torch.zeros(2)
    copy_pieces(torch.arange(8.0), [a, b, c])
    assert a.tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert c.tolist() == [6.0, 7.0]


def test_finished_work() -> None:
    t = torch.ones(2)
    w = GroupcoordWork([t])
    assert w.is_completed() and w.is_success() and w.exception() is None
    assert w.wait() is True and w.wait(datetime.timedelta(seconds=1)) is True
    assert w.result() == [t] and w.get_future().wait()[0] is t
    seen: list[bool] = []
    th = threading.Thread(target=lambda: seen.append(w.wait()))
    th.start()
    th.join(10)
    assert seen == [True]


def test_failed_work_raises_on_every_wait_and_in_its_future() -> None:
    err = CommTimeout("late")
    w = GroupcoordWork(error=err)
    for _ in range(2):
        with pytest.raises(CommTimeout, match="late"):
            w.wait()
    assert w.is_completed() and not w.is_success() and w.exception() is err
    with pytest.raises(CommTimeout, match="late"):
        w.get_future().wait()


@pytest.mark.parametrize("spec", ["groupcoord", "cpu:groupcoord", "cpu:groupcoord,cuda:gloo",
                                  "cuda:gloo,cpu:groupcoord"])
def test_backend_strings_give_our_group(spec: str) -> None:
    """torch takes a Python group as the whole group, whatever the other devices say
    (a one-rank world in this process: nothing to share, nothing started)."""
    from coordinator.torch_backend import GroupcoordProcessGroup

    if dist.is_initialized():
        pytest.skip("this process already has a default group")
    dist.init_process_group(spec, store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert isinstance(dist.group.WORLD, GroupcoordProcessGroup)
        assert dist.get_backend() == spec
        t = torch.ones(2)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()

"""CudaCommunicator: registration, and every op end to end on CPU processes.

Without a GPU the class is registered but unavailable. Its op hooks (dims moved
to dim 0, uneven sizes, roots, the custom all-reduce hook, lifecycle) run here
through a test-only subclass on CPU tensors whose NCCL is the gloo stand-in of
:mod:`._gloo_nccl`, against the same references as the other communicators.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from device_comms import (
    CommunicatorClosed,
    CudaCommunicator,
    ReduceOp,
    TorchDistributedCommunicator,
    get_device_communicator,
    list_device_communicators,
    select_device_communicator,
)
from device_comms.cuda.pynccl import PyNcclCommunicator
from tests.device_comms import general_cases
from tests.device_comms.cuda.pynccl._gloo_nccl import GlooNccl


class _CpuCuda(CudaCommunicator):
    """CudaCommunicator on CPU tensors, NCCL replaced by the gloo stand-in (tests only)."""

    def _make_pynccl(self) -> PyNcclCommunicator:
        self.fake = GlooNccl(self.cpu_group)
        return PyNcclCommunicator(self.cpu_group, self.device, library=self.fake)


class _FakeCustomAR:
    """The custom all-reduce interface: takes small float32 tensors, returns 42s."""

    def __init__(self) -> None:
        self.used = 0
        self.captures: list[str] = []
        self.closed = False

    def should_use(self, t: torch.Tensor) -> bool:
        return t.dtype == torch.float32 and t.numel() <= 16

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.used += 1
        return torch.full_like(t, 42.0)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        self.captures.append("enter")
        yield
        self.captures.append("exit")

    def close(self) -> None:
        self.closed = True


def _expects_value_error(case: tuple[Any, ...]) -> bool:
    _, kind, dt, _, op, _ = case
    if kind not in ("all_reduce", "reduce", "reduce_scatter", "reduce_scatterv"):
        return False
    bitwise = op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
    return bitwise and not (dt == torch.bool and op is not ReduceOp.BXOR)


def _same(got: Any, want: Any) -> bool:
    if want is None or got is None:
        return got is want
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if got.dtype.is_complex:  # NCCL reduces complex numbers as real pairs
        return torch.allclose(got, want)
    return torch.equal(got, want)


# ---------------------------------------------------------------------- rank functions
def _general_cases(rank: int, n: int) -> dict[str, Any]:
    comm = _CpuCuda(dist.group.WORLD, torch.device("cpu"), unique_name="cuda-test")
    failures, refused = [], 0
    for case in general_cases.cases(n):
        try:
            got = general_cases.run_case(comm, case, rank, n)
        except ValueError as e:
            if not _expects_value_error(case) or "not supported by NCCL" not in str(e):
                raise
            refused += 1
            continue
        if _expects_value_error(case):
            failures.append(f"{case[:5]}: no ValueError")
        elif not _same(got, general_cases.expected(case, n, rank)):
            failures.append(f"{case[:5]}: got {got!r}")
    names = comm.fake.names()
    comm.destroy()
    return {"failures": failures, "refused": refused, "calls": names,
            "closed_with": comm.fake.closed_with}


def _custom_ar(rank: int, n: int) -> dict[str, Any]:
    comm = _CpuCuda(dist.group.WORLD, torch.device("cpu"))
    reason = comm.custom_ar_reason
    try:
        _CpuCuda(dist.group.WORLD, torch.device("cpu"), use_custom_allreduce="yes")
    except TypeError as e:
        refused = str(e)
    with comm.graph_capture():  # nothing plugged in: a no-op
        pass
    car = comm.custom_ar = _FakeCustomAR()
    small = torch.ones(4)
    out: dict[str, Any] = {"custom": comm.all_reduce(small).tolist(), "reason": reason,
                           "refused": refused}
    before = comm.fake.names().count("all_reduce")
    out["max"] = comm.all_reduce(small * (rank + 1), ReduceOp.MAX).tolist()  # not SUM: NCCL
    out["big"] = comm.all_reduce(torch.ones(100)).sum().item()  # should_use False: NCCL
    out["int"] = comm.all_reduce(torch.ones(4, dtype=torch.int32)).tolist()
    out["nccl_calls"] = comm.fake.names().count("all_reduce") - before
    out["used"] = car.used
    with comm.graph_capture():
        out["inside"] = list(car.captures)
    out["after"] = list(car.captures)
    fake = comm.fake
    comm.destroy()
    comm.destroy()  # idempotent
    out["closed"] = (car.closed, fake.closed_with, comm.custom_ar, comm.pynccl)
    try:
        comm.all_reduce(small)
    except CommunicatorClosed as e:
        out["after_destroy"] = str(e)
    return out


def _group_of_one(rank: int, n: int) -> dict[str, Any]:
    singles = [dist.new_group([r], backend="gloo") for r in range(n)]
    comm = _CpuCuda(singles[rank], torch.device("cpu"))
    x = torch.arange(6.0).reshape(2, 3)
    res = {"pynccl": comm.pynccl, "sum": comm.all_reduce(x).tolist(),
           "gather": comm.all_gather(x, 1).shape}
    comm.destroy()
    return res


# ---------------------------------------------------------------------- tests
def test_registered_but_unavailable_without_gpu() -> None:
    assert get_device_communicator("cuda") is CudaCommunicator
    assert CudaCommunicator.name == "cuda" and CudaCommunicator.device_types == {"cuda"}
    assert CudaCommunicator.priority == 10 > TorchDistributedCommunicator.priority
    assert issubclass(CudaCommunicator, TorchDistributedCommunicator)
    info = list_device_communicators()["cuda"]
    assert info["priority"] == 10 and info["devices"] == ["cuda"]
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        pytest.skip("a GPU is visible: availability depends on NCCL here")
    assert CudaCommunicator.is_available() is False and info["available"] is False
    assert select_device_communicator("cuda") is TorchDistributedCommunicator
    assert select_device_communicator("cuda:0") is not CudaCommunicator


def test_is_available_never_raises(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    from device_comms.cuda.pynccl import library

    def broken(*a: Any, **k: Any) -> Any:
        raise library.CommunicatorUnavailable("no NCCL (test)")

    monkeypatch.setattr(library, "load_library", broken)
    assert CudaCommunicator.is_available() is False


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_op_matches_reference(dist_pool, world_size: int) -> None:
    outs = dist_pool(world_size).run(_general_cases)
    for out in outs:
        assert out["failures"] == [], f"{len(out['failures'])} mismatches: {out['failures'][:3]}"
        assert out["refused"] > 0 and out["closed_with"] == "destroy"
        calls = set(out["calls"])
        assert {"all_reduce", "reduce", "reduce_scatter", "all_gather", "broadcast", "send",
                "recv", "group_start", "group_end"} <= calls, calls


def test_custom_allreduce_goes_first(dist_pool) -> None:
    for out in dist_pool(2).run(_custom_ar):
        assert out["custom"] == [42.0] * 4 and out["used"] == 1
        assert out["reason"] == "device cpu is not a CUDA device"
        assert "use_custom_allreduce must be a bool or None, got str" in out["refused"]
        assert out["max"] == [2.0] * 4 and out["big"] == 200.0 and out["int"] == [2] * 4
        assert out["nccl_calls"] == 3
        assert out["inside"] == ["enter"] and out["after"] == ["enter", "exit"]
        assert out["closed"] == (True, "destroy", None, None)
        assert "was destroyed" in out["after_destroy"]


def test_group_of_one_needs_no_nccl(dist_pool) -> None:
    for out in dist_pool(2).run(_group_of_one):
        assert out["pynccl"] is None
        assert out["sum"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] and out["gather"] == (2, 3)

"""Every rank of a custom all-reduce reaches the same verdict, whatever fails on one rank.

* **Peer access.** Each rank used to probe peer access between every rank's
  device on its own and act on its own answer: a device index that is not a
  device of that process made the probe raise there (a CUDA binding's error,
  outside this project's family) while the other ranks went on to the handle
  exchange. Now the ranks gather their answers and decide from the gathered
  words only: the group is disabled on every rank alike, with a reason naming
  the rank.
* **Registration of captured inputs.** The rank whose own backend failed
  (making a handle, opening a peer's) used to stay usable, launching eager
  kernels its peers would never join. Now every rank is broken afterwards.

Real processes and gloo groups; the fakes stand in for the CUDA driver and
the device memory (buffers, tables, fault words) only.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch

from device_comms.cuda.custom_allreduce.communicator import CustomAllreduce, _Pending
from device_comms.cuda.custom_allreduce.handles import HandleBook, IpcBackend
from tests.device_comms.cuda.custom_allreduce.fakes import (
    FakeIpcBackend,
    HostFaultWords,
    HostTables,
    fake_driver,
    fake_peer_probe,
)

pytestmark = pytest.mark.timeout(120)

GROUP_TIMEOUT_S = 20  # the timeout of the group each test makes, where a hang would wait it out
LOCAL_PTR = 0x5000_0000
INPUT_BYTES = 4096


class HostOnlyAllreduce(CustomAllreduce):
    """The real agreement and registration; the device memory kept on the host."""

    def _setup(self, backend: IpcBackend, max_graph_inputs: int) -> None:
        self._backend, self._book = backend, HandleBook(backend, self.rank)
        self._errors, self._tables = HostFaultWords(), HostTables(max_graph_inputs + 1)
        self._sig = self._tmp = [0x7000_0000 + 0x10_0000 * r for r in range(self.world_size)]

    def close(self) -> None:
        if not self.disabled:
            self._book.close()
        self._closed = True


def _short_group() -> Any:
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))


def _described(e: BaseException) -> dict:
    return {"type": type(e).__name__, "msg": str(e), "peers": list(getattr(e, "peers", ()))}


# ---------------------------------------------------------------------- peer access
def _construct(rank: int, world_size: int, devices: list[int], counts: list[int],
               broken_probe: int | None = None) -> dict:
    group = _short_group()
    probe = fake_peer_probe(counts[rank], broken=rank == broken_probe)
    try:
        with fake_driver(counts[rank], probe):
            car = HostOnlyAllreduce(group, torch.device("cuda", devices[rank]),
                                    ipc_backend=FakeIpcBackend(rank=rank), unique_name="agree")
    except Exception as e:
        return {"error": _described(e)}
    car.close()
    return {"disabled": car.disabled, "reason": car.reason}


def test_device_another_rank_does_not_see_disables_every_rank(dist_pool: Any) -> None:
    """Rank 1 sees 2 devices, and rank 0's device index is 3. Old code: rank 1's probe
    raised the binding's error there, and rank 0 went on to the handle exchange."""
    outs = dist_pool(2).run(_construct, [3, 0], [8, 2], timeout=60)
    for rank, out in enumerate(outs):
        assert out.get("disabled") is True, (rank, out)
        assert "rank 1 sees 2 CUDA devices" in out["reason"] and "[0, 3]" in out["reason"]
    assert outs[0]["reason"] == outs[1]["reason"].split(" (device 3")[0], outs


def test_probe_that_raises_on_one_rank_disables_every_rank(dist_pool: Any) -> None:
    """The driver's probe raises on rank 2 only: no error of a foreign type escapes, and
    no rank goes on alone."""
    outs = dist_pool(4).run(_construct, [0, 1, 2, 3], [4, 4, 4, 4], 2, timeout=60)
    for rank, out in enumerate(outs):
        assert out.get("disabled") is True, (rank, out)
        assert "rank 2 could not probe peer access" in out["reason"], (rank, out)
    assert "FakeCudaRuntimeError: cudaErrorInvalidDevice" in outs[2]["reason"]
    assert "FakeCudaRuntimeError" not in outs[0]["reason"]


def test_devices_every_rank_sees_enable_every_rank(dist_pool: Any) -> None:
    outs = dist_pool(2).run(_construct, [1, 0], [2, 2], timeout=60)
    assert outs == [{"disabled": False, "reason": ""}] * 2


# ---------------------------------------------------------------------- kernels not ready
def _one_rank_cannot_run_the_kernels(rank: int, world_size: int, old_gpu: int) -> dict:
    group = _short_group()
    why = "device 0 has compute capability 7.5; the kernels need 8.0 or newer"
    try:
        with fake_driver(world_size, not_ready=why if rank == old_gpu else ""):
            car = HostOnlyAllreduce(group, torch.device("cuda", rank),
                                    ipc_backend=FakeIpcBackend(rank=rank), unique_name="old")
    except Exception as e:
        return {"error": _described(e)}
    car.close()
    return {"disabled": car.disabled, "reason": car.reason}


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_rank_whose_gpu_cannot_run_the_kernels_disables_every_rank(
        dist_pool: Any, world_size: int) -> None:
    """An older GPU (or a failed compile) on the last rank: every rank is disabled
    alike, the reason names the rank (and, there, the cause); none sets up alone."""
    old_gpu = world_size - 1
    outs = dist_pool(world_size).run(_one_rank_cannot_run_the_kernels, old_gpu, timeout=60)
    for rank, out in enumerate(outs):
        assert out.get("disabled") is True, (rank, out)
        assert f"the kernels cannot run on rank(s) [{old_gpu}]" in out["reason"], (rank, out)
    assert "compute capability 7.5" in outs[old_gpu]["reason"]


def _garbage_ready_word(rank: int, world_size: int, liar: int) -> dict:
    import torch.distributed as dist

    class Liar(HostOnlyAllreduce):
        """Sends kernels-ready word 5, which is neither yes nor no."""

        def _agree_on_kernels(self, index: int) -> Any:
            rows = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
            dist.all_gather(rows, torch.tensor([5], dtype=torch.int64), group=self.cpu_group)
            from device_comms.cuda.custom_allreduce.eligibility import GroupVerdict

            return GroupVerdict(False, "lying")

    group = _short_group()
    cls = Liar if rank == liar else HostOnlyAllreduce
    try:
        with fake_driver(2):
            cls(group, torch.device("cuda", rank), ipc_backend=FakeIpcBackend(rank=rank))
    except Exception as e:
        return {"error": _described(e)}
    return {}


def test_a_garbage_kernels_ready_word_is_a_decode_error(dist_pool: Any) -> None:
    out = dist_pool(2).run(_garbage_ready_word, 1, timeout=60)[0]
    assert out["error"]["type"] == "DecodeError", out
    assert out["error"]["peers"] == [1] and "kernels ready 5" in out["error"]["msg"], out


def _cpu_input_on_an_enabled_group(rank: int, world_size: int) -> dict:
    group = _short_group()
    with fake_driver(2):
        car = HostOnlyAllreduce(group, torch.device("cuda", rank),
                                ipc_backend=FakeIpcBackend(rank=rank), unique_name="dev")
    try:
        car.all_reduce(torch.ones(8, dtype=torch.float16))  # eligible, but on the CPU
    except Exception as e:
        return {"disabled": car.disabled, "error": _described(e)}
    finally:
        car.close()
    return {"disabled": car.disabled}


def test_an_input_on_another_device_is_refused_before_any_launch(dist_pool: Any) -> None:
    for out in dist_pool(2).run(_cpu_input_on_an_enabled_group, timeout=60):
        assert out["disabled"] is False, out
        assert out["error"]["type"] == "ValueError", out
        assert "input_ must be on the custom all-reduce's device cuda:" in out["error"]["msg"]
        assert "got a tensor on cpu" in out["error"]["msg"], out


def _full_table(rank: int, world_size: int, inputs: int) -> dict:
    group = _short_group()
    with fake_driver(2):
        car = HostOnlyAllreduce(group, torch.device("cuda", rank), max_graph_inputs=inputs,
                                ipc_backend=FakeIpcBackend(rank=rank), unique_name="full")
    t = torch.ones(8, dtype=torch.float16)
    try:
        with car.capture():
            inside = car.should_use(t)
        return {"inside": inside, "outside": car.should_use(t)}
    finally:
        car.close()


@pytest.mark.parametrize("inputs, inside", [(0, False), (3, True)], ids=["full", "room"])
def test_a_full_table_of_captured_inputs_leaves_the_call_to_nccl(dist_pool: Any, inputs: int,
                                                                 inside: bool) -> None:
    """Past ``max_graph_inputs`` captured calls, ``should_use`` says no inside a capture
    (the same on every rank: each captured the same calls), so NCCL serves them;
    ``reserve`` raised during the capture before."""
    for out in dist_pool(2).run(_full_table, inputs, timeout=60):
        assert out == {"inside": inside, "outside": True}, out


@pytest.mark.parametrize("bad, kind", [(-1.0, ValueError), (0, ValueError),
                                        (float("nan"), ValueError), ("5", TypeError)],
                         ids=["negative", "zero", "nan", "str"])
def test_a_bad_kernel_timeout_is_refused_at_construction(bad: Any, kind: type) -> None:
    """Before any collective (the group is never touched): the kernels took the
    timeout in nanoseconds, and a negative one failed at every launch on that rank."""
    from device_comms.cuda.custom_allreduce.virtual import VirtualRanks

    with pytest.raises(kind, match="timeout"):
        CustomAllreduce(object(), torch.device("cuda", 0), timeout=bad)  # type: ignore[arg-type]

    with pytest.raises(kind, match="timeout"):
        VirtualRanks(2, "cuda:0", timeout=bad)


@pytest.mark.parametrize("bad, kind", [(-1, ValueError), ("5", TypeError), (1.5, TypeError)],
                         ids=["negative", "str", "float"])
def test_a_bad_max_graph_inputs_is_refused_at_construction(bad: Any, kind: type) -> None:
    with pytest.raises(kind, match="max_graph_inputs"):
        CustomAllreduce(object(), torch.device("cuda", 0),  # type: ignore[arg-type]
                        max_graph_inputs=bad)


@pytest.mark.parametrize("blocks", [0, 65])
def test_virtual_ranks_check_max_blocks(blocks: int) -> None:
    """Each block owns a signal slot of a phase (64 of them): more wrote past them."""
    from device_comms.cuda.custom_allreduce.virtual import VirtualRanks

    with pytest.raises(ValueError, match="max_blocks must be in"):
        VirtualRanks(2, "cuda:0", max_blocks=blocks)


def _garbage_answer(rank: int, world_size: int, liar: int) -> dict:
    import torch.distributed as dist

    class Liar(HostOnlyAllreduce):
        """Sends peer-access answer 7, which is none (the peer's misbehaviour)."""

        def _agree_on_peer_access(self, devices: list[int]) -> tuple[bool, str]:
            rows = [torch.zeros(2, dtype=torch.int64) for _ in range(self.world_size)]
            dist.all_gather(rows, torch.tensor([7, 2], dtype=torch.int64), group=self.cpu_group)
            return False, "lying"  # no further step: the honest rank has raised

    group = _short_group()
    cls = Liar if rank == liar else HostOnlyAllreduce
    try:
        with fake_driver(2):
            car = cls(group, torch.device("cuda", rank), ipc_backend=FakeIpcBackend(rank=rank))
    except Exception as e:
        return {"error": _described(e)}
    car.close()
    return {"disabled": car.disabled}


def test_garbage_peer_access_answer_is_a_decode_error(dist_pool: Any) -> None:
    out = dist_pool(2).run(_garbage_answer, 1, timeout=60)[0]
    assert out["error"]["type"] == "DecodeError", out
    assert out["error"]["peers"] == [1] and "sent peer-access answer 7" in out["error"]["msg"]


# ---------------------------------------------------------------------- registration
def _registration_fails(rank: int, world_size: int, failing: int, how: str) -> dict:
    group = _short_group()
    backend = FakeIpcBackend(rank=rank)
    with fake_driver(world_size):
        car = HostOnlyAllreduce(group, torch.device("cuda", rank), ipc_backend=backend,
                                unique_name="captured")
    assert not car.disabled, car.reason
    ptr = LOCAL_PTR + 0x1000 * rank
    if rank == failing and how == "handle_of":
        backend.fail_handle_of = ptr
    elif rank == failing:  # the next rank's input cannot be opened here
        peer = (rank + 1) % world_size
        backend.fail_open = FakeIpcBackend(rank=peer).handle_of(LOCAL_PTR + 0x1000 * peer).handle
    car._pending.append(_Pending(1, ptr, INPUT_BYTES))  # a call captured on every rank
    try:
        car.register_graph_buffers()
    except Exception as e:
        error: dict | None = _described(e)
    else:
        error = None
    try:  # an eager call afterwards must not reach a kernel launch on any rank
        car.all_reduce(torch.zeros(INPUT_BYTES // 4, dtype=torch.float32))
    except Exception as e:
        after = _described(e)
    else:
        after = {"type": "nothing"}
    car.close()
    return {"error": error, "after": after}


@pytest.mark.parametrize("how", ["handle_of", "open"])
def test_failed_registration_breaks_every_rank(dist_pool: Any, how: str) -> None:
    """Old code: the failing rank's backend error left its communicator usable (its next
    all_reduce went on to launch); with a failing handle_of its peers also waited out
    the group's timeout."""
    outs = dist_pool(4).run(_registration_fails, 1, how, timeout=90)
    assert outs[1]["error"]["type"] == "RuntimeError", outs[1]
    expected = "PeerRejectedError" if how == "handle_of" else "CollectiveMismatch"
    for rank in (0, 2, 3):
        assert outs[rank]["error"]["type"] == expected, (rank, outs[rank])
        assert 1 in outs[rank]["error"]["peers"], (rank, outs[rank])
    for rank, out in enumerate(outs):
        assert out["after"]["type"] == "BrokenCommunicator", (rank, out)
        assert "the captured graph must not be replayed" in out["after"]["msg"]


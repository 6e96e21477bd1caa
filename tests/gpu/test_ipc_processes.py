"""CUDA IPC between processes sharing one GPU.

Each process allocates memory, publishes an IPC handle over a gloo group (72
bytes, no pickle), opens its peer's, and reads the peer's data through the
opened pointer, for a buffer of its own and for a tensor that sits at an
offset inside a torch caching-allocator block (base + offset). Then the full
:class:`CustomAllreduce` runs across two and four processes (they time-slice
the GPU, so this checks the protocol across processes, not its speed).
"""

from __future__ import annotations

import pytest
import torch

from coordinator.testing import run_distributed

pytestmark = [pytest.mark.cupy, pytest.mark.timeout(300)]


def _view(ptr: int, nbytes: int) -> torch.Tensor:
    import cupy

    mem = cupy.cuda.UnownedMemory(ptr, nbytes, None, 0)
    arr = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
    return torch.as_tensor(arr, device="cuda:0")


def _read_peer(rank: int, world_size: int) -> dict:
    from coordinator.parallel_state import get_world_group
    from device_comms.cuda.custom_allreduce.device_memory import DeviceBuffer
    from device_comms.cuda.custom_allreduce.handles import (
        CudaIpcBackend,
        HandleBook,
        all_gather_handles,
    )

    torch.cuda.set_device(0)
    group = get_world_group().cpu_group
    own = DeviceBuffer(1 << 20, 0)
    _view(own.ptr, 1 << 20).fill_(rank + 1)
    block = torch.zeros(3 << 20, dtype=torch.uint8, device="cuda:0")
    inner = block[(1 << 20) + 4096 :][: 1 << 20]  # a pointer inside a larger block
    inner.fill_(rank + 101)
    torch.cuda.synchronize()
    backend = CudaIpcBackend()
    mine = [backend.handle_of(own.ptr), backend.handle_of(inner.data_ptr())]
    got = all_gather_handles(group, mine, "test buffers")
    peer = 1 - rank
    with HandleBook(backend, rank) as book:
        ptrs_own = book.register([got[r][0] for r in range(world_size)], own.ptr)
        ptrs_inner = book.register([got[r][1] for r in range(world_size)], inner.data_ptr())
        seen_own = _view(ptrs_own[peer], 1 << 20).unique().tolist()
        seen_inner = _view(ptrs_inner[peer], 1 << 20).unique().tolist()
        offset = got[peer][1].offset
        opened = book.open_count
    torch.distributed.barrier(group)  # the peer is done reading before memory goes
    own.close()
    return {"own": seen_own, "inner": seen_inner, "offset": offset, "opened": opened}


def test_each_process_reads_the_others_buffer() -> None:
    outs = run_distributed(_read_peer, 2)
    for rank, out in enumerate(outs):
        peer = 1 - rank
        assert out["own"] == [peer + 1]
        assert out["inner"] == [peer + 101]
        assert out["offset"] > 0, "a sub-allocation must travel as base + offset"
        assert out["opened"] == 2


def _custom_allreduce(rank: int, world_size: int) -> dict:
    import hashlib

    from coordinator.parallel_state import get_world_group
    from device_comms.cuda.custom_allreduce.communicator import CustomAllreduce

    torch.cuda.set_device(0)
    group = get_world_group().cpu_group
    errors, digests = {}, {}
    with CustomAllreduce(group, torch.device("cuda", 0), 1 << 20, timeout=30.0) as car:
        if car.disabled:
            return {"disabled": car.reason}
        for nbytes in (16, 4096, 1 << 20):
            for dtype in (torch.float32, torch.bfloat16):
                numel = nbytes // torch.tensor([], dtype=dtype).element_size()
                g = torch.Generator(device="cpu").manual_seed(nbytes)
                base = torch.randn(world_size, numel, generator=g).to(dtype)
                out = car.all_reduce(base[rank].cuda())
                torch.cuda.synchronize()
                car.check_error()
                want = base.double().sum(0).to(dtype).double()  # the sum, rounded once
                key = f"{nbytes} {dtype}"
                errors[key] = ((out.cpu().double() - want).abs().max() / want.abs().max()).item()
                digests[key] = hashlib.sha256(out.cpu().view(torch.uint8).numpy()).hexdigest()
    return {"errors": errors, "digests": digests}


@pytest.mark.parametrize("world_size", [2, 4])
def test_custom_allreduce_across_processes_on_one_gpu(world_size: int) -> None:
    """Every rank gets the float64 sum to within one rounding, bitwise alike on all ranks
    (two processes sum two terms: exact)."""
    outs = run_distributed(_custom_allreduce, world_size)
    for out in outs:
        assert "disabled" not in out, out
        for key, err in out["errors"].items():
            tol = 0.0 if world_size == 2 else (1e-6 if "float32" in key else 8e-3)
            assert err <= tol, (key, err)
        assert out["digests"] == outs[0]["digests"], "ranks differ"


class _NoNcclCuda:
    """Built lazily: CudaCommunicator without NCCL (NCCL refuses two ranks on one GPU)."""

    @staticmethod
    def make(group, device):
        from device_comms.cuda.communicator import CudaCommunicator

        class _Comm(CudaCommunicator):
            def _make_pynccl(self):  # the custom all-reduce path needs no NCCL
                return None

        return _Comm(group, device, unique_name="tp-test", timeout=30.0)


def _cuda_communicator(rank: int, world_size: int) -> dict:
    from coordinator.parallel_state import get_world_group

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    comm = _NoNcclCuda.make(get_world_group().cpu_group, dev)
    try:
        if comm.custom_ar is None:
            return {"disabled": comm.custom_ar_reason}
        x = torch.full((4, 256), float(rank + 1), device=dev, dtype=torch.float16)
        eager = comm.all_reduce(x)
        static = torch.zeros(1024, device=dev)
        with comm.graph_capture():
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                comm.all_reduce(static)  # warm-up outside the graph
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=s):
                    out = comm.all_reduce(static)
            torch.cuda.current_stream().wait_stream(s)
        replays = []
        for step in range(3):
            static.fill_(float((rank + 1) * (step + 1)))
            g.replay()
            torch.cuda.synchronize()
            replays.append(out.unique().tolist())
        return {"eager": eager.unique().tolist(), "replays": replays}
    finally:
        comm.destroy()


def test_cuda_communicator_routes_all_reduce_to_custom_allreduce() -> None:
    outs = run_distributed(_cuda_communicator, 2)
    for out in outs:
        assert "disabled" not in out, out
        assert out["eager"] == [3.0]
        assert out["replays"] == [[3.0], [6.0], [9.0]]

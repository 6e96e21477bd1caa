"""Result tensors from the pool of mappings: right tensors, reused only when free, bounded."""

from __future__ import annotations

import gc
import resource
import threading
import time

import numpy as np
import pytest
import torch

from device_comms.cpu_shm import host_alloc
from device_comms.cpu_shm.host_alloc import IDLE_PER_SIZE, POOL_MIN_BYTES, ResultPool

_MIB = 1 << 20


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn,
                                   torch.int64, torch.complex64, torch.bool, torch.uint8],
                         ids=str)
@pytest.mark.parametrize("shape", [(POOL_MIN_BYTES,), (3, 257, POOL_MIN_BYTES // 771 + 1),
                                   (2, 3, POOL_MIN_BYTES // 6 + 1)],
                         ids=lambda s: "x".join(map(str, s)))
def test_pooled_tensor_has_the_shape_dtype_and_room_asked_for(shape: tuple[int, ...],
                                                              dtype: torch.dtype) -> None:
    try:
        t = host_alloc.empty(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert t.device.type == "cpu" and t.data_ptr() % 4096 == 0
        ref = torch.arange(t.numel()).reshape(shape).to(dtype)
        t.copy_(ref)  # every byte is writable and its own
        assert torch.equal(t.view(torch.uint8), ref.view(torch.uint8))
        del t
    finally:
        host_alloc.release_idle()


def test_small_results_come_from_torch() -> None:
    t = host_alloc.empty((POOL_MIN_BYTES // 4 - 1,), torch.float32)
    t.untyped_storage().resize_(8)  # torch's own storage: resizable


def test_a_free_mapping_is_reused_without_page_faults() -> None:
    pool = ResultPool()
    t = pool.tensor((4 * _MIB,), torch.uint8, 4 * _MIB)
    t.fill_(1)
    address = t.data_ptr()
    del t
    u = pool.tensor((_MIB,), torch.float32, 4 * _MIB)
    assert u.data_ptr() == address
    before = _faults()
    u.fill_(2.0)
    assert _faults() - before < 256  # not one per page (1,024 pages)
    assert pool.idle_bytes == 0 and pool.lent == 1


@pytest.mark.parametrize("first,then", [(3 * _MIB, 4 * _MIB), (4 * _MIB, 2 * _MIB + 8)],
                         ids=["3MiB-then-4MiB", "4MiB-then-2MiB+8"])
def test_sizes_of_one_class_share_its_mappings(first: int, then: int) -> None:
    pool = ResultPool()
    t = pool.tensor((first,), torch.uint8, first)
    address = t.data_ptr()
    del t
    u = pool.tensor((then,), torch.uint8, then)
    assert u.data_ptr() == address
    u.fill_(9)
    assert int(u[-1]) == 9 and u.numel() == then


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("holder", ["view", "numpy", "slice-of-view", "storage", "as_strided",
                                    "dlpack", "autograd"])
def test_a_mapping_stays_lent_while_anything_derived_from_the_tensor_lives(
        holder: str, dtype: torch.dtype) -> None:
    if holder == "numpy" and dtype == torch.bfloat16:
        pytest.skip("numpy has no bfloat16")
    pool = ResultPool()
    n = _MIB // dtype.itemsize
    t = pool.tensor((n,), dtype, _MIB)
    t.fill_(7.0)
    kept: object
    if holder == "view":
        kept = t.view(16, -1)
    elif holder == "numpy":
        kept = t.numpy()
    elif holder == "slice-of-view":
        kept = t.view(16, -1)[3:5, 1:]
    elif holder == "storage":
        kept = t.untyped_storage()
    elif holder == "as_strided":
        kept = t.as_strided((4, 8), (16, 1), 100)
    elif holder == "dlpack":
        kept = torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(t))
    else:  # autograd keeps the operand of a product for the backward pass
        w = torch.ones(n, dtype=dtype, requires_grad=True)
        kept = (w * t).sum()
    address = t.data_ptr()
    del t
    gc.collect()
    others = [pool.tensor((n,), dtype, _MIB) for _ in range(3)]
    assert all(o.data_ptr() != address for o in others)
    for other in others:
        other.fill_(-1.0)
    del other
    if holder == "storage":
        values = torch.empty(0, dtype=dtype).set_(kept)
    elif holder == "autograd":
        kept.backward()
        values = w.grad
    else:
        values = torch.as_tensor(kept)
    assert bool((values == 7.0).all())
    del kept, values, others
    if holder == "autograd":
        del w
    gc.collect()
    assert pool.lent == 0
    assert pool.idle_bytes == IDLE_PER_SIZE * _MIB  # all four back, two kept


def test_live_tensors_from_many_threads_never_share_memory() -> None:
    pool = ResultPool(idle_max_bytes=8 * _MIB)
    errors: list[str] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        live: list[tuple[torch.Tensor, float]] = []
        for i in range(120):
            n = int(rng.choice([POOL_MIN_BYTES, _MIB + 4096, 2 * _MIB + 4096]))
            t = pool.tensor((n // 4,), torch.float32, n)
            value = float(seed * 1000 + i)
            t.fill_(value)
            live.append((t, value))
            if len(live) > 3 or rng.random() < 0.5:
                u, v = live.pop(int(rng.integers(len(live))))
                if not bool((u == v).all()):
                    errors.append(f"thread {seed}: a tensor was overwritten while it lived")
        for u, v in live:
            if not bool((u == v).all()):
                errors.append(f"thread {seed}: a tensor was overwritten while it lived")

    def release() -> None:
        while any(th.is_alive() for th in threads):
            pool.release_idle()
            time.sleep(0.002)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(6)]
    releaser = threading.Thread(target=release)
    for th in threads:
        th.start()
    releaser.start()
    for th in [*threads, releaser]:
        th.join(60)
        assert not th.is_alive(), "a thread of the pool hangs"
    assert not errors, errors[:3]
    gc.collect()
    assert pool.lent == 0
    assert pool.idle_bytes <= 8 * _MIB


def test_idle_memory_stays_within_the_bound_and_old_sizes_are_evicted() -> None:
    bound = 10 * _MIB
    pool = ResultPool(idle_max_bytes=bound)
    for size_mib in (1, 2, 3, 1, 4, 2):
        ts = [pool.tensor((size_mib * _MIB,), torch.uint8, size_mib * _MIB) for _ in range(3)]
        del ts
        assert pool.idle_bytes <= bound
    # classes 1, 2, 4, 1, 4 and 2 MiB, each reserving room for two: making room for
    # the 4 MiB class evicted 1 and 2, and the last 2 MiB needed the room of 1 and 4
    assert pool.idle_bytes == IDLE_PER_SIZE * 2 * _MIB
    big = pool.tensor((6 * _MIB,), torch.uint8, 6 * _MIB)  # class 8 MiB, 2 x 8 > bound
    big.fill_(3)
    del big
    assert pool.idle_bytes == IDLE_PER_SIZE * 2 * _MIB
    assert pool.release_idle() == IDLE_PER_SIZE * 2 * _MIB
    assert pool.idle_bytes == 0


def test_a_pool_that_keeps_nothing_still_lends() -> None:
    pool = ResultPool(idle_max_bytes=0)
    t = pool.tensor((2, _MIB), torch.int8, 2 * _MIB)
    t.fill_(5)
    assert int(t.sum()) == 10 * _MIB
    del t
    assert pool.idle_bytes == 0

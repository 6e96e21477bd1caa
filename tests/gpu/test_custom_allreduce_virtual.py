"""Custom all-reduce kernels at 2, 4 and 8 virtual ranks on one GPU.

Every rank's kernel runs on its own stream over its own buffer, concurrently,
as N processes would; results are checked against a float64 reference and
for bitwise equality across ranks, eagerly and replayed from a CUDA graph.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.cupy, pytest.mark.timeout(600)]

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
SIZES = [16, 1024, 64 * 1024 + 16, 1 << 20, 8 << 20]  # bytes


def _virtual(n: int, **kw):
    from device_comms.cuda.custom_allreduce.virtual import VirtualRanks

    return VirtualRanks(n, "cuda:0", **kw)


def _inputs(n: int, nbytes: int, dtype: torch.dtype) -> list[torch.Tensor]:
    numel = nbytes // torch.tensor([], dtype=dtype).element_size()
    return [torch.randn(numel, dtype=dtype, device="cuda") for _ in range(n)]


def _check(inputs: list[torch.Tensor], outs: list[torch.Tensor]) -> float:
    ref = torch.stack([x.double() for x in inputs]).sum(0)
    rel = ((outs[0].double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert rel == rel and rel < TOL[inputs[0].dtype], f"relative error {rel}"
    for r, o in enumerate(outs):
        assert torch.equal(o, outs[0]), f"rank {r} differs from rank 0"
    return rel


@pytest.mark.parametrize("variant", ["oneshot", "twoshot"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("n", [2, 4, 8])
def test_eager_matches_float64(n: int, dtype: str, variant: str) -> None:
    with _virtual(n) as vr:
        for nbytes in SIZES:
            inputs = _inputs(n, nbytes, DTYPES[dtype])
            outs = vr.all_reduce(inputs, variant=variant)
            torch.cuda.synchronize()
            vr.check_errors()
            _check(inputs, outs)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_graph_replay_reads_registered_inputs(n: int) -> None:
    with _virtual(n) as vr:
        bufs = {nb: _inputs(n, nb, torch.bfloat16) for nb in (4096, 512 << 10, 4 << 20)}
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with vr.capture(), torch.cuda.graph(g):
            outs = {nb: vr.all_reduce(xs) for nb, xs in bufs.items()}
            chained = vr.all_reduce([o * 2 for o in outs[4096]])
        for _ in range(5):
            for xs in bufs.values():
                for x in xs:
                    x.copy_(torch.randn_like(x))
            g.replay()
            torch.cuda.synchronize()
            vr.check_errors()
            for nb, xs in bufs.items():
                _check(xs, outs[nb])
            assert torch.allclose(chained[0].float(), outs[4096][0].float() * 2 * n, rtol=2e-2)


def test_ten_thousand_random_calls_do_not_hang() -> None:
    rng = random.Random(1234)
    for n in (2, 4, 8):
        with _virtual(n) as vr:
            for i in range(10_000 if n == 8 else 2_000):
                dtype = rng.choice(list(DTYPES.values()))
                nbytes = 16 * rng.randint(1, 65536)  # 16 B .. 1 MiB
                inputs = _inputs(n, nbytes, dtype)
                outs = vr.all_reduce(inputs)
                if i % 500 == 0:
                    torch.cuda.synchronize()
                    vr.check_errors()
                    _check(inputs, outs)
            torch.cuda.synchronize()
            vr.check_errors()


def test_missing_rank_times_out_with_its_name() -> None:
    """A rank whose kernel never runs makes its peers give up and name it."""
    from device_comms.errors import CollectiveTimeout

    with _virtual(2, timeout=0.2) as vr:
        x = _inputs(2, 4096, torch.float32)
        out = torch.empty_like(x[0])
        vr._launch("oneshot", torch.float32, 0, 0, out, x[0].nbytes, vr._streams[0])
        torch.cuda.synchronize()
        with pytest.raises(CollectiveTimeout, match="rank 1 did not reach the start barrier"):
            vr.check_errors()


@pytest.mark.parametrize("which", [0, 1])
def test_caller_on_a_rank_stream_does_not_serialise_the_ranks(which: int) -> None:
    # torch's stream pool is round-robin: after enough streams, a rank's stream
    # can be the caller's current one. The ranks must still run concurrently.
    with _virtual(2, timeout=5.0) as vr:
        inputs = _inputs(2, 4096, torch.float32)
        torch.cuda.synchronize()
        with torch.cuda.stream(vr._streams[which]):
            outs = vr.all_reduce(inputs, variant="oneshot")
        torch.cuda.synchronize()
        vr.check_errors()
        _check(inputs, outs)

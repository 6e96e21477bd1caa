"""A rank that rejects its own arguments does not leave its peers waiting.

Only one rank passes a wrong argument (its own size entry, the broadcast
source's tensor...). It raises its TypeError/ValueError; the peers, which made
the same call validly, raise PeerRejectedError naming that rank within a
second or two, and the group keeps working. Shared memory and plain gloo,
2 and 3 ranks, every rank as the offender.
"""

from __future__ import annotations

import pytest

from device_comms import CollectiveMismatch, DeviceCommError, PeerRejectedError
from tests.device_comms import _reject_fns as fns


def test_peer_rejected_error_is_in_the_family() -> None:
    assert issubclass(PeerRejectedError, CollectiveMismatch)
    assert issubclass(PeerRejectedError, DeviceCommError) and issubclass(PeerRejectedError, ValueError)
    e = PeerRejectedError("g", "broadcast", 2, "ValueError: input_ must be contiguous")
    assert "rank 2" in str(e) and "contiguous" in str(e) and "Fix the call on rank 2" in str(e)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
def test_one_rank_rejects_and_peers_raise_promptly(dist_pool, world_size: int) -> None:
    outs = dist_pool(world_size).run(fns.rejected_calls, timeout=75)
    n = world_size
    for rank, out in enumerate(outs):
        assert out["mode"] == "shm"
        for path in ("shm", "gloo"):
            for name, (_, word) in fns.CASES.items():
                for bad in range(n):
                    got, total, bcast = out[f"{path}|{name}|{bad}"]
                    where = f"{path} {name} offender {bad}, rank {rank}"
                    if rank == bad:
                        assert got[0] in ("ValueError", "TypeError"), f"{where}: {got}"
                        assert word in got[1], f"{where}: {got[1]!r} lacks {word!r}"
                    else:
                        assert got[0] == "PeerRejectedError", f"{where}: {got}"
                        assert got[3] == bad and f"rank {bad}" in got[1], f"{where}: {got[1]}"
                        assert word in got[1], f"{where}: reason missing in {got[1]!r}"
                        assert got[2] < 2.0, f"{where}: took {got[2]:.2f}s"
                    assert total == [float(n)] * 2, f"{where}: next all_reduce gave {total}"
                    assert bcast == [float(bad)] * 2, f"{where}: next broadcast gave {bcast}"
            assert "src" in out[f"{path}|agreed"], out[f"{path}|agreed"]
            want = [float(r) for r in range(n) for _ in range(r + 1)]
            assert out[f"{path}|final"] == want, (path, out[f"{path}|final"])

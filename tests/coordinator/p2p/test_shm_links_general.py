"""Tensor dicts along pipelines of 2-4 ranks, on links and on the CPU group.

One multi-process run per world size sends every case of :data:`CASES` from
each rank to the next and back (``rank r -> r + 1``, then ``r + 1 -> r``),
a stream of dicts whose keys, shapes and dtypes change, dicts both ways
between neighbours at once (asynchronous sends, threads), and interleaves
them with ``send_object``, single tensors and collectives of the same group.
Each case then gets its own test id, read from that one run's results.

World size 3 runs with ``GROUPCOORD_P2P_SHM=0`` on rank 1 only: its sends keep
to the CPU group, its receives still take the links its neighbours offer.

Faults: a receiver that never comes (at a direction's first dict, and once
the ring is full) times the sender out by name; a peer SIGKILLed while a
64 MiB dict streams is named by the survivor's PeerDiedError.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

# ---------------------------------------------------------------------- the cases

_RING = 2 << 20  # a link's ring chunk (coordinator.p2p.shm_links.CHUNK_BYTES)
_PART = _RING - (64 << 10)  # bytes a dict's message carries (link_messages.PART_BYTES)


def _every_dtype(src: int) -> dict[str, torch.Tensor]:
    """A small tensor of every dtype a receiver can allocate, with known bytes."""
    from coordinator.wire.tensor_dict_format import DTYPES

    out = {}
    base = torch.arange(12).reshape(3, 4) % 7 + src
    for name, dt in sorted(DTYPES.items()):
        if dt.is_complex:
            out[name] = torch.complex(base.float(), -base.float()).to(dt)
        elif dt == torch.bool:
            out[name] = base % 2 == 0
        else:
            try:
                out[name] = base.to(dt)
            except (RuntimeError, TypeError):  # bit and sub-byte types: their bytes
                out[name] = (torch.arange(12 * dt.itemsize, dtype=torch.uint8) + src).view(
                    dt).reshape(3, 4)
    return out


def _views(src: int) -> dict[str, Any]:
    s = torch.arange(64, dtype=torch.float32).reshape(8, 8) + src
    flat = torch.arange(100, dtype=torch.float32) - src
    return {
        "transposed": s.t(), "sliced": s[2:5, 1:7], "expanded": torch.ones(1, 4).expand(5, 4),
        "expanded-0d": torch.tensor(3.0 + src).expand(7), "offset": flat[17:40],
        "stepped": flat[3::7], "share-a": flat[:10], "share-b": flat[5:15],
        "neg-view": torch.complex(s, s).conj().imag, "one-odd-stride": flat[3:4:2],
        "diagonal": s.diagonal(), "channels-last": torch.arange(48.0).reshape(1, 3, 4, 4)
        .contiguous(memory_format=torch.channels_last),
    }


def _changing(i: int) -> dict[str, Any]:
    """The ``i``-th dict of a stream whose keys, shapes and dtypes change."""
    dtypes = [torch.float32, torch.int8, torch.bfloat16, torch.bool, torch.complex64,
              torch.uint16, torch.float8_e5m2]
    t = (torch.arange(i % 13) % 2).to(dtypes[i % len(dtypes)])
    out: dict[Any, Any] = {f"k{i % 7}": t.reshape(1, -1) if i % 2 else t, "i": i}
    if i % 5 == 0:
        out[i] = torch.full((i % 3, 2), i, dtype=torch.int64)
    if i % 17 == 0:  # now and then a dict larger than a ring chunk
        out["big"] = torch.full((_RING + i,), i % 251, dtype=torch.uint8)
    return out


#: ``name -> builder(src)``; every rank builds the same dict for a sender.
CASES: dict[str, Callable[[int], dict[Any, Any]]] = {
    "every-dtype": _every_dtype,
    "empty-dict": lambda src: {},
    "no-tensors": lambda src: {"a": src, "b": None, "c": [1, "x", (2, 3)], 5: "int key",
                               (1, 2): "tuple key", None: "none key", 2.5: b"bytes"},
    "nested-tensors": lambda src: {"n": {"t": torch.ones(3) + src, "l": [torch.zeros(2), 3]},
                                   "x": torch.ones(1)},
    "zero-dim-and-empty": lambda src: {
        "0d": torch.tensor(5 + src), "0d-bool": torch.tensor(True), "empty": torch.empty(0),
        "empty-3d": torch.empty(3, 0, 2, dtype=torch.bfloat16), "none": None},
    "views": _views,
    "needs-grad": lambda src: {"p": torch.nn.Parameter(torch.ones(3) * src),
                               "g": torch.ones(2, requires_grad=True) * 2},
    "ring-chunk": lambda src: {"b": torch.arange(_RING // 4, dtype=torch.float32) + src},
    "just-under-part": lambda src: {"a": torch.full((_PART - 8,), src, dtype=torch.uint8),
                                    "b": torch.ones(8, dtype=torch.uint8)},
    "just-over-part": lambda src: {"a": torch.full((_PART - 8,), src, dtype=torch.uint8),
                                   "b": torch.ones(9, dtype=torch.uint8)},
    "many-quarter-parts": lambda src: {f"k{j}": torch.full((_PART // 4 - 1000,), j + src,
                                                           dtype=torch.uint8) for j in range(9)},
    # metadata alone larger than a ring chunk: the dict's message takes the overflow socket
    "large-metadata": lambda src: {"v": list(range(600_000)), "t": torch.ones(5) * src},
    "16MiB-mixed": lambda src: {
        "a": torch.arange(4 << 20, dtype=torch.float32) + src,
        "b": torch.arange(1000).to(torch.bfloat16),
        "c": torch.arange(600_000, dtype=torch.float32).reshape(600, 1000).t()},
}


def _quantized() -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {"ok": torch.ones(2), "q": torch.quantize_per_tensor(torch.ones(4), 0.1, 3,
                                                                    torch.qint8)}


#: Cases checked by the same run, outside :data:`CASES`.
EXTRA = ["quantized-refused", "changing-stream", "interleaved", "both-ways-async",
         "both-ways-threads"]

# ---------------------------------------------------------------------- rank side


def _same(got: Any, want: Any) -> bool:
    """Equal values, types and (for tensors) dtype, shape and bytes; plain tensors."""
    from device_comms.validation import dense

    if isinstance(want, torch.Tensor):
        if (type(got) is not torch.Tensor or got.requires_grad or got.dtype != want.dtype
                or got.shape != want.shape):
            return False
        if not want.numel():
            return True
        want = dense(want.detach().as_subclass(torch.Tensor))
        return bool(torch.equal(dense(got).reshape(-1).view(torch.uint8),
                                want.reshape(-1).view(torch.uint8)))
    if isinstance(want, dict):
        return (type(got) is dict and list(got) == list(want)
                and all(_same(got[k], want[k]) for k in want))
    if isinstance(want, (list, tuple)):
        return (type(got) is type(want) and len(got) == len(want)
                and all(_same(g, w) for g, w in zip(got, want, strict=False)))
    return type(got) is type(want) and got == want


def _diff(got: Any, want: dict[Any, Any]) -> list[str]:
    if not isinstance(got, dict) or list(got) != list(want):
        return [f"keys {list(got) if isinstance(got, dict) else type(got)} != {list(want)}"]
    return [f"{k!r}: {got[k]!r:.60}" for k in want if not _same(got[k], want[k])]


def _record(results: dict[str, list[str]], case: str, fn: Callable[[], list[str]]) -> None:
    try:
        results[case] += fn()
    except Exception as e:
        results[case].append(f"{type(e).__name__}: {e}"[:400] + traceback.format_exc()[-600:])


def pipeline(rank: int, n: int, shm_off: list[int]) -> dict[str, list[str]]:
    """Every check on this rank; ``{case: problems}`` (empty lists: all well)."""
    from coordinator import GroupCoordinator

    if rank in shm_off:
        os.environ["GROUPCOORD_P2P_SHM"] = "0"
    g = GroupCoordinator([list(range(n))], rank, "gloo", True, group_name=f"pipe{n}",
                         timeout=60)
    results: dict[str, list[str]] = {c: [] for c in [*CASES, *EXTRA]}
    nxt, prv = rank + 1, rank - 1
    try:
        for case, build in CASES.items():  # forward, then back
            def forward() -> list[str]:
                bad = _diff(g.recv_tensor_dict(prv), build(prv)) if prv >= 0 else []
                if nxt < n:
                    g.send_tensor_dict(build(rank), nxt)
                return [f"forward at rank {rank}: {b}" for b in bad]

            def back() -> list[str]:
                bad = _diff(g.recv_tensor_dict(nxt), build(nxt)) if nxt < n else []
                if prv >= 0:
                    g.send_tensor_dict(build(rank), prv)
                return [f"back at rank {rank}: {b}" for b in bad]

            _record(results, case, forward)
            _record(results, case, back)
        _record(results, "quantized-refused", lambda: _quantized_refused(g, rank, n))
        _record(results, "changing-stream", lambda: _changing_stream(g, rank, n))
        _record(results, "interleaved", lambda: _interleaved(g, rank, n))
        _record(results, "both-ways-async", lambda: _both_ways(g, rank, n, False))
        _record(results, "both-ways-threads", lambda: _both_ways(g, rank, n, True))
        g.barrier()
    finally:
        os.environ.pop("GROUPCOORD_P2P_SHM", None)
        g.destroy()
    return results


def _quantized_refused(g: Any, rank: int, n: int) -> list[str]:
    """A quantized tensor cannot travel: TypeError naming its key on the sender,
    and the receiver is told in place of the dict (PeerRejectedError, or
    CollectiveMismatch over the CPU group); the next dict then arrives."""
    from coordinator.errors import CollectiveMismatch

    bad = []
    if rank == 0:
        try:
            g.send_tensor_dict(_quantized(), 1)
            bad.append("send_tensor_dict of a quantized tensor returned")
        except TypeError as e:
            if "'q'" not in str(e):
                bad.append(f"the error does not name the key: {e}")
        g.send_tensor_dict({"after": 1}, 1)
    elif rank == 1:
        try:
            got = g.recv_tensor_dict(0)
            bad.append(f"rank 1 was not told of the refused dict; got {got!r:.100}")
        except CollectiveMismatch as e:
            if "'q'" not in str(e) or "rank 0" not in str(e):
                bad.append(f"the receiver's error does not name the key and sender: {e}")
        got = g.recv_tensor_dict(0)
        if got != {"after": 1}:
            bad.append(f"rank 1 got {got!r:.100}")
    return bad


def _changing_stream(g: Any, rank: int, n: int) -> list[str]:
    """300 dicts down the pipeline and 300 back, each unlike the last."""
    bad = []
    for i in range(300):
        if rank > 0:
            bad += [f"forward #{i}: {b}" for b in _diff(g.recv_tensor_dict(rank - 1), _changing(i))]
        if rank + 1 < n:
            g.send_tensor_dict(_changing(i), rank + 1)
    for i in range(300):
        if rank + 1 < n:
            bad += [f"back #{i}: {b}" for b in _diff(g.recv_tensor_dict(rank + 1), _changing(i))]
        if rank > 0:
            g.send_tensor_dict(_changing(i), rank - 1)
    return bad[:10]


def _interleaved(g: Any, rank: int, n: int) -> list[str]:
    """Dicts between objects, single tensors and collectives of the same group;
    ``dst``/``src`` left to their defaults (the next / previous rank)."""
    bad = []
    for i in range(5):
        nxt, prv = (rank + 1) % n, (rank - 1) % n
        if rank % 2 == 0:  # even ranks send first: no cycle of blocking sends
            g.send_object(["obj", i, rank], nxt)
            g.send_tensor_dict({"i": i, "t": torch.full((i + 1,), rank)})
            g.send(torch.full((3,), float(rank)), nxt)
        got_obj = g.recv_object(prv)
        got = g.recv_tensor_dict()
        got_t = g.recv(torch.Size([3]), torch.float32, prv)
        if rank % 2:
            g.send_object(["obj", i, rank], nxt)
            g.send_tensor_dict({"i": i, "t": torch.full((i + 1,), rank)})
            g.send(torch.full((3,), float(rank)), nxt)
        total = g.all_reduce(torch.ones(2))
        if got_obj != ["obj", i, prv] or not _same(got, {"i": i, "t": torch.full((i + 1,), prv)}):
            bad.append(f"#{i}: {got_obj!r} {got!r:.80}")
        if not torch.equal(got_t, torch.full((3,), float(prv))) or total.tolist() != [n, n]:
            bad.append(f"#{i}: tensor {got_t} all_reduce {total}")
    return bad


def _both_ways(g: Any, rank: int, n: int, threads: bool) -> list[str]:
    """Neighbours (0-1, 2-3) send to each other at once, large dicts included."""
    peer = rank ^ 1
    if peer >= n:
        return []
    bad = []
    for i in range(40):
        size = [i, 10_000, _RING + 7][i % 3]
        mine = {"i": i, "t": torch.full((size,), rank, dtype=torch.int16)}
        want = {"i": i, "t": torch.full((size,), peer, dtype=torch.int16)}
        if threads:
            got: dict[str, Any] = {}
            t = threading.Thread(target=lambda: got.update(d=g.recv_tensor_dict(peer)))
            t.start()
            g.send_tensor_dict(mine, peer)
            t.join(60)
            bad += _diff(got.get("d"), want)
        else:
            h = g.isend_tensor_dict(mine, peer)
            bad += _diff(g.irecv_tensor_dict(peer).wait(), want)
            h.wait()
    return bad[:10]


# ---------------------------------------------------------------------- tests

#: ``id -> (world size, ranks with GROUPCOORD_P2P_SHM=0)``.
RUNS = {"2-ranks": (2, []), "2-ranks-cpu-group": (2, [0, 1]), "3-ranks-rank1-off": (3, [1]),
        "4-ranks": (4, [])}
#: Default runs keep CI short: links and the CPU group between two ranks; a
#: 4-stage pipeline and links off on one rank of three run with -m slow.
_SLOW_RUNS = {"3-ranks-rank1-off", "4-ranks"}
_results: dict[str, Any] = {}


def _run(dist_pool: Any, run: str) -> list[dict[str, list[str]]]:
    """The run's results per rank, computed once per run for all its cases (a run
    that failed as a whole fails each of its cases, without running again)."""
    if run not in _results:
        n, off = RUNS[run]
        t0 = time.monotonic()
        try:
            _results[run] = dist_pool(n).run(pipeline, off, timeout=300)
        except Exception as e:
            _results[run] = e
        print(f"run {run}: {time.monotonic() - t0:.1f} s")
    got = _results[run]
    if isinstance(got, Exception):
        raise AssertionError(f"run {run} failed as a whole: {got}") from got
    return got


@pytest.mark.timeout(450)
@pytest.mark.parametrize("case", [*CASES, *EXTRA])
@pytest.mark.parametrize("run", [
    pytest.param(r, marks=[pytest.mark.slow] if r in _SLOW_RUNS else []) for r in RUNS])
def test_pipeline_case(dist_pool, run, case):
    per_rank = _run(dist_pool, run)
    problems = {rank: res[case] for rank, res in enumerate(per_rank) if res[case]}
    assert problems == {}


def big_both_ways(rank: int, n: int) -> list[str]:
    """64 MiB (and a strided view of it) each way between two ranks, at once."""
    from coordinator import GroupCoordinator

    g = GroupCoordinator([list(range(n))], rank, "gloo", True, group_name="big64", timeout=60)
    try:
        big = torch.arange(16 << 20, dtype=torch.float32) + rank
        h = g.isend_tensor_dict({"b": big, "s": big[::3]}, 1 - rank)
        got = g.recv_tensor_dict(1 - rank)
        h.wait()
        want = torch.arange(16 << 20, dtype=torch.float32) + 1 - rank
        return _diff(got, {"b": want, "s": want[::3]})
    finally:
        g.destroy()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_64MiB_dicts_both_ways(dist_pool):
    assert dist_pool(2).run(big_both_ways, timeout=150) == [[], []]


# ---------------------------------------------------------------------- faults


def silent_receiver(rank: int, n: int, when: str) -> dict[str, Any]:
    """Rank 1 never receives (``at-first-dict``), or receives one dict and then
    no more (``after-settling``): rank 0's sends must end within the group's
    timeout with CommTimeout naming the group, the op and rank 1."""
    from coordinator.p2p.shm_links import CHUNKS
    from tests.coordinator.p2p.test_shm_links import timeout_outcome

    g = _group(rank, n, f"silent-{when}", timeout=1.5)
    try:
        if rank == 1:
            if when == "after-settling":
                g.recv_tensor_dict(0)
            time.sleep(4.0)  # past rank 0's timeout (1.5 s), not leaving before it
            return {}
        if when == "after-settling":
            g.send_tensor_dict({"settle": 1}, 1)

        def fill() -> None:
            for i in range(CHUNKS + 1):  # the ring holds CHUNKS dicts
                g.send_tensor_dict({"i": i, "x": torch.ones(4)}, 1)

        return timeout_outcome(fill)
    finally:
        g.destroy()


def _group(rank: int, n: int, name: str, timeout: float) -> Any:
    from coordinator import GroupCoordinator

    return GroupCoordinator([list(range(n))], rank, "gloo", True, group_name=name,
                            timeout=timeout)


@pytest.mark.slow  # test_shm_links.py covers this case in the default run
@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["at-first-dict", "after-settling"])
def test_a_receiver_that_never_comes_times_out_the_sender(dist_pool, when):
    res = dist_pool(2).run(silent_receiver, when, timeout=100)[0]
    assert res["error"] == "CommTimeout", res
    assert f"silent-{when}" in res["msg"] and "send_tensor_dict" in res["msg"], res
    assert 1 in res["peers"], res
    assert 1.2 < res["s"] < 10, res


def killed_mid_dict(rank: int, n: int, victim: int) -> dict[str, Any]:
    """A 64 MiB dict (32 parts) is cut short by SIGKILL of ``victim`` while it
    streams: the survivor's call raises PeerDiedError naming it, quickly."""
    import signal

    from coordinator.errors import PeerDiedError

    g = _group(rank, n, f"killed-mid-dict-{victim}", timeout=60)
    g.send_tensor_dict({"settle": 1}, 1) if rank == 0 else g.recv_tensor_dict(0)
    g.barrier()
    if rank == victim:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
        if rank == 1:
            time.sleep(100)  # the receiver dies without reading the parts
        while True:  # the sender dies while streaming
            g.send_tensor_dict({"big": torch.zeros(16 << 20)}, 1)
    t0 = time.monotonic()
    try:
        while True:
            if rank == 0:
                g.send_tensor_dict({"big": torch.zeros(16 << 20)}, 1)
            else:
                g.recv_tensor_dict(0)
    except PeerDiedError as e:
        out: dict[str, Any] = {"error": "PeerDiedError", "peers": list(e.peers)}
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}"}
    out["s"] = time.monotonic() - t0
    g.destroy()
    return out


@pytest.mark.slow  # test_shm_links.py covers this case in the default run
@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [0, 1], ids=["sender-killed", "receiver-killed"])
def test_a_peer_killed_mid_dict_is_named(victim):
    import signal

    from shm_broadcast.ranks.launcher import spawn_group

    outcomes = spawn_group(killed_mid_dict, 2, (victim,), timeout=90)
    assert outcomes[victim].exitcode == -signal.SIGKILL, outcomes[victim]
    res = outcomes[1 - victim]
    assert res.ok, res.error
    assert res.result["error"] == "PeerDiedError" and victim in res.result["peers"], res.result
    assert res.result["s"] < 15, res.result

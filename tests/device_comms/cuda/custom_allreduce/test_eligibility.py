"""Which groups and calls may use the custom all-reduce."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch

from device_comms.cuda.custom_allreduce import eligibility as elig

SMALL_MAX = 1024


# ---------------------------------------------------------------------- group
@pytest.mark.parametrize(
    "world_size, ok",
    [(1, False), (2, True), (3, False), (4, True), (5, False), (6, True), (7, False), (8, True),
     (16, False)],
    ids=lambda v: f"ws{v}" if isinstance(v, int) and not isinstance(v, bool) else str(v),
)
def test_world_sizes(world_size: int, ok: bool) -> None:
    v = elig.group_verdict(world_size, same_node=True, p2p_ok=True, enabled=True)
    assert v.ok is ok
    assert (v.reason == "") if ok else (f"world size {world_size}" in v.reason)


@pytest.mark.parametrize(
    "same_node, p2p_ok, enabled, words",
    [
        (True, True, False, "disabled"),
        (False, True, True, "node"),
        (True, False, True, "peer-to-peer"),
        (False, False, False, "disabled"),  # the first failing rule is named
    ],
    ids=["disabled", "multi-node", "no-p2p", "all-no"],
)
def test_group_reasons(same_node: bool, p2p_ok: bool, enabled: bool, words: str) -> None:
    v = elig.group_verdict(4, same_node, p2p_ok, enabled)
    assert not v.ok and words in v.reason


def test_verdict_is_frozen_and_world_size_typed() -> None:
    v = elig.group_verdict(2, True, True, True)
    assert v == elig.GroupVerdict(True, "")
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.ok = False  # type: ignore[misc]
    with pytest.raises(TypeError, match="world_size"):
        elig.group_verdict("2", True, True, True)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- env
@pytest.mark.parametrize(
    "value, disabled",
    [("1", True), ("true", True), ("TRUE", True), (" yes ", True), ("On", True),
     ("0", False), ("false", False), ("no", False), ("off", False), ("", False),
     ("2", False), ("disable", False), (None, False)],
    ids=["1", "true", "TRUE", "yes-padded", "On", "0", "false", "no", "off", "empty", "2",
         "disable-word", "unset"],
)
def test_env_values(value: str | None, disabled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {} if value is None else {elig.ENV_DISABLE: value}
    assert elig.disabled_by_env(env) is disabled
    if value is None:
        monkeypatch.delenv(elig.ENV_DISABLE, raising=False)
    else:
        monkeypatch.setenv(elig.ENV_DISABLE, value)
    assert elig.disabled_by_env() is disabled


# ---------------------------------------------------------------------- max_size
@pytest.mark.parametrize(
    "value, expected",
    [(16, 16), (elig.DEFAULT_MAX_SIZE, 8 * 2**20), (np.int64(32), 32)],
    ids=["16", "default", "numpy-int"],
)
def test_max_size_ok(value: object, expected: int) -> None:
    out = elig.check_max_size(value)
    assert out == expected and type(out) is int


@pytest.mark.parametrize(
    "value, exc",
    [(0, ValueError), (-16, ValueError), (8, ValueError), (17, ValueError),
     (16.0, TypeError), ("16", TypeError), (True, TypeError), (None, TypeError)],
    ids=["zero", "negative", "8", "17", "float", "str", "bool", "none"],
)
def test_max_size_bad(value: object, exc: type[Exception]) -> None:
    with pytest.raises(exc, match="max_size"):
        elig.check_max_size(value)


# ---------------------------------------------------------------------- per call
@pytest.mark.parametrize(
    "dtype, ok",
    [(torch.float16, True), (torch.bfloat16, True), (torch.float32, True),
     (torch.float64, False), (torch.int32, False), (torch.int8, False), (torch.uint8, False),
     (torch.bool, False), (torch.complex64, False)],
    ids=lambda v: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else str(v),
)
def test_dtypes(dtype: torch.dtype, ok: bool) -> None:
    t = torch.zeros(64, dtype=dtype)  # 64..512 bytes: a multiple of 16 for every dtype
    assert elig.call_eligible(t, SMALL_MAX) is ok


@pytest.mark.parametrize(
    "nbytes, max_size, ok",
    [(0, SMALL_MAX, False), (8, SMALL_MAX, False), (16, SMALL_MAX, True), (24, SMALL_MAX, False),
     (SMALL_MAX, SMALL_MAX, True), (SMALL_MAX + 16, SMALL_MAX, False),
     (elig.DEFAULT_MAX_SIZE, elig.DEFAULT_MAX_SIZE, True),
     (elig.DEFAULT_MAX_SIZE + 16, elig.DEFAULT_MAX_SIZE, False)],
    ids=["0", "8", "16", "24", "max", "max+16", "default-max", "default-max+16"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_sizes(nbytes: int, max_size: int, ok: bool, dtype: torch.dtype) -> None:
    item = torch.empty((), dtype=dtype).element_size()
    t = torch.empty(nbytes // item, dtype=dtype)
    assert t.nbytes == nbytes
    assert elig.call_eligible(t, max_size) is ok


@pytest.mark.parametrize(
    "make, ok",
    [
        (lambda: torch.zeros(8, 16).t(), False),
        (lambda: torch.zeros(64)[::2], False),
        (lambda: torch.zeros(8, 16)[:, :8], False),
        (lambda: torch.zeros(8, 16)[2:6], True),  # a contiguous view
        (lambda: torch.zeros(4, 4, 4).permute(2, 0, 1).contiguous(), True),
    ],
    ids=["transposed", "strided", "column-slice", "row-slice", "made-contiguous"],
)
def test_contiguity(make: Callable[[], torch.Tensor], ok: bool) -> None:
    assert elig.call_eligible(make(), SMALL_MAX) is ok


@pytest.mark.parametrize("value", [None, [1.0] * 4, np.zeros(4, np.float32)],
                         ids=["none", "list", "numpy"])
def test_not_a_tensor_is_not_eligible(value: object) -> None:
    assert elig.call_eligible(value, SMALL_MAX) is False  # type: ignore[arg-type]


# ---------------------------------------------------------------------- P2P cache
class Probe:
    """A peer-access probe that records calls; ``missing`` pairs have no access."""

    def __init__(self, missing: set[tuple[int, int]] | None = None) -> None:
        self.missing: set[tuple[int, int]] = set(missing or ())
        self.calls: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def __call__(self, a: int, b: int) -> bool:
        with self._lock:
            self.calls.append((a, b))
        return (a, b) not in self.missing


def test_p2p_probed_once_per_device_set() -> None:
    cache, probe = elig.P2PCache(), Probe()
    assert cache.check([0, 1, 2, 3], probe)
    assert sorted(probe.calls) == [(a, b) for a in range(4) for b in range(4) if a != b]
    n = len(probe.calls)
    assert cache.check([3, 2, 1, 0], probe) and cache.check((0, 1, 2, 3), probe)
    assert len(probe.calls) == n  # same set, any order: cached
    assert cache.check([0, 1], probe)
    assert len(probe.calls) == n + 2 and len(cache) == 2  # a new set is probed


@pytest.mark.parametrize(
    "devices, calls",
    [([0, 0], 0), ([5, 5, 5, 5], 0), ([0, 0, 1, 1], 2), ([2], 0)],
    ids=["two-on-one-gpu", "four-on-one-gpu", "two-per-gpu", "single"],
)
def test_p2p_same_device_counts_as_accessible(devices: list[int], calls: int) -> None:
    cache, probe = elig.P2PCache(), Probe()
    assert cache.check(devices, probe)
    assert len(probe.calls) == calls and all(a != b for a, b in probe.calls)


@pytest.mark.parametrize("missing", [(0, 1), (1, 0), (3, 2)], ids=["0->1", "1->0", "3->2"])
def test_p2p_one_missing_pair(missing: tuple[int, int]) -> None:
    cache, probe = elig.P2PCache(), Probe({missing})
    assert cache.check([0, 1, 2, 3], probe) is False
    n = len(probe.calls)
    assert cache.check([0, 1, 2, 3], probe) is False and len(probe.calls) == n


def test_p2p_probe_error_is_not_cached() -> None:
    cache = elig.P2PCache()

    def broken(a: int, b: int) -> bool:
        raise RuntimeError("driver said no")

    with pytest.raises(RuntimeError, match="driver said no"):
        cache.check([0, 1], broken)
    assert len(cache) == 0 and cache.check([0, 1], Probe())


def test_p2p_thread_safe_single_probe() -> None:
    cache, probe = elig.P2PCache(), Probe()
    start = threading.Barrier(16)
    results: list[bool] = []

    def worker() -> None:
        start.wait()
        results.append(cache.check([0, 1, 2, 3, 4, 5, 6, 7], probe))

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 16 and len(probe.calls) == 8 * 7


@pytest.mark.parametrize(
    "devices, probe, exc, match",
    [([], Probe(), ValueError, "devices"), ("01", Probe(), TypeError, "devices"),
     ([0, -1], Probe(), ValueError, r"devices\[1\]"),
     ([0, 1.0], Probe(), ValueError, r"devices\[1\]"),
     ([0, 1], None, TypeError, "can_access_peer")],
    ids=["empty", "str", "negative", "float", "probe-none"],
)
def test_p2p_bad_arguments(
    devices: object, probe: object, exc: type[Exception], match: str
) -> None:
    with pytest.raises(exc, match=match):
        elig.P2PCache().check(devices, probe)  # type: ignore[arg-type]


def test_module_cache_is_a_p2p_cache() -> None:
    assert isinstance(elig.P2P_CACHE, elig.P2PCache)


# ---------------------------------------------------------------------- peer-access agreement
def _probe(answer: bool = True, calls: list | None = None) -> Callable[[int, int], bool]:
    def probe(a: int, b: int) -> bool:
        if calls is not None:
            calls.append((a, b))
        return answer
    return probe


def test_local_answer_never_probes_a_device_this_process_does_not_see() -> None:
    calls: list = []
    answer, detail = elig.local_peer_access([0, 5], 2, _probe(calls=calls), elig.P2PCache())
    assert answer is elig.PeerAccess.NOT_VISIBLE and calls == []
    assert detail == "device 5 is not a device of this process (it sees 2)"


def test_local_answer_of_a_probe_that_raises_is_probe_failed() -> None:
    class BindingError(RuntimeError):  # a CUDA binding's own error type
        pass

    def probe(a: int, b: int) -> bool:
        raise BindingError("cudaErrorInvalidDevice")

    cache = elig.P2PCache()
    answer, detail = elig.local_peer_access([0, 1], 2, probe, cache)
    assert answer is elig.PeerAccess.PROBE_FAILED and len(cache) == 0
    assert detail == "the peer-access probe raised BindingError: cudaErrorInvalidDevice"


@pytest.mark.parametrize("access, expected", [(True, elig.PeerAccess.YES),
                                              (False, elig.PeerAccess.NO)], ids=["yes", "no"])
def test_local_answer_of_a_probe(access: bool, expected: elig.PeerAccess) -> None:
    assert elig.local_peer_access([1, 0], 2, _probe(access), elig.P2PCache()) == (expected, "")


def test_local_answer_checks_devices() -> None:
    with pytest.raises(ValueError, match="devices"):
        elig.local_peer_access([0, -1], 2, _probe(), elig.P2PCache())


@pytest.mark.parametrize(
    "answers, reason",
    [([[0, 2], [0, 2]], ""),
     ([[0, 2], [2, 1]], "rank 1 sees 1 CUDA devices, and the group's device indices [0, 1] "
                        "are not all among them"),
     ([[3, 2], [1, 2]], "rank 0 could not probe peer access between the group's devices"),
     ([[0, 2], [1, 2]], "rank 1 found a pair of the group's GPUs without peer-to-peer access")],
    ids=["yes", "not-visible", "probe-failed-first", "no"])
def test_verdict_from_gathered_answers(answers: list, reason: str) -> None:
    ok, why = elig.peer_access_verdict(answers, [0, 1])
    assert ok is (reason == "") and why.startswith(reason) and (reason or why == "")


def test_verdict_adds_this_ranks_detail_only_to_its_own_failure() -> None:
    answers = [[0, 2], [2, 1]]
    _, mine = elig.peer_access_verdict(answers, [0, 1], me=1, detail="device 1 is not here")
    _, theirs = elig.peer_access_verdict(answers, [0, 1], me=0, detail="irrelevant")
    assert mine == f"{theirs} (device 1 is not here)" and "irrelevant" not in theirs
    verdict = elig.group_verdict(2, True, False, True, p2p_reason=mine)
    assert not verdict.ok and verdict.reason == mine


@pytest.mark.parametrize("code", [7, -1, 2**40], ids=str)
def test_verdict_refuses_an_answer_that_is_none(code: int) -> None:
    from device_comms.errors import DecodeError

    with pytest.raises(DecodeError, match=f"rank 1 sent peer-access answer {code}") as info:
        elig.peer_access_verdict([[0, 2], [code, 2]], [0, 1], group="g", me=0)
    assert info.value.peers == (1,)

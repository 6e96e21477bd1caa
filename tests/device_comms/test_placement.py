"""Where two ranks run: last CPU, L2 siblings, and the cached answer of PeerPlacement."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from device_comms.placement import PeerPlacement, _parse_cpu_list, cache_siblings, last_cpu

OWN = sorted(os.sched_getaffinity(0))


def test_parse_cpu_list() -> None:
    assert _parse_cpu_list("0-3,8\n") == {0, 1, 2, 3, 8}
    assert _parse_cpu_list("5") == {5}
    assert _parse_cpu_list("") == frozenset()


def test_last_cpu_of_this_process() -> None:
    assert last_cpu(os.getpid()) in range(os.cpu_count() or 1)


def test_unreadable_process() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert last_cpu(gone.pid) is None
    assert PeerPlacement(gone.pid).shares_cache() is False  # the safe answer


def test_a_cpu_is_its_own_cache_sibling() -> None:
    for cpu in OWN:
        assert cpu in cache_siblings(cpu)


def test_same_process_shares_its_cache() -> None:
    assert PeerPlacement(os.getpid(), refresh_s=0.0).shares_cache() is True


@pytest.mark.timeout(30)
@pytest.mark.skipif(len(OWN) < 2, reason="needs two CPUs")
def test_peer_on_another_cpu() -> None:
    me, other = OWN[0], OWN[1]
    before = os.sched_getaffinity(0)
    peer = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(peer.pid, {other})
        os.sched_setaffinity(0, {me})
        os.sched_yield()  # run once on `me`
        placement = PeerPlacement(peer.pid, refresh_s=0.0)
        while last_cpu(peer.pid) != other:  # the busy peer moves to its CPU at once
            os.sched_yield()
        assert placement.shares_cache() is (other in cache_siblings(me))
        cached = PeerPlacement(peer.pid, refresh_s=60.0)
        first = cached.shares_cache()
        os.sched_setaffinity(peer.pid, {me})
        assert cached.shares_cache() is first  # reused within refresh_s
    finally:
        os.sched_setaffinity(0, before)
        peer.kill()
        peer.wait()

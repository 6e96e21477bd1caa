"""The queue's creation options: defaults and checks (shm_broadcast.queue.options)."""

from __future__ import annotations

from typing import Any

import pytest

from shm_broadcast.queue.options import (
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_MAX_CHUNKS,
    check_ring_options,
    check_wait_policy,
)
from shm_broadcast.waiting.policy import WaitPolicy


def test_defaults_pass_their_own_checks() -> None:
    check_ring_options(DEFAULT_MAX_CHUNK_BYTES, DEFAULT_MAX_CHUNKS, None)
    check_ring_options(128, 1, "10.0.0.1")


@pytest.mark.parametrize("args,error,named", [
    (("128", 4, None), TypeError, "max_chunk_bytes"),
    ((127, 4, None), ValueError, "max_chunk_bytes"),
    ((1 << 16, True, None), TypeError, "max_chunks"),
    ((1 << 16, 0, None), ValueError, "max_chunks"),
    ((1 << 16, 4, 127001), TypeError, "connect_ip"),
    ((1 << 16, 4, ""), ValueError, "connect_ip"),
])
def test_bad_ring_options_name_the_argument(args: tuple, error: type, named: str) -> None:
    with pytest.raises(error, match=named):
        check_ring_options(*args)


def test_wait_policy_is_a_policy_or_none() -> None:
    policy = WaitPolicy(spin_s=0.0)
    assert check_wait_policy(policy) is policy
    assert check_wait_policy(None) is None
    bad: Any = "fast"
    with pytest.raises(TypeError, match="wait_policy must be a WaitPolicy, got str"):
        check_wait_policy(bad)

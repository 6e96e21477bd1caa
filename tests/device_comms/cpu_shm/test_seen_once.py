"""SeenOnce: a key counts as seen again only at its next sighting, and the set stays bounded."""

from __future__ import annotations

from device_comms.cpu_shm.seen_once import SeenOnce


def test_a_key_is_seen_again_at_its_second_sighting_only() -> None:
    seen = SeenOnce(4)
    assert [seen.again("a"), seen.again("a"), seen.again("a")] == [False, True, False]


def test_a_full_set_starts_again() -> None:
    seen = SeenOnce(3)
    for key in range(3):
        assert not seen.again(key)
    assert not seen.again(3)  # full: dropped whole, then 3 remembered
    assert not seen.again(0)
    assert seen.again(3)


def test_clear_forgets() -> None:
    seen = SeenOnce(2)
    seen.again("k")
    seen.clear()
    assert not seen.again("k")

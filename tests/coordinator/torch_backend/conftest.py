"""The torch backend tests' rank pools: the suite's shared ones, with the groupcoord
groups a module's tests made dropped when the module ends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.coordinator.torch_backend import cases


@pytest.fixture(scope="module")
def pools(dist_pool: Callable[[int], Any]) -> Iterator[Callable[[int], Any]]:
    """``pools(world)``: ``dist_pool(world)``, its groups dropped after the module."""
    used: set[int] = set()

    def get(world: int) -> Any:
        used.add(world)
        return dist_pool(world)

    yield get
    for w in used:
        dist_pool(w).run(cases.drop_groups, timeout=60)

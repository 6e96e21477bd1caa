"""On/off environment variables read when a group is made accept the same words
as every other (``1/true/yes/on``, ``0/false/no/off``) and refuse anything else
with ``ValueError`` naming the variable, on every rank, before the group is used.
``GROUPCOORD_P2P_SHM`` and ``GROUPCOORD_CPU_SPREAD`` used to take only ``0`` as
off and silently ignored ``off``/``false`` and any typo."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.coordinator.rank_checks import env_set

_VARS = ["GROUPCOORD_P2P_SHM", "GROUPCOORD_CPU_SPREAD"]


def make_group_with(rank: int, world_size: int, var: str, value: str) -> str:
    """Create (and use) a group with ``var=value``: 'ok' or the error's class and text."""
    from coordinator import GroupCoordinator

    with env_set(var, value):
        try:
            g = GroupCoordinator([list(range(world_size))], rank, "gloo", True, True,
                                 group_name=f"env-{var[11:].lower()}", timeout=20.0)
        except Exception as e:  # reported to the test
            return f"{type(e).__name__}: {e}"
        try:
            if rank == 0:
                g.send_tensor_dict({"x": torch.ones(2)}, 1)
            elif rank == 1:
                got = g.recv_tensor_dict(0)
                assert got is not None and torch.equal(got["x"], torch.ones(2))
            ok = g.all_reduce(torch.ones(3))
            assert torch.equal(ok, torch.full((3,), float(world_size)))
        finally:
            g.destroy()
        return "ok"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("value", ["off", "FALSE", "on"])
@pytest.mark.parametrize("var", _VARS)
def test_every_on_off_word_is_accepted(dist_pool: Any, var: str, value: str) -> None:
    assert dist_pool(2).run(make_group_with, var, value, timeout=80) == ["ok", "ok"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("value", ["banana", "2"])
@pytest.mark.parametrize("var", _VARS)
def test_another_value_is_refused_naming_the_variable(dist_pool: Any, var: str,
                                                      value: str) -> None:
    outs = dist_pool(2).run(make_group_with, var, value, timeout=80)
    for out in outs:
        assert out.startswith("ValueError") and var in out and repr(value) in out, outs

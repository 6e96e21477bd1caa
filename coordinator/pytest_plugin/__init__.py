"""A pytest plugin for multi-rank tests: ``@pytest.mark.distributed(world_size=4)``.

Installing groupcoord registers it (the ``pytest11`` entry point
``coordinator.pytest_plugin``); without the installed package, load it with
``-p coordinator.pytest_plugin``. A marked test's body runs on ``world_size``
real rank processes with the world group initialised (gloo, and our
communicators through :mod:`coordinator.parallel_state`); the pytest process
only sends the test and reports how each rank did::

    import pytest
    import torch

    @pytest.mark.distributed(world_size=2, timeout=30)
    def test_sum(rank, world_size, group):
        out = group.all_reduce(torch.tensor([rank + 1.0]))
        assert out.item() == world_size * (world_size + 1) / 2

Modules: :mod:`~coordinator.pytest_plugin.marker` (the marker's options and the
rank layout), :mod:`~coordinator.pytest_plugin.hooks` (the pytest hooks),
:mod:`~coordinator.pytest_plugin.time_limit` (the ranks' time limit next to
pytest-timeout's),
:mod:`~coordinator.pytest_plugin.fixtures` (``rank``, ``world_size``, groups, and
what other arguments the ranks get), :mod:`~coordinator.pytest_plugin.pool` (rank
processes kept across tests), :mod:`~coordinator.pytest_plugin.rank_process` and
:mod:`~coordinator.pytest_plugin.rank_call` (what runs in a rank),
:mod:`~coordinator.pytest_plugin.assertions` (pytest's assert rewriting and
explanations in a rank), :mod:`~coordinator.pytest_plugin.process_state` (what a
reused rank puts back after a test),
:mod:`~coordinator.pytest_plugin.report` (the ranks' results as one outcome).
See docs/pytest_plugin.md.
"""

from coordinator.pytest_plugin.fixtures import (
    dp_group,
    group,
    local_rank,
    pp_group,
    rank,
    tp_group,
    world_size,
)
from coordinator.pytest_plugin.hooks import (
    live_rank_pids,
    pytest_configure,
    pytest_pyfunc_call,
    pytest_runtest_setup,
    pytest_unconfigure,
)

__all__ = [
    "dp_group",
    "group",
    "live_rank_pids",
    "local_rank",
    "pp_group",
    "pytest_configure",
    "pytest_pyfunc_call",
    "pytest_runtest_setup",
    "pytest_unconfigure",
    "rank",
    "tp_group",
    "world_size",
]

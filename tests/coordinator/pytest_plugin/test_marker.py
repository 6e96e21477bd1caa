"""The ``distributed`` marker's options: checked, with messages naming the option."""

from __future__ import annotations

import pytest

from coordinator.pytest_plugin.marker import DEFAULT_TIMEOUT, Layout, is_ours, parse_marker


def test_options_and_defaults() -> None:
    o = parse_marker((4,), {})
    assert o.layout == Layout(4) and o.timeout == DEFAULT_TIMEOUT
    assert not o.layout.model_parallel
    o = parse_marker((), {"world_size": 8, "timeout": 5, "tp": 2, "pp": 2, "hosts": 2,
                          "env": {"B": "2", "A": "1"}})
    assert o.timeout == 5.0 and o.layout.model_parallel_sizes() == (2, 2, 1)
    assert o.layout.env == (("A", "1"), ("B", "2"))  # sorted: equal layouts share a pool
    assert o.layout.describe() == "world_size=8, tp=2, pp=2, hosts=2, env={'A': '1', 'B': '2'}"


def test_simulated_hosts() -> None:
    layout = parse_marker((), {"world_size": 4, "hosts": 2}).layout
    assert [layout.local_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert [layout.rank_env(r)["GROUPCOORD_NODE_ID"] for r in range(4)] == [
        "host0", "host0", "host1", "host1"]
    assert "GROUPCOORD_NODE_ID" not in Layout(4).rank_env(0)


@pytest.mark.parametrize("args,kwargs,message", [
    ((), {}, "world_size is required"),
    ((2, 3), {}, "at most one positional argument"),
    ((2,), {"world_size": 2}, "both as the positional"),
    ((), {"world_size": 0}, "world_size must be an int >= 1, got 0"),
    ((), {"world_size": True}, "world_size must be an int >= 1, got True"),
    ((), {"world_size": 2, "timeout": 0}, "timeout must be a number of seconds > 0"),
    ((), {"world_size": 2, "timeout": float("inf")}, "<= 1e+06, got inf"),
    ((), {"world_size": 2, "timeout": float("nan")}, "<= 1e+06, got nan"),
    ((), {"world_size": 2, "timeout": 1e300}, "<= 1e+06, got 1e+300"),
    ((), {"world_size": 2, "timeout": 1e6 + 1}, "<= 1e+06, got 1000001.0"),
    ((), {"world_size": 2, "tp": 1.5}, "tp must be an int >= 1 or None"),
    ((), {"world_size": 3, "tp": 2}, "tp * pp * dp = 2 must divide world_size=3"),
    ((), {"world_size": 3, "hosts": 2}, "hosts=2 must divide world_size=3"),
    ((), {"world_size": 2, "env": {"A": 1}}, "env must be a mapping of str to str"),
    ((), {"world_size": 2, "hosts": 2, "env": {"GROUPCOORD_NODE_ID": "x"}},
     "env sets GROUPCOORD_NODE_ID"),
    ((), {"world_size": 2, "nodes": 2}, "unknown option(s) ['nodes']"),
])
def test_bad_options_are_named(args: tuple, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match="distributed marker: ") as e:
        parse_marker(args, kwargs)
    assert message in str(e.value)


def test_other_projects_distributed_markers_are_left_alone() -> None:
    assert not is_ours((), {"num_gpus": 2})  # vLLM's CI shard selector
    assert not is_ours((), {})  # a bare @pytest.mark.distributed label
    assert is_ours((2,), {}) and is_ours((), {"world_size": 2})
    assert is_ours((), {"timeout": 5, "num_gpus": 2})  # ours, and refused by parse_marker

"""Tensor dicts: broadcast and pipeline send/recv (with the all-gather optimisation).

The dicts mix float32/bfloat16/float16/int64/bool CPU tensors, non-contiguous
tensors, empty and 0-dim tensors, None, strings, lists, an int key and a float
(``_dist_tensor_dict.mixed_dict``). Receivers compare against the sender's dict, which
they rebuild locally.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator import tensor_dict as td
from tests.coordinator import _dist_tensor_dict as F


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_broadcast_tensor_dict_from_every_src(dist_pool, world_size):
    results = dist_pool(world_size).run(F.run_broadcast_tensor_dict, timeout=150)
    assert all(r == results[0] for r in results)
    assert [c for c in results[0] if c.startswith("broadcast_tensor_dict/")][:world_size] == [
        f"broadcast_tensor_dict/{s}" for s in range(world_size)
    ]
    if world_size == 4:
        assert "wrapper" in results[0]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 4])  # (world size 1: see single_rank_suite)
def test_send_recv_tensor_dict_between_every_pair(dist_pool, world_size):
    assert dist_pool(world_size).run(F.run_send_recv_tensor_dict_world, timeout=150) == [
        ["pairs"]
    ] * world_size


@pytest.mark.timeout(180)
def test_pipeline_send_recv_with_all_gather_group_at_tp2_pp2(dist_pool):
    results = dist_pool(4).run(F.run_send_recv_tensor_dict, timeout=150)
    assert all(r == results[0] for r in results)
    assert results[0] == ["plain", "all-gather", "all-gather-back", "errors",
                          "missing-group", "wrong-size-group"]


# ---------------------------------------------------------------------- single process
def test_flatten_tensor_dict_layout():
    t = torch.arange(6.0).reshape(2, 3)
    meta, payload = td.flatten_tensor_dict(
        {"a": t, "b": None, "c": "s", 3: [1]}, slicing={"a": True}, parts=2
    )
    assert meta[0] == ["a", td.TENSOR, ["cpu", "float32", [2, 3], 2]]
    assert meta[1:] == [["b", td.VALUE, None], ["c", td.VALUE, "s"], [3, td.VALUE, [1]]]
    assert len(payload) == 1 and payload[0] is t
    meta, payload = td.flatten_tensor_dict({"a": t}, inline_cpu=True)
    assert meta == [["a", td.INLINE, t]] and payload == []
    with pytest.raises(TypeError, match="tensor_dict"):
        td.flatten_tensor_dict([("a", t)])


_DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8])
_tensors = st.builds(
    lambda shape, dt: torch.zeros(shape, dtype=dt),
    st.lists(st.integers(0, 3), max_size=3), _DTYPES,
)
_values = st.one_of(st.none(), st.integers(), st.text(max_size=5),
                    st.lists(st.integers(), max_size=3), _tensors)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.one_of(st.text(max_size=4), st.integers()), _values, max_size=8),
       st.integers(1, 4))
def test_flatten_and_slicing_plan_properties(d, n):
    """One metadata entry per key, in order; payload = the tensors; slicing only when divisible."""
    plan = td._slicing_plan(d, n, None)
    meta, payload = td.flatten_tensor_dict(d, slicing=plan, parts=n)
    assert [m[0] for m in meta] == list(d)
    tensors = [v for v in d.values() if isinstance(v, torch.Tensor)]
    assert len(payload) == len(tensors) and all(a is b for a, b in zip(payload, tensors))
    for (key, kind, desc), v in zip(meta, d.values()):
        if isinstance(v, torch.Tensor):
            assert kind == td.TENSOR and desc[2] == list(v.shape)
            assert td._dtype(desc[1]) == v.dtype
            sliced = n > 1 and v.numel() > 0 and v.numel() % n == 0
            assert desc[3] == (n if sliced else 0)
        else:
            assert kind == td.VALUE and desc == v


def test_slicing_plan_overrides():
    d = {"even": torch.zeros(4), "odd": torch.zeros(3), "s": "x"}
    assert td._slicing_plan(d, 2, None) == {"even": True, "odd": False}
    assert td._slicing_plan(d, 2, {"even": False}) == {"even": False, "odd": False}
    with pytest.raises(ValueError, match=r"all_gather_tensors\['odd'\].*3 elements"):
        td._slicing_plan(d, 2, {"odd": True})
    with pytest.raises(ValueError, match="no all_gather_group"):
        td._slicing_plan(d, 1, {"even": True})
    with pytest.raises(TypeError, match="all_gather_tensors"):
        td._slicing_plan(d, 2, ["even"])
    with pytest.raises(ValueError, match="unknown dtype"):
        td._dtype("float33")

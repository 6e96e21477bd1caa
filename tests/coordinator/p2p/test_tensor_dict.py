"""Tensor dicts: broadcast and pipeline send/recv (with the all-gather optimisation).

The dicts mix float32/bfloat16/float16/int64/bool CPU tensors, non-contiguous
tensors, empty and 0-dim tensors, None, strings, lists, an int key and a float
(``mixed_dict`` below). Receivers compare against the sender's dict, which
they rebuild locally.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.group.tensor_dict_calls import slicing_plan
from coordinator.wire import tensor_dict_format as td
from tests.coordinator.rank_checks import (
    expect_equal,
    expect_raises,
    make,
)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_broadcast_tensor_dict_from_every_src(dist_pool, world_size):
    results = dist_pool(world_size).run(run_broadcast_tensor_dict, timeout=150)
    assert all(r == results[0] for r in results)
    assert [c for c in results[0] if c.startswith("broadcast_tensor_dict/")][:world_size] == [
        f"broadcast_tensor_dict/{s}" for s in range(world_size)
    ]
    if world_size == 4:
        assert "wrapper" in results[0]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 4])  # (world size 1: see single_rank_suite)
def test_send_recv_tensor_dict_between_every_pair(dist_pool, world_size):
    assert dist_pool(world_size).run(run_send_recv_tensor_dict_world, timeout=150) == [
        ["pairs"]
    ] * world_size


@pytest.mark.timeout(180)
def test_pipeline_send_recv_with_all_gather_group_at_tp2_pp2(dist_pool):
    results = dist_pool(4).run(run_send_recv_tensor_dict, timeout=150)
    assert all(r == results[0] for r in results)
    assert results[0] == ["plain", "all-gather", "all-gather-back", "errors",
                          "missing-group", "wrong-size-group", "not-a-group"]


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
    plan = slicing_plan(d, n, None)
    meta, payload = td.flatten_tensor_dict(d, slicing=plan, parts=n)
    assert [m[0] for m in meta] == list(d)
    tensors = [v for v in d.values() if isinstance(v, torch.Tensor)]
    assert len(payload) == len(tensors)
    assert all(a is b for a, b in zip(payload, tensors, strict=True))
    for (_key, kind, desc), v in zip(meta, d.values(), strict=False):
        if isinstance(v, torch.Tensor):
            assert kind == td.TENSOR and desc[2] == list(v.shape)
            assert td.dtype_of(desc[1]) == v.dtype
            sliced = n > 1 and v.numel() > 0 and v.numel() % n == 0
            assert desc[3] == (n if sliced else 0)
        else:
            assert kind == td.VALUE and desc == v


def test_slicing_plan_overrides():
    d = {"even": torch.zeros(4), "odd": torch.zeros(3), "s": "x"}
    assert slicing_plan(d, 2, None) == {"even": True, "odd": False}
    assert slicing_plan(d, 2, {"even": False}) == {"even": False, "odd": False}
    with pytest.raises(ValueError, match=r"all_gather_tensors\['odd'\].*3 elements"):
        slicing_plan(d, 2, {"odd": True})
    # one rank (no group, or TP=1): everything whole, as vLLM sends it
    assert slicing_plan(d, 1, {"even": True, "odd": True}) == {"even": False, "odd": False}
    with pytest.raises(TypeError, match="all_gather_tensors"):
        slicing_plan(d, 2, ["even"])
    with pytest.raises(ValueError, match="unknown dtype"):
        td.dtype_of("float33")


# ---------------------------------------------------------------------- on the ranks
# ---------------------------------------------------------------------- tensor dicts
def mixed_dict(owner: int, tag: str) -> dict[Any, Any]:
    """A tensor dict mixing every kind of value, deterministic in ``owner``."""
    base = make(owner, (4, 6), torch.float32, tag + "nc")
    return {
        "f32": make(owner, (2, 3, 4), torch.float32, tag + "f32"),
        "bf16": make(owner, (3, 4), torch.bfloat16, tag + "bf16"),
        "i64": make(owner, (5,), torch.int64, tag + "i64"),
        "f16": make(owner, (2, 2), torch.float16, tag + "f16"),
        "bool": make(owner, (6,), torch.int64, tag + "bool") > 0,
        "none": None,
        "str": f"hello from {owner}",
        "list": [owner, "two", [3.5, None], {"k": owner}],
        "empty": torch.empty(0, 3),
        "empty_bf16": torch.zeros(2, 0, dtype=torch.bfloat16),
        "zero_dim": torch.tensor(float(owner) + 0.5),
        "zero_dim_i64": torch.tensor(owner * 11),
        "noncontig": base.t(),  # (6, 4), strides (1, 6)
        "noncontig_bf16": make(owner, (4, 6), torch.bfloat16, tag + "ncb")[:, ::2],
        "u16": make(owner, (2, 3), torch.uint16, tag + "u16"),
        "f8": make(owner, (5,), torch.float8_e4m3fn, tag + "f8"),
        "c64": make(owner, (2, 2), torch.complex64, tag + "c64"),
        7: "an int key",
        "float": 2.25,
    }


def expect_same_dict(case: str, got: Any, want: dict[Any, Any]) -> None:
    """Same keys in the same order; tensors equal (dtype, shape, values); the rest ==."""
    assert isinstance(got, dict), f"{case}: got {type(got).__name__}, want a dict"
    assert list(got) == list(want), f"{case}: keys {list(got)} != {list(want)}"
    for k, w in want.items():
        if isinstance(w, torch.Tensor):
            expect_equal(f"{case}[{k!r}]", got[k], w)
            assert got[k].device.type == "cpu"
        else:
            assert got[k] == w and type(got[k]) is type(w), f"{case}[{k!r}]: {got[k]!r} != {w!r}"


def tensor_dict_broadcast_suite(g: Any, tag: str) -> list[str]:
    """broadcast_tensor_dict from every src (and through explicit groups)."""
    n, me = g.world_size, g.rank_in_group
    done = []
    for src in range(n):
        want = mixed_dict(src, f"{tag}/{src}")
        got = g.broadcast_tensor_dict(want if me == src else None, src)
        expect_same_dict(f"{tag}/broadcast_tensor_dict/src{src}", got, want)
        if me != src:
            assert all(t.is_contiguous() for t in got.values() if isinstance(t, torch.Tensor))
        done.append(f"broadcast_tensor_dict/{src}")
        # Non-src ranks may pass a dict; it is ignored.
        got = g.broadcast_tensor_dict({"ignored": 1} if me != src else want, src)
        expect_same_dict(f"{tag}/broadcast_tensor_dict/src{src}/ignored", got, want)
    src = n - 1
    want = mixed_dict(src, f"{tag}/explicit")
    got = g.broadcast_tensor_dict(want if me == src else None, src, group=g.device_group,
                                  metadata_group=g.cpu_group)
    expect_same_dict(f"{tag}/broadcast_tensor_dict/explicit-groups", got, want)
    got = g.broadcast_tensor_dict({} if me == 0 else None, 0)
    assert got == {}, f"{tag}: an empty dict must arrive empty, got {got!r}"
    done += ["explicit-groups", "empty-dict"]
    return done


def run_broadcast_tensor_dict(rank: int, world_size: int) -> list[str]:
    """broadcast_tensor_dict on the world group (and on TP/PP at world size 4)."""
    from coordinator import parallel_state as ps

    done = tensor_dict_broadcast_suite(ps.get_world_group(), "world")
    if world_size == 4:
        ps.initialize_model_parallel(2, 2)
        done += tensor_dict_broadcast_suite(ps.get_tp_group(), "tp")
        # The parallel_state wrapper broadcasts over the TP group.
        tp = ps.get_tp_group()
        for src in range(2):
            want = mixed_dict(tp.ranks[src], f"wrapper{src}")
            got = ps.broadcast_tensor_dict(want if tp.rank_in_group == src else None, src)
            expect_same_dict(f"wrapper/src{src}", got, want)
        done.append("wrapper")
    return done


def run_send_recv_tensor_dict(rank: int, world_size: int) -> list[str]:
    """Pipeline send/recv of tensor dicts at TP=2 x PP=2, incl. the all-gather optimisation.

    Rank layout: TP groups [0, 1] and [2, 3]; PP groups [0, 2] and [1, 3];
    stage 0 = ranks 0, 1; stage 1 = ranks 2, 3.

    To *see* the optimisation, the "replicated" tensors deliberately differ
    between the two senders: a sliced tensor arrives as [half of sender tp0's,
    half of sender tp1's]; an unsliced one arrives as the peer sender's whole
    tensor.
    """
    from coordinator import parallel_state as ps

    ps.initialize_model_parallel(2, 2)
    tp, pp = ps.get_tp_group(), ps.get_pp_group()
    stage = pp.rank_in_group
    done = []

    def sender_dict(sender_global: int) -> dict[Any, Any]:
        d = mixed_dict(sender_global, "p2p")
        d["rep"] = make(sender_global, (4, 6), torch.float32, "rep")  # numel 24: sliced
        d["rep_bf16"] = make(sender_global, (2, 3, 2), torch.bfloat16, "repb")  # 12: sliced
        d["rep_nc"] = make(sender_global, (6, 4), torch.int64, "repnc").t()  # non-contig, sliced
        d["odd"] = make(sender_global, (7,), torch.float32, "odd")  # 7: not divisible
        d["off"] = make(sender_global, (8,), torch.float32, "off")  # disabled per key
        return d

    sliced_keys = {"rep", "rep_bf16", "rep_nc", "f32", "bf16", "bool", "f16", "noncontig",
                   "noncontig_bf16", "u16", "c64"}

    def expected(peer_global: int, peer_tp_globals: list[int], optimised: bool) -> dict[Any, Any]:
        want = sender_dict(peer_global)
        if not optimised:
            return want
        for k in sliced_keys:
            whole = want[k]
            parts = [sender_dict(s)[k].reshape(2, -1)[i] for i, s in enumerate(peer_tp_globals)]
            want[k] = torch.cat(parts).reshape(whole.shape)
        return want

    # Every tensor of the mix with an even, non-zero numel is sliced by default.
    numel_even = {k for k, v in sender_dict(0).items()
                  if isinstance(v, torch.Tensor) and v.numel() and v.numel() % 2 == 0}
    assert numel_even - {"off"} == sliced_keys, sorted(numel_even)
    stage0_tp = [0, 1]
    peer = pp.ranks[1 - stage]
    # 1) no all_gather_group: whole tensors.
    if stage == 0:
        pp.send_tensor_dict(sender_dict(rank), dst=1)
    else:
        got = pp.recv_tensor_dict(src=0)
        expect_same_dict("p2p/plain", got, expected(peer, stage0_tp, False))
    done.append("plain")
    # 2) all_gather_group=tp: 1/2 slices rebuilt by an all-gather; "off" disabled.
    flags = {"off": False}
    if stage == 0:
        pp.send_tensor_dict(sender_dict(rank), all_gather_group=tp, all_gather_tensors=flags)
    else:
        got = pp.recv_tensor_dict(all_gather_group=tp, all_gather_tensors=flags)
        expect_same_dict("p2p/all-gather", got, expected(peer, stage0_tp, True))
    done.append("all-gather")
    # 3) the other direction, default dst/src (next/prev wrap around).
    if stage == 1:
        pp.send_tensor_dict(sender_dict(rank), all_gather_group=tp, all_gather_tensors=flags)
    else:
        got = pp.recv_tensor_dict(all_gather_group=tp)
        expect_same_dict("p2p/all-gather/back", got, expected(peer, [2, 3], True))
    done.append("all-gather-back")
    # 4) forcing a non-divisible tensor, a bad group object and a non-dict are
    # refused on the sender, and the receiver is told
    # (PeerRejectedError quoting the sender's error); a bad dst raises before the call.
    if stage == 0:
        expect_raises("p2p/force-odd", ValueError,
                      lambda: pp.send_tensor_dict({"odd": torch.ones(7)}, 1, tp, {"odd": True}),
                      "odd", "7")
        # without a group a forced slice is the whole tensor, as in vLLM
        pp.send_tensor_dict({"x": torch.ones(8)}, 1, None, {"x": True})
        expect_raises("p2p/bad-group", TypeError,
                      lambda: pp.send_tensor_dict({"x": torch.ones(8)}, 1, tp.cpu_group),
                      "all_gather_group")
        expect_raises("p2p/not-a-dict", TypeError,
                      lambda: pp.send_tensor_dict([torch.ones(2)], 1), "tensor_dict")
        expect_raises("p2p/to-self", ValueError,
                      lambda: pp.send_tensor_dict({"x": 1}, 0), "dst")
        expect_raises("p2p/dst-range", ValueError,
                      lambda: pp.send_tensor_dict({"x": 1}, 2), "dst")
    else:
        for case, words in (("force-odd", ("rejected", "odd", "7")),
                            ("force-no-group", ()),
                            ("bad-group", ("rejected", "all_gather_group must be")),
                            ("not-a-dict", ("rejected", "tensor_dict"))):
            if not words:
                got = pp.recv_tensor_dict(None, None, {"x": True})
                expect_equal(f"p2p/{case}/whole", got["x"], torch.ones(8))
                continue
            expect_raises(f"p2p/{case}/told", ValueError, lambda: pp.recv_tensor_dict(), *words)
        expect_raises("p2p/src-range", ValueError, lambda: pp.recv_tensor_dict(src=5), "src")
    done.append("errors")
    # 5) a receiver without the sender's all_gather_group (none, or one of another
    # size) gets a clear error after draining the message, so both sides stay in step.
    dp = ps.get_dp_group()  # size 1
    # A receiver's all_gather_group that is not a group at all is a TypeError,
    # raised after draining too: the sender's call returns normally.
    for case, group, exc, words in (
            ("missing-group", None, ValueError, ("no all_gather_group", "'rep'")),
            ("wrong-size-group", dp, ValueError, ("size 1", "2 parts", "'rep'")),
            ("not-a-group", tp.cpu_group, TypeError, ("all_gather_group", "ProcessGroup"))):
        if stage == 0:
            pp.send_tensor_dict({"rep": torch.ones(4), "s": "x", "w": torch.ones(3)},
                                all_gather_group=tp)
        else:
            expect_raises(f"p2p/{case}", exc,
                          lambda: pp.recv_tensor_dict(all_gather_group=group), *words)
        done.append(case)
    if stage == 0:
        pp.send_tensor_dict(sender_dict(rank), all_gather_group=tp, all_gather_tensors=flags)
    else:
        got = pp.recv_tensor_dict(all_gather_group=tp, all_gather_tensors=flags)
        expect_same_dict("p2p/in-step-after-errors", got, expected(peer, stage0_tp, True))
    return done


def run_send_recv_tensor_dict_world(rank: int, world_size: int) -> list[str]:
    """send/recv_tensor_dict between every ordered pair of the world group."""
    from coordinator import parallel_state as ps

    g = ps.get_world_group()
    for a in range(world_size):
        for b in range(world_size):
            if a != b and rank in (a, b):
                want = mixed_dict(a, f"w{a}{b}")
                if rank == a:
                    g.send_tensor_dict(want, b)
                else:
                    expect_same_dict(f"world/{a}->{b}", g.recv_tensor_dict(a), want)
    return ["pairs"]

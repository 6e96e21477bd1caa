"""``groupcoord bench collectives --ops dispatch_combine``: one MoE layer's traffic, the
all-gather path against the token all-to-all path and raw gloo (no timing is asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from device_comms.bench import dispatch_combine as dc


def test_token_counts_are_skewed_deterministic_and_sum_to_the_tokens() -> None:
    for ws in (2, 3, 4, 8):
        for tokens in (1, 2, 7, 256, 1000):
            counts = dc.token_counts(tokens, ws)
            assert sum(counts) == tokens and min(counts) >= 0 and len(counts) == ws
            assert counts == dc.token_counts(tokens, ws)
            assert counts[0] == max(counts)  # one rank with many tokens
            if ws > 2:
                assert counts[-1] == 0  # one idle rank
    assert dc.token_counts(256, 2) == [205, 51]
    assert dc.token_counts(256, 4) == [188, 47, 21, 0]


def test_routing_sends_every_slot_grouped_by_destination() -> None:
    shape = dc.Shape(hidden=16, experts=8, topk=2)
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    route = dc.routing(logits, shape, 4)
    assert sum(route.send) == 100 and len(route.send) == 4
    assert route.expert_counts.tolist() == torch.bincount(
        torch.topk(logits - torch.arange(8) / 8, 2).indices.reshape(-1), minlength=8).tolist()
    assert sorted(route.order.tolist()) == list(range(100))
    assert route.send[0] > route.send[3]  # low experts are popular
    empty = dc.routing(logits[:0], shape, 4)  # a rank without tokens sends nothing
    assert empty.send == [0, 0, 0, 0] and empty.order.numel() == 0


@pytest.mark.timeout(120)
def test_dispatch_combine_through_the_cli(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from coordinator.cli import main

    out = tmp_path / "dc.json"
    # hidden 64 in bfloat16: 128 B is one token (world size 4: three ranks without
    # tokens)
    rc = main([
        "bench", "collectives", "--world-sizes", "2", "4", "--ops", "dispatch_combine",
        "--dtypes", "bfloat16", "--sizes", "128", "--hidden", "64", "--experts", "8",
        "--topk", "2", "--min-iters", "1", "--max-iters", "1", "--threads", "1", "default",
        "--json", str(out),
    ])
    assert rc == 0
    recs = json.loads(out.read_text())["results"]
    assert sorted((r["world_size"], r["bytes"], r["threads_setting"]) for r in recs) == sorted(
        (ws, b, t) for ws in (2, 4) for b in (128,) for t in ("1", "default"))
    for r in recs:
        assert r["op"] == "dispatch_combine" and r["mode"] == "shm" and r["iters"] == 1
        assert r["results_match"] and r["checks"] == {"shm": True, "a2a": True, "gloo": True}
        assert r["tokens"] == 1
        assert r["token_counts"] == dc.token_counts(r["tokens"], r["world_size"])
        assert (r["hidden"], r["experts"], r["topk"]) == (64, 8, 2)
        assert 1 / r["world_size"] <= r["hot_share"] <= 1
        for name in ("shm", "a2a", "gloo"):
            assert 0 < r[f"{name}_p50_us"] <= r[f"{name}_p99_us"]
    table = capsys.readouterr().out
    assert "op=dispatch_combine" in table and "vs a2a" in table and "vs gloo" in table
    assert "1/0/0/0" in table  # world size 4, one token


def test_experts_must_shard_evenly(capsys: pytest.CaptureFixture[str]) -> None:
    from coordinator.cli import main

    assert main(["bench", "collectives", "--world-sizes", "2", "4", "--ops",
                 "dispatch_combine", "--experts", "6"]) == 2
    assert "multiple of every world size" in capsys.readouterr().err
    assert main(["bench", "collectives", "--ops", "dispatch_combine", "--experts", "4",
                 "--topk", "5"]) == 2
    assert "--topk must be <= --experts" in capsys.readouterr().err

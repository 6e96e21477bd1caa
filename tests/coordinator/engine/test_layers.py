"""Tensor-parallel layers: sharding math, weight loaders, and real TP runs vs unsharded math.

The single-process tests build every rank's shard in one process (a layer only
reads ``world_size``/``rank_in_group`` to load weights, and the forward paths
used there do not communicate) and recombine the shards by hand. The
multi-process tests run the layers over real gloo groups, collectives
included, and compare with plain ``torch`` on the full weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from coordinator.engine.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    divide,
    pad_to_multiple,
    shard_bounds,
)


@dataclasses.dataclass
class _RankSlot:
    """Which shard to build: the part of a group that weight loading reads."""

    world_size: int
    rank_in_group: int
    unique_name: str = "offline"


def _load(layer: torch.nn.Module, **tensors: torch.Tensor | tuple[torch.Tensor, Any]) -> None:
    for name, value in tensors.items():
        param = getattr(layer, name)
        if isinstance(value, tuple):
            param.weight_loader(param, value[0], value[1])
        else:
            param.weight_loader(param, value)


def test_sharding_helpers() -> None:
    assert divide(12, 4, "x") == 3
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) must be divisible .* \(4\)"):
        divide(6, 4, "num_attention_heads")
    assert shard_bounds(12, 3, 2) == (8, 12)
    with pytest.raises(ValueError, match="shard index"):
        shard_bounds(12, 3, 3)
    assert (
        pad_to_multiple(161, 2) == 162
        and pad_to_multiple(160, 4) == 160
        and pad_to_multiple(1, 8) == 8
    )


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_and_row_shards_recombine(tp: int) -> None:
    g = torch.Generator().manual_seed(tp)
    w1, b1 = torch.randn(16, 12, generator=g), torch.randn(16, generator=g)
    w2, b2 = torch.randn(12, 16, generator=g), torch.randn(12, generator=g)
    x = torch.randn(5, 12, generator=g)
    cols, partial_sums = [], []
    for r in range(tp):
        col = ColumnParallelLinear(12, 16, bias=True, tp_group=_RankSlot(tp, r))
        _load(col, weight=w1, bias=b1)
        row = RowParallelLinear(16, 12, bias=True, reduce_results=False, tp_group=_RankSlot(tp, r))
        _load(row, weight=w2, bias=b2)
        h = col(x)
        assert h.shape == (5, 16 // tp)
        cols.append(h)
        partial_sums.append(row(h))
    full_h = F.linear(x, w1, b1)
    torch.testing.assert_close(torch.cat(cols, -1), full_h)
    torch.testing.assert_close(sum(partial_sums), F.linear(full_h, w2, b2))
    # a row-parallel layer may also split a replicated input itself
    row0 = RowParallelLinear(
        16, 12, input_is_parallel=False, reduce_results=False, tp_group=_RankSlot(tp, 0)
    )
    _load(row0, weight=w2)
    torch.testing.assert_close(row0(full_h), F.linear(full_h[:, : 16 // tp], w2[:, : 16 // tp]))


def test_merged_column_shards() -> None:
    g = torch.Generator().manual_seed(0)
    gate, up, x = (
        torch.randn(8, 6, generator=g),
        torch.randn(8, 6, generator=g),
        torch.randn(3, 6, generator=g),
    )
    outs = []
    for r in range(2):
        layer = MergedColumnParallelLinear(6, [8, 8], tp_group=_RankSlot(2, r))
        _load(layer, weight=(gate, 0))
        layer.weight_loader(layer.weight, up, 1)
        outs.append(layer(x).chunk(2, -1))
    torch.testing.assert_close(torch.cat([o[0] for o in outs], -1), x @ gate.T)
    torch.testing.assert_close(torch.cat([o[1] for o in outs], -1), x @ up.T)
    with pytest.raises(ValueError, match="shard id"):
        layer.weight_loader(layer.weight, up, 2)
    with pytest.raises(ValueError, match=r"expected size 8 in dimension 0"):
        layer.weight_loader(layer.weight, torch.zeros(6, 6), 0)


@pytest.mark.parametrize(("tp", "heads", "kv_heads"), [(2, 4, 2), (4, 4, 2), (4, 8, 1), (1, 4, 4)])
def test_qkv_shards_follow_heads(tp: int, heads: int, kv_heads: int) -> None:
    hd, hidden = 4, 8
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    wq = torch.randn(heads * hd, hidden, generator=g)
    wk = torch.randn(kv_heads * hd, hidden, generator=g)
    wv = torch.randn(kv_heads * hd, hidden, generator=g)
    x = torch.randn(3, hidden, generator=g)
    fq, fk, fv = (x @ w.T for w in (wq, wk, wv))
    group_size = heads // kv_heads
    for r in range(tp):
        layer = QKVParallelLinear(hidden, hd, heads, kv_heads, tp_group=_RankSlot(tp, r))
        for sid, w in (("q", wq), ("k", wk), ("v", wv)):
            layer.weight_loader(layer.weight, w, sid)
        q, k, v = layer.split_qkv(layer(x))
        local_heads = heads // tp
        torch.testing.assert_close(q, fq[:, r * local_heads * hd : (r + 1) * local_heads * hd])
        # every local query head's KV head (h // group_size) is held locally
        kv_ids = sorted({(r * local_heads + j) // group_size for j in range(local_heads)})
        assert len(kv_ids) == layer.num_kv_heads
        want_k = torch.cat([fk[:, i * hd : (i + 1) * hd] for i in kv_ids], -1)
        want_v = torch.cat([fv[:, i * hd : (i + 1) * hd] for i in kv_ids], -1)
        torch.testing.assert_close(k, want_k)
        torch.testing.assert_close(v, want_v)


def test_qkv_rejects_unsplittable_heads() -> None:
    with pytest.raises(ValueError, match="num_attention_heads"):
        QKVParallelLinear(8, 4, 6, 2, tp_group=_RankSlot(4, 0))
    with pytest.raises(
        ValueError, match=r"num_key_value_heads \(3\) is smaller .* does not divide"
    ):
        QKVParallelLinear(8, 4, 12, 3, tp_group=_RankSlot(4, 0))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        QKVParallelLinear(8, 4, 6, 3, tp_group=_RankSlot(2, 0))
    layer = QKVParallelLinear(8, 4, 4, 2, tp_group=_RankSlot(2, 0))
    with pytest.raises(ValueError, match="'q', 'k' or 'v'"):
        layer.weight_loader(layer.weight, torch.zeros(16, 8), "x")
    with pytest.raises(ValueError, match=r"expected size 8 in dimension 0"):
        layer.weight_loader(layer.weight, torch.zeros(16, 8), "k")


_BAD_ARGS = {
    "column-output-negative": (lambda: ColumnParallelLinear(6, -2, tp_group=_RankSlot(2, 0)),
                               ValueError, "output_size must be an int >= 1"),
    "column-input-float": (lambda: ColumnParallelLinear(8.0, 4), TypeError, "input_size"),
    "row-output-zero": (lambda: RowParallelLinear(4, 0), ValueError, "output_size"),
    "merged-negative": (lambda: MergedColumnParallelLinear(6, [4, -4]), ValueError,
                        r"output_sizes\[1\]"),
    "qkv-no-kv-heads": (lambda: QKVParallelLinear(8, 4, 4, 0, tp_group=_RankSlot(2, 0)),
                        ValueError, "total_num_kv_heads"),
    "qkv-head-size-zero": (lambda: QKVParallelLinear(8, 0, 4, 2), ValueError, "head_size"),
    "qkv-heads-not-a-multiple": (lambda: QKVParallelLinear(8, 4, 6, 4), ValueError,
                                 "must be a multiple of total_num_kv_heads"),
    "int-params-dtype": (lambda: ColumnParallelLinear(4, 4, params_dtype=torch.int64),
                         TypeError, "params_dtype"),
    "embedding-float-size": (lambda: VocabParallelEmbedding(5.5, 4), TypeError,
                             "num_embeddings"),
}


@pytest.mark.parametrize("case", sorted(_BAD_ARGS))
def test_bad_layer_arguments_name_the_argument(case: str) -> None:
    build, error, text = _BAD_ARGS[case]
    with pytest.raises(error, match=text):
        build()


def test_vocab_shards_cover_padded_vocab() -> None:
    table = torch.randn(11, 4)
    shards = []
    for r in range(4):
        emb = VocabParallelEmbedding(11, 4, tp_group=_RankSlot(4, r))
        _load(emb, weight=table)
        assert emb.weight.shape == (3, 4) and (emb.vocab_start, emb.vocab_end) == (3 * r, 3 * r + 3)
        shards.append(emb.weight)
    full = torch.cat(shards)
    torch.testing.assert_close(full[:11], table)
    assert torch.count_nonzero(full[11:]) == 0
    with pytest.raises(ValueError, match=r"expected \(11, 4\)"):
        emb.weight_loader(emb.weight, torch.zeros(12, 4))
    single = ParallelLMHead(11, 4)
    _load(single, weight=table)
    h = torch.randn(2, 4)
    torch.testing.assert_close(single(h), h @ table.T)
    e1 = VocabParallelEmbedding(11, 4)
    _load(e1, weight=table)
    torch.testing.assert_close(e1(torch.tensor([[0, 10]])), table[[0, 10]].unsqueeze(0))


def test_rmsnorm_and_rope_match_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    x = torch.randn(3, 5, 32)
    ours, theirs = RMSNorm(32, 1e-5), LlamaRMSNorm(32, 1e-5)
    w = 1 + 0.1 * torch.randn(32)
    ours.weight.data.copy_(w)
    theirs.weight.data.copy_(w)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)

    positions = torch.tensor([0, 1, 7, 300, 4000])
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    for rope in (
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ):
        hf_cfg = LlamaConfig(
            hidden_size=64,
            num_attention_heads=4,
            max_position_embeddings=8192,
            rope_parameters={**rope, "rope_theta": 50000.0},
        )
        rope_type = rope["rope_type"]
        params = {k_: v for k_, v in rope.items() if k_ != "rope_type"}
        rot = RotaryEmbedding(16, 50000.0, rope_type, params)
        if rope_type == "default":
            hf_inv = 1.0 / (50000.0 ** (torch.arange(0, 16, 2).float() / 16))
        else:
            hf_inv, _ = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu")
        torch.testing.assert_close(rot.inv_freq, hf_inv, rtol=0, atol=0)
        freqs = positions[:, None].float() * hf_inv[None]
        emb = torch.cat((freqs, freqs), -1)
        want_q, want_k = apply_rotary_pos_emb(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None]
        )
        got_q, got_k = rot(positions, q, k)
        torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=0, atol=0)
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        RotaryEmbedding(16, 10000.0, "yarn", {"factor": 2.0})
    with pytest.raises(ValueError, match="needs 'low_freq_factor'"):
        RotaryEmbedding(16, 10000.0, "llama3", {"factor": 2.0})


# ---------------------------------------------------------------------- real TP groups
def _tp_layers(rank: int, world_size: int) -> dict[str, float]:
    """Every layer over the world as one TP group vs plain torch on full weights."""
    from coordinator import parallel_state as ps

    ps.initialize_model_parallel(world_size, 1)
    try:
        tp = ps.get_tp_group()
        g = torch.Generator().manual_seed(123)  # same full tensors on every rank
        def rn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g)


        diffs: dict[str, float] = {}

        def diff(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
            if a.shape != b.shape:
                raise AssertionError(f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}")
            diffs[name] = ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()  # relative

        t = 6 * world_size  # token count divisible by tp for the reduce-scatter checks
        x, w1, b1, w2, b2 = rn(t, 8), rn(16, 8), rn(16), rn(8, 16), rn(8)
        col = ColumnParallelLinear(8, 16, bias=True, gather_output=True, tp_group=tp)
        _load(col, weight=w1, bias=b1)
        diff("column_gather", col(x), F.linear(x, w1, b1))
        col.gather_output = False
        row = RowParallelLinear(16, 8, bias=True, tp_group=tp)
        _load(row, weight=w2, bias=b2)
        full = F.linear(F.linear(x, w1, b1), w2, b2)
        diff("column_row_all_reduce", row(col(x)), full)
        rs = RowParallelLinear(16, 8, bias=True, reduce_scatter=True, tp_group=tp)
        _load(rs, weight=w2, bias=b2)
        diff("row_reduce_scatter", rs(col(x)), full.chunk(world_size, 0)[rank])

        gate, up, down = rn(24, 8), rn(24, 8), rn(8, 24)
        mlp_in = MergedColumnParallelLinear(8, [24, 24], tp_group=tp)
        mlp_in.weight_loader(mlp_in.weight, gate, 0)
        mlp_in.weight_loader(mlp_in.weight, up, 1)
        mlp_out = RowParallelLinear(24, 8, tp_group=tp)
        _load(mlp_out, weight=down)
        gl, ul = mlp_in(x).chunk(2, -1)
        diff(
            "swiglu_mlp", mlp_out(F.silu(gl) * ul), F.linear(F.silu(x @ gate.T) * (x @ up.T), down)
        )
        # gathered: the full gate and up outputs one after the other, as the unsharded cat
        merged = MergedColumnParallelLinear(8, [24, 16], bias=True, gather_output=True,
                                            tp_group=tp)
        up16, bg, bu = rn(16, 8), rn(24), rn(16)
        merged.weight_loader(merged.weight, gate, 0)
        merged.weight_loader(merged.weight, up16, 1)
        merged.weight_loader(merged.bias, bg, 0)
        merged.weight_loader(merged.bias, bu, 1)
        diff("merged_gather", merged(x),
             F.linear(x, torch.cat([gate, up16]), torch.cat([bg, bu])))

        vocab = 4 * world_size + 3  # not divisible: padded
        table, bias = rn(vocab, 8), rn(vocab)
        ids = torch.tensor([[0, vocab - 1, 5], [vocab // 2, 1, vocab - 2]])
        emb = VocabParallelEmbedding(vocab, 8, tp_group=tp)
        _load(emb, weight=table)
        diff("embedding", emb(ids), table[ids])
        for bad_id in (-1, vocab, vocab + 1):  # as one process's lookup: refused, not zeros
            try:
                emb(torch.tensor([0, bad_id]))
                raise AssertionError(f"id {bad_id} of a vocabulary of {vocab} was embedded")
            except IndexError as e:
                assert "input_ids must lie in" in str(e), e
        emb_rs = VocabParallelEmbedding(vocab, 8, tp_group=tp, reduce_scatter=True)
        _load(emb_rs, weight=table)
        flat = torch.arange(world_size * 2) % vocab
        diff("embedding_reduce_scatter", emb_rs(flat), table[flat].chunk(world_size, 0)[rank])
        head = ParallelLMHead(vocab, 8, bias=True, tp_group=tp)
        _load(head, weight=table, bias=bias)
        diff("lm_head", head(x), F.linear(x, table, bias))

        hd, heads, kv_heads = 4, 2 * world_size, 1  # one KV head: replicated on every rank
        wq, wk, wv = rn(heads * hd, 8), rn(kv_heads * hd, 8), rn(kv_heads * hd, 8)
        qkv = QKVParallelLinear(8, hd, heads, kv_heads, tp_group=tp)
        for sid, w in (("q", wq), ("k", wk), ("v", wv)):
            qkv.weight_loader(qkv.weight, w, sid)
        q, k, v = qkv.split_qkv(qkv(x))
        diff("qkv_q", q, (x @ wq.T).chunk(world_size, -1)[rank])
        diff("qkv_kv_replicated", torch.cat([k, v], -1), torch.cat([x @ wk.T, x @ wv.T], -1))
        return diffs
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("world_size", [2, 4])
def test_layers_over_real_tp_groups(dist_pool: Any, world_size: int) -> None:
    results = dist_pool(world_size).run(_tp_layers, timeout=120)
    for rank, diffs in enumerate(results):
        assert len(diffs) == 10
        bad = {k: v for k, v in diffs.items() if not v < 1e-5}
        assert not bad, f"rank {rank}: {bad}"

"""Pipeline stages in micro-batches with asynchronous transfers (engine/models/pipeline.py).

The split and the sliced attention metadata are checked in process; a real
PP=2 run over gloo must give the unsharded model's logits for any number of
micro-batches, and its transfers must go through the asynchronous calls.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from coordinator.engine.models import KVCache, LlamaForCausalLM, ModelRunner, StepInput
from coordinator.engine.models.config import LlamaModelConfig
from coordinator.engine.models.pipeline import slice_attention, split_bounds

CFG = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
           max_position_embeddings=128, rms_norm_eps=1e-5)
PROMPTS = [[5, 7, 9], [1, 2], [40, 41, 42, 43, 44, 45], [3], [60, 61, 62, 63]]


@pytest.mark.parametrize("requests,micro_batches", [(5, 2), (5, 3), (2, 4), (1, 2), (7, 1),
                                                    (0, 2), (6, 6)])
def test_split_bounds_cover_the_requests_evenly(requests: int, micro_batches: int) -> None:
    b = split_bounds(requests, micro_batches)
    assert len(b) == max(1, min(requests, micro_batches))
    assert b[0][0] == 0 and b[-1][1] == requests
    assert all(b[i][1] == b[i + 1][0] for i in range(len(b) - 1))
    sizes = [e - s for s, e in b]
    assert max(sizes) - min(sizes) <= 1 and (requests == 0 or min(sizes) >= 1)


@pytest.mark.parametrize("bad", [(-1, 2), (3, 0)])
def test_split_bounds_refuses_bad_counts(bad: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="micro_batches"):
        split_bounds(*bad)


@pytest.mark.parametrize("micro_batches", [1, 2, 3, 5])
def test_sliced_attention_is_each_requests_own_metadata(micro_batches: int) -> None:
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=64, block_size=4)
    cache.prepare_step([10, 11], [0, 0], [5, 3])  # two requests already have context
    attn = cache.prepare_step([10, 11, 12, 13, 14], [5, 3, 0, 0, 0], [1, 1, 7, 2, 4])
    qsl, csl = attn.query_start_loc.tolist(), attn.context_start_loc.tolist()
    for r0, r1 in split_bounds(5, micro_batches):
        sub = slice_attention(attn, r0, r1)
        sq, sc = sub.query_start_loc.tolist(), sub.context_start_loc.tolist()
        assert sq[0] == 0 and sc[0] == 0 and len(sq) == r1 - r0 + 1
        for i in range(r0, r1):
            j = i - r0
            whole_tok = slice(qsl[i], qsl[i + 1])
            sub_tok = slice(sq[j], sq[j + 1])
            for field in ("positions", "slot_mapping", "seq_lens"):
                assert torch.equal(getattr(sub, field)[sub_tok], getattr(attn, field)[whole_tok])
            assert torch.equal(sub.context_slots[sc[j]:sc[j + 1]],
                               attn.context_slots[csl[i]:csl[i + 1]])
            assert int(sub.logits_indices[j]) == int(attn.logits_indices[i]) - qsl[r0]


def _steps() -> list[StepInput]:
    ids = list(range(len(PROMPTS)))
    prefill = StepInput(ids, PROMPTS, [0] * len(PROMPTS))
    decode = StepInput(ids, [[7 + i] for i in ids], [len(p) for p in PROMPTS])
    return [prefill, decode]


def pp_run(rank: int, world_size: int, micro_batches: int) -> dict[str, Any]:
    """Two steps (a prefill of 5 requests, then a decode) over PP=2."""
    from coordinator import parallel_state as ps

    ps.initialize_model_parallel(1, 2)
    try:
        pp = ps.get_pp_group()
        model = LlamaForCausalLM.from_seed(LlamaModelConfig(**CFG), 3, ps.get_tp_group(), pp)
        runner = ModelRunner(model, num_kv_blocks=32, block_size=4, micro_batches=micro_batches)
        logits = [runner.run(s) for s in _steps()]
        all_logits = runner.run(StepInput([9], [[2, 4, 6]], [0]), all_logits=True)
        threads = sorted(t.name for t in threading.enumerate()
                         if t.name.startswith(f"gc-p2p {pp.unique_name} "))
        return {"logits": logits, "all": all_logits, "threads": threads, "pp": pp.unique_name}
    finally:
        ps.destroy_model_parallel()


def _reference() -> tuple[list[torch.Tensor], torch.Tensor]:
    runner = ModelRunner(LlamaForCausalLM.from_seed(LlamaModelConfig(**CFG), 3), num_kv_blocks=32,
                         block_size=4)
    logits = [runner.run(s) for s in _steps()]
    return logits, runner.run(StepInput([9], [[2, 4, 6]], [0]), all_logits=True)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 8])
def test_pp2_in_micro_batches_matches_the_unsharded_model(dist_pool, micro_batches) -> None:
    want, want_all = _reference()
    first, last = dist_pool(2).run(pp_run, micro_batches, timeout=150)
    assert first["logits"] == [None, None] and first["all"] is None
    for got, ref in zip(last["logits"], want, strict=True):
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    torch.testing.assert_close(last["all"], want_all, rtol=1e-4, atol=1e-4)
    # The hidden states went through the asynchronous calls' threads.
    assert first["threads"] == [f"gc-p2p {first['pp']} send->1"], first["threads"]
    assert last["threads"] == [f"gc-p2p {last['pp']} recv<-0"], last["threads"]


def test_runner_refuses_a_bad_micro_batch_count() -> None:
    model = LlamaForCausalLM.from_seed(LlamaModelConfig(**CFG), 3)
    with pytest.raises(ValueError, match="micro_batches"):
        ModelRunner(model, micro_batches=0)
    with pytest.raises(TypeError, match="micro_batches"):
        ModelRunner(model, micro_batches=2.0)  # type: ignore[arg-type]

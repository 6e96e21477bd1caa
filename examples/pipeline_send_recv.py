"""A two-stage pipeline handing hidden states over with send/recv_tensor_dict (TP=2 x PP=2).

What it shows:
    Four processes laid out as TP=2 x PP=2 (``initialize_model_parallel``,
    TP varies fastest): stage 0 is ranks 0 and 1, stage 1 ranks 2 and 3; the
    pipeline groups are [0, 2] and [1, 3]. Each stage runs a tensor-parallel
    MLP block (column-parallel then row-parallel + all-reduce), so after the
    block the hidden states are *replicated* on both TP ranks of the stage.

    Stage 0 sends a dict to the next stage with ``pp.send_tensor_dict``: the
    hidden states, a residual, a small tensor and a plain value. Stage 1
    receives it with ``pp.recv_tensor_dict`` and runs its own block.

    Two hand-offs are made:

    * plain: each TP rank of stage 0 sends the whole dict to its peer;
    * ``all_gather_group=tp``: since both senders hold the same tensors, each
      sends only its half of every tensor whose size divides by 2, and the
      two receivers rebuild the tensors with one all-gather among themselves
      (over shared memory on one node). Half the bytes cross the pipeline
      link; tensors that do not divide (the 3-element one) go whole.

    Both hand-offs must deliver bitwise the tensors that were sent, and the
    pipeline's output must match the whole model computed in one process.

Run:
    python examples/pipeline_send_recv.py

Expected output (numbers vary):
    pipeline_send_recv: TP=2 x PP=2 (4 processes); stage 0 = ranks [0, 1], stage 1 = ranks [2, 3]
    pipeline_send_recv: plain send: each stage-0 rank sends 10264 tensor bytes
    pipeline_send_recv: all_gather_group=tp: each stage-0 rank sends 5144 tensor bytes
    pipeline_send_recv: received dicts identical to the sent ones: True (plain), True (all-gather)
    pipeline_send_recv: max |pipeline - unsharded| = 1.91e-06
    pipeline_send_recv: PASS

Exits with status 1 if a received dict differs or the output is wrong.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

TP, PP = 2, 2
TOKENS, HIDDEN, FF = 10, 128, 256


def weights() -> dict[str, torch.Tensor]:
    """The whole model: an input batch and two MLP blocks (one per stage)."""
    g = torch.Generator().manual_seed(0)
    w = {"x": torch.randn(TOKENS, HIDDEN, generator=g)}
    for s in range(PP):
        w[f"up{s}"] = torch.randn(HIDDEN, FF, generator=g) / HIDDEN**0.5
        w[f"down{s}"] = torch.randn(FF, HIDDEN, generator=g) / FF**0.5
    return w


def block(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, tp: Any = None) -> torch.Tensor:
    """Residual MLP block; with ``tp``, this rank's shard plus the all-reduce."""
    if tp is not None:
        cols = FF // tp.world_size
        lo = tp.rank_in_group * cols
        up, down = up[:, lo : lo + cols], down[lo : lo + cols]  # column- / row-parallel
    partial = torch.nn.functional.gelu(x @ up) @ down
    return x + (tp.all_reduce(partial) if tp is not None else partial)


def tensor_bytes(d: dict[str, Any], parts: int = 1) -> int:
    """Tensor bytes one sender puts on the link (sliced tensors: 1/parts each)."""
    total = 0
    for v in d.values():
        if isinstance(v, torch.Tensor):
            n = v.numel() * v.element_size()
            total += n // parts if parts > 1 and v.numel() % parts == 0 else n
    return total


def rank_main(rank: int, world_size: int) -> dict[str, Any]:
    """Runs on every rank: stage 0 computes and sends, stage 1 receives and computes."""
    from coordinator import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP)
    tp, pp = ps.get_tp_group(), ps.get_pp_group()
    w = weights()
    out: dict[str, Any] = {"stage": pp.rank_in_group, "tp_ranks": tp.ranks}
    with torch.no_grad():
        if pp.is_first_rank:
            h = block(w["x"], w["up0"], w["down0"], tp)
            msg = {
                "hidden_states": h,                       # [10, 128], replicated over TP
                "residual": w["x"],                       # also replicated
                "lengths": torch.tensor([3, 4, 3]),       # 3 elements: not divisible, sent whole
                "step": 7,                                # plain value, in the metadata
            }
            pp.send_tensor_dict(msg)                          # plain: whole tensors
            pp.send_tensor_dict(msg, all_gather_group=tp)     # halves + all-gather
            out["sent"] = msg
            out["bytes"] = (tensor_bytes(msg), tensor_bytes(msg, tp.world_size))
        else:
            plain = pp.recv_tensor_dict()
            gathered = pp.recv_tensor_dict(all_gather_group=tp)
            out["received"] = (plain, gathered)
            out["y"] = block(gathered["hidden_states"], w["up1"], w["down1"], tp)
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same keys; tensors bitwise equal (dtype and shape too), values equal."""
    return a.keys() == b.keys() and all(
        (isinstance(b[k], torch.Tensor) and v.dtype == b[k].dtype and torch.equal(v, b[k]))
        if isinstance(v, torch.Tensor) else v == b[k]
        for k, v in a.items()
    )


def main() -> int:
    from coordinator.testing import run_distributed

    results = run_distributed(rank_main, TP * PP, timeout=120)
    stage = {s: [r for r in results if r["stage"] == s] for s in range(PP)}
    print(f"pipeline_send_recv: TP={TP} x PP={PP} ({TP * PP} processes); "
          f"stage 0 = ranks {stage[0][0]['tp_ranks']}, stage 1 = ranks {stage[1][0]['tp_ranks']}")
    plain_bytes, sliced_bytes = stage[0][0]["bytes"]
    print(f"pipeline_send_recv: plain send: each stage-0 rank sends {plain_bytes} tensor bytes")
    print(f"pipeline_send_recv: all_gather_group=tp: each stage-0 rank sends {sliced_bytes} "
          f"tensor bytes")
    # pipeline peers: stage-0 TP rank t sends to stage-1 TP rank t
    pairs = list(zip(stage[0], stage[1], strict=True))
    plain_ok = all(same(s["sent"], r["received"][0]) for s, r in pairs)
    gather_ok = all(same(s["sent"], r["received"][1]) for s, r in pairs)

    print(f"pipeline_send_recv: received dicts identical to the sent ones: {plain_ok} (plain), "
          f"{gather_ok} (all-gather)")
    w = weights()
    ref = block(block(w["x"], w["up0"], w["down0"]), w["up1"], w["down1"])
    err = max(float((r["y"] - ref).abs().max()) for r in stage[1])
    print(f"pipeline_send_recv: max |pipeline - unsharded| = {err:.2e}")
    ok = plain_ok and gather_ok and err < 1e-4 and sliced_bytes < plain_bytes
    print(f"pipeline_send_recv: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Deterministic payloads for ``groupcoord bench mq`` (and tests).

Each payload imitates what an engine's driver broadcasts per step:

* ``256B``  a tiny control dict (step number, a few ids, flags);
* ``4KB``   scheduler metadata: about half Python lists/strings (request ids,
  token counts, positions), half small tensors (block table, slot mapping,
  sequence lengths, sampling parameters incl. a bfloat16 one);
* ``64KB``  a larger batch of the same kind;
* ``1MB``   a 1 MiB float32 tensor plus a few fields;
* ``16MB``  a 16 MiB tensor: larger than the ring's chunks (2 MiB by
  default), so it takes the overflow path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["PAYLOADS", "make_payload", "payload_names"]


def _tiny(step: int) -> dict[str, Any]:
    return {
        "step": step,
        "req_ids": ["req-000001", "req-000002", "req-000003", "req-000004"],
        "num_scheduled_tokens": [1, 1, 1, 17, 1, 1, 1, 1],
        "finished": [],
        "is_prefill": False,
        "seed": 1234567,
        "phase": "decode",
        "kv_blocks_free": 2048,
        "extra": {"lora": None, "spec_tokens": [5, 6, 7]},
    }


def _metadata(step: int, n_req: int, blocks_per_req: int, tokens: int,
              new_tokens: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(step)
    return {
        "step": step,
        "req_ids": [f"req-{step:05d}-{i:04d}" for i in range(n_req)],
        "num_scheduled_tokens": [(i * 7 + step) % 13 + 1 for i in range(n_req)],
        "positions": list(range(step, step + tokens)),
        "finished_req_ids": [f"req-{step:05d}-{i:04d}" for i in range(0, n_req, 16)],
        "new_prompt_token_ids": [[(step * 31 + j * 17 + k) % 50000 for j in range(new_tokens)]
                                 for k in range(2)],
        "block_table": torch.randint(0, 1 << 20, (n_req, blocks_per_req), generator=g,
                                     dtype=torch.int32),
        "slot_mapping": torch.arange(step, step + tokens, dtype=torch.int64),
        "seq_lens": torch.randint(1, 4096, (n_req,), generator=g, dtype=torch.int32),
        "temperature": torch.rand(n_req, generator=g),
        "top_p": torch.rand(n_req, generator=g).to(torch.bfloat16),
    }


def _tensor(step: int, numel: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(step)
    return {"step": step, "kind": "hidden_states",
            "data": torch.randn(numel, generator=g, dtype=torch.float32)}


PAYLOADS: dict[str, Callable[[int], Any]] = {
    "256B": _tiny,
    "4KB": lambda step: _metadata(step, n_req=32, blocks_per_req=8, tokens=64, new_tokens=160),
    "64KB": lambda step: _metadata(step, n_req=256, blocks_per_req=32, tokens=1024,
                                   new_tokens=2048),
    "1MB": lambda step: _tensor(step, 256 * 1024),
    "16MB": lambda step: _tensor(step, 4 * 1024 * 1024),
}


def payload_names() -> list[str]:
    """Return the payload names in size order."""
    return list(PAYLOADS)


def make_payload(name: str, step: int = 0) -> Any:
    """Build payload ``name`` for ``step`` (deterministic).

    Raises:
        ValueError: Unknown ``name``.
    """
    try:
        return PAYLOADS[name](step)
    except KeyError:
        raise ValueError(f"payload must be one of {payload_names()}, got {name!r}") from None

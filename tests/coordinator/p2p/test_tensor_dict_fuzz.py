"""The tensor-dict metadata decoder (codec + ``check_metadata``) against malformed input.

Mutated metadata must decode to metadata that passes every check, or raise
:class:`DecodeError`: never ``IndexError``/``TypeError``/``KeyError`` from a
malformed entry, and no accepted tensor descriptor with a negative dimension,
an unknown dtype or a slice count that does not divide it. ~1,000 inputs in
CI, 100,000 under the ``slow`` marker.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from coordinator.wire.tensor_dict_format import DTYPES, TENSOR, check_metadata, flatten_tensor_dict
from shm_broadcast.codec.message_codec import Codec
from shm_broadcast.errors import DecodeError
from tests.shm_broadcast.codec.test_codec_fuzz import check_decode, mutate

_TD = {
    "x": torch.arange(12.0).reshape(3, 4), "ids": torch.tensor([1, 2]), "t": (1, 2),
    ("k", 1): "tuple key", None: "none key", "np": np.ones(3, np.int32),
    "e": torch.empty(0, 2), "b": torch.ones(2, dtype=torch.bfloat16),
}


def _seeds() -> list[tuple[bytes, bytes]]:
    out = []
    c = Codec()
    for inline in (False, True):
        for slicing, parts in ((None, 1), ({"x": True}, 2)):
            meta, _ = flatten_tensor_dict(_TD, inline_cpu=inline, slicing=slicing, parts=parts)
            enc = c.encode(meta)
            out.append((bytes(enc.msg), bytes(enc.blob_bytes())))
    return out


def _decode_and_check(c: Codec, msg: bytes, blob: bytes) -> None:
    meta = check_metadata(c.decode(msg, blob, 0, len(blob)), "cpu")
    for _, kind, value in meta:  # what was accepted is well formed
        if kind == TENSOR:
            dev, dtype, shape, parts = value
            assert dev == "cpu" and dtype in DTYPES and all(n >= 0 for n in shape)
            assert parts == 0 or int(np.prod(shape, dtype=object)) % parts == 0


def _run(n: int, seed: int) -> None:
    rng = random.Random(seed)
    seeds = _seeds()
    c = Codec()
    for i in range(n):
        msg, blob = rng.choice(seeds)
        msg = mutate(rng, msg)
        check_decode(lambda: _decode_and_check(c, msg, blob), f"case {i} (seed {seed})")


@pytest.mark.timeout(120)
def test_mutated_metadata_raises_only_decode_error():
    _run(1000, seed=7)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_mutated_metadata_slow_100k():
    for s in range(4):
        _run(25_000, seed=100 + s)


_BIG = 10**5000  # repr() of it raises ValueError (CPython's int-to-str limit)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("meta", [
    {"not": "a list"},
    [["k", 9, 1]],
    [[["unhashable"], 0, 1]],
    [["k", TENSOR, ["cpu", "float32", [-4], 0]]],
    [["k", TENSOR, ["cpu", "float32", [1 << 40, 1 << 40], 0]]],
    [["k", TENSOR, ["cpu", "float32", [0, 1 << 62, 1 << 62], 0]]],
    [["k", TENSOR, ["cpu", "__class__", [2], 0]]],
    [["k", TENSOR, ["cpu", "qint8", [2], 0]]],
    [["k", TENSOR, ["cuda", "float32", [2], 0]]],
    [["k", TENSOR, ["cpu", "float32", [3], 2]]],
    [["k", TENSOR, ["cpu", "float32", [2]]]],
    [["k", TENSOR, ["cpu", "float32", [2.5], 0]]],
    [["k", 2, "inline without a tensor"]],
    # values whose repr() or truth value raises (a peer's codec carries them all)
    [["k", 7, _BIG]],
    [["k", TENSOR, ["cpu", "float32", [_BIG], 0]]],
    [["k", TENSOR, ["cpu", "float32", [4], _BIG]]],
    [["k", TENSOR, ["cpu", _BIG, [4], 0]]],
    [["k", np.array([0, 1]), None]],
    [["k", torch.tensor([1, 2]), None]],
    [["k", TENSOR, [np.array([1, 2]), "float32", [4], 0]]],
    [["k", TENSOR, ["cpu", "float32", [4], torch.tensor([1, 2])]]],
], ids=["not-list", "kind", "key", "negative", "huge", "empty-huge-strides", "getattr",
        "quantized", "device", "parts", "short", "float-dim", "inline", "bigint-entry",
        "bigint-dim", "bigint-parts", "bigint-dtype", "array-kind", "tensor-kind",
        "array-device", "tensor-parts"])
def test_bad_metadata_is_refused(meta):
    with pytest.raises(DecodeError):
        check_metadata(meta, "cpu", 3)


def test_empty_tensors_with_large_other_sizes_are_accepted():
    meta = [["k", TENSOR, ["cpu", "float32", [0, 4096, 4096], 0]]]
    check_metadata(meta, "cpu")  # no error: strides of 64 Mi elements are fine

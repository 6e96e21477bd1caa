"""describe(): bounded, never-raising descriptions of what a peer sent."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from shm_broadcast.describe import describe

BIG = 10**5000  # repr() of it raises ValueError (CPython's int-to-str limit)


class _Hostile:
    def __repr__(self) -> str:
        raise RuntimeError("repr ran")

    @property
    def shape(self) -> Any:
        raise RuntimeError("shape ran")


@pytest.mark.parametrize(("value", "want"), [
    (None, "None"), (True, "True"), (1.5, "1.5"), (-7, "-7"), ((1 << 64) - 1, str((1 << 64) - 1)),
    (BIG, f"<int of {BIG.bit_length()} bits>"), ("ab", "'ab'"), (b"\x00", "b'\\x00'"),
    (["t1", 3], "['t1', 3]"), ((1,), "(1,)"),
    ({"k": [BIG]}, f"{{'k': [<int of {BIG.bit_length()} bits>]}}"),
    (frozenset({2}), "frozenset({2})"),
    (torch.zeros(2, 3), "<Tensor (2, 3) torch.float32>"),
    (np.zeros((4,), np.int8), "<ndarray (4,) int8>"),
    (_Hostile(), "<_Hostile>"),
], ids=["none", "bool", "float", "int", "uint64", "bigint", "str", "bytes", "list", "tuple",
        "nested-bigint", "frozenset", "tensor", "ndarray", "hostile"])
def test_values_read_as_plain_data_or_their_type(value: Any, want: str) -> None:
    assert describe(value, 500) == want


def test_the_text_is_cut_at_the_limit() -> None:
    assert describe("x" * 1000, 40) == repr("x" * 64)[:37] + "..."
    assert len(describe(list(range(100)), 30)) == 30


@pytest.mark.parametrize("build", [
    lambda: list(range(2_000_000)),
    lambda: "y" * 50_000_000,
    lambda: _nested(5000),
    lambda: [[BIG] * 1000] * 1000,
], ids=["long-list", "long-str", "deep", "many-bigints"])
def test_huge_or_deep_values_read_as_their_first_items(build: Any) -> None:
    text = describe(build(), 80)
    assert len(text) <= 80 and text[0] in "[\'", text


def _nested(depth: int) -> list[Any]:
    top: list[Any] = []
    cur = top
    for _ in range(depth):
        nxt: list[Any] = []
        cur.append(nxt)
        cur = nxt
    return top

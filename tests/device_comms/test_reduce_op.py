"""reduce_local: the reference arithmetic, and its argument checks (in process)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from device_comms import ReduceOp, reduce_local


@pytest.mark.parametrize("op,want", [(ReduceOp.SUM, [5.0, 1.0]), (ReduceOp.MAX, [4.0, 2.0]),
                                     (ReduceOp.MIN, [1.0, -1.0]), ("product", [4.0, -2.0]),
                                     (ReduceOp.AVG, [2.5, 0.5])])
def test_reduces_in_list_order(op: Any, want: list[float]) -> None:
    got = reduce_local([torch.tensor([1.0, 2.0]), torch.tensor([4.0, -1.0])], op)
    assert torch.equal(got, torch.tensor(want))


def test_leaves_its_inputs_alone() -> None:
    a, b = torch.ones(3), torch.full((3,), 2.0)
    reduce_local([a, b], ReduceOp.SUM)
    assert torch.equal(a, torch.ones(3)) and torch.equal(b, torch.full((3,), 2.0))


BAD: dict[str, tuple[type, Any, Any, str]] = {  # name: (exception, tensors, op, words)
    "empty": (ValueError, [], ReduceOp.SUM, "non-empty"),
    "a-tensor": (TypeError, torch.ones(2, 2), ReduceOp.SUM, "sequence"),
    "a-generator": (TypeError, (t for t in [torch.ones(2)]), ReduceOp.SUM, "sequence"),
    "not-tensors": (TypeError, [torch.ones(2), [1.0, 2.0]], ReduceOp.SUM, "tensors[1]"),
    "shapes-differ": (ValueError, [torch.ones(2), torch.ones(3)], ReduceOp.SUM, "tensors[1]"),
    "dtypes-differ": (ValueError, [torch.ones(2), torch.ones(2, dtype=torch.int32)],
                      ReduceOp.MAX, "tensors[1]"),
    "op-unknown": (TypeError, [torch.ones(2)], "median", "op"),
    "op-bitwise-float": (TypeError, [torch.ones(2)], ReduceOp.BAND, "op"),
    "op-avg-int": (TypeError, [torch.ones(2, dtype=torch.int64)], ReduceOp.AVG, "op"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_arguments_name_the_argument(case: str) -> None:
    exc, tensors, op, words = BAD[case]
    with pytest.raises(exc, match=words.replace("[", r"\[").replace("]", r"\]")):
        reduce_local(tensors, op)

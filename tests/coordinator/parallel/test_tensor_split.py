"""Sharding arithmetic: divide, split_tensor_along_last_dim, get_pp_indices."""

from __future__ import annotations

import pytest
import torch

from coordinator import divide, ensure_divisibility, get_pp_indices, split_tensor_along_last_dim
from coordinator.parallel.tensor_split import pp_layer_ranges


@pytest.mark.parametrize("num,den,want", [(8, 2, 4), (0, 3, 0), (7, 7, 1), (12, 1, 12)])
def test_divide(num: int, den: int, want: int) -> None:
    assert divide(num, den) == want
    ensure_divisibility(num, den)


@pytest.mark.parametrize("num,den,error,word", [
    (7, 2, ValueError, "not divisible"), (4, 0, ValueError, "denominator"),
    (-2, 1, ValueError, "numerator"), (4.0, 2, TypeError, "numerator"),
    (4, True, TypeError, "denominator"), ("4", 2, TypeError, "numerator")])
def test_divide_bad_input_names_the_argument(num: object, den: object, error: type,
                                             word: str) -> None:
    with pytest.raises(error, match=word):
        divide(num, den)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape,parts", [((12,), 3), ((2, 3, 8), 4), ((5, 6), 1), ((4, 6), 6)])
@pytest.mark.parametrize("contiguous", [False, True], ids=["views", "copies"])
def test_split_along_last_dim(shape: tuple, parts: int, contiguous: bool) -> None:
    t = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    pieces = split_tensor_along_last_dim(t, parts, contiguous_split_chunks=contiguous)
    assert len(pieces) == parts
    assert torch.equal(torch.cat(pieces, dim=-1), t)
    for p in pieces:
        assert p.shape[-1] == shape[-1] // parts
        if contiguous:  # a piece already contiguous may stay a view, as in torch
            assert p.is_contiguous()
        else:
            assert p.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


@pytest.mark.parametrize("tensor,parts,error,word", [
    (torch.zeros(2, 5), 2, ValueError, "last dimension"), (torch.zeros(()), 1, ValueError, "0-d"),
    (torch.zeros(4), 0, ValueError, "num_partitions"), ([1, 2], 2, TypeError, "tensor"),
    (torch.zeros(4), 2.0, TypeError, "num_partitions")])
def test_split_bad_input(tensor: object, parts: object, error: type, word: str) -> None:
    with pytest.raises(error, match=word):
        split_tensor_along_last_dim(tensor, parts)  # type: ignore[arg-type]


def _reference_split(layers: int, stages: int) -> list[int]:
    """vLLM's default split, written out: the remainder goes to the stages before
    the last, from the second-to-last towards the first."""
    sizes = [layers // stages] * stages
    stage = stages - 2
    for _ in range(layers % stages):
        sizes[stage % stages] += 1
        stage -= 1
    return sizes


@pytest.mark.parametrize("layers,stages", [(1, 1), (6, 4), (7, 4), (8, 3), (32, 3), (80, 7),
                                           (5, 5), (61, 8)])
def test_pp_indices_cover_every_layer_once(layers: int, stages: int) -> None:
    ranges = [get_pp_indices(layers, r, stages) for r in range(stages)]
    assert ranges == pp_layer_ranges(layers, stages)
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    assert [e - s for s, e in ranges] == _reference_split(layers, stages)


def test_pp_indices_documented_example() -> None:
    assert [get_pp_indices(6, r, 4) for r in range(4)] == [(0, 1), (1, 3), (3, 5), (5, 6)]


@pytest.mark.parametrize("args,error,word", [
    ((8, 4, 4), ValueError, "pp_rank"),
    ((8, -1, 4), ValueError, "pp_rank"), ((8, 0, 0), ValueError, "pp_size"),
    ((8.0, 0, 2), TypeError, "num_hidden_layers"), ((8, "0", 2), TypeError, "pp_rank")])
def test_pp_indices_bad_input(args: tuple, error: type, word: str) -> None:
    with pytest.raises(error, match=word):
        get_pp_indices(*args)


@pytest.mark.parametrize("layers,stages,want", [(3, 4, [1, 1, 1, 0]), (2, 3, [1, 1, 0]),
                                                (0, 2, [0, 0]), (1, 3, [0, 1, 0])])
def test_fewer_layers_than_stages_leave_stages_empty_as_in_vllm(layers: int, stages: int,
                                                               want: list[int]) -> None:
    ranges = [get_pp_indices(layers, r, stages) for r in range(stages)]
    assert [e - s for s, e in ranges] == want == _reference_split(layers, stages)
    assert ranges[-1][1] == layers
    with pytest.raises(ValueError, match=f"cannot split {layers} layers over {stages}"):
        pp_layer_ranges(layers, stages)  # a model's own split refuses empty stages


def test_integer_types_other_than_int_are_accepted() -> None:
    import numpy as np

    assert divide(np.int64(8), np.int32(2)) == 4
    assert get_pp_indices(np.int64(6), 1, 4) == (1, 3)
    assert len(split_tensor_along_last_dim(torch.zeros(4, 6), np.int64(3))) == 3


def test_an_empty_last_dimension_still_gives_every_partition() -> None:
    pieces = split_tensor_along_last_dim(torch.zeros(2, 0), 3)
    assert len(pieces) == 3 and all(p.shape == (2, 0) for p in pieces)

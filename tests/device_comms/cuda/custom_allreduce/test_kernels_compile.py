"""The real custom all-reduce kernels compile to PTX for sm_80 and sm_90 (no GPU needed)."""

from __future__ import annotations

import re
from types import ModuleType

import pytest
import torch

from device_comms.cuda.custom_allreduce import kernels, layout

_ARCHS = ("80", "90")


@pytest.fixture(scope="module", params=_ARCHS, ids=[f"sm_{a}" for a in _ARCHS])
def compiled(request: pytest.FixtureRequest, nvrtc: ModuleType):
    return request.param, nvrtc.compile_to_ptx(
        kernels.kernel_source(), request.param, kernels.all_name_expressions(),
        kernels.COMPILE_OPTIONS,
    )


def test_every_instantiation_is_an_entry(compiled) -> None:
    arch, out = compiled
    assert f".target sm_{arch}" in out.ptx
    names = kernels.all_name_expressions()
    assert len(names) == len(kernels.VARIANTS) * len(kernels.DTYPE_TAGS) * len(kernels.WORLD_SIZES)
    for expr in names:
        lowered = out.lowered_names[expr]
        assert re.search(rf"\.entry\s+{re.escape(lowered)}\s*\(", out.ptx), expr


def test_barrier_uses_system_scope_release_acquire(compiled) -> None:
    _, out = compiled
    assert "st.release.sys.global.u32" in out.ptx
    assert "ld.acquire.sys.global.u32" in out.ptx
    assert "%globaltimer" in out.ptx  # waits are bounded


def test_kernels_load_16_byte_packs(compiled) -> None:
    _, out = compiled
    assert re.search(r"\bld(\.global)?\.v4\.(u32|f32)", out.ptx)
    assert re.search(r"\bst(\.global)?\.v4\.(u32|f32)", out.ptx)
    assert not re.search(r"\bld(\.global)?\.(u8|u16)\b", out.ptx)  # no byte-wise fallbacks


def test_signal_layout_matches_source() -> None:
    src = kernels.kernel_source()
    for name, value in (("GC_MAX_RANKS", layout.MAX_RANKS), ("GC_MAX_BLOCKS", layout.MAX_BLOCKS)):
        assert re.search(rf"#define {name} {value}\b", src), name
    assert "__launch_bounds__(512)" in src and layout.THREADS == 512
    assert layout.SIGNAL_BYTES <= layout.SIGNAL_REGION
    assert layout.TABLE_ENTRY_BYTES == 3 * layout.MAX_RANKS * 8


@pytest.mark.parametrize(
    ("nbytes", "world_size", "want"),
    [(16, 2, "oneshot"), (8 << 20, 2, "oneshot"), (512 << 10, 4, "oneshot"),
     ((512 << 10) + 16, 4, "twoshot"), (256 << 10, 8, "oneshot"), ((256 << 10) + 16, 8, "twoshot"),
     ((256 << 10) + 16, 6, "twoshot")],
)
def test_variant_choice(nbytes: int, world_size: int, want: str) -> None:
    assert kernels.choose_variant(nbytes, world_size) == want


@pytest.mark.parametrize(("npacks", "cap", "want"), [(1, 36, 1), (512, 36, 1), (513, 36, 2),
                                                     (10**6, 36, 36), (10**6, 16, 16)])
def test_launch_blocks(npacks: int, cap: int, want: int) -> None:
    assert layout.launch_blocks(npacks, cap) == want


def test_table_entry_packs_pointers_by_rank() -> None:
    e = layout.table_entry([1, 2], [3, 4], [5, 6])
    assert e.dtype.itemsize == 8 and e.shape == (24,)
    assert e[[0, 1, 8, 9, 16, 17]].tolist() == [1, 2, 3, 4, 5, 6]
    assert e[2:8].sum() == 0


def test_name_expressions_cover_supported_dtypes() -> None:
    from device_comms.cuda.custom_allreduce.eligibility import (
        SUPPORTED_DTYPES,
        SUPPORTED_WORLD_SIZES,
    )

    assert set(kernels.DTYPE_TAGS) == set(SUPPORTED_DTYPES)
    assert tuple(kernels.WORLD_SIZES) == tuple(SUPPORTED_WORLD_SIZES)
    assert kernels.name_expression("oneshot", torch.bfloat16, 8) == "gc_oneshot<gc_bf16, 8>"

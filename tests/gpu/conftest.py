"""GPU checks: collected everywhere, skipped with a reason where no GPU (or CuPy) is present."""

from __future__ import annotations

import importlib.util

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    for item in items:
        if "tests/gpu/" not in item.nodeid.replace("\\", "/"):
            continue
        item.add_marker(pytest.mark.gpu)
        if not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none is visible)"))
        elif item.get_closest_marker("cupy") is None:
            continue
        elif importlib.util.find_spec("cupy") is None:
            item.add_marker(
                pytest.mark.skip(reason="needs CuPy (pip install 'groupcoord[cuda13]')"))


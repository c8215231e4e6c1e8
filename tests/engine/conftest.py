"""Engine test helpers: a small engine on the tiny model and reference computations."""

from __future__ import annotations

import pytest
import torch

from compaction_gym.engine import Engine


@pytest.fixture
def engine(tiny_model_path):
    """A fresh fp32 CPU engine on the tiny model (4 slots × 1024 rows)."""
    return Engine.from_pretrained(
        tiny_model_path, dtype=torch.float32, device="cpu", max_slots=4, capacity=1024
    )


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Every engine test module runs with one torch thread (``one_torch_thread``, tests/conftest.py)."""
    yield

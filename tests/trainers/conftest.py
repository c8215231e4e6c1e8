"""Fixtures the trainer test modules share (a module overrides ``engine`` / ``model`` when it needs
other slots, capacity or train mode)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from tree_helpers import one_thread

from compaction_gym.engine import Engine


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One torch thread per module (tests/conftest.py, ``one_torch_thread``, says why)."""
    with one_thread():
        yield


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    """A float32 CPU engine over the tiny model: 4 slots of 1,024 rows."""
    return Engine.from_pretrained(
        tiny_model_path, dtype=torch.float32, device="cpu", max_slots=4, capacity=1024
    )


@pytest.fixture(scope="module")
def model(tiny_model_path):
    """The trainer's own copy of the weights (plain HF model, default attention), in eval mode."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()

"""The examples in the public docstrings run and print what they claim."""

from __future__ import annotations

import doctest
import importlib

import pytest
import torch

MODULES = ["scoring", "beta", "values", "api", "probes", "baselines", "events", "revisions"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(f"compaction_gym.compaction.{name}")
    torch.manual_seed(0)
    result = doctest.testmod(module, extraglobs={"torch": torch}, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0

"""A tiny leaderboard suite (2 methods × 2 seeds × 2 episodes, 2-step BabyAI) run once per module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_backend(tiny_model_path):
    from compaction_gym.agents.evaluate import load_backend

    backend, _ = load_backend(str(tiny_model_path), 2)
    return backend


@pytest.fixture(scope="session")
def tiny_suite_path(tiny_model_path, tmp_path_factory, write_tiny_suite):
    return write_tiny_suite(tmp_path_factory.mktemp("suite"), str(tiny_model_path))


@pytest.fixture(scope="session")
def tiny_records(tiny_suite_path, tiny_backend, tmp_path_factory):
    """The records root of one uninterrupted run of the tiny suite."""
    from compaction_gym.leaderboard import load_suite, run_suite

    out = tmp_path_factory.mktemp("records")
    run_suite(load_suite(tiny_suite_path), output=out, backend=tiny_backend, progress=False)
    return out

"""A tiny leaderboard suite (2 methods × 2 seeds × 2 episodes, 2-step BabyAI) run once per module."""

from __future__ import annotations

from pathlib import Path

import pytest

SUITE = """
name = "tiny"
env = "AttnMatch-BabyAI-v0"
tasks = ["goto"]
episodes = 2
seeds = [0, 10]
model = "{model}"
prompt = "balrog"
batch = 2
env_kwargs = {{ max_steps = 2 }}
reference_kv_len = 896

[sampling]
max_new_tokens = 3

[[methods]]
name = "none"
mode = "none"

[[methods]]
name = "attention_matching"
mode = "attention_matching"
budgets = [{{ kv_ratio = 0.5, compact_window = 96 }}]
"""


def write_suite(directory: Path, model: str) -> Path:
    path = directory / "tiny.toml"
    path.write_text(SUITE.format(model=model))
    return path


@pytest.fixture(scope="session")
def tiny_backend(tiny_model_path):
    from compaction_gym.agents.evaluate import load_backend

    backend, _ = load_backend(str(tiny_model_path), 2)
    return backend


@pytest.fixture(scope="session")
def tiny_suite_path(tiny_model_path, tmp_path_factory):
    return write_suite(tmp_path_factory.mktemp("suite"), str(tiny_model_path))


@pytest.fixture(scope="session")
def tiny_records(tiny_suite_path, tiny_backend, tmp_path_factory):
    """The records root of one uninterrupted run of the tiny suite."""
    from compaction_gym.leaderboard import load_suite, run_suite

    out = tmp_path_factory.mktemp("records")
    run_suite(load_suite(tiny_suite_path), output=out, backend=tiny_backend, progress=False)
    return out

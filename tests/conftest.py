"""Shared fixtures: a tiny random Qwen3 + BPE tokenizer saved once per test session."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# CI (``CI=true``, .ci/run) draws the same examples on every run, so a landing is never decided by a
# lucky or unlucky draw; local runs keep exploring (README, "Development").
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def load_benchmark(monkeypatch):
    """``load_benchmark(name)`` imports ``benchmarks/<name>.py`` as module ``name`` for one test:
    registered in ``sys.modules`` (spawned processes find it) with ``benchmarks/`` on the path (its
    own imports, such as ``gpu_shapes``)."""

    def load(name: str):
        monkeypatch.syspath_prepend(str(BENCHMARKS))
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        return module

    return load


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny-model ops are dominated by thread start-up on a shared 2-core box: one intra-op thread
    is as fast and does not oversubscribe. Modules opt in with ``usefixtures("one_torch_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """Directory holding a tiny random Qwen3 and its tokenizer (``save_pretrained`` format)."""
    from compaction_gym.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_path):
    """The tiny model in float32 eval mode, loaded through ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    return model.eval()


#: A tiny leaderboard suite (2 methods × 2 seeds × 2 episodes, 2-step BabyAI); ``{model}`` is the model.
TINY_SUITE = """
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


@pytest.fixture(scope="session")
def write_tiny_suite():
    """``write(directory, model) -> path``: the tiny leaderboard suite as ``directory/tiny.toml``."""

    def write(directory, model):
        path = directory / "tiny.toml"
        path.write_text(TINY_SUITE.format(model=model))
        return path

    return write

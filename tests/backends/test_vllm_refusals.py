"""What the vLLM backend refuses, checked without vLLM (the main environment)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
from torch import nn

from compaction_gym.backends.vllm_model import SUPPORTED_ARCHITECTURES, check_architecture
from compaction_gym.errors import InvalidArgumentError


def fake_model(class_name: str, with_attn: bool = True) -> nn.Module:
    """A module named like a vLLM model class, with ``model.layers[i].self_attn(.attn)``."""
    layer = nn.Module()
    layer.self_attn = nn.Module()
    if with_attn:
        layer.self_attn.attn = nn.Identity()
    inner = nn.Module()
    inner.layers = nn.ModuleList([layer])
    model = type(class_name, (nn.Module,), {})()
    model.model = inner
    return model


@pytest.mark.parametrize("name", SUPPORTED_ARCHITECTURES)
def test_supported_families_pass(name):
    check_architecture(fake_model(name), SimpleNamespace(layer_types=["full_attention"]))


@pytest.mark.parametrize("name", ["GPT2LMHeadModel", "Gemma3ForCausalLM", "MistralForCausalLM"])
def test_other_families_are_refused_by_name(name):
    with pytest.raises(InvalidArgumentError, match=rf"model: .*{name}"):
        check_architecture(fake_model(name), SimpleNamespace(architectures=[name]))


def test_sliding_window_layers_and_missing_attention_are_refused():
    with pytest.raises(InvalidArgumentError, match="full-attention"):
        check_architecture(fake_model("Qwen3ForCausalLM"), SimpleNamespace(layer_types=["sliding_attention"]))
    with pytest.raises(InvalidArgumentError, match="self_attn.attn"):
        check_architecture(fake_model("LlamaForCausalLM", with_attn=False), SimpleNamespace())


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_without_vllm_the_backend_says_how_to_install_it():
    from compaction_gym.backends.vllm_backend import VLLMBackend

    with pytest.raises(InvalidArgumentError, match=r"backend: vllm is not installed"):
        VLLMBackend("tiny-random")


def test_the_backend_offers_every_engine_call_the_server_worker_makes():
    """`serve --backend vllm` hands VLLMBackend to the worker as its engine: every engine
    attribute the worker and app use must exist on it and be forwarded to the workers."""
    import ast
    from pathlib import Path

    from compaction_gym.backends.vllm_backend import VLLMBackend
    from compaction_gym.backends.vllm_worker import CALLS

    servers = Path(__file__).resolve().parents[2] / "compaction_gym" / "servers"
    used = set()
    for name in ("worker.py", "app.py", "state.py"):
        for node in ast.walk(ast.parse((servers / name).read_text())):
            if isinstance(node, ast.Attribute) and (
                (isinstance(node.value, ast.Attribute) and node.value.attr == "engine")
                or (isinstance(node.value, ast.Name) and node.value.id == "engine")
            ):
                used.add(node.attr)
    assert {"submit", "advance"} <= used
    missing = {a for a in used if not hasattr(VLLMBackend, a)} - {"config", "types", "capacity", "max_slots", "vocab_size"}
    assert not missing, missing
    assert {"submit", "advance", "running_session_ids", "step_batch", "close"} <= CALLS

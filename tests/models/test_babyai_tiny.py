"""The bundled ``babyai-tiny`` agent: loads by name offline and still plays BabyAI (seeded smoke bound)."""

from __future__ import annotations

import json

import pytest

from compaction_gym import models
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.models.registry import model_defaults, resolve_model

#: Smoke evaluation: episodes per task (held-out seeds 0..N-1, greedy, full KV, the CPU engine's default
#: 4096-row sessions, so a looping episode stops early and counts as a failure) and the loose bound on
#: overall progression (%). The shipped model's 50-episode numbers are in its model card.
SMOKE_EPISODES = 5
SMOKE_MIN_PROGRESSION = 80.0  # the shipped model: 96 on these seeds (model card: 97.6 on 50 per task)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def test_bundled_model_resolves_and_loads_offline():
    directory = models.path("babyai-tiny")
    assert resolve_model("babyai-tiny") == str(directory)
    assert model_defaults("babyai-tiny")["prompt"] == "reasoning"
    model, tokenizer = models.load("babyai-tiny")
    cfg = model.config
    assert cfg.model_type == "qwen3" and cfg.head_dim == 64
    assert cfg.vocab_size == len(tokenizer)
    assert tokenizer.chat_template and tokenizer.convert_tokens_to_ids("<think>") != tokenizer.unk_token_id
    size = sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
    assert size < 20 * 2**20, f"the bundled model directory is {size / 2**20:.1f} MiB"
    meta = json.loads((directory / "compaction_gym.json").read_text())
    assert [stage["sft_config_sha256"] for stage in meta["recipe"]]
    assert all(d["trees_sha256"] and d["config_sha256"] for stage in meta["recipe"] for d in stage["demos"])


def test_unknown_bundled_model_is_a_clear_error():
    with pytest.raises(InvalidArgumentError, match="bundled models"):
        models.path("no-such-model")


def test_smoke_evaluation_reaches_the_seeded_bound():
    from compaction_gym.evaluation import evaluate

    summary = evaluate(
        "babyai-tiny",
        "AttnMatch-BabyAI-v0",
        episodes=SMOKE_EPISODES,
        seed=0,
        batch=SMOKE_EPISODES,
        engine_kwargs={"device": "cpu"},
        progress=False,
    )
    assert summary["config"]["prompt"] == "reasoning"
    assert summary["overall"]["episodes"] == 5 * SMOKE_EPISODES
    assert summary["overall"]["progression"]["mean"] >= SMOKE_MIN_PROGRESSION, summary["tasks"]

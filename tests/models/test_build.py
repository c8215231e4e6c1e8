"""``compaction_gym.models.build``: a fresh base model and tokenizer, optionally with object-name tokens."""

from __future__ import annotations

import pytest

from compaction_gym.demos.recorder import expert_corpus
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.models.build import BaseModelConfig, build_base_model, object_tokens

TINY = dict(layers=1, hidden=64, heads=1, kv_heads=1, intermediate=64)


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return expert_corpus(["putnext", "open"], range(100000, 100002))


@pytest.mark.parametrize("with_objects", [False, True])
def test_base_model_loads_back_and_round_trips_the_corpus(tmp_path, corpus, with_objects):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = build_base_model(tmp_path / "base", corpus, BaseModelConfig(**TINY, object_tokens=with_objects))
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == len(tokenizer) and model.config.head_dim == 64
    assert all(tokenizer.decode(tokenizer(text)["input_ids"]) == text for text in corpus)
    line = "a wall 2 steps left\na green key 1 step right\na closed red door 2 steps forward"
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(line)["input_ids"])
    # with object tokens every object is one token, wherever it is mentioned; without, two or more
    assert (" green key" in tokens and " red door" in tokens) == with_objects
    if with_objects:
        reasoning = "<think>Next: pick up the green key. It is 1 step right.</think>"
        assert tokenizer.convert_ids_to_tokens(tokenizer(reasoning)["input_ids"])[:7] == [
            "<think>", "Next", ":", "Ġpick", "Ġup", "Ġthe", " green key",
        ]  # fmt: skip
        assert all(len(tokenizer(name, add_special_tokens=False)["input_ids"]) == 1 for name in object_tokens())


def test_base_model_config_is_validated():
    with pytest.raises(InvalidArgumentError, match="multiple of kv_heads"):
        BaseModelConfig(heads=3, kv_heads=2)
    with pytest.raises(InvalidArgumentError, match="corpus is empty"):
        build_base_model("unused", [], BaseModelConfig(**TINY))

"""make_tiny_model round-trips through the real Hugging Face loading path."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from compaction_gym.models.tiny import SPECIAL_TOKENS, make_tiny_model


def test_round_trip_through_from_pretrained(tiny_model_path):
    config = AutoConfig.from_pretrained(tiny_model_path)
    assert config.model_type == "qwen3"
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (2, 4, 2)
    assert config.head_dim == 64
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert model.get_input_embeddings().num_embeddings == len(tok)
    for special in SPECIAL_TOKENS:
        (tid,) = tok.convert_tokens_to_ids([special])
        assert tok.decode([tid]) == special
    assert tok.eos_token == "<|im_end|>"
    assert config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")


def test_tokenizer_is_lossless_on_env_text(tiny_tokenizer):
    text = "a wall 6 steps forward\na green key 1 step right and 2 steps forward\nÜber 漢字 ✓"
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert tiny_tokenizer.decode(ids) == text
    # The trained merges compress the env vocabulary well below one token per byte.
    common = "a wall 6 steps forward"
    assert len(tiny_tokenizer.encode(common, add_special_tokens=False)) < len(common) // 2


def test_chat_template_renders_chatml(tiny_tokenizer):
    messages = [{"role": "user", "content": "Observation:\na wall 1 step left"}, {"role": "assistant", "content": "turn left"}]
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = (
        "<|im_start|>user\nObservation:\na wall 1 step left<|im_end|>\n"
        "<|im_start|>assistant\nturn left<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text == expected
    ids = tiny_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    assert tiny_tokenizer.decode(ids) == expected[: -len("<|im_start|>assistant\n")]


def test_model_is_seeded_and_forward_runs(tmp_path, tiny_model_path, tiny_model):
    again = make_tiny_model(tmp_path / "again")
    other = AutoModelForCausalLM.from_pretrained(again, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    with torch.no_grad():
        a = tiny_model(ids).logits
        b = other(ids).logits
    assert a.shape == (1, 5, tiny_model.config.vocab_size)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.isfinite(a).all()

"""Append-only chat framing against literal ChatML text and awkward templates."""

from __future__ import annotations

import pytest

from compaction_gym.agents.chat import ChatFormat
from compaction_gym.errors import InvalidArgumentError

#: Qwen3-style: the *last* assistant turn gets an empty think block, earlier ones do not.
THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
ALTERNATING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.index0 > 0 and message['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{{- message['role'] + ': ' + message['content'] + '\\n' }}"
    "{%- endfor %}"
)


def test_chatml_deltas_are_literal(tiny_tokenizer):
    chat = ChatFormat(tiny_tokenizer)
    assert chat.prompt_text("INSTR") == "<|im_start|>user\nINSTR<|im_end|>\n"
    assert (
        chat.first_user_text("INSTR", "obs 1") == "<|im_start|>user\nobs 1<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        chat.next_user_text("obs 2")
        == "<|im_end|>\n<|im_start|>user\nobs 2<|im_end|>\n<|im_start|>assistant\n"
    )
    # the model's own <|im_end|> is not repeated
    assert (
        chat.after_output("obs 2", "<|im_end|>")
        == "\n<|im_start|>user\nobs 2<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat.after_output("obs 2", "") == chat.next_user_text("obs 2")


def test_concatenated_deltas_equal_the_rendered_conversation(tiny_tokenizer):
    chat = ChatFormat(tiny_tokenizer)
    text = chat.prompt_text("I") + chat.first_user_text("I", "o1") + "a1<|im_end|>"
    text += chat.after_output("o2", "<|im_end|>") + "a2"
    messages = [
        {"role": "user", "content": "I"},
        {"role": "user", "content": "o1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "o2"},
        {"role": "assistant", "content": "a2"},
    ]
    rendered = tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == text + "<|im_end|>\n"


def test_system_prompt_only_in_the_prompt(tiny_tokenizer):
    chat = ChatFormat(tiny_tokenizer, system_prompt="SYS")
    assert chat.prompt_text("I") == "<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nI<|im_end|>\n"
    assert "SYS" not in chat.first_user_text("I", "o") + chat.next_user_text("o")


def test_template_that_rewrites_history_still_gives_the_delta(tiny_tokenizer):
    chat = ChatFormat(tiny_tokenizer, chat_template=THINKING_TEMPLATE)
    # rendered alone, the dummy assistant would get a think block; the delta must not contain one
    assert chat.next_user_text("o") == "<|im_end|>\n<|im_start|>user\no<|im_end|>\n<|im_start|>assistant\n"


def test_template_that_forbids_consecutive_users_is_reported(tiny_tokenizer):
    with pytest.raises(InvalidArgumentError, match="roles must alternate"):
        ChatFormat(tiny_tokenizer, chat_template=ALTERNATING_TEMPLATE)


def test_missing_template_or_tokenizer(tiny_tokenizer):
    with pytest.raises(InvalidArgumentError, match="tokenizer=..."):
        ChatFormat(None)
    saved = tiny_tokenizer.chat_template
    try:
        tiny_tokenizer.chat_template = None
        with pytest.raises(InvalidArgumentError, match="no chat template"):
            ChatFormat(tiny_tokenizer)
    finally:
        tiny_tokenizer.chat_template = saved


def test_encode_keeps_special_tokens_single(tiny_tokenizer):
    chat = ChatFormat(tiny_tokenizer)
    ids = chat.encode("<|im_start|>user\nx<|im_end|>\n")
    assert ids[0] == tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tiny_tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    assert chat.decode(ids) == "<|im_start|>user\nx<|im_end|>\n"


def test_message_frame_is_the_user_turn_delta(tiny_tokenizer):
    """prefix + content + suffix is what the template renders for a user message after another."""
    for kwargs in ({}, {"system_prompt": "SYS"}):
        chat = ChatFormat(tiny_tokenizer, **kwargs)
        prefix, suffix = chat.message_frame()
        assert (prefix, suffix) == ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
        assert prefix + "Budget: 3/9" + suffix == chat.first_user_text("INSTR", "Budget: 3/9")
    plain = ChatFormat(tiny_tokenizer, chat_template=ALTERNATING_TEMPLATE.replace(
        "{%- if loop.index0 > 0 and message['role'] == messages[loop.index0 - 1]['role'] %}", "{%- if false %}"
    ))  # fmt: skip
    assert plain.message_frame() == ("user: ", "\n")


def test_message_frame_needs_verbatim_content(tiny_tokenizer):
    twice = (
        "{%- for m in messages %}{{- m['role'] + ': ' + m['content']"
        " + (m['content'] if m['role'] == 'user' else '') + '\\n' }}{%- endfor %}"
    )
    chat = ChatFormat(tiny_tokenizer, chat_template=twice)
    with pytest.raises(InvalidArgumentError, match="budget_message_frame"):
        chat.message_frame()

"""Append-only chat framing: the text to feed a persistent session, one message at a time.

A compacted session can never rewrite what it has already read, so instead of re-rendering the
whole conversation each turn (what BALROG and most chat clients do), :class:`ChatFormat` asks the
tokenizer's chat template for the *delta* a new user message adds, with the model's previous
output kept exactly as generated. The delta for a turn is found by rendering a small dummy
conversation with the template:

* first turn: ``render([system?, user(instruction), user(content)], gen) - render([system?,
  user(instruction)])``;
* later turns: the text after a dummy assistant message in
  ``render([system?, user(U), assistant(A), user(content)], gen)``: the assistant's closing
  (e.g. ``<|im_end|>\\n``), the user message and the generation prompt. If the model already
  produced the start of that closing (its stop token), that part is dropped.

Rendering the dummy context instead of the real history makes templates that rewrite earlier
assistant turns (Qwen3 drops past ``<think>`` blocks) harmless: what the session holds is the
model's own output, verbatim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from compaction_gym.errors import InvalidArgumentError

_SENT_USER = "\u2063user-sentinel\u2063"
_SENT_ASSISTANT = "\u2063assistant-sentinel\u2063"
_SENT_MESSAGE = "\u2063message-sentinel\u2063"


class ChatFormat:
    """Incremental chat-template rendering for one tokenizer.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        system_prompt: optional system message placed before the instruction.
        chat_template: overrides the tokenizer's template.
        template_kwargs: extra variables for the template (e.g. ``enable_thinking=False``).

    Raises:
        InvalidArgumentError: the tokenizer has no chat template, or the template cannot render
            a user message directly after another user message (the instruction is its own
            message) or is not append-only.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        system_prompt: str | None = None,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if tokenizer is None:
            raise InvalidArgumentError("a tokenizer is required: the backend has none, pass tokenizer=...")
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise InvalidArgumentError(
                "the tokenizer has no chat template; pass chat_template=... (a Jinja template) to the agent"
            )
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.chat_template = chat_template
        self.template_kwargs = dict(template_kwargs or {})
        self.first_user_text("probe", "probe")  # fail early on templates we cannot use
        self.next_user_text("probe")

    # ------------------------------------------------------------------ rendering
    def render(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages`` (system prompt prepended when set)."""
        msgs = list(messages)
        if self.system_prompt is not None:
            msgs = [{"role": "system", "content": self.system_prompt}, *msgs]
        try:
            return self.tokenizer.apply_chat_template(
                msgs,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=self.chat_template,
                **self.template_kwargs,
            )
        except Exception as exc:  # jinja raises TemplateError / its own exceptions
            roles = [m["role"] for m in msgs]
            raise InvalidArgumentError(
                f"the chat template failed to render roles {roles}: {exc}. The agent appends the "
                "instruction and each observation as separate user messages; pass chat_template=... "
                "for a template that allows it"
            ) from exc

    def prompt_text(self, instruction: str) -> str:
        """The protected creation prompt: the instruction as the first user message."""
        return self.render([{"role": "user", "content": instruction}])

    def first_user_text(self, instruction: str, content: str) -> str:
        """What to feed after :meth:`prompt_text` for the first user message (+ generation prompt)."""
        base = self.prompt_text(instruction)
        full = self.render(
            [{"role": "user", "content": instruction}, {"role": "user", "content": content}],
            add_generation_prompt=True,
        )
        if not full.startswith(base):
            raise InvalidArgumentError(
                "the chat template is not append-only: rendering a second user message changed the text "
                "of the first; pass chat_template=..."
            )
        return full[len(base) :]

    def message_frame(self) -> tuple[str, str]:
        """How the template frames a user message that follows another, with the generation
        prompt after it: ``(prefix, suffix)``, so that ``prefix + content + suffix`` equals
        :meth:`first_user_text` of ``content`` (no BOS, no default system message). The agent
        passes it to the engine as ``CompactionConfig.budget_message_frame``, so budget messages
        read as a user turn of this template.

        Raises:
            InvalidArgumentError: the template does not place the content verbatim (exactly once).
        """
        text = self.first_user_text(_SENT_USER, _SENT_MESSAGE)
        if text.count(_SENT_MESSAGE) != 1:
            raise InvalidArgumentError(
                "the chat template does not place a user message's content verbatim; pass "
                "budget_message_frame=(prefix, suffix) in the CompactionConfig or chat_template=..."
            )
        prefix, suffix = text.split(_SENT_MESSAGE)
        return prefix, suffix

    def next_user_text(self, content: str) -> str:
        """What to feed after an assistant's content: its closing, the user message, the generation
        prompt. Strip the part the model generated itself (see :meth:`after_output`)."""
        full = self.render(
            [
                {"role": "user", "content": _SENT_USER},
                {"role": "assistant", "content": _SENT_ASSISTANT},
                {"role": "user", "content": content},
            ],
            add_generation_prompt=True,
        )
        i = full.find(_SENT_USER)
        j = full.find(_SENT_ASSISTANT, i + len(_SENT_USER)) if i >= 0 else -1
        if j < 0:
            raise InvalidArgumentError(
                "the chat template dropped the assistant message; pass chat_template=..."
            )
        return full[j + len(_SENT_ASSISTANT) :]

    def after_output(self, content: str, output_tail: str) -> str:
        """:meth:`next_user_text` minus the closing text the model already generated.

        Args:
            content: the next user message.
            output_tail: decoded text of the model's last token if it stopped on a stop token
                (e.g. ``<|im_end|>``), else ``""``.
        """
        text = self.next_user_text(content)
        if output_tail and text.startswith(output_tail):
            text = text[len(output_tail) :]
        return text

    # ------------------------------------------------------------------ tokens
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without adding special tokens (the template already did)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """Decode keeping special tokens (the transcript's exact text)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

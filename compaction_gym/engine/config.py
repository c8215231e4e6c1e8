"""Configuration dataclasses shared by the engine, backends, server and agents."""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal

from compaction_gym.compaction import COMPACTION_MODES as _COMPACT_MODES
from compaction_gym.errors import InvalidArgumentError

CompactionMode = Literal["none", "attention_matching", "markovian", "h2o", "snapkv", "streaming", "random"]
ProbeSource = Literal["suffix", "keys", "random"]

#: :func:`~compaction_gym.compaction.compact`'s modes, and ``none`` (sessions never compact).
COMPACTION_MODES: tuple[str, ...] = ("none", *_COMPACT_MODES)
PROBE_SOURCES: tuple[str, ...] = ("suffix", "keys", "random")
DEFAULT_BUDGET_TEMPLATE = "Budget: {used}/{total} tokens generated. ~{remaining} tokens remaining."
#: The engine's budget-message framing when a session gives none and the tokenizer speaks ChatML:
#: a user turn, then the assistant's generation prompt.
DEFAULT_BUDGET_FRAME = ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
#: ... and when the tokenizer has no chat template or no ``<|im_start|>``: blank lines around it.
PLAIN_BUDGET_FRAME = ("\n\n", "\n\n")


class _DictMixin:
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = set(data) - names
        if unknown:
            raise InvalidArgumentError(f"unknown {cls.__name__} field(s): {sorted(unknown)}; valid: {sorted(names)}")
        return cls(**data)

    def replace(self, **changes: Any):
        return replace(self, **changes)  # type: ignore[type-var]


@dataclass(frozen=True)
class SamplingParams(_DictMixin):
    """How to sample one response.

    Args:
        temperature: 0 means greedy.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        seed: seeds this request's own RNG stream (``None``: nondeterministic).
        max_new_tokens: generation stops after this many sampled tokens (finish reason ``length``).
        stop_token_ids: extra stop tokens besides the model's EOS ids.
        ignore_eos: keep generating through EOS (benchmarks).
    """

    temperature: float = field(default=1.0, metadata={"help": "sampling temperature; 0 means greedy"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus mass in (0, 1]; 1 disables it"})
    top_k: int = field(default=0, metadata={"help": "keep the k most likely tokens; 0 disables it"})
    seed: int | None = field(
        default=None, metadata={"help": "seeds this request's own RNG stream (unset: nondeterministic)"}
    )
    max_new_tokens: int = field(
        default=256, metadata={"help": "sampled tokens per response (finish reason 'length' after them)"}
    )
    stop_token_ids: tuple[int, ...] = field(
        default=(), metadata={"help": "extra stop tokens besides the model's EOS ids"}
    )
    ignore_eos: bool = field(default=False, metadata={"help": "keep generating through EOS (benchmarks)"})

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise InvalidArgumentError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens < 0:
            raise InvalidArgumentError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class CompactionConfig(_DictMixin):
    """When and how a session's KV cache is compacted (DESIGN §3-§4).

    Triggers (at most one automatic trigger is active):

    * **KV budget** — ``max_kv_len`` set and ``n_protect_turns < 0``: when the cache reaches
      ``max_kv_len`` (checked before and during decode) the first ``compact_window`` tokens after
      the protected prompt are compacted to ``compact_target_ratio`` of their length, at most
      ``n_compacts`` times per session.
    * **Turn-based** — ``n_protect_turns = k >= 0``: after each complete assistant response,
      the region between the end of the previous compacted block and the start of the last ``k``
      turns is compacted (``recompact_from_prompt`` re-compacts from the prompt instead).
    * **Manual** — ``Engine.compact(session_id, span=..., ratio=...)`` always works.

    Args:
        mode: one of ``COMPACTION_MODES``.
        max_kv_len: KV-budget trigger length (tokens in cache).
        compact_window: tokens compacted per KV-budget event (default ``max_kv_len // 2``).
        compact_target_ratio: kept fraction of a span, in (0, 1].
        n_compacts: maximum KV-budget events per session.
        max_total_tokens: cap on logical tokens generated in the session (finish reason ``budget``).
        n_protect_turns: turn-based trigger; ``-1`` disables it.
        recompact_from_prompt: turn-based: re-compact everything after the prompt each time.
        protect_prompt: never compact the session's creation prompt.
        queries: probe source, one of ``PROBE_SOURCES``.
        n_probe_queries: how many recent query positions per layer are kept for ``suffix`` probes
            (and how many random probes are drawn for ``random``).
        compute_beta: fit the per-key logit bias β (attention_matching only).
        ridge: relative ridge strength of the C2 solve.
        inject_budget_message: after each compaction event, prefill the budget message.
        budget_message_template: formatted with ``used``, ``total`` and ``remaining``.
        budget_message_frame: ``(prefix, suffix)`` text placed around the budget message before it
            is tokenized (as one text): how the caller's chat template frames a user turn and the
            generation prompt. ``CompactionAgent`` sets it from its chat template. ``None``: the
            engine's default, :data:`DEFAULT_BUDGET_FRAME` (ChatML) when the tokenizer has a chat
            template and ``<|im_start|>``, else blank lines around the message.
    """

    mode: CompactionMode = field(
        default="none", metadata={"help": "compaction mode ('none': never compact)", "choices": COMPACTION_MODES}
    )
    max_kv_len: int | None = field(
        default=None, metadata={"help": "KV-budget trigger: compact when the cache reaches this many rows"}
    )
    compact_window: int | None = field(
        default=None, metadata={"help": "rows compacted per KV-budget event (default: max_kv_len // 2)"}
    )
    compact_target_ratio: float = field(
        default=0.25, metadata={"help": "kept fraction of a compacted span, in (0, 1]", "aliases": ("ratio",)}
    )
    n_compacts: int = field(default=99, metadata={"help": "at most this many KV-budget events per session"})
    max_total_tokens: int | None = field(
        default=None, metadata={"help": "cap on tokens generated in the session (finish reason 'budget')"}
    )
    n_protect_turns: int = field(
        default=-1, metadata={"help": "turn-based trigger: keep the last k turns raw; -1 disables it"}
    )
    recompact_from_prompt: bool = field(
        default=False, metadata={"help": "turn-based: re-compact everything after the prompt each time"}
    )
    protect_prompt: bool = field(default=True, metadata={"help": "never compact the session's creation prompt"})
    queries: ProbeSource = field(
        default="suffix",
        metadata={"help": "probe queries: recent queries (suffix), cache keys (keys) or random", "choices": PROBE_SOURCES},
    )
    n_probe_queries: int = field(
        default=256, metadata={"help": "probe queries per layer (recent positions kept, or random draws)"}
    )
    compute_beta: bool = field(
        default=False, metadata={"help": "fit the per-key logit bias beta (attention_matching only)"}
    )
    ridge: float = field(default=1e-4, metadata={"help": "relative ridge strength of the C2 value solve"})
    inject_budget_message: bool = field(
        default=False, metadata={"help": "after each compaction event, feed the budget message"}
    )
    budget_message_template: str = field(
        default=DEFAULT_BUDGET_TEMPLATE,
        metadata={"help": "budget message, formatted with {used}, {total} and {remaining}"},
    )
    budget_message_frame: tuple[str, str] | None = field(
        default=None,
        metadata={
            "help": "PREFIX SUFFIX text around the budget message (the chat template's user turn and "
            "generation prompt; agents set it from their template); unset: ChatML when the tokenizer "
            "has <|im_start|>, else blank lines"
        },
    )

    def __post_init__(self) -> None:
        frame = self.budget_message_frame
        if frame is not None:
            if isinstance(frame, (str, bytes)) or not hasattr(frame, "__iter__"):
                frame = (frame,)
            frame = tuple(frame)
            if len(frame) != 2 or not all(isinstance(x, str) for x in frame):
                raise InvalidArgumentError(
                    f"budget_message_frame must be a (prefix, suffix) pair of strings or None, got {self.budget_message_frame!r}"
                )
            object.__setattr__(self, "budget_message_frame", frame)
        if self.mode not in COMPACTION_MODES:
            raise InvalidArgumentError(f"mode must be one of {COMPACTION_MODES}, got {self.mode!r}")
        if self.queries not in PROBE_SOURCES:
            raise InvalidArgumentError(f"queries must be one of {PROBE_SOURCES}, got {self.queries!r}")
        if not 0 < self.compact_target_ratio <= 1:
            raise InvalidArgumentError(f"compact_target_ratio must be in (0, 1], got {self.compact_target_ratio}")
        if self.max_kv_len is not None and self.max_kv_len <= 0:
            raise InvalidArgumentError(f"max_kv_len must be positive, got {self.max_kv_len}")
        if self.compact_window is not None and self.compact_window <= 0:
            raise InvalidArgumentError(f"compact_window must be positive, got {self.compact_window}")
        if self.n_compacts < 0:
            raise InvalidArgumentError(f"n_compacts must be >= 0, got {self.n_compacts}")
        if self.max_total_tokens is not None and self.max_total_tokens <= 0:
            raise InvalidArgumentError(f"max_total_tokens must be positive, got {self.max_total_tokens}")
        if self.n_protect_turns < -1:
            raise InvalidArgumentError(f"n_protect_turns must be >= -1 (-1 disables it), got {self.n_protect_turns}")
        if self.n_probe_queries <= 0:
            raise InvalidArgumentError(f"n_probe_queries must be positive, got {self.n_probe_queries}")
        if self.ridge < 0:
            raise InvalidArgumentError(f"ridge must be >= 0, got {self.ridge}")
        if self.mode == "none" and (self.max_kv_len is not None or self.n_protect_turns >= 0):
            raise InvalidArgumentError(
                "mode='none' contradicts a compaction trigger (max_kv_len or n_protect_turns); "
                "pick a compaction mode or drop the trigger"
            )
        if self.compute_beta and self.mode != "attention_matching":
            raise InvalidArgumentError(f"compute_beta needs mode='attention_matching', got mode={self.mode!r}")
        if self.turn_based:
            if self.compact_window is not None:
                warnings.warn(
                    "compact_window is ignored in turn-based mode (n_protect_turns >= 0)", UserWarning, stacklevel=3
                )
        elif self.max_kv_len is not None:
            window = self.compact_window if self.compact_window is not None else max(1, self.max_kv_len // 2)
            if window >= self.max_kv_len:
                raise InvalidArgumentError(
                    f"compact_window ({window}) must be smaller than max_kv_len ({self.max_kv_len})"
                )
            object.__setattr__(self, "compact_window", window)
        if self.inject_budget_message:
            try:
                self.budget_message_template.format(used=0, total=0, remaining=0)
            except (KeyError, IndexError) as exc:
                raise InvalidArgumentError(
                    f"budget_message_template may only use {{used}}, {{total}}, {{remaining}}: {exc}"
                ) from exc

    @property
    def turn_based(self) -> bool:
        return self.n_protect_turns >= 0

    @property
    def kv_budget(self) -> bool:
        return self.max_kv_len is not None and not self.turn_based

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

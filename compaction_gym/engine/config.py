"""Configuration dataclasses shared by the engine, backends, server and agents."""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from compaction_gym.compaction.modes import COMPACTION_MODES as _COMPACT_MODES
from compaction_gym.compaction.modes import PROBE_SOURCES
from compaction_gym.errors import InvalidArgumentError

#: a compaction mode name: one of :data:`COMPACTION_MODES` (checked at construction)
CompactionMode = str
#: a probe source name: one of :data:`PROBE_SOURCES`
ProbeSource = str

#: :func:`~compaction_gym.compaction.api`'s modes, and ``none`` (sessions never compact).
COMPACTION_MODES: tuple[str, ...] = ("none", *_COMPACT_MODES)
DEFAULT_BUDGET_TEMPLATE = "Budget: {used}/{total} tokens generated. ~{remaining} tokens remaining."
INT32_MAX = 2**31 - 1
INT63_MAX = 2**63 - 1
#: most probe queries a session may ask for (each is a query vector per layer and head)
MAX_PROBE_QUERIES = 65536
#: most extra stop tokens one request may give
MAX_STOP_IDS = 1024
#: where a KV-budget event's span starts (docs/engine.md, "Triggers")
KV_BUDGET_FROM: tuple[str, ...] = ("prompt", "raw")


def _check_fields(obj: Any) -> None:
    """Type and range of every field, from its annotation and ``metadata`` (``ge``, ``gt``, ``le``,
    ``max_length``); numbers must be finite, ints are not bools. Normalises numpy scalars and lists.

    Raises:
        InvalidArgumentError: naming the first bad field.
    """
    for f in fields(obj):
        value, kind, meta = getattr(obj, f.name), str(f.type), f.metadata
        name = f"{type(obj).__name__}.{f.name}"
        if value is None:
            if "None" not in kind:
                raise InvalidArgumentError(f"{name} must not be None")
            continue
        base = kind.split(" | ")[0]
        if base.startswith("tuple"):
            item = base[len("tuple[") :].split(",")[0].strip(" ]")
            if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
                raise InvalidArgumentError(f"{name} must be a list of {item}s, got {value!r:.80}")
            if len(value) > meta.get("max_length", len(value)):
                raise InvalidArgumentError(f"{name} takes at most {meta['max_length']} items, got {len(value)}")
            if "size" in meta and len(value) != meta["size"]:
                raise InvalidArgumentError(f"{name} must have exactly {meta['size']} items, got {len(value)}")
            if item == "str":
                if not all(isinstance(v, str) and len(v) <= meta.get("max_chars", 4096) for v in value):
                    raise InvalidArgumentError(f"{name} must hold strings of at most 4096 characters, got {value!r:.80}")
                items = tuple(value)
            else:
                items = tuple(_number(name, v, "int", meta) for v in value)
            object.__setattr__(obj, f.name, items)
        elif base in ("int", "float", "bool"):
            object.__setattr__(obj, f.name, _number(name, value, base, meta))
        else:  # str and the Literal aliases
            if not isinstance(value, str):
                raise InvalidArgumentError(f"{name} must be a str, got {type(value).__name__}")
            if len(value) > meta.get("max_length", len(value)):
                raise InvalidArgumentError(f"{name} is longer than {meta['max_length']} characters")
            if "choices" in meta and value not in meta["choices"]:
                raise InvalidArgumentError(f"{name} must be one of {tuple(meta['choices'])}, got {value!r}")


def _number(name: str, value: Any, kind: str, meta: Any) -> Any:
    import numbers

    if kind == "bool":
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"{name} must be a bool, got {value!r:.80}")
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{name} must be a{'n int' if kind == 'int' else ' number'}, got {value!r:.80}")
    if kind == "int":
        if not isinstance(value, numbers.Integral):
            if not float(value).is_integer():
                raise InvalidArgumentError(f"{name} must be an int, got {value!r}")
            raise InvalidArgumentError(f"{name} must be an int, got the float {value!r}")
        value = int(value)
    else:
        value = float(value)
        if not math.isfinite(value):
            raise InvalidArgumentError(f"{name} must be finite, got {value!r}")
    if "ge" in meta and value < meta["ge"]:
        raise InvalidArgumentError(f"{name} must be >= {meta['ge']}, got {value!r}")
    if "gt" in meta and value <= meta["gt"]:
        raise InvalidArgumentError(f"{name} must be > {meta['gt']}, got {value!r}")
    if "le" in meta and value > meta["le"]:
        raise InvalidArgumentError(f"{name} must be <= {meta['le']}, got {value!r}")
    return value


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

    temperature: float = field(default=1.0, metadata={"help": "sampling temperature; 0 means greedy", "ge": 0})
    top_p: float = field(default=1.0, metadata={"help": "nucleus mass in (0, 1]; 1 disables it", "gt": 0, "le": 1})
    top_k: int = field(
        default=0, metadata={"help": "keep the k most likely tokens; 0 disables it", "ge": 0, "le": INT32_MAX}
    )
    seed: int | None = field(
        default=None,
        metadata={"help": "seeds this request's own RNG stream (unset: nondeterministic)", "ge": 0, "le": INT63_MAX},
    )
    max_new_tokens: int = field(
        default=256,
        metadata={"help": "sampled tokens per response (finish reason 'length' after them)", "ge": 0, "le": INT32_MAX},
    )
    stop_token_ids: tuple[int, ...] = field(
        default=(),
        metadata={"help": "extra stop tokens besides the model's EOS ids", "ge": 0, "le": INT32_MAX, "max_length": MAX_STOP_IDS},
    )
    ignore_eos: bool = field(default=False, metadata={"help": "keep generating through EOS (benchmarks)"})

    def __post_init__(self) -> None:
        _check_fields(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class CompactionConfig(_DictMixin):
    """When and how a session's KV cache is compacted (docs/compaction.md, docs/engine.md).

    Triggers (at most one automatic trigger is active):

    * **KV budget** — ``max_kv_len`` set and ``n_protect_turns < 0``: when the cache reaches
      ``max_kv_len`` (checked before and during decode) the first ``compact_window`` tokens after
      the protected prompt (``kv_budget_from="raw"``: after the last compacted block) are
      compacted to ``compact_target_ratio`` of their length, at most ``n_compacts`` times per
      session.
    * **Turn-based** — ``n_protect_turns = k >= 0``: after each complete assistant response,
      the region between the end of the previous compacted block and the start of the last ``k``
      turns is compacted (``recompact_from_prompt`` re-compacts from the prompt instead).
    * **Manual** — ``Engine.compact(session_id, span=..., ratio=...)`` always works.

    Args:
        mode: one of ``COMPACTION_MODES``.
        max_kv_len: KV-budget trigger length (tokens in cache).
        compact_window: tokens compacted per KV-budget event (default ``max_kv_len // 2``).
        kv_budget_from: where a KV-budget event's span starts: ``"prompt"`` (right after the
            protected prompt, so earlier blocks are compacted again) or ``"raw"`` (at the end of the
            last compacted block, so each event compacts the oldest raw rows; back to ``"prompt"``
            when fewer than ``compact_window`` raw rows remain).
        compact_target_ratio: kept fraction of a span, in (0, 1].
        n_compacts: maximum KV-budget events per session.
        max_total_tokens: cap on logical tokens generated in the session (finish reason ``budget``).
        n_protect_turns: turn-based trigger; ``-1`` disables it.
        recompact_from_prompt: turn-based: re-compact everything after the prompt each time.
        protect_prompt: never compact the session's creation prompt.
        queries: probe source, one of ``PROBE_SOURCES``.
        n_probe_queries: how many recent query positions per layer are kept for ``suffix`` probes
            (how many random probes are drawn for ``random``; the most span tokens ``repeat``
            re-reads).
        compute_beta: fit the per-key logit bias β (attention_matching only).
        ridge: relative ridge strength of the C2 solve.
        refit_values: ``attention_matching`` refits C2 (``False``: the kept rows' original values).
        inject_budget_message: after each compaction event, prefill the budget message.
        inject_budget_every: prefill the budget message after every this many sampled tokens of
            the session, with or without compaction (``mode="none"``: the seeds' ``inject_only``
            baseline); ``None`` disables it.
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
        default=None,
        metadata={"help": "KV-budget trigger: compact when the cache reaches this many rows", "gt": 0, "le": INT32_MAX},
    )
    compact_window: int | None = field(
        default=None,
        metadata={"help": "rows compacted per KV-budget event (default: max_kv_len // 2)", "gt": 0, "le": INT32_MAX},
    )
    kv_budget_from: str = field(
        default="prompt",
        metadata={
            "help": "where a KV-budget event's span starts: after the protected prompt (prompt: earlier "
            "blocks are compacted again) or at the oldest not-yet-compacted row (raw: earlier blocks "
            "are kept; back to prompt when fewer than compact_window raw rows remain)",
            "choices": KV_BUDGET_FROM,
        },
    )
    compact_target_ratio: float = field(
        default=0.25,
        metadata={"help": "kept fraction of a compacted span, in (0, 1]", "aliases": ("ratio",), "gt": 0, "le": 1},
    )
    n_compacts: int = field(
        default=99, metadata={"help": "at most this many KV-budget events per session", "ge": 0, "le": INT32_MAX}
    )
    max_total_tokens: int | None = field(
        default=None,
        metadata={"help": "cap on tokens generated in the session (finish reason 'budget')", "gt": 0, "le": INT32_MAX},
    )
    n_protect_turns: int = field(
        default=-1,
        metadata={"help": "turn-based trigger: keep the last k turns raw; -1 disables it", "ge": -1, "le": INT32_MAX},
    )
    recompact_from_prompt: bool = field(
        default=False, metadata={"help": "turn-based: re-compact everything after the prompt each time"}
    )
    protect_prompt: bool = field(default=True, metadata={"help": "never compact the session's creation prompt"})
    queries: ProbeSource = field(
        default="suffix",
        metadata={
            "help": "probe queries: recent queries (suffix), cache keys (keys), random, the span re-read "
            "after a 'repeat the previous text' prompt (repeat), or suffix+repeat",
            "choices": PROBE_SOURCES,
        },
    )
    n_probe_queries: int = field(
        default=256,
        metadata={
            "help": "probe queries per layer (recent positions kept, or random draws)",
            "gt": 0,
            "le": MAX_PROBE_QUERIES,
        },
    )
    compute_beta: bool = field(
        default=False, metadata={"help": "fit the per-key logit bias beta (attention_matching only)"}
    )
    ridge: float = field(default=1e-4, metadata={"help": "relative ridge strength of the C2 value solve", "ge": 0})
    refit_values: bool = field(
        default=True,
        metadata={
            "help": "attention_matching: refit the kept rows' values C2 (off: keep their original values)"
        },
    )
    inject_budget_message: bool = field(
        default=False, metadata={"help": "after each compaction event, feed the budget message"}
    )
    inject_budget_every: int | None = field(
        default=None,
        metadata={
            "help": "feed the budget message after every N sampled tokens, with or without compaction "
            "(mode 'none': inject only); unset: never",
            "gt": 0,
            "le": INT32_MAX,
        },
    )
    budget_message_template: str = field(
        default=DEFAULT_BUDGET_TEMPLATE,
        metadata={"help": "budget message, formatted with {used}, {total} and {remaining}", "max_length": 4096},
    )
    budget_message_frame: tuple[str, str] | None = field(
        default=None,
        metadata={
            "help": "PREFIX SUFFIX text around the budget message (the chat template's user turn and "
            "generation prompt; agents set it from their template); unset: ChatML when the tokenizer "
            "has <|im_start|>, else blank lines",
            "size": 2,
        },
    )

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.mode == "none" and (self.max_kv_len is not None or self.n_protect_turns >= 0):
            raise InvalidArgumentError(
                "mode='none' contradicts a compaction trigger (max_kv_len or n_protect_turns); "
                "pick a compaction mode or drop the trigger"
            )
        if not self.refit_values and self.mode != "attention_matching":
            raise InvalidArgumentError(f"refit_values=False needs mode='attention_matching', got mode={self.mode!r}")
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
        if self.injects_budget:
            try:
                self.budget_message_template.format(used=0, total=0, remaining=0)
            except (KeyError, IndexError) as exc:
                raise InvalidArgumentError(
                    f"budget_message_template may only use {{used}}, {{total}}, {{remaining}}: {exc}"
                ) from exc

    @property
    def injects_budget(self) -> bool:
        """Whether budget messages are ever fed (after events, or every ``inject_budget_every`` tokens)."""
        return self.inject_budget_message or self.inject_budget_every is not None

    @property
    def turn_based(self) -> bool:
        return self.n_protect_turns >= 0

    @property
    def kv_budget(self) -> bool:
        return self.max_kv_len is not None and not self.turn_based

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

"""Request and result records of the session API (shared by engine, backends and server)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from compaction_gym.engine.config import CompactionConfig, SamplingParams

if TYPE_CHECKING:  # torch-free at import: request types are built by command-line parsers
    from compaction_gym.compaction.events import CompactionEvent

FinishReason = Literal["stop", "length", "budget"]


@dataclass
class StepRequest:
    """One session step: feed ``new_ids`` then generate with ``sampling`` (session default if None).

    ``response_complete=True`` says that ``new_ids`` ends with a complete assistant response (a
    teacher-forced action fed with ``max_new_tokens=0``): the after-response hook (turn-based
    compaction and its budget message) then runs as after a sampled response.

    ``score_input=True`` returns the log-probability of every token of ``new_ids`` in
    :attr:`StepResult.input_logprobs` (docs/engine.md, "Scoring fed tokens").
    """

    session_id: str
    new_ids: list[int]
    sampling: SamplingParams | None = None
    response_complete: bool = False
    score_input: bool = False


@dataclass
class CreateRequest:
    """Open a session inside a ``step_batch``: the arguments of ``Engine.create_session``."""

    prompt_ids: list[int]
    config: CompactionConfig | None = None
    sampling: SamplingParams | None = None
    session_id: str | None = None
    score_input: bool = False


@dataclass
class StepResult:
    """What one create/step call appended to a session.

    Attributes:
        session_id: the session.
        token_ids: tokens appended after the input: sampled tokens and any injected budget-message
            tokens, in order.
        logprobs: per token of ``token_ids``: log-probability of the sampled token under the
            *sampling distribution* (after temperature, top-k and top-p; greedy uses the plain
            log-softmax); ``0.0`` at injected tokens.
        completion_mask: per token of ``token_ids``: 1 if sampled by the model, 0 if injected.
        text: decoded ``token_ids`` (special tokens kept) when the backend has a tokenizer, else "".
        finish_reason: ``stop`` (EOS/stop token, included in ``token_ids``), ``length``
            (``max_new_tokens`` or cache capacity), ``budget`` (``max_total_tokens``).
        events: compaction events that fired during this call, in order.
        kv_len: cache rows after the call.
        total_tokens: logical tokens in the session after the call.
        prompt_len: length of the input fed by this call (the prompt for create).
        inject_ranges: ``(start, end)`` ranges into ``token_ids`` of injected tokens.
        timings: seconds by phase (``prefill``, ``decode``, ``compaction``, ``total``).
        input_logprobs: with ``score_input``, per token of the input (``prompt_len`` of them): its
            log-probability under the plain model distribution (log-softmax, no temperature) given
            the session's cache as it stood when it was fed (compacted as decoding sees it);
            ``None`` where no logits precede it (a session's first token). ``None`` otherwise.
        input_entropies: with ``score_input``, per input token the entropy (nats) of the same
            distribution its log-prob comes from (``None`` where that log-prob is); a mixer's
            context-only weight needs it (docs/eval-lm.md, "N-gram mixer"). ``None`` otherwise.
    """

    session_id: str
    token_ids: list[int]
    logprobs: list[float]
    completion_mask: list[int]
    text: str
    finish_reason: FinishReason
    events: list[CompactionEvent] = field(default_factory=list)
    kv_len: int = 0
    total_tokens: int = 0
    prompt_len: int = 0
    inject_ranges: list[tuple[int, int]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    input_logprobs: list[float | None] | None = None
    input_entropies: list[float | None] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "token_ids": list(self.token_ids),
            "logprobs": list(self.logprobs),
            "completion_mask": list(self.completion_mask),
            "text": self.text,
            "finish_reason": self.finish_reason,
            "events": [e.to_dict() for e in self.events],
            "kv_len": self.kv_len,
            "total_tokens": self.total_tokens,
            "prompt_len": self.prompt_len,
            "inject_ranges": [list(r) for r in self.inject_ranges],
            "timings": dict(self.timings),
            "input_logprobs": None if self.input_logprobs is None else list(self.input_logprobs),
            "input_entropies": None if self.input_entropies is None else list(self.input_entropies),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepResult:
        return cls(
            session_id=d["session_id"],
            token_ids=[int(t) for t in d["token_ids"]],
            logprobs=[float(x) for x in d["logprobs"]],
            completion_mask=[int(m) for m in d["completion_mask"]],
            text=d.get("text", ""),
            finish_reason=d["finish_reason"],
            events=[_event_from_dict(e) for e in d.get("events", [])],
            kv_len=int(d.get("kv_len", 0)),
            total_tokens=int(d.get("total_tokens", 0)),
            prompt_len=int(d.get("prompt_len", 0)),
            inject_ranges=[(int(a), int(b)) for a, b in d.get("inject_ranges", [])],
            timings={k: float(v) for k, v in d.get("timings", {}).items()},
            input_logprobs=_optional_floats(d.get("input_logprobs")),
            input_entropies=_optional_floats(d.get("input_entropies")),
        )


def _optional_floats(xs: list | None) -> list[float | None] | None:
    """A JSON list of floats and nulls (NaN read as null), or None."""
    if xs is None:
        return None
    return [None if x is None or x != x else float(x) for x in xs]


def _event_from_dict(d: dict[str, Any]) -> CompactionEvent:
    from compaction_gym.compaction.events import CompactionEvent

    return CompactionEvent.from_dict(d)

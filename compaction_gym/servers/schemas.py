"""Pydantic request/response models of the session API.

Request fields carry the names of :class:`~compaction_gym.engine.config.CompactionConfig` and
:class:`~compaction_gym.engine.config.SamplingParams` (and their help texts); the original research API's names
(:data:`SEED_ALIASES`) are accepted as aliases. Requests are strict (``"5"`` is not an int) and
reject unknown fields, so a typo such as ``max_tokens`` for ``max_new_tokens`` is a 422 naming it
instead of a silently ignored knob.
Only the fields a client *sets* reach the engine's config objects, so defaults live in one place:
:class:`~compaction_gym.engine.config.CompactionConfig` and
:class:`~compaction_gym.engine.config.SamplingParams`.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Annotated, Any, Literal

import pydantic_core
from pydantic import AliasChoices, BaseModel, ConfigDict, Discriminator, Field, Tag

from compaction_gym.engine.config import (
    COMPACTION_MODES,
    KV_BUDGET_FROM,
    MAX_STOP_IDS,
    PROBE_SOURCES,
    CompactionConfig,
    SamplingParams,
)
from compaction_gym.engine.types import StepResult

_SP = SamplingParams()
_UNSET: Any = object()

TokenId = Annotated[int, Field(ge=0)]
#: a session id: what ``DELETE /compact_session/{session_id}`` can route (no ``/``, which would
#: split the path, so an id accepted at create time can always be deleted)
SessionId = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:@+=-]+$")]

#: request fields that map one to one onto SamplingParams / CompactionConfig: the dataclasses' own
#: field names (the original research API's names ``max_response_tokens``, ``compaction_mode`` and
#: ``use_suffix_queries`` are accepted as aliases, see docs/server.md)
SAMPLING_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams))
COMPACTION_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(CompactionConfig))
#: the original research API's request names, accepted besides the dataclass names: alias -> field
SEED_ALIASES: dict[str, str] = {
    "max_response_tokens": "max_new_tokens",
    "compaction_mode": "mode",
    "use_suffix_queries": "queries",
}


def _meta(cls: type, name: str) -> Any:
    return next(f.metadata for f in fields(cls) if f.name == name)


def _is_float(cls: type, name: str) -> bool:
    return next(str(f.type) for f in fields(cls) if f.name == name).startswith("float")


def _help(cls: type, name: str) -> str:
    """The field's help text, declared once on the dataclass."""
    return _meta(cls, name).get("help", "")


def _field(cls: type, name: str, default: Any = _UNSET, **extra: Any) -> Any:
    """A request field for ``cls.name``: its default, help text and range (``ge``/``gt``/``le``/
    ``max_length`` from the dataclass metadata), so the 422 comes before the engine is asked."""
    meta = _meta(cls, name)
    bounds = {k: meta[k] for k in ("ge", "gt", "le") if k in meta}
    if "max_length" in meta and cls is CompactionConfig:  # a string's length (a list's items: see stop ids)
        bounds["max_length"] = meta["max_length"]
    default = getattr(cls(), name) if default is _UNSET else default
    if _is_float(cls, name):
        extra.setdefault("allow_inf_nan", False)  # JSON's Infinity / 1e400 are not temperatures
    return Field(default, description=meta.get("help", ""), **bounds, **extra)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SamplingFields(_Request):
    """Per-request sampling; unset fields keep the library (or, for a step, the session's) default."""

    temperature: float = _field(SamplingParams, "temperature")
    top_p: float = _field(SamplingParams, "top_p")
    top_k: int = _field(SamplingParams, "top_k")
    seed: int | None = _field(SamplingParams, "seed")
    stop_token_ids: list[TokenId] = Field(
        default_factory=list,
        max_length=MAX_STOP_IDS,
        description=f"{_help(SamplingParams, 'stop_token_ids')} (at most {MAX_STOP_IDS})",
    )
    ignore_eos: bool = _field(SamplingParams, "ignore_eos")
    max_new_tokens: int | None = Field(
        None,
        ge=0,
        le=_meta(SamplingParams, "max_new_tokens")["le"],
        validation_alias=AliasChoices("max_new_tokens", "max_response_tokens"),
        description=f"{_help(SamplingParams, 'max_new_tokens')} (alias max_response_tokens; "
        f"default {_SP.max_new_tokens})",
    )

    def sampling_overrides(self) -> dict[str, Any]:
        """The SamplingParams fields this request set explicitly."""
        out = {name: getattr(self, name) for name in SAMPLING_FIELDS if name in self.model_fields_set}
        if "stop_token_ids" in out:
            out["stop_token_ids"] = tuple(out["stop_token_ids"])
        if out.get("max_new_tokens", 0) is None:
            del out["max_new_tokens"]
        return out

    def sampling(self) -> SamplingParams | None:
        """``SamplingParams`` from the set fields, or ``None`` when none was set (engine default)."""
        overrides = self.sampling_overrides()
        return SamplingParams(**overrides) if overrides else None


def _cc(name: str, **extra: Any) -> Any:
    return _field(CompactionConfig, name, **extra)


class CompactionFields(_Request):
    """Compaction settings of a new session (or a one-shot ``/compact_generate``)."""

    mode: str | None = Field(
        None,
        validation_alias=AliasChoices("mode", "compaction_mode"),
        description=f"{_help(CompactionConfig, 'mode')}, one of {COMPACTION_MODES} (alias compaction_mode); "
        "default attention_matching when max_kv_len or n_protect_turns>=0 is set, else none",
    )
    max_kv_len: int | None = _cc("max_kv_len")
    compact_window: int | None = _cc("compact_window")
    kv_budget_from: Literal[KV_BUDGET_FROM] = _cc("kv_budget_from")  # type: ignore[valid-type]
    compact_target_ratio: float = _cc("compact_target_ratio")
    n_compacts: int = _cc("n_compacts")
    max_total_tokens: int | None = _cc("max_total_tokens")
    n_protect_turns: int = _cc("n_protect_turns")
    recompact_from_prompt: bool = _cc("recompact_from_prompt")
    protect_prompt: bool = _cc("protect_prompt")
    queries: Literal[PROBE_SOURCES] | None = Field(  # type: ignore[valid-type]
        None, description=f"{_help(CompactionConfig, 'queries')}, one of {PROBE_SOURCES}"
    )
    use_suffix_queries: bool | None = Field(
        None, description="original research API's alias of queries: true=suffix, false=random probes"
    )
    n_probe_queries: int = _cc("n_probe_queries")
    compute_beta: bool = _cc("compute_beta")
    ridge: float = _cc("ridge")
    refit_values: bool = _cc("refit_values")
    inject_budget_message: bool = _cc("inject_budget_message")
    inject_budget_every: int | None = _cc("inject_budget_every")
    budget_message_template: str = _cc("budget_message_template")
    budget_message_frame: list[Annotated[str, Field(max_length=4096)]] | None = _cc(
        "budget_message_frame", min_length=2, max_length=2
    )

    def compaction_config(self) -> CompactionConfig | None:
        """``CompactionConfig`` from the set fields, or ``None`` when none was set (engine default).

        Raises:
            InvalidArgumentError: the combination is invalid (the message names the field).
        """
        kw: dict[str, Any] = {n: getattr(self, n) for n in COMPACTION_FIELDS if n in self.model_fields_set}
        if self.queries is None and self.use_suffix_queries is not None:
            kw["queries"] = "suffix" if self.use_suffix_queries else "random"
        elif self.queries is None:
            kw.pop("queries", None)
        if self.mode is None:
            kw.pop("mode", None)
            if kw.get("max_kv_len") is not None or kw.get("n_protect_turns", -1) >= 0:
                kw["mode"] = "attention_matching"
        return CompactionConfig(**kw) if kw else None


class CompactGenerateRequest(CompactionFields, SamplingFields):
    """``POST /compact_generate``: one prompt, compacted mid-generation, no session kept.

    ``max_new_tokens`` (alias ``max_response_tokens``) defaults to ``max_total_tokens`` when only
    the latter is set: the original research code generated until the total budget.
    """

    prompt_ids: list[TokenId] = Field(min_length=1)

    def sampling(self) -> SamplingParams | None:
        overrides = self.sampling_overrides()
        if "max_new_tokens" not in overrides and self.max_total_tokens is not None:
            overrides["max_new_tokens"] = self.max_total_tokens
        return SamplingParams(**overrides) if overrides else None


class InjectGenerateRequest(SamplingFields):
    """``POST /inject_generate``: one prompt, no compaction, the budget message fed after every
    ``inject_budget_every`` sampled tokens (the original research API's ``inject_only`` baseline);
    no session is kept. ``max_new_tokens`` defaults to ``max_total_tokens``.
    """

    prompt_ids: list[TokenId] = Field(min_length=1)
    max_total_tokens: int = _cc("max_total_tokens", default=...)
    inject_budget_every: int = _cc("inject_budget_every", default=...)
    budget_message_template: str = _cc("budget_message_template")
    budget_message_frame: list[Annotated[str, Field(max_length=4096)]] | None = _cc(
        "budget_message_frame", min_length=2, max_length=2
    )

    def compaction_config(self) -> CompactionConfig:
        """The inject-only config: ``mode="none"`` with the periodic budget message.

        Raises:
            InvalidArgumentError: the combination is invalid (the message names the field).
        """
        names = ("max_total_tokens", "inject_budget_every", "budget_message_template", "budget_message_frame")
        return CompactionConfig(
            mode="none", **{n: getattr(self, n) for n in names if n in self.model_fields_set}
        )

    def sampling(self) -> SamplingParams:
        overrides = self.sampling_overrides()
        overrides.setdefault("max_new_tokens", self.max_total_tokens)
        return SamplingParams(**overrides)


class SessionCreateRequest(CompactionFields, SamplingFields):
    """``POST /compact_session/create``: prefill ``prompt_ids`` and generate the first response."""

    prompt_ids: list[TokenId] = Field(min_length=1)
    session_id: SessionId | None = Field(None, description="client-chosen id (default: the server picks one)")
    score_input: bool = Field(
        False,
        description="also return input_logprobs: the log-probability of every input token under the "
        "session's (compacted) cache as it stood when it was fed (null at the session's first token)",
    )


class SessionStepRequest(SamplingFields):
    """``POST /compact_session/step``: feed ``new_token_ids``, then generate.

    Sampling fields that are set override the session's defaults for this step only.
    """

    session_id: SessionId
    new_token_ids: list[TokenId]
    response_complete: bool = Field(
        False,
        description="new_token_ids ends with a complete assistant response (teacher forcing; needs "
        "max_new_tokens=0): turn-based compaction runs after it as after a sampled response",
    )
    score_input: bool = Field(
        False,
        description="also return input_logprobs: the log-probability of every input token under the "
        "session's (compacted) cache as it stood when it was fed (null at the session's first token)",
    )


def _batch_item_kind(item: Any) -> str:
    """An item with ``prompt_ids`` opens a session; any other item steps one."""
    if isinstance(item, dict):
        return "create" if "prompt_ids" in item else "step"
    return "create" if isinstance(item, SessionCreateRequest) else "step"


BatchItem = Annotated[
    Annotated[SessionCreateRequest, Tag("create")] | Annotated[SessionStepRequest, Tag("step")],
    Discriminator(_batch_item_kind),
]


class SessionStepBatchRequest(_Request):
    """``POST /compact_session/step_batch``: several steps (and creates) in one request, one batch.

    Items with ``prompt_ids`` are creates (the body of ``/compact_session/create``); the others
    are steps (the body of ``/compact_session/step``).
    """

    requests: list[BatchItem] = Field(min_length=1, max_length=4096)


class Diagnostics(BaseModel):
    """The original research API's diagnostics plus what a client needs to rebuild a StepResult losslessly."""

    prompt_len: int
    total_tokens: int
    kv_len: int
    finish_reason: str
    compaction_events: list[dict[str, Any]]
    segment_boundaries: list[int] = Field(
        description="index into all_token_ids of the first token produced after each compaction event"
    )
    inject_ranges: list[list[int]]
    timings: dict[str, float]
    server: dict[str, float] = Field(default_factory=dict, description="queue_s, batch_size")


class GenerateResponse(BaseModel):
    """Response of ``/compact_generate`` and the session endpoints."""

    session_id: str
    all_token_ids: list[int]
    all_logprobs: list[float]
    completion_mask: list[int]
    final_text: str
    text: str = Field(description="decoded all_token_ids with special tokens kept")
    finish_reason: str
    current_seq_len: int = Field(
        description="KV rows after the call (the original research API's name for kv_len)"
    )
    input_logprobs: list[float | None] | None = Field(
        None, description="with score_input: one log-prob per input token (null where none exists); else null"
    )
    input_entropies: list[float | None] | None = Field(
        None, description="with score_input: the entropy (nats) of each input token's distribution; else null"
    )
    diagnostics: Diagnostics


class StepBatchResponse(BaseModel):
    """Per-request results of ``/compact_session/step_batch``: a result or an error, in order."""

    results: list[dict[str, Any]]


class DeleteResponse(BaseModel):
    deleted: str


class HealthResponse(BaseModel):
    status: Literal["ok"]
    model: str
    sessions: int
    max_slots: int
    free_slots: int
    capacity: int
    vocab_size: int
    eos_token_ids: list[int]
    queue_depth: int
    running_requests: int = 0
    uptime_s: float


def segment_boundaries(result: StepResult) -> list[int]:
    """Where each compaction event fell inside ``result.token_ids`` (clamped to its range).

    An event's ``logical_len`` counts every token fed to the session when it fired; this call's
    tokens started at ``total_tokens - len(token_ids)``, so the difference is the offset.
    """
    start = result.total_tokens - len(result.token_ids)
    n = len(result.token_ids)
    return [min(max(e.logical_len - start, 0), n) for e in result.events]


def to_response(
    result: StepResult, final_text: str, server: dict[str, float] | None = None
) -> dict[str, Any]:
    """Serialise a StepResult into the wire shape of :class:`GenerateResponse`.

    Values carry the schema's types (ints where it says int, floats where it says float), so
    :func:`response_json` writes what validating against the response model would.
    """
    return {
        "session_id": result.session_id,
        "all_token_ids": [int(t) for t in result.token_ids],
        "all_logprobs": [float(x) for x in result.logprobs],
        "completion_mask": [int(m) for m in result.completion_mask],
        "final_text": final_text,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "current_seq_len": int(result.kv_len),
        "input_logprobs": _optional_floats(result.input_logprobs),
        "input_entropies": _optional_floats(result.input_entropies),
        "diagnostics": {
            "prompt_len": int(result.prompt_len),
            "total_tokens": int(result.total_tokens),
            "kv_len": int(result.kv_len),
            "finish_reason": result.finish_reason,
            "compaction_events": [e.to_dict() for e in result.events],
            "segment_boundaries": segment_boundaries(result),
            "inject_ranges": [[int(a), int(b)] for a, b in result.inject_ranges],
            "timings": {str(k): float(v) for k, v in result.timings.items()},
            "server": {str(k): float(v) for k, v in (server or {}).items()},
        },
    }


def _optional_floats(xs: list[float | None] | None) -> list[float | None] | None:
    return None if xs is None else [None if x is None else float(x) for x in xs]


def response_json(body: Any) -> bytes:
    """``body`` as the JSON bytes FastAPI writes for a response model (non-finite floats as
    ``null``), without validating it again: the routes return these bytes themselves, since
    validating and serialising every response through the model cost the event loop, which
    shares the GIL with the engine worker, time on each request (docs/server.md, "Performance")."""
    return pydantic_core.to_json(body, inf_nan_mode="null")


def from_response(data: dict[str, Any]) -> StepResult:
    """Inverse of :func:`to_response`: the StepResult the server computed."""
    diag = data["diagnostics"]
    return StepResult.from_dict(
        {
            "session_id": data["session_id"],
            "token_ids": data["all_token_ids"],
            "logprobs": data["all_logprobs"],
            "completion_mask": data["completion_mask"],
            "text": data.get("text", ""),
            "finish_reason": data["finish_reason"],
            "events": diag.get("compaction_events", []),
            "kv_len": diag.get("kv_len", data.get("current_seq_len", 0)),
            "total_tokens": diag.get("total_tokens", 0),
            "prompt_len": diag.get("prompt_len", 0),
            "inject_ranges": diag.get("inject_ranges", []),
            "timings": diag.get("timings", {}),
            "input_logprobs": data.get("input_logprobs"),
            "input_entropies": data.get("input_entropies"),
        }
    )

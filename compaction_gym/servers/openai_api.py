"""OpenAI-compatible ``GET /v1/models`` and ``POST /v1/chat/completions`` (stateless).

Each completion is an ephemeral session: the messages go through the tokenizer's chat template,
the generation joins the same auto-batcher as the session API, and the session is closed at once.
Supported: ``temperature``, ``top_p``, ``max_tokens``/``max_completion_tokens``, ``n``, ``seed``,
``stop`` (single-token stops stop generation; longer ones cut the text afterwards), ``logprobs``
(sampled token only), ``stream`` (the finished completion sent as server-sent events), and a
``compaction`` object with the session API's compaction fields (``extra_body`` in the openai
client). Options we cannot honour (tools, penalties, ``logit_bias``, JSON mode) are a 422.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from compaction_gym.engine.config import SamplingParams
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.servers.schemas import CompactionFields
from compaction_gym.servers.state import FieldError, ServerState, unless_disconnected

if TYPE_CHECKING:
    from compaction_gym.engine.types import StepResult

router = APIRouter(prefix="/v1", tags=["openai"])


class TextPart(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None


class CompactionOptions(CompactionFields):
    """The ``compaction`` extension object: the compaction fields of ``/compact_session/create``."""


class ChatCompletionRequest(BaseModel):
    """The subset of OpenAI's chat-completions request that a token-level engine can honour."""

    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, le=16)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0, description="only 0 is supported")
    presence_penalty: float = Field(0.0, ge=0, le=0, description="only 0 is supported")
    frequency_penalty: float = Field(0.0, ge=0, le=0, description="only 0 is supported")
    logit_bias: dict[str, float] | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    compaction: CompactionOptions | None = None

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        if self.logit_bias:
            return "logit_bias"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format"
        return None


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    """The one model this server serves."""
    state: ServerState = request.app.state.server
    return {
        "object": "list",
        "data": [
            {
                "id": state.model_name,
                "object": "model",
                "created": int(state.started),
                "owned_by": "compaction-gym",
            }
        ],
    }


@router.post("/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    """Chat completion through the tokenizer's chat template (one ephemeral session per choice)."""

    state: ServerState = request.app.state.server
    if body.model != state.model_name:
        raise HTTPException(
            404, f"model {body.model!r} is not served here; GET /v1/models lists {state.model_name!r}"
        )
    if (bad := body.unsupported()) is not None:
        raise FieldError(bad, f"{bad} is not supported by this server")
    if state.tokenizer is None or not getattr(state.tokenizer, "chat_template", None):
        raise InvalidArgumentError(
            "the served tokenizer has no chat template; use /compact_session/* with token ids"
        )
    prompt_ids = await asyncio.to_thread(_apply_template, state, body.messages)
    state.check_ids("messages", prompt_ids)
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > 4:
        raise FieldError("stop", "stop takes at most 4 sequences")
    stop_ids, text_stops = _split_stops(state, stops)
    max_new = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    config = body.compaction.compaction_config() if body.compaction is not None else None
    sampling = [
        SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            seed=None if body.seed is None else body.seed + i,
            stop_token_ids=tuple(stop_ids),
            **({"max_new_tokens": max_new} if max_new is not None else {}),
        )
        for i in range(body.n)
    ]
    works = [state.worker.create(prompt_ids, config, sp, ephemeral=True) for sp in sampling]
    outcomes = await unless_disconnected(request, asyncio.gather(*works))
    choices, completion_tokens = [], 0
    for i, (result, _text, _info) in enumerate(outcomes):
        content, finish = _content(state, result, text_stops)
        completion_tokens += sum(result.completion_mask)
        choice: dict[str, Any] = {"index": i, "message": {"role": "assistant", "content": content}}
        choice["finish_reason"] = finish
        choice["logprobs"] = _logprobs(state, result) if body.logprobs else None
        choices.append(choice)
    completion = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt_ids) + completion_tokens,
        },
    }
    if body.stream:
        return StreamingResponse(_as_events(completion), media_type="text/event-stream")
    return completion


def _apply_template(state: ServerState, messages: list[ChatMessage]) -> list[int]:
    conversation = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        conversation.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    with state.tokenizer_lock:
        out = state.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(t) for t in ids]


def _split_stops(state: ServerState, stops: list[str]) -> tuple[list[int], list[str]]:
    """Stops that are one token become stop token ids; the rest cut the decoded text."""
    ids, texts = [], []
    for s in stops:
        if not s:
            continue
        with state.tokenizer_lock:
            enc = state.tokenizer.encode(s, add_special_tokens=False)
        if len(enc) == 1:
            ids.append(int(enc[0]))
        texts.append(s)
    return ids, texts


def _content(state: ServerState, result: StepResult, text_stops: list[str]) -> tuple[str, str]:
    sampled = [t for t, m in zip(result.token_ids, result.completion_mask) if m]
    with state.tokenizer_lock:
        text = state.tokenizer.decode(sampled, skip_special_tokens=True)
    finish = "stop" if result.finish_reason == "stop" else "length"
    cut = min((i for i in (text.find(s) for s in text_stops) if i >= 0), default=-1)
    if cut >= 0:
        text, finish = text[:cut], "stop"
    return text, finish


def _logprobs(state: ServerState, result: StepResult) -> dict[str, Any]:
    content = []
    with state.tokenizer_lock:
        for tid, lp, m in zip(result.token_ids, result.logprobs, result.completion_mask):
            if not m:
                continue
            tok = state.tokenizer.decode([tid], skip_special_tokens=False)
            content.append(
                {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")), "top_logprobs": []}
            )
    return {"content": content}


async def _as_events(completion: dict[str, Any]) -> AsyncIterator[str]:
    """The finished completion as OpenAI ``chat.completion.chunk`` server-sent events."""
    base = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    for choice in completion["choices"]:
        delta = {"role": "assistant", "content": choice["message"]["content"]}
        chunk = {
            "index": choice["index"],
            "delta": delta,
            "logprobs": choice["logprobs"],
            "finish_reason": None,
        }
        yield f"data: {json.dumps(base | {'choices': [chunk]})}\n\n"
        end = {
            "index": choice["index"],
            "delta": {},
            "logprobs": None,
            "finish_reason": choice["finish_reason"],
        }
        yield f"data: {json.dumps(base | {'choices': [end]})}\n\n"
    yield f"data: {json.dumps(base | {'choices': [], 'usage': completion['usage']})}\n\n"
    yield "data: [DONE]\n\n"

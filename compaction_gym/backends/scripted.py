"""A model-free :class:`~compaction_gym.backends.Backend` for testing agents and wrappers.

:class:`ScriptedBackend` "generates" scripted texts, so agent logic (chat framing, token
accounting, teacher forcing, batching) can be tested exactly and in milliseconds.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.engine.types import StepRequest, StepResult
from compaction_gym.errors import CapacityError, InvalidArgumentError, UnknownSessionError

#: ``script(session_id, call_index, token_ids_so_far) -> text`` (call_index counts generating calls).
Script = Callable[[str, int, list[int]], str]


class ScriptedBackend:
    """Implements the Backend protocol by answering each generating call with a scripted text.

    Args:
        tokenizer: the tokenizer that encodes the scripted texts.
        script: a list of texts used in turn (cycled), or a :data:`Script` callable.
        stop: end every response with ``stop_token`` (finish ``stop``); otherwise finish ``length``.
        stop_token: the token that ends a response (default: the tokenizer's EOS).
        logprob: the log-prob reported for every generated token.
        input_logprob: the log-prob reported for every scored input token (``score_input``;
            ``None`` at a session's first token, as the engine).
        max_slots: sessions that may be open at once (``CapacityError`` beyond).
        capacity: tokens a session may hold; a step that would exceed it raises ``CapacityError``.

    Attributes:
        sessions: ``session_id -> {"token_ids", "completion_mask", "logprobs"}`` (every logical token).
        calls: ``(verb, session_id, len(new_ids), sampling)`` per session call, in order.
        batch_sizes: requests per ``step``/``step_batch`` call.
    """

    def __init__(
        self,
        tokenizer: Any,
        script: Sequence[str] | Script = ("turn left",),
        *,
        stop: bool = True,
        stop_token: int | None = None,
        logprob: float = -0.5,
        input_logprob: float = -1.0,
        max_slots: int = 64,
        capacity: int | None = None,
        name: str = "scripted",
    ) -> None:
        self._tokenizer = tokenizer
        self.script: Script = script if callable(script) else _cycle(list(script))
        self.stop = stop
        self.logprob = logprob
        self.input_logprob = input_logprob
        self.max_slots = max_slots
        self.capacity = capacity
        self.name = name
        self.eos_token_ids = (int(tokenizer.eos_token_id),)
        self.stop_token = int(stop_token) if stop_token is not None else self.eos_token_ids[0]
        self.sessions: dict[str, dict[str, list]] = {}
        self.calls: list[tuple[str, str, int, SamplingParams | None]] = []
        self.batch_sizes: list[int] = []
        self._ids = itertools.count()
        self._generations: dict[str, int] = {}

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def create_session(
        self,
        prompt_ids: list[int],
        config: CompactionConfig | None = None,
        sampling: SamplingParams | None = None,
        *,
        session_id: str | None = None,
        score_input: bool = False,
    ) -> StepResult:
        if not prompt_ids:
            raise InvalidArgumentError("prompt_ids is empty")
        if len(self.sessions) >= self.max_slots:
            raise CapacityError(f"all {self.max_slots} slots are in use")
        sid = session_id or f"s{next(self._ids)}"
        self.sessions[sid] = {"token_ids": [], "completion_mask": [], "logprobs": [], "sampling": sampling}
        self._generations[sid] = 0
        self.calls.append(("create", sid, len(prompt_ids), sampling))
        return self._run(sid, list(prompt_ids), sampling or SamplingParams(), score_input)

    def step(
        self,
        session_id: str,
        new_ids: list[int],
        sampling: SamplingParams | None = None,
        *,
        response_complete: bool = False,
        score_input: bool = False,
    ) -> StepResult:
        self.batch_sizes.append(1)
        return self._step(StepRequest(session_id, list(new_ids), sampling, response_complete, score_input))

    def step_batch(self, requests: list[StepRequest]) -> list[StepResult]:
        self.batch_sizes.append(len(requests))
        for r in requests:  # like the engine: validate the whole batch before changing anything
            self._check(r)
        return [self._step(r) for r in requests]

    def close(self, session_id: str) -> None:
        if self.sessions.pop(session_id, None) is None:
            raise UnknownSessionError(f"unknown session {session_id!r}")

    def _check(self, req: StepRequest) -> None:
        """Raise what the engine would for ``req``: an unknown session, or tokens beyond ``capacity``."""
        if req.session_id not in self.sessions:
            raise UnknownSessionError(f"unknown session {req.session_id!r}")
        held = len(self.sessions[req.session_id]["token_ids"])
        if self.capacity is not None and held + len(req.new_ids) > self.capacity:
            raise CapacityError(
                f"session {req.session_id!r}: {held} + {len(req.new_ids)} tokens exceed {self.capacity}"
            )

    def _step(self, req: StepRequest) -> StepResult:
        self._check(req)
        self.calls.append(("step", req.session_id, len(req.new_ids), req.sampling))
        return self._run(
            req.session_id, req.new_ids, req.sampling or self.sessions[req.session_id]["sampling"], req.score_input
        )

    def _run(self, sid: str, new_ids: list[int], sampling: SamplingParams, score_input: bool = False) -> StepResult:
        s = self.sessions[sid]
        scores: list[float | None] | None = None
        if score_input:
            scores = [None if not s["token_ids"] and i == 0 else self.input_logprob for i in range(len(new_ids))]
        s["token_ids"] += new_ids
        s["completion_mask"] += [0] * len(new_ids)
        s["logprobs"] += [0.0] * len(new_ids)
        out: list[int] = []
        finish = "length"
        if sampling.max_new_tokens > 0:
            text = self.script(sid, self._generations[sid], list(s["token_ids"]))
            self._generations[sid] += 1
            out = list(self._tokenizer(text, add_special_tokens=False)["input_ids"])
            if self.stop:
                out.append(self.stop_token)
            if len(out) > sampling.max_new_tokens:
                out = out[: sampling.max_new_tokens]
            else:
                finish = "stop" if self.stop else "length"
        s["token_ids"] += out
        s["completion_mask"] += [1] * len(out)
        s["logprobs"] += [self.logprob] * len(out)
        return StepResult(
            session_id=sid,
            token_ids=out,
            logprobs=[self.logprob] * len(out),
            completion_mask=[1] * len(out),
            text=self._tokenizer.decode(out, skip_special_tokens=False) if out else "",
            finish_reason=finish,
            kv_len=len(s["token_ids"]),
            total_tokens=len(s["token_ids"]),
            prompt_len=len(new_ids),
            input_logprobs=scores,
        )


def _cycle(texts: list[str]) -> Script:
    if not texts:
        raise InvalidArgumentError("script needs at least one text")
    return lambda sid, i, ids: texts[i % len(texts)]

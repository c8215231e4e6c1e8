"""The embedded engine: persistent, compacted KV-cache sessions over any HF causal LM (DESIGN §5)."""

from __future__ import annotations

import contextlib
import operator
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from compaction_gym.compaction.events import CompactionEvent
from compaction_gym.compaction.modes import REPEAT_SOURCES
from compaction_gym.engine.attention import register_attention
from compaction_gym.engine.compactor import REPEAT_PROMPT, Compactor, harvest_queries
from compaction_gym.engine.config import (
    DEFAULT_BUDGET_FRAME,
    PLAIN_BUDGET_FRAME,
    CompactionConfig,
    SamplingParams,
)
from compaction_gym.engine.model_runner import ModelLayout, ModelRunner
from compaction_gym.engine.scheduler import Scheduler, Work
from compaction_gym.engine.session import Session, SessionView
from compaction_gym.engine.slot_cache import SlotKVCache
from compaction_gym.engine.types import CreateRequest, StepRequest, StepResult
from compaction_gym.errors import CapacityError, CompactionGymError, InvalidArgumentError

#: Default rows per slot on CPU (GPU: 8192), capped by the model's ``max_position_embeddings``.
DEFAULT_CAPACITY = {"cpu": 4096, "cuda": 8192}


class Engine:
    """Persistent KV-cache sessions with compaction, on one HF causal LM.

    The engine is not thread-safe: callers (the server) serialise calls.

    Args:
        model: a Hugging Face causal LM with standard attention (Llama, Qwen2, Qwen3, ...). It is
            left as given: the engine's attention implementation and eval mode are switched in
            around the engine's own forwards only (its ``config._attn_implementation`` and
            ``training`` read the same between calls).
        tokenizer: optional HF tokenizer (``text`` of results, budget messages).
        max_slots: sessions that can be open at once.
        capacity: cache rows per slot (default: 4096 on CPU, 8192 on GPU, at most the model's
            ``max_position_embeddings``).
        prefill_chunk: longest run of tokens fed to one session in one forward pass.
        fast: run the GPU fast path (:mod:`compaction_gym.engine.fast`: fused kernels, CUDA-graph
            decode, fused compaction). ``None`` (default): on for Qwen3/Qwen2/Llama models on
            CUDA with Triton installed, else the generic path. ``True`` raises
            ``InvalidArgumentError`` where the fast path cannot run.
        record_mass: record each event's ``mass_kept`` (the probes' attention mass the block
            keeps; docs/compaction.md, "Mass kept") — a diagnostic for plots, off by default.

    Example:
        >>> engine = Engine.from_pretrained("Qwen/Qwen3-0.6B", max_slots=4)  # doctest: +SKIP
        >>> r = engine.create_session(ids, CompactionConfig(mode="attention_matching", max_kv_len=2048),
        ...                           SamplingParams(temperature=0.6, seed=0))  # doctest: +SKIP
        >>> r2 = engine.step(r.session_id, more_ids)  # doctest: +SKIP
        >>> engine.close(r.session_id)  # doctest: +SKIP
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer=None,
        *,
        max_slots: int = 8,
        capacity: int | None = None,
        prefill_chunk: int = 2048,
        fast: bool | None = None,
        record_mass: bool = False,
    ) -> None:
        if max_slots < 1:
            raise InvalidArgumentError(f"max_slots must be >= 1, got {max_slots}")
        if prefill_chunk < 1:
            raise InvalidArgumentError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.layout = layout = ModelLayout.from_model(model)  # refuses unsupported models first
        register_attention()  # switched in around the engine's own forwards only (ModelRunner)
        self.model = model
        self.tokenizer = tokenizer
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        max_pos = getattr(model.config.get_text_config(), "max_position_embeddings", None) or 1 << 30
        if capacity is None:
            capacity = min(max_pos, DEFAULT_CAPACITY.get(self.device.type, 8192))
        if capacity < 1:
            raise InvalidArgumentError(f"capacity must be >= 1, got {capacity}")
        self.max_slots, self.capacity = max_slots, capacity
        self.eos_token_ids = _eos_ids(model, tokenizer)
        #: how budget messages are framed for sessions whose config gives no ``budget_message_frame``
        self.default_budget_frame = default_budget_frame(tokenizer)
        self.cache = SlotKVCache(
            layout.n_layers, layout.n_kv_heads, layout.head_dim, max_slots, capacity, self.dtype, self.device,
            v_head_dim=layout.v_head_dim,
        )  # fmt: skip
        self.fast = _use_fast(model, self.device, fast)
        if self.fast:
            from compaction_gym.engine.fast import FastModelRunner, compact_fast

            self.runner = FastModelRunner(model, self.cache, layout)
            self.compactor = Compactor(self.cache, layout, compact_fn=compact_fast, record_mass=record_mass)
        else:
            self.runner = ModelRunner(model, self.cache, layout)
            self.compactor = Compactor(self.cache, layout, record_mass=record_mass)
        # ``repeat`` probes: a scratch forward of the re-read span over a session's cache
        self.compactor.harvest = lambda slot, ids, start: harvest_queries(
            self.runner, self.cache, slot, ids, start, prefill_chunk
        )
        if tokenizer is not None:
            self.compactor.repeat_prompt = list(tokenizer.encode(REPEAT_PROMPT, add_special_tokens=False))
        self.scheduler = Scheduler(
            self.runner,
            self.compactor,
            self.cache,
            eos_token_ids=self.eos_token_ids,
            budget_message=self._budget_message,
            decode_text=self._decode,
            prefill_chunk=prefill_chunk,
        )

    @classmethod
    def from_pretrained(
        cls,
        model_name_or_path: str | Path,
        *,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        max_slots: int = 8,
        capacity: int | None = None,
        **kwargs,
    ) -> Engine:
        """Load a model (registered name, local path or hub id) and its tokenizer (``None`` if it has none).

        Args:
            dtype: weights and cache dtype (default: float32 on CPU, the checkpoint's dtype on GPU).
            device: default ``cuda`` when available, else ``cpu``.
            max_slots, capacity: see :class:`Engine`; other keyword arguments too.
        """
        from compaction_gym.models.registry import load_model

        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model, tokenizer = load_model(model_name_or_path, dtype=dtype, device=device)
        return cls(model, tokenizer, max_slots=max_slots, capacity=capacity, **kwargs)

    # ------------------------------------------------------------ properties
    @property
    def num_free_slots(self) -> int:
        return self.cache.num_free

    @property
    def session_ids(self) -> list[str]:
        return list(self.scheduler.sessions)

    def session(self, session_id: str) -> SessionView:
        """A read-only snapshot of a session. Raises ``UnknownSessionError``."""
        s = self.scheduler.get(session_id)
        return SessionView.of(s, self.cache.length(s.slot))

    def read_cache(self, session_id: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies of a session's live cache rows: K, V ``[L, H_kv, kv_len, d]`` and β ``[L, H_kv, kv_len]``."""
        s = self.scheduler.get(session_id)
        n = self.cache.length(s.slot)
        c = self.cache
        return c.k[s.slot, :, :, :n].clone(), c.v[s.slot, :, :, :n].clone(), c.beta[s.slot, :, :, :n].clone()

    # -------------------------------------------------------------- sessions
    def create_session(
        self,
        prompt_ids: Sequence[int],
        config: CompactionConfig | None = None,
        sampling: SamplingParams | None = None,
        *,
        session_id: str | None = None,
        score_input: bool = False,
    ) -> StepResult:
        """Open a session: prefill the (protected) prompt, then generate unless ``max_new_tokens == 0``.

        ``sampling`` becomes the session's default; its ``seed`` seeds the session's RNG stream
        (and random probes). ``score_input=True``: the result's ``input_logprobs`` score the
        prompt (docs/engine.md, "Scoring fed tokens"). Raises ``InvalidArgumentError`` (empty prompt, ids outside the
        vocabulary, prompt longer than ``capacity``, id in use) or ``CapacityError`` (no free slot).
        """
        return self.step_batch([CreateRequest(prompt_ids, config, sampling, session_id, score_input)])[0]

    def step(
        self,
        session_id: str,
        new_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        response_complete: bool = False,
        score_input: bool = False,
    ) -> StepResult:
        """Feed ``new_ids`` to a session and generate a response (``sampling=None``: the session default).

        A ``sampling`` with a ``seed`` starts a fresh RNG stream for this request; otherwise the
        session's stream continues. ``response_complete=True`` (needs ``max_new_tokens=0``): the
        input ends with a complete assistant response (a teacher-forced action), so turn-based
        compaction runs after it as after a sampled response. ``score_input=True``: the result's
        ``input_logprobs`` hold the log-probability of every token of ``new_ids`` under the
        session's (compacted) cache as it stood when it was fed (docs/engine.md, "Scoring fed tokens").
        """
        request = StepRequest(session_id, new_ids, sampling, response_complete, score_input)
        return self.step_batch([request])[0]

    def step_batch(self, requests: Sequence[StepRequest | CreateRequest]) -> list[StepResult]:
        """Open and step many sessions: one batched prefill and one batched decode loop.

        A :class:`CreateRequest` opens a session (as :meth:`create_session`), a
        :class:`StepRequest` steps an existing one (as :meth:`step`); results come in request
        order. Every request keeps its own sampling parameters and RNG stream, so results equal
        making the calls one by one (same seeds: same tokens, log-probs and events).

        Atomic: every request is validated before anything changes — its ids, a free slot for
        each create, and whether its input fits its slot after the KV-budget compaction it would
        trigger (planned, not applied). On a typed error no session has changed and no slot was
        taken; the error's ``request_index`` attribute is the position of the offending request,
        so the others can be retried as a batch. An untyped error raised while validating or
        opening sessions (before any session advances) carries ``request_index`` and
        ``batch_unchanged = True`` too; one raised by the batched computation carries neither.
        """
        works = self._admit(requests, "step_batch")
        if not works:
            return []
        try:
            return self.scheduler.run(works)
        except BaseException as exc:
            mine = {id(w) for w in works}
            self._abandon(works + [w for w in self.scheduler.running if id(w) not in mine], exc)
            raise

    # ------------------------------------------------- continuous batching
    def submit(self, requests: Sequence[StepRequest | CreateRequest], *, prefill: bool = True) -> list[str]:
        """Admit requests into the running work: validate, open sessions, feed the inputs (one
        batched prefill); their responses are generated by :meth:`advance`, together with the
        work already running (continuous batching, docs/engine.md).

        Validation is that of :meth:`step_batch` (atomic, ``request_index`` on errors), plus: a
        session that is still generating cannot be stepped. Returns the requests' session ids
        (a create's new id). An exception from the prefill leaves the running work intact; it
        carries ``lost_session_ids`` (these requests' sessions; the ones they opened are closed).

        ``prefill=False``: the inputs of requests that generate are fed by the next
        :meth:`advance`, in the same forward as the running requests' decode step (one forward
        instead of two; results equal up to float rounding, the batch being another). An
        exception from that forward loses every running request, as any round's does.
        """
        works = self._admit(requests, "submit")
        try:
            self.scheduler.begin(works, prefill=prefill)
        except BaseException as exc:
            self._abandon(works, exc)
            raise
        return [w.session.session_id for w in works]

    def advance(self, max_steps: int | None = None) -> list[StepResult]:
        """One decode round over the running work; the results of the requests it finished.

        A round runs at most ``max_steps`` (default: the runner's chunk, 32) decode steps per
        request, so new :meth:`submit` calls join at most that many tokens later. Results equal
        :meth:`step_batch` of the same requests, however they were split into rounds and whatever
        ran beside them. An exception from the batched computation loses every running request:
        it carries ``lost_session_ids``, and the sessions those requests opened are closed.
        """
        if max_steps is not None and (
            isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1
        ):
            raise InvalidArgumentError(f"max_steps must be a positive int or None, got {max_steps!r}")
        try:
            return [r for _, r in self.scheduler.advance(max_steps)]
        except BaseException as exc:
            self._abandon(list(self.scheduler.running), exc)
            raise

    @property
    def running_session_ids(self) -> list[str]:
        """Sessions whose submitted request is still generating (or whose result awaits :meth:`advance`)."""
        return [w.session.session_id for w in self.scheduler.running] + [
            w.session.session_id for w, _ in self.scheduler.held
        ]

    def _abandon(self, works: list[Work], exc: BaseException) -> None:
        """Drop ``works`` after a failed computation (closing the sessions they opened); tag ``exc``."""
        for w in works:
            self.scheduler.cancel(w.session)
            if w.created and self.scheduler.sessions.get(w.session.session_id) is w.session:
                self.scheduler.drop(w.session)
        with contextlib.suppress(Exception):
            exc.lost_session_ids = [w.session.session_id for w in works]  # type: ignore[attr-defined]

    def _admit(self, requests: Sequence[StepRequest | CreateRequest], caller: str) -> list[Work]:
        """Validate every request (nothing changes on an error), then open the creates' sessions."""
        opens: list[tuple[int, list[int], CompactionConfig, SamplingParams, str]] = []
        works: list[Work | None] = []
        seen: set[str] = set()
        for i, req in enumerate(requests):
            try:
                if isinstance(req, CreateRequest):
                    opens.append((i, *self._check_create(req, seen, len(opens))))
                    works.append(None)
                elif isinstance(req, StepRequest):
                    works.append(self._check_step(req, seen))
                else:
                    raise InvalidArgumentError(
                        f"{caller} takes StepRequest or CreateRequest objects, got {type(req).__name__}"
                    )
            except CompactionGymError as exc:
                exc.request_index = i  # type: ignore[attr-defined]
                raise
            except Exception as exc:  # untyped, but nothing has changed yet: blame this request alone
                exc.request_index, exc.batch_unchanged = i, True  # type: ignore[attr-defined]
                raise
        created: list[Session] = []
        try:
            for i, prompt, config, sampling, session_id in opens:
                try:
                    s = self.scheduler.open(session_id, len(prompt), config, sampling)
                except Exception as exc:  # the sessions opened before it are dropped below
                    exc.request_index, exc.batch_unchanged = i, True  # type: ignore[attr-defined]
                    raise
                created.append(s)
                works[i] = Work(
                    s, prompt, sampling, s.stream, score_input=bool(requests[i].score_input), created=True
                )
        except BaseException:
            for s in created:
                self.scheduler.drop(s)
            raise
        return works  # type: ignore[return-value]

    def _check_create(
        self, req: CreateRequest, seen: set[str], creates_before: int
    ) -> tuple[list[int], CompactionConfig, SamplingParams, str]:
        """Validate a create without changing anything; returns its prompt, config, sampling, id."""
        prompt = self._ids(req.prompt_ids, "prompt_ids")
        config = req.config if req.config is not None else CompactionConfig()
        sampling = req.sampling if req.sampling is not None else SamplingParams()
        if not isinstance(config, CompactionConfig) or not isinstance(sampling, SamplingParams):
            raise InvalidArgumentError("config must be a CompactionConfig and sampling a SamplingParams")
        if not prompt:
            raise InvalidArgumentError("prompt_ids is empty; a session starts from at least one token")
        if len(prompt) > self.capacity:
            raise InvalidArgumentError(
                f"prompt has {len(prompt)} tokens but a slot holds {self.capacity}; shorten it or raise capacity"
            )
        self._check_config(config)
        _warn_if_budget_cannot_hold(config, len(prompt))
        session_id = req.session_id
        if session_id is None:
            session_id = uuid.uuid4().hex
        elif not isinstance(session_id, str) or not session_id:
            raise InvalidArgumentError(f"session_id must be a non-empty string or None, got {session_id!r}")
        elif session_id in self.scheduler.sessions:
            raise InvalidArgumentError(
                f"session_id {session_id!r} is already in use; pick another or omit it"
            )
        elif session_id in seen:
            raise InvalidArgumentError(f"session_id {session_id!r} appears twice in one step_batch")
        seen.add(session_id)
        free = self.cache.num_free
        if creates_before >= free:
            what = (
                f"all {self.max_slots} slots are in use"
                if free == 0
                else f"only {free} slot(s) are free for the {creates_before + 1} creates of this step_batch"
            )
            raise CapacityError(f"{what}; close a session or create the engine with a larger max_slots")
        return prompt, config, sampling, session_id

    def _check_step(self, req: StepRequest, seen: set[str]) -> Work:
        """Validate a step without changing anything; returns its work item."""
        s = self.scheduler.get(req.session_id)
        if self.scheduler.work_of(s) is not None:
            raise InvalidArgumentError(
                f"session {req.session_id!r} is still generating its previous response; step it after that result"
            )
        if req.session_id in seen:
            raise InvalidArgumentError(f"session {req.session_id!r} appears twice in one step_batch")
        seen.add(req.session_id)
        if req.sampling is not None and not isinstance(req.sampling, SamplingParams):
            raise InvalidArgumentError("sampling must be a SamplingParams or None")
        new_ids = self._ids(req.new_ids, "new_ids")
        params, stream = self.scheduler.stream_for(s, req.sampling)
        if req.response_complete and params.max_new_tokens != 0:
            raise InvalidArgumentError(
                "response_complete=True means the input ends with a complete response: "
                f"it needs max_new_tokens=0, got {params.max_new_tokens}"
            )
        self.scheduler.check(s, new_ids)
        return Work(
            s,
            new_ids,
            params,
            stream,
            response_complete=bool(req.response_complete),
            score_input=bool(req.score_input),
        )

    def fork(self, session_id: str) -> str:
        """Copy a session (cache, history, RNG stream position) into a new slot; returns the new id."""
        src = self._idle(session_id, "fork")
        return self.scheduler.fork(src, uuid.uuid4().hex).session_id

    def _idle(self, session_id: str, what: str) -> Session:
        """The session, refusing one that is still generating (``InvalidArgumentError``)."""
        s = self.scheduler.get(session_id)
        if self.scheduler.work_of(s) is not None:
            raise InvalidArgumentError(f"cannot {what} session {session_id!r} while it is still generating")
        return s

    def close(self, session_id: str) -> None:
        """Free a session's slot (a response it is generating is cancelled). Raises ``UnknownSessionError``."""
        self.scheduler.drop(self.scheduler.get(session_id))

    def compact(
        self, session_id: str, span: tuple[int, int] | None = None, ratio: float | None = None
    ) -> CompactionEvent:
        """Compact cache rows ``span`` now (default: everything after the protected prompt).

        Args:
            span: ``(start, end)`` cache rows, ``0 <= start < end <= kv_len``.
            ratio: kept fraction (default: the config's ``compact_target_ratio``).

        Returns:
            The event (also appended to the session's events).
        """
        s = self._idle(session_id, "compact")
        if not s.config.enabled:
            raise InvalidArgumentError(
                f"session {session_id!r} has mode='none'; create it with a compaction mode"
            )
        kv_len = self.cache.length(s.slot)
        if span is None:
            span = (s.protected_rows, kv_len)
        try:
            start, end = (operator.index(x) for x in span)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"span must be a pair of ints, got {span!r}") from None
        if not 0 <= start < end <= kv_len:
            raise InvalidArgumentError(
                f"span must satisfy 0 <= start < end <= kv_len={kv_len}, got {(start, end)}"
            )
        ratio = s.config.compact_target_ratio if ratio is None else float(ratio)
        if not 0 < ratio <= 1:
            raise InvalidArgumentError(f"ratio must be in (0, 1], got {ratio}")
        return self.compactor.compact(s, (start, end), ratio, "manual")

    def compact_generate(
        self, prompt_ids: Sequence[int], config: CompactionConfig, sampling: SamplingParams | None = None
    ) -> StepResult:
        """One prompt, KV-budget compaction mid-generation, session closed after (the seeds' endpoint)."""
        result = self.create_session(prompt_ids, config, sampling)
        self.close(result.session_id)
        return result

    def inject_generate(
        self, prompt_ids: Sequence[int], config: CompactionConfig, sampling: SamplingParams | None = None
    ) -> StepResult:
        """One prompt, no compaction, the budget message fed every ``config.inject_budget_every``
        sampled tokens; session closed after (the seeds' ``inject_only`` baseline).

        ``sampling=None`` generates up to ``config.max_total_tokens``.

        Raises:
            InvalidArgumentError: ``config.inject_budget_every`` unset or ``config.mode`` not ``none``.
        """
        if not isinstance(config, CompactionConfig) or config.inject_budget_every is None:
            raise InvalidArgumentError(
                "inject_generate needs a CompactionConfig with inject_budget_every set"
            )
        if config.enabled:
            raise InvalidArgumentError(
                f"inject_generate does not compact: mode must be 'none', got {config.mode!r}"
            )
        if sampling is None and config.max_total_tokens is not None:
            sampling = SamplingParams(max_new_tokens=config.max_total_tokens)
        return self.compact_generate(prompt_ids, config, sampling)

    # ------------------------------------------------------------- helpers
    def _ids(self, ids, name: str) -> list[int]:
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
                raise InvalidArgumentError(
                    f"{name} must be a 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}"
                )
            ids = ids.tolist()
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise InvalidArgumentError(f"{name} must be a sequence of token ids, got {type(ids).__name__}")
        out = []
        for t in ids:
            if isinstance(t, bool):
                raise InvalidArgumentError(f"{name} must contain integer token ids, not booleans")
            try:
                out.append(operator.index(t))
            except TypeError:
                raise InvalidArgumentError(f"{name} must contain integer token ids, got {t!r}") from None
        vocab = self.layout.vocab_size
        bad = [t for t in out if not 0 <= t < vocab]
        if bad:
            raise InvalidArgumentError(f"{name} has ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        return out

    def _check_config(self, config: CompactionConfig) -> None:
        if config.max_kv_len is not None and config.max_kv_len > self.capacity:
            raise InvalidArgumentError(
                f"max_kv_len ({config.max_kv_len}) exceeds the engine's capacity ({self.capacity}) rows per slot"
            )
        if config.queries in REPEAT_SOURCES and config.mode != "none" and self.tokenizer is None:
            raise InvalidArgumentError(
                f"queries={config.queries!r} needs an engine with a tokenizer (the repeat prompt)"
            )
        if config.injects_budget:
            name = "inject_budget_message" if config.inject_budget_message else "inject_budget_every"
            if self.tokenizer is None:
                raise InvalidArgumentError(f"{name} needs an engine with a tokenizer")
            if config.max_total_tokens is None:
                raise InvalidArgumentError(f"{name} needs max_total_tokens (the budget it reports)")

    def _decode(self, ids: list[int]) -> str:
        return (
            self.tokenizer.decode(ids, skip_special_tokens=False)
            if self.tokenizer is not None and ids
            else ""
        )

    def _budget_message(self, s: Session) -> list[int]:
        """Token ids of the budget message, framed by the session's ``budget_message_frame`` (the
        caller's chat template) or the engine's default (:func:`default_budget_frame`)."""
        total = s.config.max_total_tokens
        text = s.config.budget_message_template.format(
            used=s.generated, total=total, remaining=max(0, total - s.generated)
        )
        prefix, suffix = s.config.budget_message_frame or self.default_budget_frame
        return self.tokenizer.encode(prefix + text + suffix, add_special_tokens=False)

    def __repr__(self) -> str:
        return (
            f"Engine({type(self.model).__name__}, device={self.device}, dtype={self.dtype}, "
            f"slots={self.max_slots - self.num_free_slots}/{self.max_slots}, capacity={self.capacity})"
        )


def _use_fast(model: torch.nn.Module, device: torch.device, fast: bool | None) -> bool:
    """Whether the engine runs the fast path (see ``Engine``'s ``fast`` argument)."""
    if fast is False:
        return False
    from compaction_gym.engine.fast import HAS_TRITON, unsupported_reason

    reason = unsupported_reason(model)
    if reason is None and device.type != "cuda":
        reason = f"it needs a CUDA device, the model is on {device}"
    if reason is None and not HAS_TRITON:
        reason = "Triton is not installed (pip install triton)"
    if fast and reason is not None:
        raise InvalidArgumentError(f"fast=True: the fast path cannot run this model: {reason}")
    return reason is None


def _eos_ids(model: torch.nn.Module, tokenizer) -> tuple[int, ...]:
    """EOS ids from the generation config, the model config and the tokenizer, deduplicated."""
    ids: set[int] = set()
    sources = [getattr(getattr(model, "generation_config", None), "eos_token_id", None)]
    sources.append(getattr(model.config.get_text_config(), "eos_token_id", None))
    if tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    for src in sources:
        if src is None:
            continue
        ids.update([src] if isinstance(src, int) else list(src))
    return tuple(sorted(ids))


def default_budget_frame(tokenizer) -> tuple[str, str]:
    """The budget-message framing for sessions that give none: :data:`DEFAULT_BUDGET_FRAME`
    (a ChatML user turn and generation prompt) when the tokenizer has a chat template and
    ``<|im_start|>``, else :data:`PLAIN_BUDGET_FRAME` (blank lines)."""
    if tokenizer is not None and tokenizer.chat_template and "<|im_start|>" in tokenizer.get_vocab():
        return DEFAULT_BUDGET_FRAME
    return PLAIN_BUDGET_FRAME


def _warn_if_budget_cannot_hold(config: CompactionConfig, prompt_len: int) -> None:
    """Warn when no KV-budget event can keep the cache under ``max_kv_len``: events compact rows
    ``[P, P + window)`` after the protected prompt, so ``P + window > max_kv_len`` lets the cache
    grow past the budget (docs/engine.md, "Triggers")."""
    if not config.kv_budget or not config.protect_prompt:
        return
    window = config.compact_window or 0
    if prompt_len + window > config.max_kv_len:
        warnings.warn(
            f"max_kv_len={config.max_kv_len} cannot be honoured: the protected prompt ({prompt_len} tokens) "
            f"plus compact_window ({window}) exceed it, so the cache grows past the budget; raise "
            "max_kv_len, lower compact_window, or set protect_prompt=False",
            UserWarning,
            stacklevel=5,
        )

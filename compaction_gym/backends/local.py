"""The in-process backend: the embedded engine behind the :class:`~compaction_gym.backends.Backend` protocol."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.engine.types import CreateRequest, StepRequest, StepResult

if TYPE_CHECKING:
    from compaction_gym.engine import Engine


class LocalBackend:
    """The embedded engine, in process (the default backend), a
    :class:`~compaction_gym.backends.protocol.ContinuousBackend`.

    Args:
        engine: a :class:`compaction_gym.engine.Engine`.
        name: model name recorded in trajectories (defaults to the model's ``name_or_path``).

    Example:
        >>> backend = LocalBackend.from_pretrained("path/to/model", max_slots=4)  # doctest: +SKIP
        >>> r = backend.create_session(backend.tokenizer("hi")["input_ids"])  # doctest: +SKIP
    """

    def __init__(self, engine: Engine, *, name: str | None = None) -> None:
        self.engine = engine
        if name is None:
            config = getattr(getattr(engine, "model", None), "config", None)
            name = str(getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", "") or "")
        self.name = name

    @classmethod
    def from_pretrained(cls, path_or_id: str, **engine_kwargs: Any) -> LocalBackend:
        """Load a Hugging Face causal LM into an :class:`Engine` and wrap it.

        Args:
            path_or_id: a registered model name (``babyai-tiny``), a local ``save_pretrained``
                directory or a hub id.
            **engine_kwargs: passed to ``Engine.from_pretrained`` (``dtype``, ``device``,
                ``max_slots``, ``capacity``).
        """
        from compaction_gym.engine import Engine

        return cls(Engine.from_pretrained(path_or_id, **engine_kwargs), name=str(path_or_id))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.engine.eos_token_ids)

    @property
    def max_slots(self) -> int:
        return int(self.engine.max_slots)

    def create_session(
        self,
        prompt_ids: list[int],
        config: CompactionConfig | None = None,
        sampling: SamplingParams | None = None,
        *,
        session_id: str | None = None,
        score_input: bool = False,
    ) -> StepResult:
        return self.engine.create_session(
            prompt_ids, config, sampling, session_id=session_id, score_input=score_input
        )

    def step(
        self,
        session_id: str,
        new_ids: list[int],
        sampling: SamplingParams | None = None,
        *,
        response_complete: bool = False,
        score_input: bool = False,
    ) -> StepResult:
        return self.engine.step(
            session_id, new_ids, sampling, response_complete=response_complete, score_input=score_input
        )

    def step_batch(self, requests: list[StepRequest | CreateRequest]) -> list[StepResult]:
        return self.engine.step_batch(requests)

    def submit(self, requests: list[StepRequest | CreateRequest], *, prefill: bool = True) -> list[str]:
        """Admit requests into the running work (``Engine.submit``; continuous batching)."""
        return self.engine.submit(requests, prefill=prefill)

    def advance(self, max_steps: int | None = None) -> list[StepResult]:
        """One decode round; the results of the requests it finished (``Engine.advance``)."""
        return self.engine.advance(max_steps)

    def close(self, session_id: str) -> None:
        self.engine.close(session_id)

    def inject_generate(
        self, prompt_ids: list[int], config: CompactionConfig, sampling: SamplingParams | None = None
    ) -> StepResult:
        """One prompt, no compaction, the periodic budget message (``Engine.inject_generate``)."""
        return self.engine.inject_generate(prompt_ids, config, sampling)

    def __repr__(self) -> str:
        return f"LocalBackend(name={self.name!r}, max_slots={getattr(self.engine, 'max_slots', '?')})"

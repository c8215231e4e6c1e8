"""The session-API protocol every backend implements (see docs/agents.md, "Backends").

Agents only ever talk to a :class:`Backend`: the embedded engine (:class:`~compaction_gym.backends.LocalBackend`,
the default), the HTTP client of ``compaction-gym serve``
(:class:`~compaction_gym.servers.HTTPBackend`), or a test double
(:class:`~compaction_gym.backends.ScriptedBackend`). The session verbs have exactly the engine's
signatures, so a backend is a thin adapter.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.engine.types import CreateRequest, StepRequest, StepResult


@runtime_checkable
class Backend(Protocol):
    """What an agent needs from an inference backend.

    Attributes:
        name: the model's name, recorded in trajectories.
        tokenizer: the model's Hugging Face tokenizer (``None`` if the backend has none; agents
            then need one passed explicitly).
        eos_token_ids: the ids that end a response.

    Methods mirror :class:`compaction_gym.engine.Engine`:

    * ``create_session(prompt_ids, config=None, sampling=None, *, session_id=None, score_input=False)``
      prefills the protected prompt and generates unless ``sampling.max_new_tokens == 0``.
    * ``step(session_id, new_ids, sampling=None, *, response_complete=False, score_input=False)``
      feeds ``new_ids`` then generates; ``response_complete`` says the input ends with a whole
      assistant reply (turn triggers fire after it).
    * ``score_input=True`` fills ``StepResult.input_logprobs``: the log-probability of every fed
      input token under the session's (compacted) cache (docs/engine.md, "Scoring fed tokens").
    * ``step_batch(requests)`` steps many sessions at once, each with its own parameters
      (``StepRequest`` items, and ``CreateRequest`` items that open sessions in the same batch).
    * ``close(session_id)`` frees the session.

    Errors: :class:`~compaction_gym.errors.UnknownSessionError`,
    :class:`~compaction_gym.errors.CapacityError`,
    :class:`~compaction_gym.errors.InvalidArgumentError`.
    """

    @property
    def name(self) -> str: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def eos_token_ids(self) -> list[int]: ...

    def create_session(
        self,
        prompt_ids: list[int],
        config: CompactionConfig | None = None,
        sampling: SamplingParams | None = None,
        *,
        session_id: str | None = None,
        score_input: bool = False,
    ) -> StepResult: ...

    def step(
        self,
        session_id: str,
        new_ids: list[int],
        sampling: SamplingParams | None = None,
        *,
        response_complete: bool = False,
        score_input: bool = False,
    ) -> StepResult: ...

    def step_batch(self, requests: list[StepRequest | CreateRequest]) -> list[StepResult]: ...

    def close(self, session_id: str) -> None: ...


@runtime_checkable
class ContinuousBackend(Backend, Protocol):
    """A :class:`Backend` with continuous batching: requests join running work between decode rounds.

    The verbs mirror :meth:`compaction_gym.engine.Engine.submit` and
    :meth:`~compaction_gym.engine.Engine.advance` (docs/engine.md, "Continuous batching"):

    * ``submit(requests, *, prefill=True)`` validates as ``step_batch`` does (atomic; a typed
      error carries the offending ``request_index``), feeds the inputs (``prefill=False``: in the
      next round's forward, beside the running requests' decode step) and returns the requests'
      session ids;
    * ``advance(max_steps=None)`` runs one decode round (at most ``max_steps`` tokens per request)
      over everything running and returns the results of the requests it finished, which equal
      ``step_batch`` of the same requests however they were split into rounds.

    :func:`~compaction_gym.agents.run_episodes` lets each episode advance on its own on such a
    backend; on any other it plays in lock-step (one ``step_batch`` per turn).
    """

    def submit(self, requests: list[StepRequest | CreateRequest], *, prefill: bool = True) -> list[str]: ...

    def advance(self, max_steps: int | None = None) -> list[StepResult]: ...

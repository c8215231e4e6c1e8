"""The record of one agent episode: exactly what the trainers consume.

A :class:`Trajectory` is the whole token stream of one persistent session, in logical order
(prompt, every turn's fed tokens, every generated or injected token), with a completion mask,
the sampling log-probs, the turn boundaries, the compaction events and the rewards. It
serialises to JSON losslessly (:meth:`Trajectory.to_dict` / :meth:`Trajectory.from_dict`,
:func:`write_jsonl` / :func:`read_jsonl`).

Token-level conventions:

* ``completion_mask[i] == 1`` exactly where the model *sampled* token ``i``; prompt, observation
  and chat-template tokens, injected budget messages and teacher-forced actions are 0.
  Teacher-forced turns carry ``Turn.forced = True``: an SFT trainer may take their
  ``output_range`` as targets, an RL trainer must not (they were never sampled).
* ``logprobs[i]`` is the log-probability of token ``i`` under the sampling distribution where
  ``completion_mask[i] == 1`` and ``0.0`` elsewhere.
* ``Turn.input_range`` / ``Turn.output_range`` are half-open ranges into ``token_ids``. A turn's
  input is everything fed before its action (the rest of the previous assistant message's
  template closing, the user message, the generation prompt); its output is what the model
  generated (plus any budget message the engine injected while generating) or the forced action.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from compaction_gym.compaction.events import CompactionEvent

SCHEMA_VERSION = 1


@dataclass
class Turn:
    """One observation → action exchange inside a trajectory.

    Attributes:
        input_range: ``(start, end)`` into ``token_ids`` of the tokens fed for this turn (for an
            episode without instruction, the first turn's input is the prompt, ``(0, prompt_len)``).
        output_range: ``(start, end)`` of the action tokens (generated or forced) and any tokens
            the engine injected while generating.
        observation: the env's observation text, as received.
        action_text: the model's output text for this turn (sampled tokens decoded, a trailing stop
            token removed) or the forced text.
        action: the action the env executed, when it reports one (e.g. BabyAI's parsed action
            name); ``None`` if unknown.
        reward: the env reward for this step.
        forced: ``True`` when the action was teacher-forced (``completion_mask`` 0 on its tokens).
        message: the user-message content that framed the observation (what the chat template saw).
        finish_reason: the backend's finish reason (``stop``, ``length``, ``budget``; ``forced``).
        kv_len: cache rows after this turn's backend call.
        peak_kv_len: the largest cache length reached during the call (before any compaction).
        invalid_action: the env reported the output held no valid action (``info["invalid_action"]``).
    """

    input_range: tuple[int, int]
    output_range: tuple[int, int]
    observation: str
    action_text: str
    action: str | None = None
    reward: float = 0.0
    forced: bool = False
    message: str = ""
    finish_reason: str = ""
    kv_len: int = 0
    peak_kv_len: int = 0
    invalid_action: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "input_range": list(self.input_range),
            "output_range": list(self.output_range),
            "observation": self.observation,
            "action_text": self.action_text,
            "action": self.action,
            "reward": self.reward,
            "forced": self.forced,
            "message": self.message,
            "finish_reason": self.finish_reason,
            "kv_len": self.kv_len,
            "peak_kv_len": self.peak_kv_len,
            "invalid_action": self.invalid_action,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Turn:
        return cls(
            input_range=(int(d["input_range"][0]), int(d["input_range"][1])),
            output_range=(int(d["output_range"][0]), int(d["output_range"][1])),
            observation=d["observation"],
            action_text=d["action_text"],
            action=d.get("action"),
            reward=float(d.get("reward", 0.0)),
            forced=bool(d.get("forced", False)),
            message=d.get("message", ""),
            finish_reason=d.get("finish_reason", ""),
            kv_len=int(d.get("kv_len", 0)),
            peak_kv_len=int(d.get("peak_kv_len", 0)),
            invalid_action=bool(d.get("invalid_action", False)),
        )


@dataclass
class Trajectory:
    """One episode of one persistent session (see the module docstring for conventions).

    Attributes:
        token_ids: every logical token of the session, in order.
        completion_mask: 1 exactly on model-sampled tokens.
        logprobs: sampling log-probs at sampled tokens, 0.0 elsewhere.
        prompt_len: tokens of the protected creation prompt (``token_ids[:prompt_len]``).
        turns: the turns, in order.
        events: every compaction event of the session, in order.
        rewards: the env reward of each step (``len(rewards) == len(turns)`` once finished).
        total_reward: ``sum(rewards)``.
        success: whether the episode was solved (env's ``success``/``progression`` or reward > 0).
        info: JSON-safe episode info (the env's final ``info`` plus the agent's own keys such as
            ``aborted`` when the backend refused a step).
        compaction: the session's ``CompactionConfig.to_dict()``.
        sampling: the ``SamplingParams.to_dict()`` the agent sampled with (per-turn seeds are
            derived from ``sampling["seed"]`` and ``seed``).
        model: model name or path.
        instruction: the first user message (the env's instruction).
        prompt_format: the agent's prompt format name (``balrog``, ``reasoning``, ...).
        env_id: the env id, when known.
        seed: the episode seed passed to ``reset``.
        metrics: per-episode numbers (``wall_time_s``, ``peak_kv_len``, ``generated_tokens``, ...).
    """

    token_ids: list[int] = field(default_factory=list)
    completion_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_len: int = 0
    turns: list[Turn] = field(default_factory=list)
    events: list[CompactionEvent] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    total_reward: float = 0.0
    success: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    compaction: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    model: str = ""
    instruction: str = ""
    prompt_format: str = ""
    env_id: str = ""
    seed: int | None = None
    metrics: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ derived views
    @property
    def num_tokens(self) -> int:
        """Logical tokens in the session."""
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        """Tokens sampled by the model."""
        return int(sum(self.completion_mask))

    @property
    def peak_kv_len(self) -> int:
        """Largest KV-cache length reached during the episode."""
        return max([self.prompt_len, *(t.peak_kv_len for t in self.turns)])

    def messages(self) -> list[dict[str, str]]:
        """The conversation as chat messages (instruction, then user/assistant per turn)."""
        out = [{"role": "user", "content": self.instruction}]
        for t in self.turns:
            out.append({"role": "user", "content": t.message})
            out.append({"role": "assistant", "content": t.action_text})
        return out

    def validate(self) -> None:
        """Check the internal invariants; raises ``ValueError`` naming the first one broken."""
        n = len(self.token_ids)
        if len(self.completion_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"token_ids ({n}), completion_mask ({len(self.completion_mask)}) and logprobs "
                f"({len(self.logprobs)}) must have the same length"
            )
        if not 0 <= self.prompt_len <= n:
            raise ValueError(f"prompt_len {self.prompt_len} outside [0, {n}]")
        pos = 0
        for i, t in enumerate(self.turns):
            (a, b), (c, d) = t.input_range, t.output_range
            if not pos <= a <= b <= c <= d <= n:
                raise ValueError(
                    f"turn {i}: ranges {t.input_range}, {t.output_range} out of order (from {pos})"
                )
            if a < self.prompt_len and (i > 0 or a != 0):
                raise ValueError(f"turn {i}: input starts inside the prompt but is not the prompt itself")
            pos = d
        for i, (m, lp) in enumerate(zip(self.completion_mask, self.logprobs)):
            if m not in (0, 1):
                raise ValueError(f"completion_mask[{i}] = {m}; must be 0 or 1")
            if m == 0 and lp != 0.0:
                raise ValueError(f"logprobs[{i}] = {lp} at a non-sampled token; must be 0.0")
        if any(self.completion_mask[: self.prompt_len]):
            raise ValueError("the prompt must not contain sampled tokens")

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict; :meth:`from_dict` inverts it exactly."""
        return {
            "schema_version": SCHEMA_VERSION,
            "token_ids": [int(t) for t in self.token_ids],
            "completion_mask": [int(m) for m in self.completion_mask],
            "logprobs": [float(x) for x in self.logprobs],
            "prompt_len": int(self.prompt_len),
            "turns": [t.to_dict() for t in self.turns],
            "events": [e.to_dict() for e in self.events],
            "rewards": [float(r) for r in self.rewards],
            "total_reward": float(self.total_reward),
            "success": bool(self.success),
            "info": jsonable(self.info),
            "compaction": jsonable(self.compaction),
            "sampling": jsonable(self.sampling),
            "model": self.model,
            "instruction": self.instruction,
            "prompt_format": self.prompt_format,
            "env_id": self.env_id,
            "seed": self.seed,
            "metrics": jsonable(self.metrics),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        version = d.get("schema_version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise ValueError(
                f"unsupported trajectory schema_version {version}; this library reads {SCHEMA_VERSION}"
            )
        return cls(
            token_ids=[int(t) for t in d["token_ids"]],
            completion_mask=[int(m) for m in d["completion_mask"]],
            logprobs=[float(x) for x in d["logprobs"]],
            prompt_len=int(d["prompt_len"]),
            turns=[Turn.from_dict(t) for t in d.get("turns", [])],
            events=[CompactionEvent.from_dict(e) for e in d.get("events", [])],
            rewards=[float(r) for r in d.get("rewards", [])],
            total_reward=float(d.get("total_reward", 0.0)),
            success=bool(d.get("success", False)),
            info=dict(d.get("info", {})),
            compaction=dict(d.get("compaction", {})),
            sampling=dict(d.get("sampling", {})),
            model=d.get("model", ""),
            instruction=d.get("instruction", ""),
            prompt_format=d.get("prompt_format", ""),
            env_id=d.get("env_id", ""),
            seed=d.get("seed"),
            metrics=dict(d.get("metrics", {})),
        )


def jsonable(value: Any) -> Any:
    """Convert ``value`` to plain JSON types: numpy scalars/arrays, tuples, sets, paths, dataclass
    configs with ``to_dict``; anything else becomes its ``repr``. Non-finite floats stay floats
    (Python's ``json`` writes them as ``NaN``/``Infinity`` and reads them back)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, np.generic):
        return jsonable(value.item())
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return jsonable(to_dict())
    return repr(value)


def write_jsonl(path: str | Path, trajectories: Iterable[Trajectory], *, append: bool = False) -> int:
    """Write one trajectory per line; returns how many were written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("a" if append else "w", encoding="utf-8") as f:
        for traj in trajectories:
            f.write(jsonl_line(traj))
            n += 1
    return n


def jsonl_line(traj: Trajectory) -> str:
    """One line of a trajectories file (what :func:`write_jsonl` writes per trajectory)."""
    return json.dumps(traj.to_dict(), ensure_ascii=False, allow_nan=True) + "\n"


def read_jsonl(path: str | Path) -> list[Trajectory]:
    """Read a file written by :func:`write_jsonl` (blank lines skipped)."""
    out = []
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(Trajectory.from_dict(json.loads(line)))
            except (KeyError, ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a trajectory record: {exc}") from exc
    return out

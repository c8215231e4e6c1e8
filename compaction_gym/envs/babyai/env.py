"""``BabyAITextEnv``: BabyAI as text, observation for observation what BALROG shows an LLM."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import minigrid  # noqa: F401  (registers the BabyAI-* ids used by base_env_id)
import numpy as np
from gymnasium.error import ResetNeeded
from minigrid.minigrid_env import MiniGridEnv

from compaction_gym.envs.babyai.actions import ACTION_INDEX, DEFAULT_ACTION, check_parse_mode, parse_action
from compaction_gym.envs.babyai.expert import BabyAIExpert
from compaction_gym.envs.babyai.levels import MixedTrainLocal, check_task
from compaction_gym.envs.babyai.prompts import INVALID_ACTION_PREFIX, instruction_prompt
from compaction_gym.envs.babyai.text import describe_lines, join_lines
from compaction_gym.envs.spaces import text_space
from compaction_gym.errors import InvalidArgumentError


class BabyAITextEnv(gym.Env[str, str]):
    """BabyAI with BALROG's text observations and free-text actions.

    ## Description
    BALROG's ``MixedTrainLocal`` tasks (``goto``, ``pickup``, ``open``, ``putnext``,
    ``pick_up_seq_go_to``; see :mod:`compaction_gym.envs.babyai.levels`), or any standard
    ``BabyAI-*`` level through ``base_env_id``. The agent reads the BabyAI-Text description of its
    7×7 egocentric view and answers with text naming one of six actions.

    ## Action Space
    ``Text`` (free text, any ``str`` accepted). It is parsed with ``action_parsing``
    (``"balrog"``: BALROG's exact rule, ``"tag"``: ``<action>…</action>``, ``"lenient"``) into
    ``turn left, turn right, go forward, pick up, drop, toggle`` (MiniGrid actions 0–5). Text
    holding no valid action plays ``go forward``.

    ## Observation Space
    ``Text``: the description lines without ``"You see "``, joined by ``"\\n"``, e.g.
    ``"a wall 6 steps forward\\na wall 2 steps left\\na green key 1 step right and 2 steps forward"``.
    After an invalid action (and ``invalid_action_feedback=True``) BALROG's
    :data:`~compaction_gym.envs.babyai.prompts.INVALID_ACTION_PREFIX` comes first.

    ``info`` holds ``mission``, ``instruction`` (BALROG's first user message), ``descriptions``
    (the raw lines), ``task``, ``step``, ``max_steps``, ``progression`` (1.0 once any reward was
    earned), ``invalid_action``, ``action`` (the action name played, ``None`` after reset) and
    ``action_index`` (its MiniGrid index, ``None`` after reset).

    ## Rewards
    ``1 − 0.9 · step / max_steps`` on success, 0 otherwise.

    ## Episode End
    Terminated on success (or a BabyAI failure, e.g. a sequence done in the wrong order);
    truncated after ``max_steps`` steps (64 for goto/pickup, 128 for open/putnext/sequence).

    ## Arguments
    * ``task``: a BALROG task name, or ``None`` for a uniform draw at every reset.
    * ``base_env_id``: a ``BabyAI-*`` id to wrap instead of ``MixedTrainLocal`` (not with ``task``).
    * ``num_dists``, ``room_size``: ``MixedTrainLocal`` layout (BALROG: 0 and 8).
    * ``max_steps``: fixed step limit instead of the BabyAI rule.
    * ``action_parsing``: ``"balrog"`` (default), ``"tag"`` or ``"lenient"``.
    * ``invalid_action_feedback``: prefix the feedback text after an invalid action (default on).
    * ``render_mode``: ``None`` or ``"rgb_array"`` (:meth:`render` returns the full-grid frame).
    * ``max_text_length``: ``max_length`` of the two ``Text`` spaces.

    ## Version History
    * v0: initial release.

    Example:
        >>> import gymnasium as gym, compaction_gym
        >>> env = gym.make("AttnMatch-BabyAI-GoTo-v0")
        >>> obs, info = env.reset(seed=0)
        >>> obs, reward, terminated, truncated, info = env.step("turn left")
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(
        self,
        task: str | None = None,
        *,
        base_env_id: str | None = None,
        num_dists: int = 0,
        room_size: int = 8,
        max_steps: int | None = None,
        action_parsing: str = "balrog",
        invalid_action_feedback: bool = True,
        render_mode: str | None = None,
        max_text_length: int = 8192,
    ) -> None:
        check_task(task)
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise InvalidArgumentError(f"render_mode must be None or 'rgb_array', got {render_mode!r}")
        self.action_parsing = check_parse_mode(action_parsing)
        self.invalid_action_feedback = bool(invalid_action_feedback)
        self.render_mode = render_mode
        self.base_env_id = base_env_id
        if base_env_id is None:
            self.level: MiniGridEnv = MixedTrainLocal(
                task, num_dists=num_dists, room_size=room_size, max_steps=max_steps, render_mode=render_mode
            )
        else:
            if task is not None:
                raise InvalidArgumentError("pass either task (MixedTrainLocal) or base_env_id, not both")
            self.level = _make_babyai(base_env_id, max_steps=max_steps, render_mode=render_mode)
        self.observation_space = text_space(max_text_length)
        self.action_space = text_space(max_text_length)
        self._expert: BabyAIExpert | None = None
        self._progression = 0.0
        self._needs_reset = True

    @property
    def task(self) -> str:
        """The current episode's task name (the ``base_env_id`` when wrapping a standard level)."""
        return self.base_env_id or self.level.current_task

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self.level.reset(seed=seed)
        self._expert = None
        self._progression = 0.0
        self._needs_reset = False
        lines = describe_lines(self.level)
        return join_lines(lines), self._info(lines, invalid=False, action=None)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._needs_reset:
            raise ResetNeeded("call reset() before step() (after the episode ended, too)")
        if not isinstance(action, str):
            raise InvalidArgumentError(f"action must be a str (free text), got {type(action).__name__}")
        name = parse_action(action, self.action_parsing)
        invalid = name is None
        name = name or DEFAULT_ACTION
        index = ACTION_INDEX[name]
        _, reward, terminated, truncated, _ = self.level.step(index)
        self._needs_reset = bool(terminated or truncated)  # as the math env: no step past the end
        if reward > 0:
            self._progression = 1.0
        if self._expert is not None:
            self._observe_expert(index, done=terminated or truncated)
        lines = describe_lines(self.level)
        text = join_lines(lines)
        if invalid and self.invalid_action_feedback:
            text = INVALID_ACTION_PREFIX + text
        return text, float(reward), bool(terminated), bool(truncated), self._info(lines, invalid, name)

    def expert_action(self) -> str:
        """The expert bot's next action name (the bot follows the episode from its first call on)."""
        if self._needs_reset:
            raise ResetNeeded("call reset() before expert_action()")
        if self._expert is None:
            self._expert = BabyAIExpert(self.level)
        return self._expert.suggestion_name

    def render(self) -> np.ndarray | None:
        return self.level.render() if self.render_mode == "rgb_array" else None

    def close(self) -> None:
        self.level.close()
        super().close()

    def _observe_expert(self, index: int, done: bool) -> None:
        if done:
            self._expert = None
            return
        try:
            self._expert.observe(index)
        except Exception:  # the bot can fail after off-plan actions; start a fresh one when asked
            self._expert = None

    def _info(self, lines: list[str], invalid: bool, action: str | None) -> dict[str, Any]:
        mission = self.level.mission
        return {
            "mission": mission,
            "instruction": instruction_prompt(mission),
            "descriptions": lines,
            "task": self.task,
            "step": int(self.level.step_count),
            "max_steps": int(self.level.max_steps),
            "progression": self._progression,
            "invalid_action": invalid,
            "action": action,
            "action_index": None if action is None else ACTION_INDEX[action],
        }


def _make_babyai(env_id: str, *, max_steps: int | None, render_mode: str | None) -> MiniGridEnv:
    """The unwrapped standard BabyAI level ``env_id``."""
    if not isinstance(env_id, str) or not env_id.startswith("BabyAI-"):
        raise InvalidArgumentError(
            f"base_env_id must be a 'BabyAI-*' id such as 'BabyAI-GoToLocal-v0', got {env_id!r}"
        )
    kwargs: dict[str, Any] = {"render_mode": render_mode}
    if max_steps is not None:
        kwargs["max_steps"] = max_steps
    try:
        level = gym.make(env_id, **kwargs).unwrapped
    except gym.error.Error as exc:
        raise InvalidArgumentError(f"base_env_id {env_id!r} cannot be made: {exc}") from exc
    if not isinstance(level, MiniGridEnv):
        raise InvalidArgumentError(f"base_env_id {env_id!r} is not a MiniGrid environment")
    return level

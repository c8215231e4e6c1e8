"""The BALROG BabyAI tasks with MiniGrid's symbolic observations, for classic RL baselines."""

from __future__ import annotations

from typing import Any

from gymnasium import spaces
from gymnasium.error import ResetNeeded

from compaction_gym.envs.babyai.actions import ACTION_NAMES
from compaction_gym.envs.babyai.levels import MixedTrainLocal
from compaction_gym.errors import InvalidArgumentError


class BabyAISymbolicEnv(MixedTrainLocal):
    """``MixedTrainLocal`` as MiniGrid serves it: the same layouts per seed as the text env.

    ## Description
    The level behind ``AttnMatch-BabyAI-v0`` (and the per-task ids): ``reset(seed=s)`` builds the
    very layout and mission that the text env builds for ``s`` with the same arguments, so a
    stable-baselines3 policy can be scored on exactly the LLM's episodes.

    ## Action Space
    ``Discrete(6)`` by default: the text env's actions (turn left, turn right, go forward,
    pick up, drop, toggle); ``num_actions=7`` adds MiniGrid's no-op ``done``.

    ## Observation Space
    MiniGrid's ``Dict``: ``image`` (7×7×3 uint8 object/colour/state codes of the egocentric
    view), ``direction`` (``Discrete(4)``), ``mission`` (str). Wrap with
    ``minigrid.wrappers.ImgObsWrapper`` for a CNN policy.

    ## Rewards
    ``1 − 0.9 · step / max_steps`` on success, 0 otherwise.

    ## Episode End
    As the text env: success or BabyAI failure terminates, ``max_steps`` truncates; a step after
    the end (or before the first reset) raises ``gymnasium.error.ResetNeeded``.

    ## Arguments
    ``task``, ``num_dists``, ``room_size``, ``max_steps``, ``render_mode`` as
    :class:`~compaction_gym.envs.babyai.levels.MixedTrainLocal`; ``num_actions`` 6 or 7.

    ## Version History
    * v0: initial release.
    """

    def __init__(self, task: str | None = None, *, num_actions: int = 6, **kwargs: Any) -> None:
        if num_actions not in (6, 7):
            raise InvalidArgumentError(
                f"num_actions must be 6 (text env's actions) or 7 (with 'done'), got {num_actions!r}"
            )
        super().__init__(task, **kwargs)
        assert len(ACTION_NAMES) == 6
        self.action_space = spaces.Discrete(num_actions)
        self._needs_reset = True

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        out = super().reset(seed=seed, options=options)
        self._needs_reset = False
        return out

    def step(self, action: Any):
        if self._needs_reset:
            raise ResetNeeded("call reset() before step() (after the episode ended, too)")
        if isinstance(action, bool) or not self.action_space.contains(action):
            raise InvalidArgumentError(f"action must be an int in {self.action_space}, got {action!r}")
        obs, reward, terminated, truncated, info = super().step(int(action))
        self._needs_reset = bool(terminated or truncated)
        return obs, reward, terminated, truncated, info

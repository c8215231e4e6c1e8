"""``ExpertDemoWrapper``: a BabyAI text env that also plays minigrid's expert bot as the teacher,
with optional DART-style noise (see docs/agents.md, "Expert demonstrations")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from compaction_gym.envs.babyai.reasoning import babyai_reasoning, demo_text
from compaction_gym.errors import InvalidArgumentError

#: Movements a noisy turn draws from (never pick up / drop / toggle: those can end an episode badly).
NOISE_ACTIONS: tuple[str, ...] = ("turn left", "turn right", "go forward")


class ExpertDemoWrapper(gym.Wrapper):
    """A BabyAI text env that also plays the expert teacher, with optional DART-style noise.

    :meth:`teacher_text` is the teacher for :func:`~compaction_gym.agents.run_episodes`: the bot's
    action (or, with probability ``noise``, another movement) with its templated reasoning. The
    bot is asked every turn, so it follows the episode and replans after a noisy action.
    ``info["demo_noise_turns"]`` lists the turns (0-based) that played noise.

    Args:
        env: a BabyAI text env (``gym.make("AttnMatch-BabyAI-v0", task=...)``).
        noise: probability that a turn plays a random action of ``noise_actions`` (not the bot's).
        noise_actions: the actions noise draws from.
        noise_seed: with the episode seed, seeds the noise stream (deterministic per episode).
        max_turns: truncate the episode after this many turns (``info["demo_cut"]`` is then True).
    """

    def __init__(
        self,
        env: gym.Env,
        *,
        noise: float = 0.0,
        noise_actions: Sequence[str] = NOISE_ACTIONS,
        noise_seed: int = 0,
        max_turns: int | None = None,
    ) -> None:
        super().__init__(env)
        if not 0.0 <= noise < 1.0:
            raise InvalidArgumentError(f"noise must be in [0, 1), got {noise}")
        if max_turns is not None and max_turns < 1:
            raise InvalidArgumentError(f"max_turns must be >= 1 (or None), got {max_turns}")
        self.max_turns = max_turns
        self.noise = float(noise)
        self.noise_actions = tuple(noise_actions)
        self.noise_seed = int(noise_seed)
        self._rng = np.random.default_rng(noise_seed)
        self._obs = ""
        self._mission = ""
        self._turn = 0
        self._pending = False
        self._noise_turns: list[int] = []

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        obs, info = self.env.reset(seed=seed, options=options)
        if seed is not None:
            self._rng = np.random.default_rng([self.noise_seed, seed])
        self._obs, self._mission = obs, info["mission"]
        self._turn, self._pending, self._noise_turns = 0, False, []
        return obs, info

    def teacher_text(self) -> str:
        """This turn's assistant text: templated reasoning, then the (possibly noisy) action."""
        from compaction_gym.envs.babyai.expert import expert_action

        action = expert_action(self.env)
        self._pending = self.noise > 0 and bool(self._rng.random() < self.noise)
        if self._pending:
            others = [a for a in self.noise_actions if a != action]
            action = others[int(self._rng.integers(len(others)))]
        return demo_text(babyai_reasoning(self._mission, self._obs), action)

    def step(self, action: str):
        obs, reward, terminated, truncated, info = self.env.step(action)
        if self._pending:
            self._noise_turns.append(self._turn)
        self._turn, self._pending, self._obs = self._turn + 1, False, obs
        info["demo_noise_turns"] = list(self._noise_turns)
        info["demo_cut"] = bool(
            self.max_turns is not None and self._turn >= self.max_turns and not (terminated or truncated)
        )
        return obs, reward, terminated, truncated or info["demo_cut"], info


def expert_teacher(env: gym.Env) -> str:
    """``run_episodes`` teacher: ``env.teacher_text()`` of an :class:`ExpertDemoWrapper`."""
    return env.teacher_text()

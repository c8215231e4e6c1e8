"""The classic-RL reference row: stable-baselines3 PPO on the symbolic view of a suite's BabyAI tasks.

A suite method ``{name = "sb3_ppo", agent = "sb3_ppo", total_timesteps = N, n_envs = E, ppo = {...}}``
trains one PPO policy per run seed on ``AttnMatch-BabyAI-Symbolic-v0`` (same layouts per env seed as
the text env: ``docs/envs.md``) and plays the suite's very ``(task, env seed)`` episodes with it,
greedily. Training resets draw env seeds from ``TRAIN_SEED_BASE`` upwards, never an evaluation
seed. Its records have no KV or token numbers (``null``; ``docs/leaderboard.md``, "sb3 reference
row"). Needs the ``[sb3]`` extra (``stable-baselines3``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.leaderboard.store import sha256_file

AGENT = "sb3_ppo"
SYMBOLIC_ENV = "AttnMatch-BabyAI-Symbolic-v0"
#: Training resets use env seeds TRAIN_SEED_BASE + 100_000 · env index + k: never a suite's seeds.
TRAIN_SEED_BASE = 10_000_000
#: PPO settings a suite may leave out (stable-baselines3's names; rl-zoo's MiniGrid values).
PPO_DEFAULTS: dict[str, Any] = {
    "n_steps": 128,
    "batch_size": 256,
    "n_epochs": 4,
    "learning_rate": 2.5e-4,
    "gamma": 0.99,
    "gae_lambda": 0.95,
    "clip_range": 0.2,
    "ent_coef": 0.01,
}
#: The text env's kwargs that the symbolic env does not take (its layout kwargs pass through).
TEXT_ONLY_KWARGS = ("action_parsing", "invalid_action_feedback", "base_env_id", "max_text_length")
#: BabyAI mission words (BALROG's five tasks); anything else is ``<unk>``.
MISSION_WORDS: tuple[str, ...] = (
    "<pad>", "<unk>", ",", "a", "after", "ball", "blue", "box", "door", "go", "green", "grey", "key",
    "next", "open", "pick", "purple", "put", "red", "the", "then", "to", "up", "yellow", "you",
)  # fmt: skip
MAX_MISSION_WORDS = 14
#: MiniGrid's object, colour and state code counts (``minigrid.core.constants``).
N_OBJECTS, N_COLORS, N_STATES = 11, 6, 3


def trainer_settings(where: str, method: Mapping[str, Any], env: str) -> dict[str, Any]:
    """Validate an ``agent = "sb3_ppo"`` suite method into the cell's ``trainer`` block.

    Raises:
        InvalidArgumentError: a non-BabyAI suite env, or a bad ``total_timesteps`` / ``n_envs`` /
            ``ppo`` (named).
    """
    from compaction_gym.agents.evaluate import is_babyai

    if not is_babyai(env):
        raise InvalidArgumentError(f"{where}: agent {AGENT!r} needs a BabyAI suite env, got env {env!r}")
    steps, n_envs = method.get("total_timesteps", 200_000), method.get("n_envs", 8)
    for key, value in (("total_timesteps", steps), ("n_envs", n_envs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"{where}: {key} must be an int >= 1, got {value!r}")
    ppo = method.get("ppo", {})
    if not isinstance(ppo, Mapping):
        raise InvalidArgumentError(f"{where}: ppo must be a table of PPO arguments, got {ppo!r}")
    if "seed" in ppo or "device" in ppo:
        raise InvalidArgumentError(f"{where}: ppo.seed / ppo.device are set by the runner (run seed, cpu)")
    return {
        "agent": AGENT,
        "env": SYMBOLIC_ENV,
        "total_timesteps": steps,
        "n_envs": n_envs,
        "ppo": {**PPO_DEFAULTS, **ppo},
    }


class FlatObservation(gym.ObservationWrapper):
    """MiniGrid's symbolic ``Dict`` observation as one float vector for an MLP policy: the 7×7 view
    one-hot per cell (object, colour, state), the direction one-hot, and the mission's first
    ``MAX_MISSION_WORDS`` words one-hot per position."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.index = {w: i for i, w in enumerate(MISSION_WORDS)}
        size = 7 * 7 * (N_OBJECTS + N_COLORS + N_STATES) + 4 + MAX_MISSION_WORDS * len(MISSION_WORDS)
        self.observation_space = gym.spaces.Box(0.0, 1.0, (size,), np.float32)

    def observation(self, observation: dict[str, Any]) -> np.ndarray:
        image = np.asarray(observation["image"], dtype=np.int64).reshape(49, 3)
        view = np.concatenate(
            [
                np.eye(N_OBJECTS, dtype=np.float32)[image[:, 0]],
                np.eye(N_COLORS, dtype=np.float32)[image[:, 1]],
                np.eye(N_STATES, dtype=np.float32)[image[:, 2]],
            ],
            axis=1,
        ).ravel()
        direction = np.eye(4, dtype=np.float32)[int(observation["direction"])]
        words = str(observation["mission"]).replace(",", " ,").split()[:MAX_MISSION_WORDS]
        ids = [self.index.get(w, 1) for w in words] + [0] * (MAX_MISSION_WORDS - len(words))
        mission = np.eye(len(MISSION_WORDS), dtype=np.float32)[ids].ravel()
        return np.concatenate([view, direction, mission])


class TrainSeeds(gym.Wrapper):
    """Reset with env seeds ``start, start + 1, …`` (training never sees an evaluation seed)."""

    def __init__(self, env: gym.Env, start: int) -> None:
        super().__init__(env)
        self.next_seed = start

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.next_seed += 1
        return self.env.reset(seed=self.next_seed - 1, options=options)


def symbolic_env(task: str | None, env_kwargs: Mapping[str, Any]) -> gym.Env:
    """The symbolic env of ``task`` with the suite's layout kwargs, observations flattened."""
    import compaction_gym.envs  # noqa: F401 - registers the ids

    kwargs = {k: v for k, v in env_kwargs.items() if k not in TEXT_ONLY_KWARGS}
    return FlatObservation(gym.make(SYMBOLIC_ENV, task=task, **kwargs))


def policy_path(directory: Path, seed: int) -> Path:
    return directory / f"policy_seed{seed}.zip"


def train(cell: Any, seed: int, path: Path, log: Callable[[str], None] | None = None) -> Any:
    """Train the cell's PPO policy for run seed ``seed`` on every task of the cell (env ``i``
    plays ``tasks[i % len(tasks)]``) and save it atomically to ``path``."""
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import DummyVecEnv

    settings = cell.trainer or {}
    tasks = list(cell.tasks) or [None]
    n_envs = int(settings["n_envs"])

    def factory(i: int) -> Callable[[], gym.Env]:
        start = (
            TRAIN_SEED_BASE + 100_000 * i + 1_000_000 * (cell.seeds.index(seed) if seed in cell.seeds else 0)
        )
        return lambda: TrainSeeds(symbolic_env(tasks[i % len(tasks)], cell.env_kwargs), start)

    torch.manual_seed(seed)
    t0 = time.perf_counter()
    model = PPO(
        "MlpPolicy", DummyVecEnv([factory(i) for i in range(n_envs)]), seed=seed, device="cpu", verbose=0,
        **settings["ppo"],
    )  # fmt: skip
    model.learn(total_timesteps=int(settings["total_timesteps"]))
    tmp = path.with_name(path.name + ".tmp.zip")
    model.save(tmp)
    os.replace(tmp, path)
    if log is not None:
        log(f"trained {path.name}: {settings['total_timesteps']} steps in {time.perf_counter() - t0:.1f} s")
    return model


def load_or_train(cell: Any, seed: int, directory: Path, log: Callable[[str], None] | None = None) -> Any:
    """The saved policy of run seed ``seed`` (a resumed cell never retrains), else a new one."""
    from stable_baselines3 import PPO

    path = policy_path(directory, seed)
    if path.exists():
        return PPO.load(path, device="cpu")
    return train(cell, seed, path, log)


def play_episode(
    model: Any, task: str | None, env_seed: int, env_kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """One greedy episode on env seed ``env_seed``: actions, rewards, success (BALROG progression)."""
    env = symbolic_env(task, env_kwargs)
    t0 = time.perf_counter()
    try:
        obs, _ = env.reset(seed=env_seed)
        mission = str(env.unwrapped.mission)
        actions: list[int] = []
        rewards: list[float] = []
        done = False
        while not done:
            action, _ = model.predict(obs, deterministic=True)
            obs, reward, terminated, truncated, _ = env.step(int(action))
            actions.append(int(action))
            rewards.append(float(reward))
            done = terminated or truncated
    finally:
        env.close()
    success = any(r > 0 for r in rewards)
    return {
        "kind": AGENT,
        "seed": env_seed,
        "mission": mission,
        "actions": actions,
        "rewards": rewards,
        "total_reward": float(sum(rewards)),
        "success": success,
        "info": {
            "eval_task": str(task),
            "eval_task_requested": task,
            "progression": 1.0 if success else 0.0,
        },
        "metrics": {"wall_time_s": time.perf_counter() - t0},
    }


def play_cell(
    cell: Any,
    plan: Mapping[str | None, Sequence[int]],
    directory: Path,
    on_line: Callable[[dict[str, Any]], None],
    log: Callable[[str], None] | None = None,
) -> None:
    """Play the planned ``{task: env seeds}`` with each run seed's policy (trained first if
    missing), calling ``on_line`` with each finished episode's line."""
    for seed in cell.seeds:
        mine = {t: [e for e in seeds if cell.run_seed(e) == seed] for t, seeds in plan.items()}
        if not any(mine.values()):
            continue
        model = load_or_train(cell, seed, directory, log)
        for task, env_seeds in mine.items():
            for env_seed in env_seeds:
                line = play_episode(model, task, env_seed, cell.env_kwargs)
                line["info"]["leaderboard_seed"] = seed
                on_line(line)


def model_block(directory: Path) -> dict[str, Any]:
    """The record's ``model`` block: the saved policies and their sha256 (no tokenizer)."""
    files = sorted(directory.glob("policy_seed*.zip"))
    return {
        "spec": AGENT,
        "resolved": "stable-baselines3 PPO MlpPolicy on " + SYMBOLIC_ENV,
        "weights_sha256": {p.name: sha256_file(p) for p in files},
        "tokenizer_sha256": None,
    }


def episode_row(line: Mapping[str, Any]) -> dict[str, Any]:
    """The record row of an sb3 episode line (no tokens or KV: ``None``)."""
    return {
        "task": str(line["info"]["eval_task"]),
        "seed": int(line["info"]["leaderboard_seed"]),
        "env_seed": int(line["seed"]),
        "progression": 100.0 * float(line["info"]["progression"]),
        "success": bool(line["success"]),
        "reward": float(line["total_reward"]),
        "turns": len(line["actions"]),
        "tokens": None,
        "generated_tokens": None,
        "peak_kv": None,
        "mean_kv": None,
        "kv_retained": None,
        "compaction_events": 0,
        "aborted": False,
        "wall_time_s": float(line["metrics"]["wall_time_s"]),
    }

"""Registered ids: Gymnasium's env checker, vector envs, spaces, and the symbolic twin."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import compaction_gym  # noqa: F401  (registers the ids)
from compaction_gym.envs.babyai.text import describe
from compaction_gym.envs.registration import ENV_IDS
from compaction_gym.envs.spaces import TEXT_CHARSET

FAST_KWARGS = {  # RGMix without zebra 7×5 (seconds per item on a CPU); its config is tested in test_envs_math
    "AttnMatch-RGMix-v0": {"weights": {"arc_1d": 1, "sokoban": 1, "countdown": 1, "cryptarithm": 1}},
}
TEXT_IDS = [i for i in ENV_IDS if "Symbolic" not in i]


def test_every_id_is_registered():
    assert ENV_IDS == (
        "AttnMatch-BabyAI-v0",
        "AttnMatch-BabyAI-GoTo-v0",
        "AttnMatch-BabyAI-Pickup-v0",
        "AttnMatch-BabyAI-Open-v0",
        "AttnMatch-BabyAI-PutNext-v0",
        "AttnMatch-BabyAI-PickUpSeqGoTo-v0",
        "AttnMatch-BabyAI-Symbolic-v0",
        "AttnMatch-Math-v0",
        "AttnMatch-RGMix-v0",
        "AttnMatch-Recall-v0",
    )
    assert all(env_id in gym.registry for env_id in ENV_IDS)


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_check_env(env_id):
    env = gym.make(env_id, **FAST_KWARGS.get(env_id, {}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the checker's warnings count as failures
        warnings.filterwarnings("ignore", message=".*font.*")  # pygame, from minigrid's renderer
        check_env(env.unwrapped, skip_render_check=True)


@pytest.mark.parametrize("env_id", TEXT_IDS)
def test_text_spaces(env_id):
    env = gym.make(env_id, **FAST_KWARGS.get(env_id, {}))
    for space in (env.observation_space, env.action_space):
        assert isinstance(space, gym.spaces.Text) and space.min_length == 0
        assert set(space.character_set) == set(TEXT_CHARSET)
    obs, _ = env.reset(seed=0)
    assert obs in env.observation_space
    assert "\n" in TEXT_CHARSET and ":" in TEXT_CHARSET and "<" in TEXT_CHARSET


@pytest.mark.parametrize("env_id", TEXT_IDS)
def test_sync_vector_env_steps(env_id):
    envs = gym.make_vec(env_id, num_envs=2, vectorization_mode="sync", **FAST_KWARGS.get(env_id, {}))
    obs, infos = envs.reset(seed=[0, 1])
    assert len(obs) == 2 and all(isinstance(o, str) for o in obs)
    for _ in range(3):
        obs, rewards, terminated, truncated, infos = envs.step(("go forward", "<answer>1</answer>"))
        assert len(obs) == 2 and rewards.shape == (2,)
    envs.close()


def test_symbolic_twin_has_the_same_episodes():
    text = gym.make("AttnMatch-BabyAI-v0")
    symbolic = gym.make("AttnMatch-BabyAI-Symbolic-v0")
    assert symbolic.action_space == gym.spaces.Discrete(6)
    assert set(symbolic.observation_space.spaces) == {"image", "direction", "mission"}
    for seed in range(20):
        text_obs, info = text.reset(seed=seed)
        sym_obs, _ = symbolic.reset(seed=seed)
        assert sym_obs["mission"] == info["mission"]
        assert describe(symbolic) == text_obs
        for name, index in (("turn left", 0), ("go forward", 2)):
            text_obs, *_ = text.step(name)
            sym_obs, *_ = symbolic.step(index)
            assert describe(symbolic) == text_obs
            assert isinstance(sym_obs["image"], np.ndarray) and sym_obs["image"].shape == (7, 7, 3)
    assert gym.make("AttnMatch-BabyAI-Symbolic-v0", task="open", num_actions=7).action_space.n == 7


@pytest.mark.parametrize("env_id", ["AttnMatch-BabyAI-GoTo-v0", "AttnMatch-BabyAI-Open-v0", "AttnMatch-Math-v0"])
@pytest.mark.parametrize("copy", [True, False])
def test_async_vector_env_reads_the_same_text_as_sync(env_id, copy):
    """Gymnasium 1.4's shared memory decodes Text once; ours must read every observation back."""
    actions = ["turn left", "go forward", "toggle"] if "BabyAI" in env_id else ["<answer>1</answer>"] * 3
    seen = {}
    for mode in ("sync", "async"):
        kwargs = {"vector_kwargs": {"copy": copy}} if mode == "async" else {}
        envs = gym.make_vec(env_id, num_envs=3, vectorization_mode=mode, **kwargs)
        try:
            obs, _ = envs.reset(seed=7)
            trace = [tuple(obs)]
            for _ in range(3):
                obs, *_ = envs.step(actions)
                trace.append(tuple(obs))
        finally:
            envs.close()
        seen[mode] = trace
    assert seen["async"] == seen["sync"]
    assert all(seen["async"][0]) and not any(set(o) == {"\t"} for step in seen["async"] for o in step)


@pytest.mark.parametrize("env_id", ["AttnMatch-BabyAI-GoTo-v0", "AttnMatch-BabyAI-Symbolic-v0", "AttnMatch-Math-v0"])
def test_no_step_after_the_episode_ends(env_id):
    """Every env raises ResetNeeded for a step before reset and after the episode ended."""
    from gymnasium.error import ResetNeeded

    env = gym.make(env_id, max_steps=2) if "BabyAI" in env_id else gym.make(env_id)
    raw = env.unwrapped
    with pytest.raises(ResetNeeded):
        raw.step(0 if "Symbolic" in env_id else "turn left")
    env.reset(seed=1)
    action = 0 if "Symbolic" in env_id else ("turn left" if "BabyAI" in env_id else "<answer>1</answer>")
    done = False
    while not done:
        _, _, terminated, truncated, _ = raw.step(action)
        done = terminated or truncated
    with pytest.raises(ResetNeeded):
        raw.step(action)
    env.reset(seed=2)
    raw.step(action)  # a new episode steps again


def test_symbolic_env_refuses_actions_outside_its_space():
    from compaction_gym.errors import InvalidArgumentError

    env = gym.make("AttnMatch-BabyAI-Symbolic-v0").unwrapped
    env.reset(seed=0)
    for bad in (6, -1, "left", 2.5, True):
        with pytest.raises(InvalidArgumentError, match="action"):
            env.step(bad)
    env.step(np.int64(2))  # numpy ints from action_space.sample() are fine
    seven = gym.make("AttnMatch-BabyAI-Symbolic-v0", num_actions=7).unwrapped
    seven.reset(seed=0)
    seven.step(6)  # 'done' exists with num_actions=7

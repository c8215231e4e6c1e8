"""LLMAgentWrapper: agent-in-the-loop stepping, teacher forcing, Gymnasium wrapper composition."""

from __future__ import annotations

import gymnasium as gym
import pytest
from gymnasium.wrappers import RecordEpisodeStatistics

import compaction_gym  # noqa: F401
from compaction_gym.agents import CompactionAgent, Trajectory
from compaction_gym.backends import LocalBackend
from compaction_gym.backends.scripted import ScriptedBackend
from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.envs.babyai.expert import expert_action
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.wrappers import LLMAgentWrapper


def make(tokenizer, script=("turn left",), max_steps=3, **kwargs):
    backend = ScriptedBackend(tokenizer, list(script))
    env = gym.make("AttnMatch-BabyAI-GoTo-v0", max_episode_steps=max_steps)
    return backend, LLMAgentWrapper(env, CompactionAgent(backend, **kwargs))


def test_step_lets_the_agent_act_and_step_text_forces(tiny_tokenizer):
    backend, env = make(tiny_tokenizer, ["turn left"])
    obs, info = env.reset(seed=0)
    assert isinstance(obs, str) and "instruction" in info
    obs, reward, terminated, truncated, info = env.step()
    assert info["action_text"] == "turn left" and info["action"] == "turn left"
    turn = info["agent_turn"]
    assert turn["forced"] is False and turn["action_text"] == "turn left"
    obs, reward, terminated, truncated, info = env.step("turn right")
    assert info["agent_turn"]["forced"] is True and info["action"] == "turn right"
    assert "trajectory" not in info
    obs, reward, terminated, truncated, info = env.step(None)
    assert truncated and isinstance(info["trajectory"], Trajectory)
    traj = info["trajectory"]
    assert [t.forced for t in traj.turns] == [False, True, False] and traj.info["truncated"]
    assert traj is env.trajectory
    with pytest.raises(gym.error.ResetNeeded):
        env.step()
    env.close()
    assert backend.sessions == {}


def test_works_under_record_episode_statistics(tiny_tokenizer):
    _, inner = make(tiny_tokenizer, ["go forward"], max_steps=4)
    env = RecordEpisodeStatistics(inner)
    env.reset(seed=1)
    done = False
    while not done:
        _, _, terminated, truncated, info = env.step(None)
        done = terminated or truncated
    assert info["episode"]["l"] == len(info["trajectory"].turns)
    assert info["episode"]["r"] == pytest.approx(info["trajectory"].total_reward)


def test_unseeded_resets_continue_a_deterministic_seed_stream(tiny_tokenizer):
    seeds = []
    for _ in range(2):
        _, env = make(tiny_tokenizer)
        env.reset(seed=7)
        first = env.trajectory.sampling["seed"]
        env.reset()
        seeds.append((first, env.trajectory.sampling["seed"], env.trajectory.seed))
    assert seeds[0] == seeds[1] and seeds[0][0] != seeds[0][1]


def test_step_batch_makes_one_backend_call(tiny_tokenizer):
    backend = ScriptedBackend(tiny_tokenizer, ["turn left"])
    envs = [
        LLMAgentWrapper(gym.make("AttnMatch-BabyAI-GoTo-v0", max_episode_steps=3), CompactionAgent(backend))
        for _ in range(3)
    ]
    for i, env in enumerate(envs):
        env.reset(seed=i)
    backend.batch_sizes.clear()
    results = LLMAgentWrapper.step_batch(envs, [None, "drop", None])
    assert backend.batch_sizes == [3]
    assert [r[4]["action"] for r in results] == ["turn left", "drop", "turn left"]


def test_rejects_non_agents(tiny_tokenizer):
    with pytest.raises(InvalidArgumentError, match="CompactionAgent"):
        LLMAgentWrapper(gym.make("AttnMatch-BabyAI-GoTo-v0"), object())


@pytest.mark.parametrize(("task", "seed"), [("goto", 0), ("pickup", 1), ("open", 2)])
def test_teacher_forced_expert_episodes_succeed_with_compaction(tiny_model_path, task, seed):
    backend = LocalBackend.from_pretrained(tiny_model_path, max_slots=1, capacity=1024)
    config = CompactionConfig(mode="attention_matching", max_kv_len=512, compact_window=128)
    agent = CompactionAgent(
        backend, compaction=config, sampling=SamplingParams(temperature=0.0, max_new_tokens=4)
    )
    env = RecordEpisodeStatistics(LLMAgentWrapper(gym.make("AttnMatch-BabyAI-v0", task=task), agent))
    env.reset(seed=seed)
    done = False
    while not done:
        _, reward, terminated, truncated, info = env.step(expert_action(env))
        done = terminated or truncated
    traj = info["trajectory"]
    assert terminated and reward > 0 and traj.success and info["episode"]["r"] > 0
    assert all(t.forced for t in traj.turns) and traj.num_generated == 0 and not any(traj.completion_mask)
    # demonstrations carry real compaction events: the session stayed within the small budget
    assert traj.events and all(e.trigger == "kv_budget" for e in traj.events)
    assert traj.peak_kv_len < min(traj.num_tokens, 640)
    if task == "open":  # 14 turns: more logical tokens than the 1024-row slot could ever hold
        assert traj.num_tokens > 1024
    view = backend.engine.session(agent.session_id)
    assert traj.token_ids == list(view.token_ids) and traj.events == list(view.events)
    assert [t.action for t in traj.turns] == [t.action_text for t in traj.turns]
    env.close()
    assert backend.engine.num_free_slots == 1

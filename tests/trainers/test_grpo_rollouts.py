"""EnvRollouts: groups of episodes on an engine that shares the policy's weights, and the TRL batch."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import compaction_gym  # noqa: F401  (registers the env ids)
from compaction_gym.engine import CompactionConfig, SamplingParams
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.replay import replay_logprobs_batch
from compaction_gym.trainers.rollouts import EnvRollouts, group_specs, resolve_envs, rollout_batch


def test_groups_share_the_episode_and_the_policy(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model.train()
    attn = model.config._attn_implementation
    rollouts = EnvRollouts(
        model,
        AutoTokenizer.from_pretrained(tiny_model_path),
        "AttnMatch-BabyAI-GoTo-v0",
        compaction=CompactionConfig(mode="markovian", n_protect_turns=1),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=4),
        env_kwargs={"max_episode_steps": 2},
        max_slots=3,  # 4 episodes: played in two chunks
    )
    assert model.config._attn_implementation == attn and model.training  # the engine took nothing
    specs = group_specs([("AttnMatch-BabyAI-GoTo-v0", 0), ("AttnMatch-BabyAI-GoTo-v0", 1)], 2, base_seed=3)
    assert len({s.sampling_seed for s in specs}) == 4
    trajs = rollouts.run(specs)
    assert model.config._attn_implementation == attn and model.training
    assert [t.seed for t in trajs] == [0, 0, 1, 1]
    assert trajs[0].instruction == trajs[1].instruction and trajs[0].token_ids != trajs[1].token_ids
    assert all(len(t.turns) == 2 and t.events for t in trajs)

    batch = rollout_batch(trajs)
    for i, t in enumerate(trajs):
        assert batch["prompt_ids"][i] + batch["completion_ids"][i] == t.token_ids
        assert len(batch["prompt_ids"][i]) == t.prompt_len
        assert batch["env_mask"][i] == t.completion_mask[t.prompt_len :]
        assert batch["logprobs"][i] == t.logprobs[t.prompt_len :] and batch["trajectory"][i] is t
    # a weight update is seen by the next rollout at once (shared parameters), and replay still matches
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
    again = rollouts.run(specs[:1])
    lp = replay_logprobs_batch(model, again).logprobs[0]
    mask = torch.tensor(again[0].completion_mask, dtype=torch.bool)
    assert (lp[mask] - torch.tensor(again[0].logprobs)[mask]).abs().max() < 1e-4
    rollouts.close()


def test_resolve_envs():
    assert list(resolve_envs("AttnMatch-BabyAI-GoTo-v0, AttnMatch-BabyAI-Open-v0")) == [
        "AttnMatch-BabyAI-GoTo-v0",
        "AttnMatch-BabyAI-Open-v0",
    ]
    assert list(resolve_envs({"a": "AttnMatch-BabyAI-GoTo-v0", "b": lambda: None})) == ["a", "b"]
    with pytest.raises(InvalidArgumentError, match="unknown env id"):
        resolve_envs("NoSuchEnv-v0")


def test_kv_budget_overshoot_and_per_event_metrics(tiny_model_path):
    """The KV budget inside rollouts: with a protected prompt P and P + compact_window > max_kv_len the
    engine cannot honour max_kv_len (events wait for ``window`` rows after the prompt); with room it
    holds except for a step input fed whole. Per-event metrics are the events' own numbers."""
    from compaction_gym.trainers.rollouts import budget_overshoot_reason, rollout_metrics

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    env = "AttnMatch-BabyAI-GoTo-v0"
    specs = group_specs([(env, 0)], 2)

    def play(config: CompactionConfig):
        rollouts = EnvRollouts(
            model,
            tok,
            env,
            compaction=config,
            sampling=SamplingParams(max_new_tokens=16),
            env_kwargs={"max_episode_steps": 6},
            max_slots=2,
        )
        return rollouts.run(specs)

    tight = CompactionConfig(mode="attention_matching", max_kv_len=320)  # window 160
    trajs = play(tight)
    prompt = trajs[0].prompt_len
    assert prompt + 160 > 320 and max(t.peak_kv_len for t in trajs) > 320
    reason = budget_overshoot_reason(trajs, tight)
    assert reason is not None and "compact_window (160) exceeds max_kv_len" in reason
    events = [e for t in trajs for e in t.events]
    assert events and all(e.span[0] == prompt and e.span[1] - e.span[0] == 160 for e in events)
    # no event fires with fewer than `window` rows after the prompt: the cache stays above P + window·ratio
    assert all(e.kv_len_after >= prompt + 40 for e in events)

    metrics = rollout_metrics(trajs, 320)
    m = len(events)
    assert metrics["compaction/kv_len_before"] == pytest.approx(sum(e.kv_len_before for e in events) / m)
    assert metrics["compaction/kv_len_after"] == pytest.approx(sum(e.kv_len_after for e in events) / m)
    assert metrics["compaction/kept_fraction"] == pytest.approx(
        sum(e.kv_len_after / e.kv_len_before for e in events) / m
    )
    assert metrics["compaction/span_kept_fraction"] == pytest.approx(40 / 160)
    assert metrics["compaction/event_time_max_s"] == max(e.timings["total"] for e in events) > 0
    assert metrics["rollout/kv_over_budget_max"] == max(t.peak_kv_len for t in trajs) - 320

    # with room for the prompt plus a window, the budget holds up to one step input fed whole
    roomy = CompactionConfig(mode="attention_matching", max_kv_len=prompt + 200, compact_window=100)
    trajs = play(roomy)
    assert any(t.events for t in trajs)
    for t in trajs:
        largest_input = max(turn.input_range[1] - turn.input_range[0] for turn in t.turns)
        assert t.peak_kv_len <= roomy.max_kv_len + largest_input
    assert budget_overshoot_reason(trajs, roomy) is None or "fed whole" in budget_overshoot_reason(
        trajs, roomy
    )


def test_continuous_rollouts_equal_lockstep(tiny_model_path):
    """``EnvRollouts(continuous=...)``: each episode advancing on its own plays the trajectories of
    lock-step (tokens, masks, events, rewards; log-probs to float32 batch rounding)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    kwargs = dict(
        compaction=CompactionConfig(mode="attention_matching", max_kv_len=400, compact_window=64),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=list(range(200, 230))),
        env_kwargs={"max_episode_steps": 3},
        max_slots=4,
    )
    specs = group_specs([("AttnMatch-BabyAI-GoTo-v0", 0), ("AttnMatch-BabyAI-GoTo-v0", 1)], 2, base_seed=5)
    cont = EnvRollouts(model, tok, "AttnMatch-BabyAI-GoTo-v0", **kwargs)
    lock = EnvRollouts(model, tok, "AttnMatch-BabyAI-GoTo-v0", continuous=False, **kwargs)
    assert cont.continuous and not lock.continuous
    for x, y in zip(cont.run(specs), lock.run(specs)):
        assert (x.token_ids, x.completion_mask, x.rewards) == (y.token_ids, y.completion_mask, y.rewards)
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
        assert x.events and len(x.events) == len(y.events)
        assert [e.indices.tolist() for e in x.events] == [e.indices.tolist() for e in y.events]
    with pytest.raises(InvalidArgumentError, match="continuous must be a bool"):
        EnvRollouts(model, tok, "AttnMatch-BabyAI-GoTo-v0", continuous=None)

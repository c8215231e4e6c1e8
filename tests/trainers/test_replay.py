"""Compaction replay reproduces the engine's rollout log-probs (fp32 CPU, tiny model, temperature 1).

The reference is the engine's own record of each sampled token's log-probability; replay runs a
*separate* copy of the model (the trainer's) with its own attention function and rebuilds every
compaction event from the trajectory alone.
"""

from __future__ import annotations

import dataclasses

import gymnasium as gym
import pytest
import torch
from replay_helpers import MODES, SAMPLING, TOL, TRIGGERS, max_sampled_diff, plain_session

import compaction_gym  # noqa: F401  (registers the env ids)
from compaction_gym.agents import CompactionAgent, Trajectory, run_episode
from compaction_gym.backends import LocalBackend
from compaction_gym.compaction import CompactionEvent
from compaction_gym.engine import CompactionConfig
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.replay import replay_logprobs, replay_logprobs_batch


def config(mode: str, trigger: str, **extra) -> CompactionConfig:
    return CompactionConfig(**MODES[mode], **TRIGGERS[trigger], n_probe_queries=16, **extra)


@pytest.mark.parametrize("trigger", list(TRIGGERS))
@pytest.mark.parametrize("mode", list(MODES))
def test_replay_equals_rollout(engine, model, mode, trigger):
    view = plain_session(engine, config(mode, trigger), seed=len(mode))
    assert len(view.events) >= 2 and {e.mode for e in view.events} == {MODES[mode]["mode"]}
    assert {e.trigger for e in view.events} == {trigger}
    assert view.kv_len < len(view.token_ids) - 1  # the cache really was compacted
    assert max_sampled_diff(replay_logprobs(model, view), view) < TOL
    attn = model.config._attn_implementation
    assert max_sampled_diff(replay_logprobs(model, view, grad=True), view) < TOL  # differentiable path
    assert model.config._attn_implementation == attn  # the model's own attention is restored


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.7])
def test_replay_takes_each_trajectorys_own_temperature(engine, model, temperature):
    """Without ``temperature=``, every trajectory replays at the temperature it was sampled at (greedy:
    the plain log-softmax the engine records); a batch may mix temperatures."""
    views = [
        plain_session(engine, config("attention_matching", "kv_budget"), seed=40 + i, sampling=SAMPLING.replace(temperature=t))
        for i, t in enumerate((temperature, 1.3))
    ]
    for view, lp in zip(views, replay_logprobs_batch(model, views).logprobs, strict=True):
        assert max_sampled_diff(lp, view) < TOL
    if temperature not in (0.0, 1.0):
        assert max_sampled_diff(replay_logprobs(model, views[0], temperature=1.0), views[0]) > 1e-2


def test_replay_without_compaction(engine, model):
    view = plain_session(engine, CompactionConfig(), seed=3)
    assert not view.events
    assert max_sampled_diff(replay_logprobs(model, view), view) < TOL
    plain = torch.log_softmax(model(torch.tensor([view.token_ids])).logits[0, :-1].float(), -1)
    reference = torch.cat([torch.zeros(1), plain.gather(1, torch.tensor(view.token_ids[1:])[:, None])[:, 0]])
    mask = torch.tensor(view.completion_mask, dtype=torch.bool)
    assert torch.allclose(replay_logprobs(model, view)[mask], reference.detach()[mask], atol=TOL)


@pytest.mark.parametrize(
    ("probes", "trigger", "extra"),
    [
        # keys probes are the latest response's raw rows (a handful mid-decode); replay takes β from the
        # record, and the property test covers larger t — these ratios also keep a refit well posed
        # (test_replay_of_version_1_records)
        ("keys", "turn", {"n_protect_turns": 0, "compact_target_ratio": 0.125}),
        ("keys", "kv_budget", {"compact_target_ratio": 0.125}),
        ("random", "kv_budget", {}),
        ("random", "turn", {}),
        ("suffix", "turn", {"recompact_from_prompt": True}),
        ("suffix", "kv_budget", {"protect_prompt": False, "compact_target_ratio": 0.5}),
    ],
)
def test_replay_probe_sources_and_options(engine, model, probes, trigger, extra):
    cfg = dataclasses.replace(config("attention_matching+beta", trigger), queries=probes, **extra)
    view = plain_session(engine, cfg, seed=7)
    assert len(view.events) >= 2 and {e.probe_source for e in view.events} == {probes}
    assert max_sampled_diff(replay_logprobs(model, view), view) < TOL


@pytest.mark.parametrize(
    ("mode", "trigger", "extra"),
    [
        # a 36-token message must fit in what one event frees: a larger window than TRIGGERS'
        ("attention_matching", "kv_budget", {"max_kv_len": 96, "compact_window": 64}),
        ("attention_matching+beta", "turn", {}),
    ],
)
def test_replay_with_budget_messages(engine, model, mode, trigger, extra):
    cfg = dataclasses.replace(
        config(mode, trigger), inject_budget_message=True, max_total_tokens=400, **extra
    )
    view = plain_session(engine, cfg, seed=11)
    sampled = torch.tensor(view.completion_mask, dtype=torch.bool)
    injected = [p for p in range(view.prompt_len, len(view.token_ids)) if not sampled[p]]
    assert len(view.events) >= 2 and len(injected) >= 3 * 10 + 2 * 36  # inputs plus budget messages
    assert max_sampled_diff(replay_logprobs(model, view), view) < TOL


def test_replay_manual_events(engine, model):
    cfg = CompactionConfig(mode="attention_matching", compute_beta=True, n_probe_queries=16)
    r = engine.create_session(list(range(3, 40)), cfg, SAMPLING.replace(seed=5))
    engine.compact(r.session_id, span=(4, 30), ratio=0.3)
    engine.step(r.session_id, list(range(50, 60)), SAMPLING.replace(seed=None))
    engine.compact(r.session_id)  # everything after the prompt, recursively
    engine.step(r.session_id, list(range(60, 66)), SAMPLING.replace(seed=None))
    view = engine.session(r.session_id)
    engine.close(r.session_id)
    assert [e.trigger for e in view.events] == ["manual", "manual"]
    assert max_sampled_diff(replay_logprobs(model, view), view) < TOL


def test_batched_replay_equals_single(engine, model):
    views = [
        plain_session(engine, config("attention_matching+beta", "kv_budget"), seed=21, turns=2),
        plain_session(engine, config("markovian", "turn"), seed=22, turns=3),
        plain_session(engine, CompactionConfig(), seed=23, turns=1),
        plain_session(engine, config("streaming", "kv_budget"), seed=24, turns=3),
    ]
    out = replay_logprobs_batch(model, views, compute_entropy=True, max_tokens_per_forward=16)
    for view, lp, ent, n in zip(views, out.logprobs, out.entropies, out.num_events):
        assert max_sampled_diff(lp, view) < TOL
        assert torch.allclose(lp, replay_logprobs(model, view), atol=TOL)
        last = max(p for p, m in enumerate(view.completion_mask) if m)
        assert n == sum(e.logical_len < last for e in view.events)  # later events change no score
        mask = torch.tensor(view.completion_mask, dtype=torch.bool)
        assert (ent[mask] > 0).all() and (ent[~mask] == 0).all()


def test_replay_detects_what_it_must_reproduce(engine, model):
    """Negative controls: without the events, or with other probes, replay no longer matches."""
    view = plain_session(engine, config("attention_matching+beta", "kv_budget"), seed=31)
    no_events = dataclasses.replace(view, events=())
    assert max_sampled_diff(replay_logprobs(model, no_events), view) > 1e-2
    # the original research code's bug: C2 refitted from other probes than the rollout's
    other = tuple(dataclasses.replace(e, probe_source="random", probe_seed=1) for e in view.events)
    assert max_sampled_diff(replay_logprobs(model, dataclasses.replace(view, events=other)), view) > 10 * TOL


def test_replay_refuses_inconsistent_events(engine, model):
    view = plain_session(engine, config("attention_matching", "kv_budget"), seed=41)
    first, *rest = view.events

    def with_first(**changes):
        return dataclasses.replace(view, events=(dataclasses.replace(first, **changes), *rest))

    with pytest.raises(InvalidArgumentError, match="the rollout held"):
        replay_logprobs(model, with_first(kv_len_before=first.kv_len_before + 1))
    with pytest.raises(InvalidArgumentError, match="stand for logical tokens"):
        replay_logprobs(model, with_first(logical_span=(first.logical_span[0] + 1, first.logical_span[1])))
    with pytest.raises(InvalidArgumentError, match="suffix probes need"):
        replay_logprobs(model, with_first(probe_logical_range=(0, first.logical_len + 5)))
    with pytest.raises(InvalidArgumentError, match="positions to score"):
        replay_logprobs(model, view, positions=[0])


def test_replay_of_babyai_agent_trajectory(engine, model):
    """An agent's episode on AttnMatch-BabyAI-v0 (chat template, observations, KV-budget β events),
    through the trajectory's JSON round trip."""
    backend = LocalBackend(engine)
    cfg = CompactionConfig(
        mode="attention_matching",
        compute_beta=True,
        max_kv_len=448,
        compact_window=96,
        compact_target_ratio=0.125,
        n_probe_queries=32,
    )
    agent = CompactionAgent(backend, compaction=cfg, sampling=SAMPLING.replace(max_new_tokens=6, seed=0))
    env = gym.make("AttnMatch-BabyAI-v0", max_episode_steps=3)
    traj = run_episode(env, agent, seed=0)
    env.close()
    traj = Trajectory.from_dict(traj.to_dict())
    assert len(traj.events) >= 2 and traj.num_generated == 18
    assert max_sampled_diff(replay_logprobs(model, traj), traj) < TOL


@pytest.mark.parametrize(("probes", "extra"), [("suffix", {}), ("keys", {"compact_target_ratio": 0.125})])
def test_replay_of_version_1_records(engine, model, probes, extra):
    """Records written before format 2 (no recorded β, no probe_rows) still replay: β is refitted and
    the key probes are located from their logical range (well-posed fits, as before format 2)."""
    cfg = dataclasses.replace(config("attention_matching+beta", "kv_budget"), queries=probes, **extra)
    view = plain_session(engine, cfg, seed=7)
    assert all(e.beta is not None for e in view.events)
    assert all((e.probe_rows is not None) == (probes == "keys") for e in view.events)
    old = tuple(
        CompactionEvent.from_dict({k: v for k, v in e.to_dict().items() if k not in ("version", "probe_rows", "beta")})
        for e in view.events
    )
    assert all(e.beta is None and e.probe_rows is None for e in old)
    assert max_sampled_diff(replay_logprobs(model, dataclasses.replace(view, events=old)), view) < TOL


def test_recorded_beta_is_what_replay_writes(engine, model):
    """Replay writes the recorded β on the kept rows: a perturbed record changes the scores."""
    view = plain_session(engine, config("attention_matching+beta", "kv_budget"), seed=31)
    assert max_sampled_diff(replay_logprobs(model, view), view) < TOL
    first, *rest = view.events
    shifted = dataclasses.replace(first, beta=first.beta + 1.0)
    moved = dataclasses.replace(view, events=(shifted, *rest))
    assert max_sampled_diff(replay_logprobs(model, moved), view) > 10 * TOL


@pytest.mark.parametrize(
    "cfg",
    [
        CompactionConfig(inject_budget_every=9, max_total_tokens=400),  # inject_only: no compaction
        CompactionConfig(mode="markovian", n_protect_turns=1, inject_budget_every=7, max_total_tokens=400),
        CompactionConfig(
            mode="attention_matching", max_kv_len=128, compact_window=64, n_probe_queries=16,
            inject_budget_every=11, max_total_tokens=400,
        ),  # fmt: skip
    ],
    ids=["inject_only", "turn", "kv_budget"],
)
def test_replay_with_periodic_budget_messages(engine, model, cfg):
    """Periodic budget messages are injected ranges like any other: replay equals rollout, single and batched."""
    view = plain_session(engine, cfg, seed=13)
    sampled = [p for p in range(len(view.token_ids)) if view.completion_mask[p]]
    assert len(sampled) == view.generated_tokens == 80
    masked = sum(1 for p in range(view.prompt_len, len(view.token_ids)) if not view.completion_mask[p])
    assert masked > 3 * 10 + (80 // cfg.inject_budget_every - 1) * 20  # inputs plus the messages
    assert all(view.logprobs[p] == 0.0 for p in range(len(view.token_ids)) if not view.completion_mask[p])
    assert max_sampled_diff(replay_logprobs(model, view), view) < TOL
    batched = replay_logprobs_batch(model, [view, view], max_tokens_per_forward=32)
    assert max_sampled_diff(batched.logprobs[1], view) < TOL

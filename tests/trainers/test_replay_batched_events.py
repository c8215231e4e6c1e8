"""Batched event application (``batch_events=True``) equals the event-by-event reference path.

Several sessions of different seeds, triggers and lengths (so their events fall in the same and in
different replay rounds, several per session), temperature 1-2, β on and off, gradients through
the compacted blocks on and off: log-probs and parameter gradients of both paths agree to float32
rounding, and both match the rollout.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import example, given, settings
from replay_helpers import MODES, SAMPLING, TOL, TRIGGERS, max_sampled_diff, plain_session
from transformers import AutoModelForCausalLM

import compaction_gym.trainers.replay as replay_mod
from compaction_gym.engine import CompactionConfig
from compaction_gym.trainers.replay import replay_logprobs_batch

#: batched vs event-by-event: float32 rounding of the same operations on stacked spans
SAME = 1e-5


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).train()


def sessions(
    engine, mode: str, probes: str, seed: int, temperature: float, extra: dict | None = None
) -> list:
    """Three sessions: two kv-budget ones of different lengths (events due in the same rounds and, as
    they diverge, in different ones) and a turn-triggered one."""
    sampling = SAMPLING.replace(temperature=temperature)
    out = []
    for k, (trigger, turns) in enumerate((("kv_budget", 4), ("kv_budget", 3), ("turn", 3))):
        cfg = CompactionConfig(
            **MODES[mode], **TRIGGERS[trigger], queries=probes, n_probe_queries=16, **(extra or {})
        )
        out.append(plain_session(engine, cfg, seed=seed + k, turns=turns, sampling=sampling))
    assert all(len(v.events) >= 2 for v in out), "the property needs several events per session"
    return out


def both_paths(model, views, grad: bool, through: bool, temperature: float, cap: int = 2048):
    results = []
    for batched in (False, True):
        model.zero_grad(set_to_none=True)
        out = replay_logprobs_batch(
            model, views, grad=grad, grad_through_compaction=through, temperature=temperature,
            max_tokens_per_forward=cap, batch_events=batched, method="segments",
        )  # fmt: skip
        grads = None
        if grad:
            torch.stack([lp.sum() for lp in out.logprobs]).sum().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append(([lp.detach() for lp in out.logprobs], grads, out.num_events))
    model.zero_grad(set_to_none=True)
    return results


def assert_same(results, views) -> None:
    (lp_a, g_a, n_a), (lp_b, g_b, n_b) = results
    assert n_a == n_b
    for a, b, v in zip(lp_a, lp_b, views):
        assert (a - b).abs().max().item() < SAME
        assert max_sampled_diff(b, v) < TOL
    if g_a is not None:
        assert g_a.keys() == g_b.keys() and g_a
        for name, ga in g_a.items():
            scale = ga.abs().max().clamp(min=1e-30)
            assert ((ga - g_b[name]).abs().max() / scale).item() < SAME, name


@settings(max_examples=4, deadline=None)
@example(seed=0, mode="attention_matching+beta", probes="suffix", temperature=1.0, grad=True, through=True)
@example(seed=1, mode="attention_matching", probes="suffix", temperature=2.0, grad=True, through=False)
@example(seed=2, mode="attention_matching+beta", probes="keys", temperature=1.5, grad=False, through=True)
@example(seed=3, mode="h2o", probes="random", temperature=1.0, grad=True, through=True)
@given(
    seed=st.integers(0, 10_000),
    mode=st.sampled_from(["attention_matching+beta", "attention_matching", "snapkv", "markovian"]),
    probes=st.sampled_from(["suffix", "keys", "random"]),
    temperature=st.sampled_from([1.0, 1.5, 2.0]),
    grad=st.booleans(),
    through=st.booleans(),
)
def test_batched_events_equal_event_by_event(engine, model, seed, mode, probes, temperature, grad, through):
    views = sessions(engine, mode, probes, seed, temperature)
    assert_same(both_paths(model, views, grad, through, temperature, cap=5 + seed % 11), views)


@pytest.mark.parametrize("extra", [{"refit_values": False}, {"queries": "repeat"}])
def test_batched_events_other_options(engine, model, extra):
    probes = extra.pop("queries", "suffix")
    views = sessions(engine, "attention_matching+beta", probes, 7, 1.0, extra)
    assert_same(both_paths(model, views, True, True, 1.0), views)


def test_events_of_one_round_share_one_call(engine, model, monkeypatch):
    """Three alike sessions whose events are due in the same rounds: fewer calls than events."""
    cfg = CompactionConfig(**MODES["attention_matching+beta"], **TRIGGERS["kv_budget"], n_probe_queries=16)
    views = [plain_session(engine, cfg, seed=50 + k, turns=3) for k in range(3)]
    calls = []
    real = replay_mod.apply_event

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(replay_mod, "apply_event", counting)
    out = replay_logprobs_batch(model, views, batch_events=True, method="segments")
    events = sum(out.num_events)
    assert events >= 6
    assert len(calls) < events
    lh = views[0].events[0].forced_indices().shape[0]  # layers x KV heads
    assert sum(calls) == events * lh  # every event's rows went through exactly one call

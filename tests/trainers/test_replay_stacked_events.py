"""The replay contract holds for sessions whose compaction events the engine scored in stacked calls
(several sessions' events due at one scheduler step, docs/engine.md "Batched events"): each
trajectory replays alone, from its own events, to the rollout's log-probs within ``TOL``."""

from __future__ import annotations

import pytest
import torch
from replay_helpers import SAMPLING, TOL, max_sampled_diff, token_ids
from transformers import AutoModelForCausalLM

from compaction_gym.compaction import compact
from compaction_gym.engine import CompactionConfig, CreateRequest, Engine, StepRequest
from compaction_gym.trainers.replay import replay_logprobs, replay_logprobs_batch


@pytest.fixture(scope="module")
def engine_and_model(tiny_model_path):
    engine = Engine.from_pretrained(
        tiny_model_path, dtype=torch.float32, device="cpu", max_slots=4, capacity=512
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    return engine, model


def stacked_rollout(engine, config, prompt_lens, temperature, seed, turns=3):
    """Sessions created and stepped together; their views and the rows of every scoring call."""
    calls: list[int] = []

    def recording(keys, *args, **kwargs):
        calls.append(keys.shape[0])
        return compact(keys, *args, **kwargs)

    engine.compactor.compact_fn, engine.compactor.batch_events = recording, True  # CPU default: alone
    sampling = SAMPLING.replace(temperature=temperature)
    try:
        created = engine.step_batch(
            [
                CreateRequest(token_ids(n, seed + i), config, sampling.replace(seed=seed + i))
                for i, n in enumerate(prompt_lens)
            ]
        )
        sids = [r.session_id for r in created]
        for t in range(turns):
            engine.step_batch(
                [StepRequest(s, token_ids(10, 1000 * seed + 10 * i + t)) for i, s in enumerate(sids)]
            )
        views = [engine.session(s) for s in sids]
    finally:
        engine.compactor.compact_fn, engine.compactor.batch_events = compact, False
        for s in engine.session_ids:
            engine.close(s)
    return views, calls


@pytest.mark.parametrize(
    ("compute_beta", "probes", "temperature", "kv_budget_from"),
    [(True, "suffix", 1.0, "prompt"), (True, "keys", 2.0, "raw"), (False, "random", 1.0, "prompt")],
)
def test_replay_matches_stacked_rollouts(engine_and_model, compute_beta, probes, temperature, kv_budget_from):
    engine, model = engine_and_model
    cfg = CompactionConfig(
        mode="attention_matching", compute_beta=compute_beta, queries=probes, kv_budget_from=kv_budget_from,
        max_kv_len=64, compact_window=32, compact_target_ratio=0.25, n_probe_queries=16,
    )  # fmt: skip
    views, calls = stacked_rollout(engine, cfg, [16, 12, 20, 9], temperature, seed=7)
    rows = engine.layout.n_layers * engine.layout.n_kv_heads
    assert max(calls) > rows, "no events were stacked: the test would not cover them"
    assert all(len(v.events) >= 3 for v in views)
    for view in views:
        assert max_sampled_diff(replay_logprobs(model, view, temperature=temperature), view) < TOL
    out = replay_logprobs_batch(model, views, temperature=temperature)
    for lp, view in zip(out.logprobs, views):
        assert max_sampled_diff(lp, view) < TOL

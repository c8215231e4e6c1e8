"""Replay reproduces rollouts with the ``repeat`` probe sources and with kept (not refitted) values.

float32 CPU, tiny model, β on, temperature 1.5, several events per session; the reference is the
engine's own record of each sampled token's log-probability (docs/compaction.md, "Probes").
"""

from __future__ import annotations

import pytest
import torch
from replay_helpers import SAMPLING, TOL, TRIGGERS, max_sampled_diff, plain_session

from compaction_gym.compaction import CompactionEvent
from compaction_gym.engine import CompactionConfig, Engine
from compaction_gym.engine.compactor import REPEAT_PROMPT
from compaction_gym.trainers.replay import replay_logprobs

HOT = SAMPLING.replace(temperature=1.5)


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return Engine.from_pretrained(tiny_model_path, dtype=torch.float32, device="cpu", max_slots=2, capacity=1024)


@pytest.mark.parametrize("trigger", list(TRIGGERS))
@pytest.mark.parametrize(
    ("queries", "refit_values"),
    [("repeat", True), ("suffix+repeat", True), ("repeat", False), ("suffix", False)],
)
def test_replay_equals_rollout_with_new_probe_sources(engine, model, trigger, queries, refit_values):
    cfg = CompactionConfig(
        mode="attention_matching", compute_beta=True, queries=queries, refit_values=refit_values,
        n_probe_queries=16, **TRIGGERS[trigger],
    )  # fmt: skip
    view = plain_session(engine, cfg, seed=3, sampling=HOT)
    assert len(view.events) >= 2 and view.kv_len < len(view.token_ids) - 1
    assert {e.probe_source for e in view.events} == {queries}
    assert {e.refit_values for e in view.events} == {refit_values}
    assert all(e.beta is not None for e in view.events)
    if "repeat" in queries:
        prompt = engine.tokenizer.encode(REPEAT_PROMPT, add_special_tokens=False)
        for e in view.events:  # the prompt, then the span's last tokens (at most n_probe_queries)
            a, b = e.logical_span
            span = view.token_ids[a:b]
            n = min(16, len(span))
            assert list(e.probe_tokens) == [*prompt, *span[len(span) - n :]]
            assert CompactionEvent.from_dict(e.to_dict()) == e  # recorded, and survives JSON
    else:
        assert all(e.probe_tokens is None for e in view.events)
    assert max_sampled_diff(replay_logprobs(model, view), view) < TOL
    assert max_sampled_diff(replay_logprobs(model, view, grad=True), view) < TOL


def test_kept_values_are_the_original_rows(engine, model):
    """``refit_values=False``: the block's values are the kept rows' values; replay needs no probes."""
    cfg = CompactionConfig(
        mode="attention_matching", refit_values=False, n_probe_queries=16, **TRIGGERS["kv_budget"]
    )
    r = engine.create_session(list(range(3, 19)), cfg, HOT.replace(seed=0, max_new_tokens=0))
    s = engine.scheduler.sessions[r.session_id]
    engine.step(r.session_id, list(range(40, 80)), HOT.replace(seed=0, max_new_tokens=0))
    k_before, v_before, _ = (t.clone() for t in engine.cache.rows(s.slot))
    engine.step(r.session_id, list(range(100, 130)), HOT.replace(seed=0, max_new_tokens=0))
    ev = engine.session(r.session_id).events[0]
    assert ev.kv_len_before == k_before.shape[1] and not ev.refit_values
    k_after, v_after, _ = engine.cache.rows(s.slot)
    idx = ev.forced_indices()
    start, t = ev.span[0], ev.target
    gathered = torch.gather(v_before, 1, idx[..., None].expand(-1, -1, v_before.shape[-1]))
    torch.testing.assert_close(v_after[:, start : start + t], gathered, rtol=0, atol=0)
    engine.close(r.session_id)

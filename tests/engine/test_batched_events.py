"""Compaction events due at one scheduler step are scored in stacked calls (docs/engine.md, "Batched
events"): the same sessions run with events stacked and with every event alone must give the same
events (indices, β, C2 in the cache), the same tokens and log-probs, and stacking must really happen."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from engine_helpers import make_prompt
from hypothesis import example, given, settings

from compaction_gym.engine import CompactionConfig, CreateRequest, Engine, SamplingParams, StepRequest

BUDGET = {"max_kv_len": 64, "compact_window": 32, "compact_target_ratio": 0.25, "n_probe_queries": 16}
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_model_path):
    """The tiny model's CPU engine in float32 (the engine's dtype in tests) and float64."""
    return {
        dtype: Engine.from_pretrained(tiny_model_path, dtype=dtype, device="cpu", max_slots=4, capacity=512)
        for dtype in (torch.float32, torch.float64)
    }


def rollout(engine, configs, prompts, inputs, sampling, *, stacked: bool):
    """Create the sessions in one ``step_batch``, then step them together once per input turn.

    Returns the sessions' views, their final cache rows (K, V, β) and the batch size (rows) of
    every scoring call.
    """
    calls: list[int] = []
    scorer, batch_events = engine.compactor.compact_fn, engine.compactor.batch_events

    def recording(keys, *args, **kwargs):
        calls.append(keys.shape[0])
        return scorer(keys, *args, **kwargs)

    engine.compactor.compact_fn, engine.compactor.batch_events = recording, stacked
    try:
        created = engine.step_batch(
            [CreateRequest(p, c, sampling.replace(seed=i)) for i, (p, c) in enumerate(zip(prompts, configs))]
        )
        sids = [r.session_id for r in created]
        for turn in range(len(inputs[0])):
            engine.step_batch([StepRequest(sid, inputs[i][turn]) for i, sid in enumerate(sids)])
        views = [engine.session(sid) for sid in sids]
        caches = [engine.read_cache(sid) for sid in sids]
    finally:
        engine.compactor.compact_fn, engine.compactor.batch_events = scorer, batch_events
        for sid in engine.session_ids:
            engine.close(sid)
    return views, caches, calls


def assert_same_sessions(a, b, tol: float) -> None:
    """Session by session: equal tokens and events' indices; log-probs to ``tol``; β and the cache
    rows, whose rounding differences later tokens' keys and later fits carry on, to ``10 · tol``."""
    (views_a, caches_a, _), (views_b, caches_b, _) = a, b
    for va, vb, ca, cb in zip(views_a, views_b, caches_a, caches_b):
        assert va.token_ids == vb.token_ids
        assert torch.allclose(torch.tensor(va.logprobs), torch.tensor(vb.logprobs), rtol=0, atol=tol)
        assert len(va.events) == len(vb.events)
        for ea, eb in zip(va.events, vb.events):
            assert (ea.span, ea.logical_span, ea.kv_len_after, ea.probe_logical_range) == (
                eb.span, eb.logical_span, eb.kv_len_after, eb.probe_logical_range,
            )  # fmt: skip
            assert torch.equal(ea.indices, eb.indices)
            assert (ea.beta is None) == (eb.beta is None)
            if ea.beta is not None:
                assert torch.allclose(ea.beta, eb.beta, rtol=0, atol=10 * tol)
        for xa, xb in zip(ca, cb):  # K, V (C1, C2) and β of every row, rounding carried over events
            assert torch.allclose(xa.double(), xb.double(), rtol=10 * tol, atol=10 * tol)


def workload(n: int, prompt_lens: list[int], seed: int, turns: int = 3):
    prompts = [make_prompt(prompt_lens[i], seed=seed + i) for i in range(n)]
    inputs = [
        [make_prompt(8 + (i + t) % 3, seed=1000 * seed + 10 * i + t) for t in range(turns)] for i in range(n)
    ]
    return prompts, inputs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("compute_beta", [True, False])
def test_stacked_events_equal_events_alone(engines, dtype, compute_beta):
    """Four sessions of different prompt lengths, several events each, β on and off; float64 agrees
    to 1e-9, the engine's float32 to 1e-5."""
    engine = engines[dtype]
    cfg = CompactionConfig(mode="attention_matching", compute_beta=compute_beta, **BUDGET)
    prompts, inputs = workload(4, [12, 16, 9, 20], seed=3)
    stacked = rollout(engine, [cfg] * 4, prompts, inputs, GREEDY, stacked=True)
    alone = rollout(engine, [cfg] * 4, prompts, inputs, GREEDY, stacked=False)
    assert_same_sessions(stacked, alone, 1e-9 if dtype == torch.float64 else 1e-5)
    rows = engine.layout.n_layers * engine.layout.n_kv_heads
    n_events = sum(len(v.events) for v in stacked[0])
    assert all(len(v.events) >= 3 for v in stacked[0])
    assert set(alone[2]) == {rows} and len(alone[2]) == n_events  # alone: one call per event
    assert max(stacked[2]) > rows and len(stacked[2]) < n_events  # stacked: fewer, larger calls
    assert sum(stacked[2]) == n_events * rows


def test_stacking_is_on_by_default_on_cuda_only(engines):
    """On CPU an event's cost is arithmetic, which padding adds to: events go alone unless asked."""
    assert not engines[torch.float32].compactor.batch_events


def test_mixed_configs_stack_only_same_shapes(engines):
    """A session of another mode and one of another window share steps with stacked ones: they are
    scored alone, and every session is as when all its events ran alone."""
    engine = engines[torch.float32]
    am = CompactionConfig(mode="attention_matching", compute_beta=True, **BUDGET)
    configs = [am, am.replace(mode="h2o", compute_beta=False), am, am.replace(compact_window=24)]
    prompts, inputs = workload(4, [12, 12, 14, 12], seed=5)
    stacked = rollout(engine, configs, prompts, inputs, GREEDY, stacked=True)
    alone = rollout(engine, configs, prompts, inputs, GREEDY, stacked=False)
    assert_same_sessions(stacked, alone, 1e-5)
    rows = engine.layout.n_layers * engine.layout.n_kv_heads
    assert max(stacked[2]) == 2 * rows  # only the two same-shape AM sessions stack


@settings(max_examples=6, deadline=None)
@example(n=3, lens=[10, 18, 14, 7], seed=1, temperature=1.0, beta=True, probes="suffix", raw=False)
@example(n=4, lens=[16, 16, 16, 16], seed=2, temperature=2.0, beta=True, probes="keys", raw=True)
@given(
    n=st.integers(2, 4),
    lens=st.lists(st.integers(6, 24), min_size=4, max_size=4),
    seed=st.integers(0, 10_000),
    temperature=st.sampled_from([0.0, 1.0, 2.0]),
    beta=st.booleans(),
    probes=st.sampled_from(["suffix", "keys", "random"]),
    raw=st.booleans(),
)
def test_stacking_never_changes_a_session(engines, n, lens, seed, temperature, beta, probes, raw):
    """Property: over session counts, prompt lengths, sampling temperatures, β, probe sources and
    KV-budget schedules, stacked and lone events give the same sessions."""
    engine = engines[torch.float32]
    cfg = CompactionConfig(
        mode="attention_matching", compute_beta=beta, queries=probes, kv_budget_from="raw" if raw else "prompt",
        **BUDGET,
    )  # fmt: skip
    prompts, inputs = workload(n, lens, seed)
    sampling = GREEDY.replace(temperature=temperature)
    stacked = rollout(engine, [cfg] * n, prompts, inputs, sampling, stacked=True)
    alone = rollout(engine, [cfg] * n, prompts, inputs, sampling, stacked=False)
    assert_same_sessions(stacked, alone, 1e-5)
    assert all(len(v.events) >= 2 for v in stacked[0])
    assert len(stacked[2]) <= len(alone[2])


def test_budget_messages_with_stacked_events(engines):
    """Budget messages after stacked events (a second round of events makes room for them)."""
    engine = engines[torch.float32]
    cfg = CompactionConfig(
        mode="attention_matching",
        compute_beta=True,
        inject_budget_message=True,
        max_total_tokens=1000,
        **BUDGET,
    )
    prompts, inputs = workload(3, [10, 18, 14], seed=4, turns=2)
    sampling = GREEDY.replace(temperature=1.0)
    stacked = rollout(engine, [cfg] * 3, prompts, inputs, sampling, stacked=True)
    alone = rollout(engine, [cfg] * 3, prompts, inputs, sampling, stacked=False)
    assert_same_sessions(stacked, alone, 1e-5)
    assert max(stacked[2]) > engine.layout.n_layers * engine.layout.n_kv_heads


def test_stacked_events_without_beta_beside_a_slot_holding_beta(engines):
    """``compute_beta`` off, one slot of a stacked call holding β (as a slot forked from a β session
    does): that slot keeps its kept rows' β, the other stays without β (zeros, ``has_beta`` off),
    and both end as with their events alone."""
    engine = engines[torch.float32]
    cfg = CompactionConfig(mode="attention_matching", compute_beta=False, n_probe_queries=16)
    sampling = GREEDY.replace(max_new_tokens=0)
    sids = [engine.create_session(make_prompt(48, seed=20 + i), cfg, sampling).session_id for i in range(2)]
    held, cache = engine.scheduler.get(sids[0]).slot, engine.cache
    n = cache.length(held)
    cache.beta[held, :, :, :n] = torch.randn(
        cache.beta[held, :, :, :n].shape, generator=torch.Generator().manual_seed(3)
    )
    cache.has_beta[held] = True
    before = cache.beta[held, :, :, :n].clone()
    scorer, batch_events = engine.compactor.compact_fn, engine.compactor.batch_events
    out = {}
    try:
        for stacked in (True, False):
            calls: list[int] = []

            def recording(keys, *args, **kwargs):
                calls.append(keys.shape[0])  # noqa: B023
                return scorer(keys, *args, **kwargs)

            engine.compactor.compact_fn, engine.compactor.batch_events = recording, stacked
            forks = [engine.scheduler.get(engine.fork(s)) for s in sids]
            events = engine.compactor.compact_many([(s, (8, 40), 0.25, "manual") for s in forks])
            out[stacked] = (
                events, [engine.read_cache(s.session_id) for s in forks], [cache.has_beta[s.slot] for s in forks], calls
            )  # fmt: skip
            for s in forks:
                engine.close(s.session_id)
    finally:
        engine.compactor.compact_fn, engine.compactor.batch_events = scorer, batch_events
        for sid in sids:
            engine.close(sid)
    (ev_s, caches_s, has_s, calls_s), (ev_a, caches_a, has_a, calls_a) = out[True], out[False]
    rows = engine.layout.n_layers * engine.layout.n_kv_heads
    assert calls_s == [2 * rows] and calls_a == [rows, rows]
    assert has_s == has_a == [True, False]
    for ea, eb in zip(ev_s, ev_a):
        assert torch.equal(ea.indices, eb.indices) and ea.beta is None and eb.beta is None
    for events, caches in ((ev_s, caches_s), (ev_a, caches_a)):  # the kept rows' β, the others moved
        kept = before.gather(-1, events[0].indices)
        assert torch.equal(caches[0][2], torch.cat([before[..., :8], kept, before[..., 40:]], -1))
        assert not caches[1][2].any()  # the slot without β holds none
    for ca, cb in zip(caches_s, caches_a):
        for xa, xb in zip(ca, cb):
            assert torch.allclose(xa.double(), xb.double(), rtol=1e-4, atol=1e-4)

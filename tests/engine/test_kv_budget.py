"""KV-budget compaction: the trigger arithmetic, the events, and equality with a reference forward."""

from __future__ import annotations

import math

import pytest
import torch
from engine_helpers import load_reference_model, make_prompt, reference_logprobs_over_cache

from compaction_gym.compaction.events import CompactionEvent
from compaction_gym.engine import CompactionConfig, Engine, SamplingParams

MAX_KV, WINDOW, RATIO = 64, 32, 0.25  # the reference budget 2048/1024/0.25, scaled down 32×
GREEDY = SamplingParams(temperature=0, max_new_tokens=160, ignore_eos=True)


@pytest.fixture(scope="module")
def kv_engine(tiny_model_path):
    return Engine.from_pretrained(tiny_model_path, max_slots=2, capacity=512)


def expected_events(fed: int, target: int) -> int:
    """Events while feeding ``fed`` tokens one by one: each fires at ``max_kv`` and frees ``window - target``."""
    return max(0, math.ceil((fed - MAX_KV) / (WINDOW - target)))


@pytest.mark.parametrize("mode", ["attention_matching", "markovian", "h2o", "snapkv", "streaming", "random"])
def test_kv_budget_arithmetic(kv_engine, mode):
    prompt = make_prompt(16, seed=60)
    cfg = CompactionConfig(mode=mode, max_kv_len=MAX_KV, compact_window=WINDOW, compact_target_ratio=RATIO)
    r = kv_engine.create_session(prompt, cfg, GREEDY)
    view = kv_engine.session(r.session_id)
    kv_engine.close(r.session_id)
    fed = len(prompt) + len(r.token_ids) - 1
    target = 0 if mode == "markovian" else max(1, math.floor(WINDOW * RATIO))
    assert len(r.events) == expected_events(fed, target) > 3
    assert r.kv_len <= MAX_KV  # decode headroom is 0 (checked before every feed, docs/engine.md)
    lay = kv_engine.layout
    for i, e in enumerate(r.events):
        assert (e.index, e.trigger, e.mode, e.span, e.target) == (i, "kv_budget", mode, (16, 48), target)
        assert e.indices.shape == (lay.n_layers, lay.n_kv_heads, target) and e.indices.dtype == torch.int64
        assert bool(((e.indices >= 16) & (e.indices < 48)).all())
        assert bool((e.indices.diff(dim=-1) > 0).all())
        assert e.kv_len_before == MAX_KV and e.kv_len_after == MAX_KV - WINDOW + target
        assert e.position_offset == e.logical_len - e.kv_len_after
        # recursive: the span holds the previous block + (window - target) raw rows after it
        if mode == "markovian":
            assert e.logical_span == (16 + i * WINDOW, 48 + i * WINDOW)
        else:
            assert e.logical_span == (16, 48 + i * (WINDOW - target))
        assert CompactionEvent.from_dict(e.to_dict()) == e
    assert view.position_offset == fed - r.kv_len


def test_n_compacts_caps_events(kv_engine):
    cfg = CompactionConfig(
        mode="streaming", max_kv_len=MAX_KV, compact_window=WINDOW, compact_target_ratio=RATIO, n_compacts=2
    )
    r = kv_engine.create_session(make_prompt(16, seed=61), cfg, GREEDY.replace(max_new_tokens=120))
    kv_engine.close(r.session_id)
    assert len(r.events) == 2
    assert r.kv_len == 16 + 119 - 2 * (WINDOW - WINDOW // 4)  # no more room is made: the cache grows


@pytest.mark.parametrize(("queries", "beta"), [("suffix", True), ("keys", False), ("random", True)])
def test_logprobs_after_compaction_match_a_reference_forward(kv_engine, tiny_model_path, queries, beta):
    """Tokens after the last event equal HF's own forward over the compacted cache (β included)."""
    prompt = make_prompt(16, seed=62)
    cfg = CompactionConfig(
        mode="attention_matching", max_kv_len=MAX_KV, compact_window=WINDOW, compact_target_ratio=RATIO,
        n_compacts=2, compute_beta=beta, queries=queries, n_probe_queries=32,
    )  # fmt: skip
    r = kv_engine.create_session(prompt, cfg, GREEDY.replace(max_new_tokens=120))
    k, v, b = kv_engine.read_cache(r.session_id)
    view = kv_engine.session(r.session_id)
    kv_engine.close(r.session_id)
    last = r.events[-1]
    assert len(r.events) == 2 and (b.abs().max() > 0) == beta
    assert last.probe_source == queries and (last.probe_seed is not None) == (queries == "random")
    # rows [0, kv_len_after) are the cache right after the event; later rows were appended since
    p, fed = last.kv_len_after, len(view.token_ids) - 1
    ids = list(view.token_ids)
    model = load_reference_model(tiny_model_path)
    ref = reference_logprobs_over_cache(
        model, k[:, :, :p], v[:, :, :p], b[:, :, :p], ids[last.logical_len : fed], last.logical_len
    )
    nxt = torch.tensor(ids[last.logical_len + 1 : fed + 1])
    expected = ref.gather(1, nxt[:, None]).squeeze(1)
    got = torch.tensor(view.logprobs[last.logical_len + 1 : fed + 1])
    assert len(got) >= 40
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    assert nxt.tolist() == ref.argmax(-1).tolist()  # greedy tokens agree too


def test_step_input_triggers_compaction_before_prefill(kv_engine):
    cfg = CompactionConfig(mode="markovian", max_kv_len=MAX_KV, compact_window=WINDOW)
    r = kv_engine.create_session(make_prompt(8, seed=63), cfg, GREEDY.replace(max_new_tokens=40))
    assert r.events == [] and r.kv_len == 47
    r2 = kv_engine.step(r.session_id, make_prompt(20, seed=64), GREEDY.replace(max_new_tokens=1))
    kv_engine.close(r.session_id)
    assert [e.span for e in r2.events] == [(8, 40)] and r2.events[0].kv_len_before == 47
    assert r2.kv_len == 47 - 32 + 1 + 20  # the pending token and the input were fed after the event


def test_compact_generate_runs_one_prompt_and_closes(kv_engine):
    cfg = CompactionConfig(mode="attention_matching", max_kv_len=MAX_KV, compact_window=WINDOW, max_total_tokens=90)
    free = kv_engine.num_free_slots
    r = kv_engine.compact_generate(make_prompt(16, seed=65), cfg, GREEDY)
    assert r.finish_reason == "budget" and len(r.token_ids) == 90
    assert len(r.events) == expected_events(16 + 89, WINDOW // 4) and r.kv_len <= MAX_KV
    assert kv_engine.num_free_slots == free and r.session_id not in kv_engine.session_ids


def test_a_budget_the_prompt_leaves_no_room_in_warns(engine):
    """With prompt + compact_window > max_kv_len no KV-budget event can fire, so the cache grows past
    the budget: the engine says so when the session opens."""
    cfg = CompactionConfig(mode="attention_matching", max_kv_len=64, compact_window=32)
    with pytest.warns(UserWarning, match="cannot be honoured"):
        r = engine.create_session(make_prompt(40, seed=3), cfg, SamplingParams(temperature=0, max_new_tokens=1))
    engine.close(r.session_id)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = engine.create_session(make_prompt(16, seed=3), cfg, SamplingParams(temperature=0, max_new_tokens=1))
    engine.close(r.session_id)

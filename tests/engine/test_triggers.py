"""Turn-based, manual and markovian compaction; budget messages."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import load_reference_model, make_prompt, reference_logprobs_over_cache

from compaction_gym.engine import CompactionConfig, Engine, SamplingParams
from compaction_gym.engine.config import DEFAULT_BUDGET_TEMPLATE

P, OBS, RESP = 10, 4, 6  # prompt, observation and response lengths
GREEDY = SamplingParams(temperature=0, max_new_tokens=RESP, ignore_eos=True)


def _play(engine, cfg, turns):
    r = engine.create_session(make_prompt(P, seed=70), cfg, GREEDY)
    results = [r]
    for t in range(turns):
        results.append(engine.step(r.session_id, make_prompt(OBS, seed=71 + t)))
    return r.session_id, results


@pytest.mark.parametrize("mode", ["attention_matching", "markovian"])
def test_turn_based_compacts_exactly_the_old_turns(engine, mode):
    cfg = CompactionConfig(mode=mode, n_protect_turns=1, compact_target_ratio=0.5)
    sid, res = _play(engine, cfg, 1)
    twin, twin_res = _play(engine, CompactionConfig(), 1)
    assert res[0].events == []  # after create the only turn is the protected last one
    assert [r.token_ids for r in res] == [r.token_ids for r in twin_res]  # compaction came after generation
    (ev,) = res[1].events
    # turn 0's response: RESP rows (its last token was fed at the start of turn 1)
    assert (ev.trigger, ev.span, ev.logical_span) == ("turn", (P, P + RESP), (P, P + RESP))
    t = 0 if mode == "markovian" else RESP // 2
    k, v, _ = engine.read_cache(sid)
    k2, v2, _ = engine.read_cache(twin)
    assert k.shape[2] == k2.shape[2] - RESP + t == res[1].kv_len
    assert torch.equal(k[:, :, :P], k2[:, :, :P])  # the prompt is protected
    assert torch.equal(k[:, :, P + t :], k2[:, :, P + RESP :]) and torch.equal(
        v[:, :, P + t :], v2[:, :, P + RESP :]
    )
    if t:  # C1 = the original keys at the kept indices, per layer and head
        kept = torch.gather(k2, 2, ev.indices[..., None].expand(-1, -1, -1, k2.shape[-1]))
        assert torch.equal(k[:, :, P : P + t], kept)


@pytest.mark.parametrize(
    ("mode", "recompact"), [("attention_matching", False), ("attention_matching", True), ("markovian", False)]
)
def test_turn_based_blocks_stack_or_recompact(engine, mode, recompact):
    cfg = CompactionConfig(
        mode=mode, n_protect_turns=1, compact_target_ratio=0.5, recompact_from_prompt=recompact
    )
    sid, res = _play(engine, cfg, 3)
    t1 = 0 if mode == "markovian" else RESP // 2
    turn = OBS + RESP  # rows of one complete turn (input + response)
    e2 = res[2].events[0]
    if recompact:  # everything after the prompt up to the last turn, block included
        assert e2.span == (P, P + t1 + turn) and e2.logical_span == (P, P + RESP + turn)
    else:  # from the end of the previous block (stacked); markovian left no block
        assert e2.span == (P + t1, P + t1 + turn) and e2.logical_span == (P + RESP, P + RESP + turn)
    view = engine.session(sid)
    last_turn = res[3].prompt_len + RESP  # the last turn's rows are intact, at the end of the cache
    assert view.kv_len == res[3].kv_len and view.position_offset == len(view.token_ids) - 1 - view.kv_len
    e3 = res[3].events[0]
    assert e3.span[1] + last_turn - 1 == e3.kv_len_before  # its pending token is not fed yet
    assert view.kv_len == e3.span[0] + e3.target + last_turn - 1


def test_turn_based_k0_compacts_the_response_itself(engine):
    cfg = CompactionConfig(mode="markovian", n_protect_turns=0)
    r = engine.create_session(make_prompt(P, seed=72), cfg, GREEDY)
    (ev,) = r.events
    assert ev.span == (P, P + RESP - 1) and r.kv_len == P  # the pending last token is not in the cache


def test_markovian_manual_deletes_exactly_the_span(engine):
    prompt = make_prompt(20, seed=73)
    r = engine.create_session(prompt, CompactionConfig(mode="markovian"), GREEDY.replace(max_new_tokens=10))
    k0, v0, _ = engine.read_cache(r.session_id)
    ev = engine.compact(r.session_id, (5, 17))
    k, v, _ = engine.read_cache(r.session_id)
    assert (ev.trigger, ev.target, ev.kv_len_before, ev.kv_len_after) == ("manual", 0, 29, 17)
    assert ev.indices.shape == (engine.layout.n_layers, engine.layout.n_kv_heads, 0)
    assert torch.equal(k, torch.cat([k0[:, :, :5], k0[:, :, 17:]], dim=2))
    assert torch.equal(v, torch.cat([v0[:, :, :5], v0[:, :, 17:]], dim=2))
    view = engine.session(r.session_id)
    assert view.events == (ev,) and view.position_offset == 12


def test_manual_compaction_then_step_matches_reference(engine, tiny_model_path):
    prompt = make_prompt(24, seed=74)
    cfg = CompactionConfig(mode="attention_matching", compute_beta=True)
    r = engine.create_session(prompt, cfg, GREEDY.replace(max_new_tokens=20))
    ev = engine.compact(r.session_id, (4, 36), ratio=0.25)
    assert ev.target == 8 and ev.probe_logical_range is not None and ev.logical_span == (4, 36)
    k, v, b = engine.read_cache(r.session_id)
    obs = make_prompt(6, seed=75)
    r2 = engine.step(r.session_id, obs, GREEDY.replace(max_new_tokens=15))
    ids = list(engine.session(r.session_id).token_ids)
    start = ev.logical_len  # the pending token, the input, then the response
    ref = reference_logprobs_over_cache(load_reference_model(tiny_model_path), k, v, b, ids[start:-1], start)
    expected = ref[-len(r2.token_ids) :].gather(1, torch.tensor(r2.token_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(r2.logprobs), expected, atol=1e-4)


def test_budget_messages_are_injected_after_each_event(engine, tiny_tokenizer):
    cfg = CompactionConfig(
        mode="markovian", max_kv_len=96, compact_window=48, max_total_tokens=150, inject_budget_message=True
    )
    r = engine.create_session(make_prompt(8, seed=76), cfg, GREEDY.replace(max_new_tokens=400))
    assert r.finish_reason == "budget" and len(r.events) >= 3
    assert len(r.inject_ranges) == len(r.events)  # one message per event (each round has one here)
    pos = used = 0
    for (a, b), ev in zip(r.inject_ranges, r.events):
        used += sum(r.completion_mask[pos:a])
        pos = b
        text = DEFAULT_BUDGET_TEMPLATE.format(used=used, total=150, remaining=150 - used)
        assert (
            tiny_tokenizer.decode(r.token_ids[a:b])
            == f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        )
        assert r.completion_mask[a:b] == [0] * (b - a) and r.logprobs[a:b] == [0.0] * (b - a)
        assert ev.kv_len_before + 1 + (b - a) > 96 >= ev.kv_len_after + 1 + (b - a)  # room for the message
    assert sum(r.completion_mask) == 150  # injected tokens do not count as generated
    assert r.kv_len <= 96


def test_turn_based_budget_message_follows_the_response(engine, tiny_tokenizer):
    cfg = CompactionConfig(mode="markovian", n_protect_turns=0, max_total_tokens=50, inject_budget_message=True)
    r = engine.create_session(make_prompt(P, seed=77), cfg, GREEDY)
    (ev,) = r.events
    ((a, b),) = r.inject_ranges
    assert a == RESP and b == len(r.token_ids)  # after the response
    assert "Budget: 6/50 tokens generated. ~44 tokens remaining." in tiny_tokenizer.decode(r.token_ids[a:b])
    assert r.kv_len == P + 1 + (b - a)  # the response's last token and the message were fed
    r2 = engine.step(r.session_id, make_prompt(OBS, seed=78))
    assert len(r2.token_ids) >= RESP and r2.completion_mask[:RESP] == [1] * RESP


@pytest.mark.parametrize(("mode", "queries"), [("h2o", "suffix"), ("snapkv", "suffix"), ("h2o", "keys"), ("tova", "suffix")])
def test_compactor_gives_compact_each_probes_cache_row(tiny_model_path, mode, queries):
    """h2o/snapkv score with kvpress's causal mask, so the engine passes every probe's cache row
    (suffix probes: their tokens' rows, once per query head of the group; key probes: their own
    rows); tova gets the KV-head count to average over a layer's heads."""
    from compaction_gym.compaction import compact

    seen: list[dict] = []

    def recording(*args, **kwargs):
        seen.append({"queries": args[2], **kwargs})
        return compact(*args, **kwargs)

    eng = Engine.from_pretrained(tiny_model_path, dtype=torch.float32, device="cpu", max_slots=1, capacity=256)
    eng.compactor.compact_fn = recording
    cfg = CompactionConfig(mode=mode, max_kv_len=64, compact_window=32, n_probe_queries=8, queries=queries)
    r = eng.create_session(list(range(30, 46)), cfg, SamplingParams(temperature=0.0, max_new_tokens=110, ignore_eos=True))
    assert len(r.events) == len(seen) >= 2
    group = eng.layout.n_q_heads // eng.layout.n_kv_heads
    for event, call in zip(r.events, seen, strict=True):
        assert call["n_kv_heads"] == eng.layout.n_kv_heads
        qpos = call["query_positions"]
        if queries == "keys":
            lo, hi = event.probe_rows
            assert qpos.tolist() == list(range(lo, hi))
        else:  # the newest n positions are the last raw rows before the event
            a, b = event.probe_logical_range
            rows = list(range(event.kv_len_before - (b - a), event.kv_len_before))
            assert qpos.tolist() == rows * group
        assert call["queries"].shape[1] == qpos.numel()
        assert int(qpos.min()) >= event.span[1]  # probes come after the span they score


def test_budget_message_frame_from_the_config(engine, tiny_tokenizer):
    """A session's ``budget_message_frame`` replaces the default ChatML framing; the message is
    tokenized as one text (reference: the tokenizer on prefix + message + suffix)."""
    frame = ("<start_of_turn>user\n", "<end_of_turn>\n<start_of_turn>model\n")
    cfg = CompactionConfig(
        mode="markovian", max_kv_len=96, compact_window=48, max_total_tokens=150, inject_budget_message=True,
        budget_message_frame=frame,
    )  # fmt: skip
    r = engine.create_session(make_prompt(8, seed=76), cfg, GREEDY.replace(max_new_tokens=400))
    assert r.inject_ranges and len(r.events) >= len(r.inject_ranges)  # back-to-back events share one
    pos = used = 0
    for a, b in r.inject_ranges:
        used += sum(r.completion_mask[pos:a])
        pos = b
        text = DEFAULT_BUDGET_TEMPLATE.format(used=used, total=150, remaining=150 - used)
        assert r.token_ids[a:b] == tiny_tokenizer.encode(frame[0] + text + frame[1], add_special_tokens=False)
        assert "<|im_start|>" not in tiny_tokenizer.decode(r.token_ids[a:b])
    assert sum(r.completion_mask) == 150 and r.kv_len <= 96

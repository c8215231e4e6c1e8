"""Persistent sessions: multi-turn, batched stepping, fork, slots, errors."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import make_prompt

from compaction_gym.engine import CompactionConfig, Engine, SamplingParams, StepRequest
from compaction_gym.errors import CapacityError, InvalidArgumentError, UnknownSessionError

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


def test_multi_turn_equals_reprefilling_the_history(engine, tiny_model):
    prompt = make_prompt(16, seed=10)
    r = engine.create_session(prompt, sampling=GREEDY)
    history = prompt + r.token_ids
    for turn in range(3):
        obs = make_prompt(5 + turn, seed=20 + turn)
        r = engine.step(r.session_id, obs)
        history += obs
        ref = tiny_model.generate(
            torch.tensor([history]), max_new_tokens=12, do_sample=False, min_new_tokens=12
        )
        assert r.token_ids == ref[0, len(history) :].tolist(), f"turn {turn}"
        assert r.prompt_len == len(obs)
        history += r.token_ids
    view = engine.session(r.session_id)
    assert list(view.token_ids) == history
    assert view.kv_len == len(history) - 1 and view.position_offset == 0


def _run_sessions(eng: Engine, batched: bool):
    prompts = [make_prompt(n, seed=30 + n) for n in (5, 17, 9)]
    defaults = [
        SamplingParams(temperature=0.8, seed=1, max_new_tokens=6, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=30, seed=2, max_new_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0, max_new_tokens=7, ignore_eos=True),
    ]
    ids = [eng.create_session(p, sampling=sp).session_id for p, sp in zip(prompts, defaults)]
    turns = []
    for t in range(2):
        requests = [
            StepRequest(ids[0], make_prompt(3, seed=t)),  # session stream continues
            StepRequest(
                ids[1],
                make_prompt(8, seed=t + 5),
                SamplingParams(temperature=0.9, top_p=0.7, seed=40 + t, max_new_tokens=5 + t),
            ),
            StepRequest(ids[2], make_prompt(1 + 4 * t, seed=t + 9)),
        ]
        turns.append(
            eng.step_batch(requests)
            if batched
            else [eng.step(q.session_id, q.new_ids, q.sampling) for q in requests]
        )
    return turns


def test_step_batch_equals_stepping_one_by_one(tiny_model_path):
    one = _run_sessions(Engine.from_pretrained(tiny_model_path, max_slots=4, capacity=256), batched=False)
    many = _run_sessions(Engine.from_pretrained(tiny_model_path, max_slots=4, capacity=256), batched=True)
    for turn_a, turn_b in zip(one, many):
        for a, b in zip(turn_a, turn_b):
            assert a.token_ids == b.token_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
            assert (a.finish_reason, a.kv_len, a.total_tokens) == (b.finish_reason, b.kv_len, b.total_tokens)
    assert [len(r.token_ids) for r in many[1]] == [6, 6, 7]


def test_fork_continues_identically_and_independently(engine):
    r = engine.create_session(
        make_prompt(12, seed=50), sampling=SamplingParams(temperature=1.0, seed=3, max_new_tokens=6)
    )
    fid = engine.fork(r.session_id)
    assert engine.session(fid).token_ids == engine.session(r.session_id).token_ids
    a = engine.step(r.session_id, [7, 8, 9])
    b = engine.step(fid, [7, 8, 9])
    assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
    engine.step(fid, [1])
    assert len(engine.session(fid).token_ids) > len(engine.session(r.session_id).token_ids)


def test_slots_are_a_resource(tiny_model_path):
    eng = Engine.from_pretrained(tiny_model_path, max_slots=2, capacity=128)
    sp = GREEDY.replace(max_new_tokens=2)
    a = eng.create_session([5, 6, 7], sampling=sp)
    eng.create_session([5, 6, 7], sampling=sp)
    assert eng.num_free_slots == 0
    with pytest.raises(CapacityError, match="slots are in use"):
        eng.create_session([5, 6, 7], sampling=sp)
    with pytest.raises(CapacityError):
        eng.fork(a.session_id)
    eng.close(a.session_id)
    assert eng.num_free_slots == 1 and a.session_id not in eng.session_ids
    c = eng.create_session([5, 6, 7], sampling=sp, session_id="mine")
    assert c.session_id == "mine" and eng.session("mine").slot == 0


def test_bad_input_raises_clear_errors_and_engine_stays_usable(engine):
    sp = GREEDY.replace(max_new_tokens=3)
    good = engine.create_session([5, 6, 7], sampling=sp)
    marko = engine.create_session([5, 6, 7], CompactionConfig(mode="markovian"), sp)
    vocab = engine.layout.vocab_size
    cases = [
        (InvalidArgumentError, "empty", lambda: engine.create_session([], sampling=sp)),
        (
            InvalidArgumentError,
            "outside the vocabulary",
            lambda: engine.create_session([1, vocab], sampling=sp),
        ),
        (InvalidArgumentError, "outside the vocabulary", lambda: engine.step(good.session_id, [-1])),
        (
            InvalidArgumentError,
            "capacity",
            lambda: engine.create_session([5] * (engine.capacity + 1), sampling=sp),
        ),
        (InvalidArgumentError, "integer token ids", lambda: engine.step(good.session_id, [1.5])),
        (InvalidArgumentError, "sequence of token ids", lambda: engine.step(good.session_id, "hello")),
        (InvalidArgumentError, "twice", lambda: engine.step_batch([StepRequest(good.session_id, [1])] * 2)),
        (InvalidArgumentError, "span", lambda: engine.compact(marko.session_id, (0, 999))),
        (InvalidArgumentError, "mode='none'", lambda: engine.compact(good.session_id)),
        (
            InvalidArgumentError,
            "max_kv_len",
            lambda: engine.create_session([5], CompactionConfig(mode="markovian", max_kv_len=10**6)),
        ),
        (
            InvalidArgumentError,
            "session_id",
            lambda: engine.create_session([5], sampling=sp, session_id=good.session_id),
        ),
        (UnknownSessionError, "unknown session", lambda: engine.step("nope", [1])),
        (UnknownSessionError, "unknown session", lambda: engine.close("nope")),
        (UnknownSessionError, "unknown session", lambda: engine.fork("nope")),
        (UnknownSessionError, "unknown session", lambda: engine.session("nope")),
        (UnknownSessionError, "unknown session", lambda: engine.compact("nope")),
        (CapacityError, "do not fit", lambda: engine.step(good.session_id, [5] * engine.capacity)),
    ]
    for exc, msg, call in cases:
        with pytest.raises(exc, match=msg):
            call()
    assert engine.session_ids == [good.session_id, marko.session_id] and engine.num_free_slots == 2
    before = engine.session(good.session_id)
    r = engine.step(good.session_id, [8, 9])
    fresh = engine.create_session(list(before.token_ids) + [8, 9], sampling=sp)
    assert r.token_ids == fresh.token_ids  # the failed calls left the session untouched


def test_opening_a_session_is_transactional(engine, monkeypatch):
    """A failure after the slot was taken (here: the probe ring's allocation, as with an absurd
    n_probe_queries before it was bounded) gives the slot back; a fork that fails likewise."""
    from compaction_gym.engine import scheduler as scheduler_module

    free = engine.num_free_slots

    def no_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(scheduler_module, "ProbeRing", no_memory)
    cfg = CompactionConfig(mode="attention_matching", max_kv_len=64)
    for _ in range(engine.max_slots + 2):  # more attempts than slots: none may leak
        with pytest.raises(RuntimeError, match="out of memory"):
            engine.create_session(make_prompt(8, seed=1), cfg, GREEDY)
    assert engine.num_free_slots == free
    monkeypatch.undo()
    r = engine.create_session(make_prompt(8, seed=1), sampling=GREEDY)
    monkeypatch.setattr(engine.cache, "copy_slot", no_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.fork(r.session_id)
    assert engine.num_free_slots == free - 1
    engine.close(r.session_id)
    assert engine.num_free_slots == free


def test_an_untyped_failure_opening_one_session_blames_that_request_alone(engine, monkeypatch):
    """A create whose opening fails (not a typed error) marks itself (``request_index``,
    ``batch_unchanged``): nothing of the batch ran, the other sessions did not advance."""
    from compaction_gym.engine import CreateRequest, StepRequest
    from compaction_gym.engine import scheduler as scheduler_module

    r = engine.create_session(make_prompt(8, seed=2), sampling=GREEDY)
    before = engine.session(r.session_id).token_ids
    real_ring = scheduler_module.ProbeRing

    def ring(*args, **kwargs):
        if args[3] == 13:  # the poisoned request's n_probe_queries
            raise RuntimeError("allocation failed (simulated)")
        return real_ring(*args, **kwargs)

    monkeypatch.setattr(scheduler_module, "ProbeRing", ring)
    good = CompactionConfig(mode="attention_matching", max_kv_len=64, n_probe_queries=8)
    bad = CompactionConfig(mode="attention_matching", max_kv_len=64, n_probe_queries=13)
    free = engine.num_free_slots
    with pytest.raises(RuntimeError) as info:
        engine.step_batch([
            CreateRequest(make_prompt(8, seed=3), good, GREEDY),
            StepRequest(r.session_id, make_prompt(3, seed=4), GREEDY),
            CreateRequest(make_prompt(8, seed=5), bad, GREEDY),
        ])  # fmt: skip
    assert info.value.request_index == 2 and info.value.batch_unchanged
    assert engine.num_free_slots == free and engine.session(r.session_id).token_ids == before
    engine.close(r.session_id)

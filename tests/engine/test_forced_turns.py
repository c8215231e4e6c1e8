"""Teacher-forced turns (``response_complete=True``) fire the turn-based trigger like sampled turns."""

from __future__ import annotations

import pytest
from engine_helpers import make_prompt

from compaction_gym.agents import CompactionAgent
from compaction_gym.backends import LocalBackend
from compaction_gym.engine import CompactionConfig, SamplingParams, StepRequest
from compaction_gym.errors import InvalidArgumentError

P, OBS, RESP = 10, 4, 6  # prompt, observation and response lengths
T = OBS + RESP  # rows of one complete turn
GREEDY = SamplingParams(temperature=0, max_new_tokens=RESP, ignore_eos=True, seed=0)
FEED = GREEDY.replace(max_new_tokens=0)


def _sampled(engine, cfg, turns: int):
    """Reference: a prefilled prompt, then ``turns`` sampled turns; returns (responses, results)."""
    sid = engine.create_session(make_prompt(P, seed=90), cfg, FEED).session_id
    results = [engine.step(sid, make_prompt(OBS, seed=91 + t), GREEDY) for t in range(turns)]
    return [r.token_ids for r in results], results


def _forced(engine, cfg, responses, *, complete: bool = True):
    """The same token stream with every response teacher-forced (fed with its observation)."""
    sid = engine.create_session(make_prompt(P, seed=90), cfg, FEED).session_id
    return [
        engine.step(sid, make_prompt(OBS, seed=91 + t) + resp, FEED, response_complete=complete)
        for t, resp in enumerate(responses)
    ]


def _regions(result) -> list[tuple]:
    return [(e.trigger, e.span, e.logical_span, e.target) for e in result.events]


# Expected events per turn, worked out by hand. k=1 markovian: after turn t the previous turn is
# deleted (no block remains, so every span starts at the prompt). k=2 attention matching at ratio
# 0.5: the turn two back becomes a block of T/2 rows; the next block stacks after it.
EXPECTED = {
    "markovian_k1": (
        CompactionConfig(mode="markovian", n_protect_turns=1),
        [[], [("turn", (P, P + T), (P, P + T), 0)], [("turn", (P, P + T), (P + T, P + 2 * T), 0)]],
    ),
    "attention_matching_k2": (
        CompactionConfig(mode="attention_matching", n_protect_turns=2, compact_target_ratio=0.5),
        [
            [],
            [],
            [("turn", (P, P + T), (P, P + T), T // 2)],
            [("turn", (P + T // 2, P + T // 2 + T), (P + T, P + 2 * T), T // 2)],
        ],
    ),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_forced_turns_record_the_turn_events_of_sampled_turns(engine, name):
    cfg, expected = EXPECTED[name]
    responses, sampled = _sampled(engine, cfg, len(expected))
    forced = _forced(engine, cfg, responses)
    assert [_regions(r) for r in sampled] == expected
    assert [_regions(r) for r in forced] == expected
    for s, f in zip(sampled, forced):
        assert f.token_ids == [] and f.finish_reason == "length"
        assert f.kv_len == s.kv_len + 1  # the forced reply's last token is fed, a sampled one pending
        assert f.total_tokens == s.total_tokens
    # without the flag nothing marks the end of a response: no turn-based event ever fires
    assert not any(r.events for r in _forced(engine, cfg, responses, complete=False))


def test_forced_turn_with_k0_compacts_the_whole_fed_turn(engine):
    cfg = CompactionConfig(mode="markovian", n_protect_turns=0)
    responses, _ = _sampled(engine, cfg, 2)
    forced = _forced(engine, cfg, responses)
    # unlike a sampled turn (whose last token is still pending) everything fed is compacted
    assert [_regions(r) for r in forced] == [
        [("turn", (P, P + T), (P, P + T), 0)],
        [("turn", (P, P + T), (P + T, P + 2 * T), 0)],
    ]
    assert [r.kv_len for r in forced] == [P, P]


def test_forced_turn_budget_message_follows_the_forced_reply(engine, tiny_tokenizer):
    cfg = CompactionConfig(
        mode="markovian", n_protect_turns=0, max_total_tokens=50, inject_budget_message=True
    )
    sid = engine.create_session(make_prompt(P, seed=90), cfg, FEED).session_id
    r = engine.step(sid, make_prompt(OBS + RESP, seed=92), FEED, response_complete=True)
    ((a, b),) = r.inject_ranges
    assert (a, b) == (0, len(r.token_ids)) and r.completion_mask == [0] * b
    assert "Budget: 0/50 tokens generated." in tiny_tokenizer.decode(r.token_ids)
    assert r.kv_len == P + b  # the turn was deleted, the message fed


def test_response_complete_needs_max_new_tokens_0(engine):
    cfg = CompactionConfig(mode="markovian", n_protect_turns=1)
    sid = engine.create_session([5, 6, 7], cfg, FEED).session_id
    other = engine.create_session([5, 6], cfg, FEED).session_id
    with pytest.raises(InvalidArgumentError, match="max_new_tokens=0"):
        engine.step(sid, [8, 9], GREEDY, response_complete=True)
    with pytest.raises(InvalidArgumentError, match="max_new_tokens=0") as info:
        engine.step_batch(
            [StepRequest(other, [8], FEED), StepRequest(sid, [8], GREEDY, response_complete=True)]
        )
    assert info.value.request_index == 1
    assert engine.session(sid).token_ids == (5, 6, 7) and engine.session(other).token_ids == (5, 6)


def test_agent_force_fires_turn_based_compaction(tiny_model_path):
    backend = LocalBackend.from_pretrained(tiny_model_path, max_slots=1, capacity=1024)
    cfg = CompactionConfig(mode="markovian", n_protect_turns=1)
    agent = CompactionAgent(
        backend, compaction=cfg, sampling=SamplingParams(temperature=0.0, max_new_tokens=4)
    )
    agent.reset("go to the red ball", seed=0)
    for i in range(4):
        agent.force(f"you see a wall {i}", ["turn left", "go forward"][i % 2])
        agent.observe(0.0)
    traj = agent.finish()
    view = backend.engine.session(agent.session_id)
    assert traj.events == list(view.events) and traj.token_ids == list(view.token_ids)
    # after forced turn i >= 1, the previous turn (its input and its forced reply) is compacted
    starts = [t.input_range[0] for t in traj.turns]
    assert [(e.trigger, e.logical_span) for e in traj.events] == [
        ("turn", (starts[i - 1], starts[i])) for i in range(1, 4)
    ]
    assert (
        all(t.forced for t in traj.turns)
        and view.kv_len == traj.prompt_len + len(traj.token_ids) - starts[-1]
    )
    agent.close()

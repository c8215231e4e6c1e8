"""``AttnMatch-Recall-v0``: seeded facts, filler turns, exact-match scoring."""

from __future__ import annotations

import re

import gymnasium as gym
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import compaction_gym  # noqa: F401  (registers the ids)
from compaction_gym.envs.recall import FACT_KINDS, PRESETS, RecallEnv, normalize
from compaction_gym.errors import InvalidArgumentError


def _play(env: gym.Env, seed: int, answer) -> tuple[list[str], list[str], dict]:
    """Play an episode replying ``answer(obs, facts)``; returns observations, phases and the last info."""
    obs, info = env.reset(seed=seed)
    facts = info["facts"]
    observations, phases = [obs], [info["phase"]]
    terminated = False
    while not terminated:
        obs, _reward, terminated, truncated, info = env.step(answer(obs, facts))
        assert not truncated
        observations.append(obs)
        phases.append(info["phase"])
    return observations, phases, info


def _oracle(obs: str, facts: list[str]) -> str:
    """Answers from the fact sentences, found by regex from the templates (not the env's state)."""
    for fact_t, question_t, _ in FACT_KINDS:
        q = re.match(re.escape(question_t).replace(re.escape("{k}"), "(.+?)"), obs)
        if q is None:
            continue
        pattern = re.escape(fact_t.replace("{k}", q.group(1))).replace(re.escape("{v}"), "(.+?)") + "$"
        for fact in facts:
            m = re.match(pattern, fact)
            if m:
                return f" {m.group(1)}.\n"
    return "OK"


def test_phases_and_perfect_score():
    env = gym.make("AttnMatch-Recall-v0", n_facts=3, n_filler=2, filler_sentences=3)
    observations, phases, info = _play(env, 7, _oracle)
    assert phases == ["facts", "filler", "filler", "question", "question", "question", "done"]
    assert observations[-1] == "" and info["score"] == 1.0
    assert [a["correct"] for a in info["answers"]] == [True, True, True]
    assert observations[0].count("\n- ") == 3 and "Reply with OK." in observations[1]


def test_wrong_and_missing_answers_score_zero():
    env = gym.make("AttnMatch-Recall-v0", n_facts=4, n_filler=1)
    _, _, info = _play(env, 3, lambda obs, facts: "I do not remember")
    assert info["score"] == 0.0 and len(info["answers"]) == 4


def test_partial_score_is_the_fraction_correct():
    env = RecallEnv(n_facts=4, n_filler=0)
    obs, info = env.reset(seed=11)
    facts = info["facts"]
    rewards, correct_so_far = [], 0
    obs, r, term, _, info = env.step("OK")
    rewards.append(r)
    for i in range(4):
        reply = _oracle(obs, facts) if i % 2 == 0 else "wrong"
        correct_so_far += i % 2 == 0
        obs, r, term, _, info = env.step(reply)
        rewards.append(r)
    assert term and info["score"] == 0.5 and sum(rewards) == pytest.approx(0.5)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_seeded_and_distinct(seed):
    a, b = RecallEnv(preset="standard"), RecallEnv(preset="standard")
    oa, ia = a.reset(seed=seed)
    ob, ib = b.reset(seed=seed)
    assert oa == ob and ia == ib
    subjects = [f.rsplit(" is ", 1)[0] if " is " in f else f for f in ia["facts"]]
    assert len(ia["facts"]) == PRESETS["standard"]["n_facts"] and len(set(subjects)) == len(subjects)
    # the filler turns are seeded too
    assert a.step("OK")[0] == b.step("OK")[0]


def test_filler_makes_the_chat_long():
    env = RecallEnv(preset="long")
    observations, _, _ = _play(env, 0, lambda obs, facts: "OK")
    words = sum(len(o.split()) for o in observations)
    assert words > 12 * 12 * 8  # n_filler turns of >= 12 sentences of >= 8 words


@pytest.mark.parametrize(
    ("text", "value", "match"),
    [
        ("Teal", "teal", True),
        (" teal.\n(because...)", "teal", True),
        ("<answer>4821</answer>", "4821", True),
        ("The colour is teal", "teal", False),
        ("48 21", "4821", False),
        ('"Lisbon"', "Lisbon", True),
    ],
)
def test_exact_match_normalisation(text, value, match):
    assert (normalize(text) == normalize(value)) is match


def test_bad_arguments_name_the_field():
    with pytest.raises(InvalidArgumentError, match="preset"):
        RecallEnv(preset="huge")
    with pytest.raises(InvalidArgumentError, match="n_facts"):
        RecallEnv(n_facts=0)
    with pytest.raises(InvalidArgumentError, match="n_filler"):
        RecallEnv(n_filler=-1)
    with pytest.raises(InvalidArgumentError, match="n_facts"):
        RecallEnv(n_facts=99)


def _values_of(facts: list[str]) -> list[str]:
    """Each fact sentence's value, read back from the templates (independent of the env's state)."""
    out = []
    for fact in facts:
        for fact_t, _q, _pool in FACT_KINDS:
            pattern = (
                re.escape(fact_t).replace(re.escape("{k}"), "(.+?)").replace(re.escape("{v}"), "(.+?)") + "$"
            )
            m = re.match(pattern, fact)
            if m:
                out.append(m.group(2))
                break
    return out


@pytest.mark.parametrize("seed", range(6))
def test_first_value_credits_the_first_fact_value_named(seed):
    env = gym.make("AttnMatch-Recall-v0", preset="standard", match="first_value")
    # a sentence answer naming the right value first scores; one reciting another fact first does not
    _obs, _ph, info = _play(
        env, seed, lambda obs, facts: f"Sure. The answer is {_oracle(obs, facts)}, I think."
    )
    assert info["score"] == 1.0
    obs, info = env.reset(seed=seed)
    facts = info["facts"]
    values = _values_of(facts)
    assert len(values) == 4
    terminated, answers = False, []
    while not terminated:
        if info["phase"] == "question":
            right = normalize(_oracle(obs, facts))
            other = next(v for v in values if v.lower() != right)
            reply = f"{other.upper()} and then {right}"
        else:
            reply = f"OK {' '.join(values)}"  # not scored
        obs, _r, terminated, _t, info = env.step(reply)
        answers = info["answers"]
    assert [a["correct"] for a in answers] == [False] * 4
    exact = gym.make("AttnMatch-Recall-v0", preset="standard")
    _obs, _ph, info = _play(exact, seed, lambda obs, facts: f"The answer is {_oracle(obs, facts)}.")
    assert info["score"] == 0.0  # exact match wants the value only


def test_first_value_whole_words_and_bad_match():
    from compaction_gym.envs.recall import first_value

    assert first_value("codes 95123 and 9512", ["9512", "95123"]) == "95123"
    assert first_value("Porto? no: porto", ["Porto"]) == "Porto"
    assert first_value("porton", ["Porto"]) is None
    with pytest.raises(InvalidArgumentError, match="match must be one of"):
        RecallEnv(match="fuzzy")

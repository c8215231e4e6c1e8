"""MathEnv and RGMixEnv: reasoning-gym problems, answer extraction, scoring that never raises."""

from __future__ import annotations

import socket

import gymnasium as gym
import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

import compaction_gym  # noqa: F401  (registers the ids)
from compaction_gym.envs.math import (
    ANSWER_INSTRUCTION,
    RGMIX_CONFIGS,
    STEP_BY_STEP_INSTRUCTION,
    MathEnv,
    RGMixEnv,
    extract_answer,
)
from compaction_gym.envs.spaces import TEXT_CHARSET
from compaction_gym.errors import InvalidArgumentError

FAST_MIX = {"arc_1d": 1, "sokoban": 1, "countdown": 1, "cryptarithm": 1}  # zebra 7×5 takes ~3 s per item


@pytest.fixture
def offline(monkeypatch):
    """Any attempt to open a network connection fails."""

    def refuse(*args, **kwargs):
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_correct_scores_one_wrong_scores_zero():
    env = gym.make("AttnMatch-Math-v0")
    obs, info = env.reset(seed=3)
    assert obs == info["question"] + ANSWER_INSTRUCTION
    assert obs.endswith("\n\nGive your final answer between <answer> and </answer> tags.")
    obs, reward, terminated, truncated, step_info = env.step(
        f"Let me think. <answer> {info['answer']} </answer>"
    )
    assert (obs, reward, terminated, truncated) == ("", 1.0, True, False)
    assert (step_info["extracted"], step_info["score"], step_info["error"]) == (info["answer"], 1.0, None)
    env.reset(seed=3)
    *_, step_info = env.step("<answer>-1.5e99</answer>")
    assert step_info["score"] == 0.0 and step_info["error"] is None


@pytest.mark.parametrize(
    "response", ["", "no tags at all", "<answer>", "<answer>12", "</answer>3<answer>", "🙂" * 1000, "\x00"]
)
def test_malformed_never_raises(response):
    env = MathEnv()
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(response)
    assert (obs, reward, terminated, truncated) == ("", 0.0, True, False)
    assert info["extracted"] is None and info["error"] == "no <answer>...</answer> tag in the response"


def test_scorer_exception_scores_zero_with_the_reason(monkeypatch):
    env = MathEnv()
    env.reset(seed=0)

    def boom(answer, entry):
        raise ValueError("boom")

    monkeypatch.setattr(env.datasets["basic_arithmetic"], "score_answer", boom)
    *_, reward, _, _, info = env.step("<answer>1</answer>")
    assert reward == 0.0 and info["error"] == "score_answer raised ValueError: boom"


def test_untagged_answer_when_tag_not_required():
    env = MathEnv(require_answer_tag=False)
    _, info = env.reset(seed=1)
    assert env.step(f" {info['answer']}\n")[1] == 1.0


EASY_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def test_last_number_fallback_scores_the_last_number_written():
    env = MathEnv("chain_sum", EASY_SUM, require_answer_tag=False, answer_fallback="last_number")
    question, info = env.reset(seed=3)
    answer = int(info["answer"])
    assert env.step(f"First {answer + 1}, no: the sum is {answer}.")[1] == 1.0
    env.reset(seed=3)
    *_, reward, _, _, step_info = env.step(f"It is {answer}. Check: {answer + 7}")
    assert reward == 0.0 and step_info["extracted"] == str(answer + 7)
    env.reset(seed=3)
    assert env.step(f"<answer>{answer}</answer> and then 12345")[1] == 1.0  # a tag wins over the fallback
    env.reset(seed=3)
    *_, reward, _, _, step_info = env.step("no idea")
    assert reward == 0.0 and step_info["extracted"] is None and "no number" in step_info["error"]
    tagged = MathEnv("chain_sum", EASY_SUM, answer_fallback="last_number")  # tag required: no fallback
    tagged.reset(seed=3)
    assert tagged.step(f"the sum is {answer}")[1] == 0.0


@settings(max_examples=60, deadline=None)
@given(
    st.text(alphabet=st.characters(blacklist_categories=("Nd",), blacklist_characters="<>-."), max_size=40),
    st.lists(st.integers(-10_000, 10_000), max_size=3),
    st.integers(-10_000, 10_000),
    st.text(alphabet=st.characters(blacklist_categories=("Nd",), blacklist_characters="<>-."), max_size=10),
)
def test_last_number_is_the_last_integer_written(prefix, earlier, last, suffix):
    """Whatever words and numbers come first, the fallback reads the last integer written, and the
    env's score of the response is reasoning-gym's score of that integer."""
    env = MathEnv("chain_sum", EASY_SUM, require_answer_tag=False, answer_fallback="last_number")
    text = prefix + " " + " ".join(map(str, earlier)) + " " + str(last) + suffix
    assert env.extract(text) == str(last)
    _, info = env.reset(seed=7)
    entry = env.datasets["chain_sum"][info["index"]]
    assert env.step(text)[1] == env.datasets["chain_sum"].score_answer(str(last), entry)


def test_step_by_step_instruction_replaces_the_answer_instruction():
    plain, _ = MathEnv("chain_sum", EASY_SUM).reset(seed=5)
    step, info = MathEnv("chain_sum", EASY_SUM, instruction="step_by_step").reset(seed=5)
    assert (
        plain == info["question"] + ANSWER_INSTRUCTION and step == info["question"] + STEP_BY_STEP_INSTRUCTION
    )
    mixed, info = RGMixEnv({"countdown": 1}, instruction="step_by_step").reset(seed=0)
    assert mixed.endswith(STEP_BY_STEP_INSTRUCTION)


def test_configs_give_each_dataset_its_own_config():
    configs = {
        "chain_sum": EASY_SUM,
        "basic_arithmetic": {"operators": ["+"], "min_terms": 3, "max_terms": 3},
    }
    chain = MathEnv("chain_sum", configs=configs)
    assert chain.reset(seed=0)[0] == MathEnv("chain_sum", EASY_SUM).reset(seed=0)[0]
    basic = MathEnv("basic_arithmetic", configs=configs)
    _, info = basic.reset(seed=0)
    assert (
        info["question"]
        == MathEnv("basic_arithmetic", configs["basic_arithmetic"]).reset(seed=0)[1]["question"]
    )
    assert (
        MathEnv("leg_counting", configs=configs).datasets["leg_counting"].config.min_animals == 3
    )  # its defaults
    with pytest.raises(InvalidArgumentError, match="not both"):
        MathEnv("chain_sum", EASY_SUM, configs=configs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"answer_fallback": "first_number"}, "answer_fallback must be one of"),
        ({"instruction": "cot"}, "instruction must be one of"),
    ],
)
def test_bad_answering_kwargs_raise(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        MathEnv(**kwargs)


def test_extract_answer_takes_the_last_tag():
    assert extract_answer("<answer>1</answer> wait <ANSWER>\n2 </ANSWER>") == "2"
    assert extract_answer("<answer>1") is None


def test_seeding_and_index_option():
    env = MathEnv("basic_arithmetic", {"min_terms": 3, "max_terms": 3})
    first = env.reset(seed=42)
    assert env.reset(seed=42) == first
    obs, info = env.reset(options={"index": 7})
    assert info["index"] == 7 and info["metadata"]["num_terms"] == 3
    assert MathEnv("basic_arithmetic", dataset_seed=1).reset(options={"index": 7})[0] != obs
    with pytest.raises(InvalidArgumentError, match=r"options\['index'\] must be an int in \[0, 100000\)"):
        env.reset(options={"index": -1})


def test_single_step_then_reset_needed():
    env = MathEnv()
    env.reset(seed=0)
    env.step("<answer>0</answer>")
    with pytest.raises(gym.error.ResetNeeded):
        env.step("<answer>0</answer>")


def test_bad_arguments_name_themselves():
    with pytest.raises(
        InvalidArgumentError, match=r"not a reasoning-gym dataset. Did you mean \['basic_arithmetic'"
    ):
        MathEnv("basic_arithmetc")
    with pytest.raises(InvalidArgumentError, match="config .* is not valid for dataset 'basic_arithmetic'"):
        MathEnv("basic_arithmetic", {"min_termz": 2})
    with pytest.raises(
        InvalidArgumentError, match="config must not set 'seed'; pass the env argument dataset_seed="
    ):
        MathEnv("basic_arithmetic", {"seed": 1})
    with pytest.raises(InvalidArgumentError, match="size must be an int >= 1"):
        MathEnv(size=0)
    with pytest.raises(InvalidArgumentError, match="outside the mix"):
        RGMixEnv({"chess": 1})
    with pytest.raises(InvalidArgumentError, match="positive sum"):
        RGMixEnv({"arc_1d": 0})


def test_rgmix_configs_match_the_seeds_mix():
    env = RGMixEnv()
    assert list(env.datasets) == ["arc_1d", "sokoban", "countdown", "zebra_puzzles", "cryptarithm"]
    assert env.weights == dict.fromkeys(env.datasets, 0.2)
    assert (env.datasets["countdown"].config.min_numbers, env.datasets["countdown"].config.max_numbers) == (
        7,
        7,
    )
    zebra = env.datasets["zebra_puzzles"].config
    assert (zebra.num_people, zebra.num_characteristics) == (7, 5)
    assert env.datasets["sokoban"].config.min_w == RGMIX_CONFIGS["sokoban"]["min_w"]


def test_rgmix_weights_and_gold_answers_offline(offline):
    env = RGMixEnv(FAST_MIX, configs={"countdown": {"min_numbers": 7, "max_numbers": 7, "max_target": 500}})
    drawn = set()
    for seed in range(12):
        obs, info = env.reset(seed=seed)
        drawn.add(info["dataset"])
        assert set(obs) <= set(TEXT_CHARSET)
        assert env.step(f"<answer>{info['answer']}</answer>")[1] == 1.0
    assert drawn == set(FAST_MIX)
    assert env.reset(seed=0) == env.reset(seed=0)
    assert RGMixEnv({"countdown": 1}).reset(seed=0)[1]["dataset"] == "countdown"


def test_rgmix_zebra_item_is_generated_locally(offline):
    # a 3×3 puzzle: the default 7×5 takes seconds per item on a CPU (its config is checked above)
    env = RGMixEnv(configs={"zebra_puzzles": {"num_people": 3, "num_characteristics": 3}})
    obs, info = env.reset(seed=0, options={"dataset": "zebra_puzzles", "index": 0})
    assert "There are 3 houses" in obs and set(obs) <= set(TEXT_CHARSET)
    assert env.step(f"<answer>{info['answer']}</answer>")[1] == 1.0

"""Recursive Self-Aggregation (docs/rsa.md): bookkeeping, determinism, batching, scoring, the command."""

from __future__ import annotations

import argparse
from collections import Counter

import gymnasium as gym
import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

import compaction_gym  # noqa: F401  (registers the env ids)
from compaction_gym.agents.rsa import (
    RSA,
    RSAConfig,
    aggregation_prompt,
    choose_subsets,
    majority,
    score_population,
)
from compaction_gym.engine import CompactionConfig, Engine, SamplingParams
from compaction_gym.envs.math import extract_answer
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.evaluation.rsa import (
    answer_extractor,
    env_scorer,
    evaluate_rsa,
    markdown_table,
    normalise,
    plain_config,
)
from compaction_gym.evaluation.rsa_cli import add_arguments, load_configs

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=10)
QUESTION = "What is 17 + 25?\n\nGive your final answer between <answer> and </answer> tags."


@pytest.fixture(scope="module")
def engine(tiny_model_path, one_torch_thread_module):
    return Engine.from_pretrained(tiny_model_path, dtype=torch.float32, device="cpu", max_slots=8, capacity=2048)


@pytest.fixture(scope="module")
def one_torch_thread_module():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Recorder:
    """The engine with every create / fork / step recorded (a test double that forwards)."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.creates, self.forks, self.steps = engine, [], [], []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def create_session(self, prompt_ids, config, sampling):
        self.creates.append(list(prompt_ids))
        return self.engine.create_session(prompt_ids, config, sampling)

    def fork(self, sid):
        self.forks.append(sid)
        return self.engine.fork(sid)

    def step_batch(self, reqs):
        self.steps.append([list(r.new_ids) for r in reqs])
        return self.engine.step_batch(reqs)


@given(n=st.integers(1, 9), data=st.data(), round_=st.integers(1, 5), seed=st.integers(0, 2**40))
def test_subsets_are_k_distinct_members(n, data, round_, seed):
    k = data.draw(st.integers(1, n))
    cfg = RSAConfig(population=n, subset=k, rounds=round_, seed=seed)
    subsets = choose_subsets(cfg, round_)
    assert len(subsets) == n and subsets == choose_subsets(cfg, round_)
    for s in subsets:
        assert len(s) == k == len(set(s)) and all(0 <= j < n for j in s)


def test_subsets_are_uniform():
    """Each member is shown with probability K/N; each ordered pair equally often (brute force)."""
    counts, pairs, draws = Counter(), Counter(), 0
    for seed in range(600):
        for s in choose_subsets(RSAConfig(population=4, subset=2, seed=seed), 1):
            counts.update(s)
            pairs[tuple(s)] += 1
            draws += 1
    for j in range(4):
        assert abs(counts[j] / draws - 0.5) < 0.03
    assert len(pairs) == 12 and all(abs(c / draws - 1 / 12) < 0.02 for c in pairs.values())


def test_config_checks_name_the_field():
    with pytest.raises(InvalidArgumentError, match="subset"):
        RSAConfig(population=2, subset=3)
    with pytest.raises(InvalidArgumentError, match="rounds"):
        RSAConfig(rounds=-1)
    with pytest.raises(InvalidArgumentError, match="population"):
        RSAConfig(population=True)


def test_population_bookkeeping(engine):
    """T+1 populations of N; each round prefills its shared prefix once, forks it N times, and
    member i's input shows exactly population[r-1][subsets[r-1][i]] in order."""
    rec = Recorder(engine)
    rsa = RSA(rec, RSAConfig(population=3, subset=2, rounds=2, seed=5), sampling=SAMPLING)
    run = rsa.run(QUESTION)
    assert [len(p) for p in run.populations] == [3, 3, 3] and len(run.subsets) == 2
    assert len(rec.creates) == 3 and len(rec.forks) == 9 and [len(s) for s in rec.steps] == [3, 3, 3]
    for r in (1, 2):
        for i, chosen in enumerate(run.subsets[r - 1]):
            prefix, part = aggregation_prompt(QUESTION, [run.populations[r - 1][j] for j in chosen])
            shared, member = rsa.encode_prompt(prefix, part)
            assert rec.creates[r] == shared and rec.steps[r][i] == member
    c = run.compute
    assert c.prefilled == sum(map(len, rec.creates)) + sum(len(m) for s in rec.steps for m in s)
    assert c.prefilled_unshared == sum(len(rec.creates[r]) * 3 + sum(map(len, rec.steps[r])) for r in range(3))
    assert 0 < c.generated <= 9 * SAMPLING.max_new_tokens
    assert engine.num_free_slots == engine.max_slots  # every fork and base session was closed


def test_deterministic_under_a_seed(engine):
    cfg = RSAConfig(population=3, subset=2, rounds=1, seed=11)
    a = RSA(engine, cfg, sampling=SAMPLING).run(QUESTION)
    b = RSA(engine, cfg, sampling=SAMPLING).run(QUESTION)
    c = RSA(engine, RSAConfig(population=3, subset=2, rounds=1, seed=12), sampling=SAMPLING).run(QUESTION)
    assert a.populations == b.populations and a.subsets == b.subsets and a.compute == b.compute
    assert a.populations != c.populations


@pytest.mark.parametrize(
    "compaction",
    [None, CompactionConfig(mode="attention_matching", max_kv_len=200, compact_window=48, n_probe_queries=8)],
)
def test_batching_equals_sequential(engine, tiny_model_path, compaction):
    """step_batch over the members == stepping them one by one == running in groups of 2 slots."""
    cfg = RSAConfig(population=4, subset=3, rounds=1, seed=3)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True)
    batched = RSA(engine, cfg, compaction=compaction, sampling=sampling).run(QUESTION)
    one_by_one = RSA(engine, cfg, compaction=compaction, sampling=sampling, batched=False).run(QUESTION)
    small = Engine.from_pretrained(tiny_model_path, dtype=torch.float32, device="cpu", max_slots=3, capacity=2048)
    grouped = RSA(small, cfg, compaction=compaction, sampling=sampling).run(QUESTION)
    assert batched.populations == one_by_one.populations == grouped.populations
    assert batched.compute == one_by_one.compute == grouped.compute
    if compaction is not None:
        assert batched.compute.events > 0  # the members really were compacted


def test_majority_and_scoring_brute_force():
    assert majority([None, "3", "4", "4", "3"]) == 1  # a tie goes to the answer seen first
    assert majority([None, "3", "4", "4"]) == 2
    assert majority([None, None]) is None
    texts = ["<answer>5</answer>", "<answer>6</answer>", "<answer>6</answer>", "no tag"]
    got = score_population(lambda t: float(extract_answer(t) == "5"), texts, extract_answer)
    assert got == {"mean": 0.25, "vote": 0.0, "any": 1.0}


def test_env_scorer_uses_the_envs_verifier():
    env = gym.make("AttnMatch-Math-v0", dataset="basic_arithmetic")
    _, info = env.reset(seed=3)
    score = env_scorer(env, info)
    assert score(f"so <answer>{info['answer']}</answer>") == 1.0
    assert score("<answer>not a number</answer>") == 0.0
    assert score(f"<answer>{info['answer']}</answer>") == 1.0  # the item is the same every time


def test_last_number_answers_are_scored_by_the_env():
    """``last_number``: an untagged response is scored on its last number; a tagged one as is."""
    assert normalise("so 3 + 4 is 7.", "last_number") == "<answer>7</answer>"
    assert normalise("<answer>5</answer> then 9", "last_number") == "<answer>5</answer> then 9"
    assert normalise("no digits", "last_number") == "no digits" and normalise("is 7", "tag") == "is 7"
    with pytest.raises(InvalidArgumentError, match="answer_format"):
        normalise("7", "first_number")
    env = gym.make("AttnMatch-Math-v0", dataset="basic_arithmetic")
    _, info = env.reset(seed=1)
    right, wrong = f"The result is {info['answer']}.", f"The result is {int(info['answer']) + 1}."
    assert env_scorer(env, info, "last_number")(right) == 1.0 and env_scorer(env, info)(right) == 0.0
    assert env_scorer(env, info, "last_number")(wrong) == 0.0
    assert answer_extractor(env, "last_number")(right) == str(info["answer"])


def test_end_to_end_scored_by_the_env(engine, tmp_path):
    cfg = RSAConfig(population=2, subset=2, rounds=1)
    out = evaluate_rsa(engine, "AttnMatch-Math-v0", cfg, tasks=["basic_arithmetic"], episodes=2, seed=4,
                       sampling=SAMPLING, output=tmp_path)  # fmt: skip
    assert [q["seed"] for q in out["questions"]] == [4, 5]
    for q in out["questions"]:
        env = gym.make("AttnMatch-Math-v0", dataset="basic_arithmetic")
        _, info = env.reset(seed=q["seed"])
        assert q["answer"] == str(info["answer"]) and q["index"] == info["index"]
        for m in ("rsa", "plain"):
            assert 0 <= q[m]["mean"] <= 1 and len(q[m]["final_answers"]) == (2 if m == "rsa" else 4)
        eq = q["plain_tokens"]  # batches of 4 until RSA's sampled tokens are reached
        assert eq["tokens_generated"] >= q["rsa"]["tokens_generated"] and eq["samples"] % 4 == 0
        assert eq["samples"] == 4 or eq["tokens_generated"] - q["rsa"]["tokens_generated"] < 4 * SAMPLING.max_new_tokens
    s = out["summary"]
    assert s["plain"]["tokens_generated"] > 0 and s["rsa"]["questions"] == 2
    assert (tmp_path / "rsa.jsonl").read_text().count("\n") == 2
    assert "RSA N=2 K=2 T=1" in markdown_table(s, cfg)
    assert plain_config(cfg) == RSAConfig(population=4, subset=1, rounds=0, seed=0)


def test_cli_flags_declared_once():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--population", "5", "--subset", "3", "--rounds", "2", "--temperature", "0.5",
                              "--max-kv-len", "256", "--mode", "markovian", "--env-kwargs", '{"require_answer_tag": false}'])  # fmt: skip
    cfg, rsa, comp, samp = load_configs(args)
    assert (rsa.population, rsa.subset, rsa.rounds) == (5, 3, 2)
    assert comp.max_kv_len == 256 and samp.temperature == 0.5 and cfg.env_kwargs == {"require_answer_tag": False}
    with pytest.raises(InvalidArgumentError, match="subset"):
        load_configs(parser.parse_args(["--population", "2", "--subset", "3"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--seed", "1"])  # the seed is the env seed (--env-seed), declared once


def test_rgmix_questions_are_scored_on_their_own_dataset(engine):
    """On AttnMatch-RGMix-v0 a task pins the dataset; the scorer re-opens the same item."""
    env = gym.make("AttnMatch-RGMix-v0", weights={"countdown": 1.0})
    _, info = env.reset(seed=2)
    score = env_scorer(env, info)
    assert info["dataset"] == "countdown" and score(f"<answer>{info['answer']}</answer>") == 1.0
    out = evaluate_rsa(engine, "AttnMatch-RGMix-v0", RSAConfig(population=2, subset=1, rounds=1),
                       tasks=["countdown"], episodes=1, seed=2, sampling=SAMPLING, baseline=False)  # fmt: skip
    (q,) = out["questions"]
    assert q["task"] == "countdown" and q["index"] == info["index"] and set(out["summary"]) == {"rsa"}

"""CompactionAgent on the real embedded engine with the tiny random model (CPU)."""

from __future__ import annotations

import gymnasium as gym
import pytest

import compaction_gym  # noqa: F401
from compaction_gym.agents import CompactionAgent, run_episode, run_episodes
from compaction_gym.backends import Backend, LocalBackend
from compaction_gym.engine.config import DEFAULT_BUDGET_TEMPLATE, CompactionConfig, SamplingParams

MAX_STEPS = 3
#: One config per mode, each with a trigger that fires within 3 BabyAI turns of the tiny model
#: (prompt ≈ 310 tokens, ≈ 190 per turn). Both triggers and β are covered.
KV = {"max_kv_len": 448, "compact_window": 96}
MODE_CONFIGS = {
    "none": CompactionConfig(),
    "attention_matching": CompactionConfig(mode="attention_matching", compute_beta=True, **KV),
    "markovian": CompactionConfig(mode="markovian", n_protect_turns=1),
    "h2o": CompactionConfig(mode="h2o", **KV),
    "snapkv": CompactionConfig(mode="snapkv", n_protect_turns=0),
    "streaming": CompactionConfig(mode="streaming", **KV),
    "random": CompactionConfig(mode="random", queries="random", **KV),
}


@pytest.fixture(scope="module")
def backend(tiny_model_path):
    return LocalBackend.from_pretrained(tiny_model_path, max_slots=4, capacity=2048)


def test_local_backend_is_a_backend(backend, tiny_model_path):
    assert isinstance(backend, Backend)
    assert backend.tokenizer is backend.engine.tokenizer and backend.max_slots == 4
    assert backend.name == str(tiny_model_path) and backend.eos_token_ids == list(
        backend.engine.eos_token_ids
    )
    assert "LocalBackend" in repr(backend)


@pytest.mark.parametrize("mode", list(MODE_CONFIGS))
def test_episode_runs_to_truncation_in_every_mode(backend, mode):
    tok = backend.tokenizer
    agent = CompactionAgent(
        backend, compaction=MODE_CONFIGS[mode], sampling=SamplingParams(temperature=0.0, max_new_tokens=4)
    )
    env = gym.make("AttnMatch-BabyAI-GoTo-v0", max_episode_steps=MAX_STEPS)
    traj = run_episode(env, agent, seed=0, close_session=False)
    try:
        view = backend.engine.session(agent.session_id)
        assert traj.info["truncated"] and not traj.info["terminated"] and len(traj.turns) == MAX_STEPS
        traj.validate()
        # the engine's own record of the session is the reference for tokens, mask and log-probs
        assert traj.token_ids == list(view.token_ids)
        assert traj.completion_mask == list(view.completion_mask)
        assert traj.logprobs == list(view.logprobs)
        assert traj.events == list(view.events)
        # mask 1 exactly on the generated tokens of each turn
        generated = {i for t in traj.turns for i in range(*t.output_range)}
        assert {i for i, m in enumerate(traj.completion_mask) if m} == generated
        assert traj.num_generated == MAX_STEPS * 4
        # the tokens are the chat transcript: the template's rendering of the conversation
        text = tok.decode(traj.token_ids, skip_special_tokens=False)
        assert tok.apply_chat_template(traj.messages(), tokenize=False) == text + "<|im_end|>\n"
        for a, b in [(0, traj.prompt_len)] + [t.input_range for t in traj.turns]:
            piece = tok.decode(traj.token_ids[a:b], skip_special_tokens=False)
            assert tok(piece, add_special_tokens=False)["input_ids"] == traj.token_ids[a:b]
        if mode == "none":
            assert not traj.events and traj.peak_kv_len >= traj.num_tokens - 1
        else:
            assert traj.events and {e.mode for e in traj.events} == {mode}
            assert traj.peak_kv_len < traj.num_tokens - 1
        assert traj.compaction["mode"] == mode and traj.metrics["compaction_events"] == len(traj.events)
    finally:
        agent.close()
    assert backend.engine.num_free_slots == 4


def test_batched_rollout_equals_sequential_rollouts(backend):
    seeds = [0, 1, 2, 3]
    # β is left out on purpose: its NNLS active set flips on 1e-6 differences between batched and
    # single-row attention, so recursive events with β may keep different keys (engine numerics,
    # not agent logic). Attention Matching without β must agree exactly.
    config = CompactionConfig(mode="attention_matching", **KV)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4)

    def make_env():
        return gym.make("AttnMatch-BabyAI-v0", max_episode_steps=MAX_STEPS)

    agents = [CompactionAgent(backend, compaction=config, sampling=sampling) for _ in seeds]
    calls = []
    original = backend.step_batch
    backend.step_batch = lambda reqs: calls.append(len(reqs)) or original(reqs)
    try:
        batched = run_episodes([make_env() for _ in seeds], agents, seeds, continuous=False)
    finally:
        del backend.step_batch
    assert calls and max(calls) == 4  # one step_batch per turn across the 4 episodes
    solo = CompactionAgent(backend, compaction=config, sampling=sampling)
    env = make_env()
    for seed, traj in zip(seeds, batched):
        ref = run_episode(env, solo, seed=seed)
        assert traj.info["task"] == ref.info["task"] and traj.info["mission"] == ref.info["mission"]
        assert traj.token_ids == ref.token_ids
        assert traj.completion_mask == ref.completion_mask
        assert traj.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
        assert [e.indices.tolist() for e in traj.events] == [e.indices.tolist() for e in ref.events]
        assert [t.action_text for t in traj.turns] == [t.action_text for t in ref.turns]
        assert traj.rewards == ref.rewards
    assert backend.engine.num_free_slots == 4


def test_math_env_single_step(backend):
    agent = CompactionAgent(backend, prompt="raw", sampling=SamplingParams(temperature=0.0, max_new_tokens=6))
    env = gym.make("AttnMatch-Math-v0")
    traj = run_episode(env, agent, seed=0)
    assert len(traj.turns) == 1 and traj.info["terminated"]
    assert traj.turns[0].input_range == (0, traj.prompt_len)
    assert traj.info["dataset"] == "basic_arithmetic" and traj.total_reward == traj.info["score"]
    text = backend.tokenizer.decode(traj.token_ids[: traj.prompt_len])
    assert (
        text.startswith("<|im_start|>user\n")
        and "<answer>" in text
        and text.endswith("<|im_start|>assistant\n")
    )


#: A Gemma-style template (not ChatML): the agent's budget messages must follow it.
GEMMA_TEMPLATE = (
    "{%- for m in messages %}{{- '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role'])"
    " + '\\n' + m['content'] + '<end_of_turn>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)


def test_budget_messages_follow_the_agents_chat_template(backend):
    tok = backend.tokenizer
    config = CompactionConfig(
        mode="markovian", max_kv_len=160, compact_window=64, max_total_tokens=300, inject_budget_message=True
    )
    agent = CompactionAgent(
        backend,
        compaction=config,
        sampling=SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True),
        prompt="raw",
        chat_template=GEMMA_TEMPLATE,
    )
    results = []
    step = backend.step
    backend.step = lambda *a, **k: results.append(step(*a, **k)) or results[-1]
    try:
        agent.reset("INSTRUCTION", seed=0)
        agent.act("an observation")
    finally:
        del backend.step
        agent.close()
    (r,) = results
    assert r.inject_ranges and r.events

    def render(messages, gen):  # the reference: the template itself, through the tokenizer
        return tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen, chat_template=GEMMA_TEMPLATE
        )

    first = [{"role": "user", "content": "X"}]
    for a, b in r.inject_ranges:
        used = sum(r.completion_mask[:a])  # nothing was sampled before this step
        text = DEFAULT_BUDGET_TEMPLATE.format(used=used, total=300, remaining=300 - used)
        expected = render([*first, {"role": "user", "content": text}], True)[len(render(first, False)) :]
        assert expected == f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"
        assert r.token_ids[a:b] == tok(expected, add_special_tokens=False)["input_ids"]
    assert tuple(agent.trajectory.compaction["budget_message_frame"]) == (
        "<start_of_turn>user\n",
        "<end_of_turn>\n<start_of_turn>model\n",
    )


def test_agent_keeps_a_given_budget_frame(backend):
    frame = ("\n[budget] ", " [/budget]\n")
    config = CompactionConfig(
        mode="markovian",
        n_protect_turns=0,
        max_total_tokens=50,
        inject_budget_message=True,
        budget_message_frame=frame,
    )
    agent = CompactionAgent(backend, compaction=config, chat_template=GEMMA_TEMPLATE)
    assert agent.compaction == config
    plain = CompactionAgent(backend, compaction=CompactionConfig(mode="markovian", n_protect_turns=0))
    assert plain.compaction.budget_message_frame is None  # no budget messages: nothing to frame

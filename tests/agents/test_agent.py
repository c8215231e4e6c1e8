"""CompactionAgent logic against a scripted, model-free backend (exact and fast)."""

from __future__ import annotations

import gymnasium as gym
import pytest

import compaction_gym  # noqa: F401  (registers the env ids)
from compaction_gym.agents import CompactionAgent, act_batch, run_episode, run_episodes
from compaction_gym.backends.scripted import ScriptedBackend
from compaction_gym.engine.config import SamplingParams
from compaction_gym.envs.babyai.prompts import PLAIN_AGENT_SUFFIX
from compaction_gym.errors import InvalidArgumentError

IM_END = "<|im_end|>"


def rendered(tokenizer, traj) -> str:
    """The reference transcript: the conversation through the tokenizer's own chat template."""
    return tokenizer.apply_chat_template(traj.messages(), tokenize=False)


def check_token_accounting(traj, backend, sid, tokenizer):
    """The trajectory equals the backend's own record; mask 1 exactly on generated tokens."""
    s = backend.sessions[sid]
    assert traj.token_ids == s["token_ids"]
    assert traj.completion_mask == s["completion_mask"]
    assert traj.logprobs == s["logprobs"]
    traj.validate()
    generated = set()
    for turn in traj.turns:
        if not turn.forced:
            generated |= set(range(*turn.output_range))
    assert {i for i, m in enumerate(traj.completion_mask) if m} == generated
    # what the agent fed (outside the outputs) is exactly the tokenisation of its text
    spans = [(0, traj.prompt_len)] + [t.input_range for t in traj.turns]
    for a, b in spans:
        text = tokenizer.decode(traj.token_ids[a:b], skip_special_tokens=False)
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == traj.token_ids[a:b]


def test_balrog_episode_transcript_matches_the_chat_template(tiny_tokenizer):
    backend = ScriptedBackend(tiny_tokenizer, ["turn left", "go forward"])
    agent = CompactionAgent(backend, sampling=SamplingParams(temperature=0.0, max_new_tokens=16))
    agent.reset("INSTRUCTION", seed=3)
    sid = agent.session_id
    assert agent.act("a wall 1 step forward") == "turn left"
    agent.observe(0.0, {"action": "turn left"})
    assert agent.act("a wall 2 steps left") == "go forward"
    agent.observe(0.5, {"action": "go forward", "invalid_action": False})
    traj = agent.finish({"progression": 1.0})

    # the model's <|im_end|> ended the last output; the template adds only the newline after it
    assert (
        rendered(tiny_tokenizer, traj)
        == tiny_tokenizer.decode(traj.token_ids, skip_special_tokens=False) + "\n"
    )
    assert traj.turns[0].message == "Current Observation:\na wall 1 step forward" + PLAIN_AGENT_SUFFIX
    assert [t.finish_reason for t in traj.turns] == ["stop", "stop"]
    assert [t.action for t in traj.turns] == ["turn left", "go forward"]
    assert traj.rewards == [0.0, 0.5] and traj.total_reward == 0.5 and traj.success
    assert traj.prompt_len == len(tiny_tokenizer("<|im_start|>user\nINSTRUCTION<|im_end|>\n")["input_ids"])
    check_token_accounting(traj, backend, sid, tiny_tokenizer)
    assert (
        traj.metrics["generated_tokens"]
        == traj.num_generated
        == sum(t.output_range[1] - t.output_range[0] for t in traj.turns)
    )

    # creation prefills only; each step continues the session's RNG stream (no per-request seed)
    verbs = [(c[0], c[3].max_new_tokens, c[3].seed) for c in backend.calls]
    seed = verbs[0][2]
    assert seed is not None and traj.sampling["seed"] == seed
    assert verbs == [("create", 0, seed), ("step", 16, None), ("step", 16, None)]


def test_length_finish_gets_the_full_closing(tiny_tokenizer):
    backend = ScriptedBackend(tiny_tokenizer, ["turn left and more words"], stop=False)
    agent = CompactionAgent(backend, sampling=SamplingParams(max_new_tokens=3))
    agent.reset("I")
    first = agent.act("o1")
    agent.observe(0.0)
    agent.act("o2")
    agent.observe(0.0)
    traj = agent.finish()
    assert (
        traj.turns[0].finish_reason == "length"
        and traj.turns[0].output_range[1] - traj.turns[0].output_range[0] == 3
    )
    assert traj.turns[0].action_text == first and first == tiny_tokenizer.decode(
        tiny_tokenizer("turn left and more words", add_special_tokens=False)["input_ids"][:3]
    )
    assert rendered(tiny_tokenizer, traj) == tiny_tokenizer.decode(traj.token_ids) + IM_END + "\n"
    check_token_accounting(traj, backend, agent.session_id, tiny_tokenizer)


def test_stop_token_that_is_not_the_template_closing_stays_in_the_text(tiny_tokenizer):
    dot = tiny_tokenizer(".", add_special_tokens=False)["input_ids"]
    assert len(dot) == 1
    backend = ScriptedBackend(tiny_tokenizer, ["turn left"], stop_token=dot[0])
    agent = CompactionAgent(backend)
    agent.reset("I")
    assert agent.act("o1") == "turn left."
    agent.observe(0.0)
    agent.act("o2")
    agent.observe(0.0)
    traj = agent.finish()
    assert rendered(tiny_tokenizer, traj) == tiny_tokenizer.decode(traj.token_ids) + IM_END + "\n"


def test_forced_turn_is_fed_not_sampled(tiny_tokenizer):
    backend = ScriptedBackend(tiny_tokenizer, ["turn left"])
    agent = CompactionAgent(backend, sampling=SamplingParams(max_new_tokens=8))
    agent.reset("I")
    assert agent.force("o1", "turn right") == "turn right"
    agent.observe(0.0)
    assert agent.act("o2") == "turn left"
    agent.observe(1.0)
    traj = agent.finish()
    forced, sampled = traj.turns
    assert forced.forced and not sampled.forced and forced.finish_reason == "forced"
    a, b = forced.output_range
    eos = tiny_tokenizer.convert_tokens_to_ids(IM_END)
    assert traj.token_ids[a:b] == tiny_tokenizer("turn right", add_special_tokens=False)["input_ids"] + [eos]
    assert traj.completion_mask[a:b] == [0] * (b - a)
    assert backend.calls[1][0] == "step" and backend.calls[1][3].max_new_tokens == 0
    assert rendered(tiny_tokenizer, traj) == tiny_tokenizer.decode(traj.token_ids) + "\n"
    check_token_accounting(traj, backend, agent.session_id, tiny_tokenizer)


def test_reasoning_format(tiny_tokenizer):
    backend = ScriptedBackend(tiny_tokenizer, ["<think>go</think><action>go forward</action>"])
    agent = CompactionAgent(backend, prompt="reasoning")
    agent.reset("I")
    assert agent.force("o", "turn left") == "<action>turn left</action>"
    agent.observe(0.0)
    assert (
        agent.force("o", "<think>x</think><action>drop</action>") == "<think>x</think><action>drop</action>"
    )
    agent.observe(0.0)
    assert agent.act("o") == "<think>go</think><action>go forward</action>"
    assert "<action>" in agent.trajectory.turns[0].message


def test_without_instruction_the_first_observation_is_the_prompt(tiny_tokenizer):
    backend = ScriptedBackend(tiny_tokenizer, ["<answer>4</answer>"])
    agent = CompactionAgent(backend, prompt="raw")
    agent.reset(None, seed=0)
    assert agent.session_id is None
    assert agent.act("What is 2+2?") == "<answer>4</answer>"
    agent.observe(1.0, {"extracted": "4", "score": 1.0})
    traj = agent.finish({"score": 1.0})
    prompt = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert traj.prompt_len == len(tiny_tokenizer(prompt)["input_ids"])
    assert traj.turns[0].input_range == (0, traj.prompt_len)
    assert traj.turns[0].action == "4" and traj.success
    assert tiny_tokenizer.decode(traj.token_ids) == prompt + "<answer>4</answer>" + IM_END
    check_token_accounting(traj, backend, agent.session_id, tiny_tokenizer)


def test_episode_seeds(tiny_tokenizer):
    backend = ScriptedBackend(tiny_tokenizer)

    def session_seed(agent, seed):
        agent.reset("I", seed=seed)
        return agent.trajectory.sampling["seed"]

    a = CompactionAgent(backend)
    b = CompactionAgent(backend)
    assert session_seed(a, 5) == session_seed(b, 5) != session_seed(a, 6)
    assert session_seed(a, None) is None
    c = CompactionAgent(backend, sampling=SamplingParams(seed=1))
    d = CompactionAgent(backend, sampling=SamplingParams(seed=2))
    assert session_seed(c, 5) != session_seed(d, 5)
    # a fixed sampling seed without episode seeds still varies across episodes
    assert session_seed(c, None) != session_seed(c, None)


def test_session_lifecycle(tiny_tokenizer):
    backend = ScriptedBackend(tiny_tokenizer)
    agent = CompactionAgent(backend)
    with pytest.raises(InvalidArgumentError, match="reset"):
        agent.act("o")
    agent.reset("I")
    first = agent.session_id
    agent.reset("I")
    assert first not in backend.sessions and agent.session_id in backend.sessions
    agent.act("o")
    with pytest.raises(InvalidArgumentError, match="observe"):
        agent.act("o")
    with pytest.raises(InvalidArgumentError, match="observation must be a str"):
        agent.observe(0.0) or agent.act(3)
    agent.close()
    agent.close()
    assert backend.sessions == {}
    with pytest.raises(InvalidArgumentError, match="closed"):
        agent.act("o")
    with pytest.raises(InvalidArgumentError, match="prompt must be one of"):
        CompactionAgent(backend, prompt="chatty")


def test_act_batch_uses_one_backend_call(tiny_tokenizer):
    backend = ScriptedBackend(tiny_tokenizer, lambda sid, i, ids: f"turn left {len(ids) % 3}")
    agents = [CompactionAgent(backend) for _ in range(3)]
    for i, a in enumerate(agents):
        a.reset(f"instruction {i}")
    backend.batch_sizes.clear()
    texts = act_batch(agents, ["o1", "o2", "o3"], [None, "drop", None])
    assert backend.batch_sizes == [3]
    assert texts[1] == "drop" and agents[1].trajectory.turns[0].forced
    # the same turn taken one agent at a time gives the same records
    solo_backend = ScriptedBackend(tiny_tokenizer, lambda sid, i, ids: f"turn left {len(ids) % 3}")
    for i, (a, obs, act) in enumerate(zip(agents, ["o1", "o2", "o3"], [None, "drop", None])):
        solo = CompactionAgent(solo_backend)
        solo.reset(f"instruction {i}")
        assert (solo.act(obs) if act is None else solo.force(obs, act)) == texts[i]
        assert solo.trajectory.token_ids == a.trajectory.token_ids
    other = CompactionAgent(ScriptedBackend(tiny_tokenizer))
    other.reset("I")
    for a in agents:
        a.observe(0.0)
    with pytest.raises(InvalidArgumentError, match="share one backend"):
        act_batch([agents[0], other], ["o", "o"])
    with pytest.raises(InvalidArgumentError, match="one observation"):
        act_batch(agents, ["o"])


def test_run_episode_on_babyai(tiny_tokenizer):
    backend = ScriptedBackend(tiny_tokenizer, ["turn left", "nonsense"])
    agent = CompactionAgent(backend)
    env = gym.make("AttnMatch-BabyAI-GoTo-v0", max_episode_steps=3)
    traj = run_episode(env, agent, seed=0)
    assert len(traj.turns) == 3 and traj.info["truncated"] and not traj.info["terminated"]
    assert traj.instruction.startswith("You are an agent playing a simple navigation game.")
    assert "instruction" not in traj.info and traj.info["mission"] in traj.instruction
    assert [t.action for t in traj.turns] == ["turn left", "go forward", "turn left"]
    assert [t.invalid_action for t in traj.turns] == [False, True, False]
    assert "Defaulted to action: go forward" in traj.turns[2].observation
    assert traj.env_id == "AttnMatch-BabyAI-GoTo-v0" and traj.seed == 0
    assert backend.sessions == {}  # closed at the end


def test_run_episode_stops_cleanly_when_the_backend_is_full(tiny_tokenizer):
    backend = ScriptedBackend(tiny_tokenizer, ["turn left"], capacity=700)
    agent = CompactionAgent(backend)
    env = gym.make("AttnMatch-BabyAI-GoTo-v0", max_episode_steps=50)
    traj = run_episode(env, agent, seed=0)
    assert "CapacityError" in traj.info["aborted"] and 0 < len(traj.turns) < 50
    assert len(traj.rewards) == len(traj.turns)


def test_run_episodes_equals_sequential_runs(tiny_tokenizer):
    def script(sid, i, ids):  # depends on the context, so any mix-up between sessions shows
        return ["turn left", "go forward", "turn right"][sum(ids) % 3]

    seeds = [0, 1, 2, 3, 4]
    backend = ScriptedBackend(tiny_tokenizer, script)
    envs = [gym.make("AttnMatch-BabyAI-GoTo-v0", max_episode_steps=4) for _ in range(2)]
    agents = [CompactionAgent(backend) for _ in range(2)]
    order = []
    batched = run_episodes(envs, agents, seeds, on_episode=lambda i, t: order.append(i))
    assert sorted(order) == list(range(5)) and max(backend.batch_sizes) == 2
    solo_backend = ScriptedBackend(tiny_tokenizer, script)
    solo = CompactionAgent(solo_backend)
    env = gym.make("AttnMatch-BabyAI-GoTo-v0", max_episode_steps=4)
    for seed, traj in zip(seeds, batched):
        ref = run_episode(env, solo, seed=seed)
        assert traj.seed == seed
        assert traj.token_ids == ref.token_ids and traj.rewards == ref.rewards and traj.turns == ref.turns
    assert backend.sessions == {}


def test_run_episodes_aborts_only_what_does_not_fit(tiny_tokenizer):
    envs = [gym.make("AttnMatch-BabyAI-GoTo-v0", max_episode_steps=3) for _ in range(2)]
    systems = [None, "You are a careful agent. " * 10]  # the second agent's sessions are longer
    lengths = []
    for system in systems:
        agent = CompactionAgent(ScriptedBackend(tiny_tokenizer), system_prompt=system)
        lengths.append(run_episode(envs[0], agent, seed=0).num_tokens)
    assert lengths[0] < lengths[1]
    backend = ScriptedBackend(tiny_tokenizer, capacity=lengths[0])
    agents = [CompactionAgent(backend, system_prompt=system) for system in systems]
    trajs = run_episodes(envs, agents, [0, 0])
    assert "aborted" not in trajs[0].info and len(trajs[0].turns) == 3 and trajs[0].num_tokens == lengths[0]
    assert "CapacityError" in trajs[1].info["aborted"] and len(trajs[1].turns) < 3
    assert len(trajs[1].rewards) == len(trajs[1].turns)
    assert backend.sessions == {}


def test_scripted_backend_scores_inputs_like_the_engine(tiny_tokenizer):
    """``score_input``: one value per input token, ``None`` at the session's first token only."""
    from compaction_gym.engine.types import StepRequest

    backend = ScriptedBackend(tiny_tokenizer, ["go"], input_logprob=-2.0)
    r = backend.create_session([5, 6, 7], sampling=SamplingParams(max_new_tokens=0), score_input=True)
    assert r.input_logprobs == [None, -2.0, -2.0]
    assert backend.step(r.session_id, [8, 9], score_input=True).input_logprobs == [-2.0, -2.0]
    [b] = backend.step_batch([StepRequest(r.session_id, [1], score_input=True)])
    assert b.input_logprobs == [-2.0]
    assert backend.step(r.session_id, [2]).input_logprobs is None

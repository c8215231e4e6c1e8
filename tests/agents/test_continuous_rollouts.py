"""Continuous-batched ``run_episodes`` (each episode advances on its own) against lock-step.

The reference is the lock-step schedule on the same seeds (itself checked against one-by-one
episodes in ``test_agent_engine.py``): token ids, completion masks, actions, rewards and the
compaction events' records (kept rows, spans, lengths) must be equal; log-probs agree to 1e-4 and
the fitted β to 1e-3 (the same row in a batch of another size rounds differently in the last bits
of float32, as for lock-step against one by one; the NNLS fit of β amplifies it).
"""

from __future__ import annotations

import re

import gymnasium as gym
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compaction_gym  # noqa: F401  (registers the env ids)
from compaction_gym.agents import CompactionAgent, Trajectory, run_episodes
from compaction_gym.backends import ContinuousBackend, LocalBackend, ScriptedBackend
from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.envs.babyai.expert import expert_action
from compaction_gym.errors import CapacityError, InvalidArgumentError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SLOTS = 4
#: both fire several times within a few BabyAI turns of the tiny model (prompt ≈ 310 tokens)
CONFIGS = {
    "am_beta": CompactionConfig(
        mode="attention_matching", compute_beta=True, max_kv_len=400, compact_window=64
    ),
    "markovian": CompactionConfig(mode="markovian", n_protect_turns=1),
}


class SeedLength(gym.Wrapper):
    """Truncates episode ``seed`` after ``2 + seed % 4`` steps, so workers finish at different times."""

    def reset(self, *, seed=None, options=None):
        self._left = 2 + (seed or 0) % 4
        return self.env.reset(seed=seed, options=options)

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._left -= 1
        return obs, reward, terminated, truncated or self._left <= 0, info


@pytest.fixture(scope="module")
def backend(tiny_model_path):
    return LocalBackend.from_pretrained(tiny_model_path, max_slots=SLOTS, capacity=2048, device="cpu")


def _sampling(backend, temperature: float, seed: int = 7) -> SamplingParams:
    # a few frequent ids stop a reply early, so replies in one batch have different lengths
    stops = list(range(200, 240))
    return SamplingParams(temperature=temperature, max_new_tokens=8, seed=seed, stop_token_ids=stops)


def _play(backend, config, sampling, seeds, workers, continuous, **kwargs) -> list[Trajectory]:
    envs = [SeedLength(gym.make("AttnMatch-BabyAI-v0", max_episode_steps=8)) for _ in range(workers)]
    agents = [CompactionAgent(backend, compaction=config, sampling=sampling) for _ in range(workers)]
    out = run_episodes(envs, agents, seeds, continuous=continuous, **kwargs)
    assert backend.engine.num_free_slots == SLOTS and not backend.engine.running_session_ids
    return out


def _event(e) -> dict:
    """The event's record but its timings and fitted floats (compared with a tolerance)."""
    return {k: v for k, v in e.to_dict().items() if k not in ("timings", "beta", "mass_kept")}


def assert_same(a: list[Trajectory], b: list[Trajectory]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.seed, x.token_ids, x.completion_mask) == (y.seed, y.token_ids, y.completion_mask)
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
        assert [(t.action_text, t.action, t.finish_reason, t.kv_len) for t in x.turns] == [
            (t.action_text, t.action, t.finish_reason, t.kv_len) for t in y.turns
        ]
        assert (x.rewards, x.total_reward, x.success) == (y.rewards, y.total_reward, y.success)
        assert [_event(e) for e in x.events] == [_event(e) for e in y.events]
        for e, f in zip(x.events, y.events):
            assert (e.beta is None) == (f.beta is None)
            if e.beta is not None:  # an NNLS fit: its conditioning amplifies the rounding (2e-4 seen)
                assert torch.allclose(e.beta, f.beta, atol=1e-3)
        assert _aborted(x) == _aborted(y)


def _aborted(t: Trajectory) -> str | None:
    """Why the episode was stopped, its session id left out (random)."""
    reason = t.info.get("aborted")
    return None if reason is None else re.sub(r"session '[0-9a-f]+'", "session", reason)


def test_local_backend_is_continuous(backend):
    assert isinstance(backend, ContinuousBackend)
    assert not isinstance(ScriptedBackend(backend.tokenizer), ContinuousBackend)


@pytest.mark.parametrize("merge_prefill", [False, True], ids=["prefill", "merged"])
@pytest.mark.parametrize("mode", list(CONFIGS))
@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_continuous_equals_lockstep(backend, mode, temperature, merge_prefill):
    config, sampling = CONFIGS[mode], _sampling(backend, temperature)
    seeds = [0, 5, 2, 7, 4, 1, 6]  # more seeds than workers; episodes of 2 to 5 turns
    calls: list[int] = []
    original = backend.submit
    backend.submit = lambda reqs, **kw: calls.append(len(reqs)) or original(reqs, **kw)
    try:
        cont = _play(backend, config, sampling, seeds, 3, True, merge_prefill=merge_prefill)
    finally:
        del backend.submit
    lock = _play(backend, config, sampling, seeds, 3, False)
    assert_same(cont, lock)
    assert sum(calls) == sum(len(t.turns) for t in cont)  # every turn went through submit
    assert min(calls) < 3  # ... and not in lock-step: some turns were submitted while others decoded
    assert [t.seed for t in cont] == seeds
    # compaction fired in every turn but the first (markovian: the previous turn), more with AM
    assert all(len(t.events) >= len(t.turns) - 1 for t in cont)
    assert len({len(t.turns) for t in cont}) > 1


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    workers=st.integers(1, SLOTS),
    n_seeds=st.integers(1, 6),
    temperature=st.sampled_from([0.0, 1.0, 2.0]),
    mode=st.sampled_from(list(CONFIGS)),
    round_steps=st.integers(1, 3),
    merge_prefill=st.booleans(),
    first_seed=st.integers(0, 50),
)
def test_continuous_equals_lockstep_property(
    backend, workers, n_seeds, temperature, mode, round_steps, merge_prefill, first_seed
):
    seeds = [first_seed + 3 * i for i in range(n_seeds)]
    config, sampling = CONFIGS[mode], _sampling(backend, temperature, seed=first_seed)
    cont = _play(
        backend, config, sampling, seeds, workers, True, round_steps=round_steps, merge_prefill=merge_prefill
    )
    lock = _play(backend, config, sampling, seeds, workers, False)
    assert_same(cont, lock)


def test_teacher_forcing_and_on_episode(backend):
    seeds = [3, 0, 2, 1, 4]
    ended: dict[str, list] = {"continuous": [], "lock": []}
    kw = {"teacher": expert_action}
    sampling = _sampling(backend, 1.0)
    cont = _play(
        backend, CONFIGS["am_beta"], sampling, seeds, 2, True, on_episode=lambda i, t: ended["continuous"].append((i, t)), **kw
    )  # fmt: skip
    lock = _play(
        backend, CONFIGS["am_beta"], sampling, seeds, 2, False, on_episode=lambda i, t: ended["lock"].append((i, t)), **kw
    )  # fmt: skip
    assert_same(cont, lock)
    assert all(t.forced for traj in cont for t in traj.turns) and not any(
        sum(t.completion_mask) for t in cont
    )
    for name, trajs in (("continuous", cont), ("lock", lock)):
        assert sorted(i for i, _ in ended[name]) == list(range(len(seeds)))
        assert all(trajs[i] is t for i, t in ended[name])


@pytest.mark.parametrize("named", [True, False], ids=["request_index", "unnamed"])
def test_capacity_error_aborts_only_the_episode_that_does_not_fit(tiny_model_path, named):
    # no compaction, 800 rows a slot: an episode stops at its third turn, whose input no longer fits
    backend = LocalBackend.from_pretrained(tiny_model_path, max_slots=SLOTS, capacity=800, device="cpu")
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=1, stop_token_ids=list(range(200, 240)))
    seeds = [3, 4, 0, 1, 6, 2]  # 2..5 turns: the 2-turn ones fit, the others are aborted mid-episode
    refused: list[int | None] = []
    original = backend.submit

    def submit(reqs, **kw):
        try:
            return original(reqs, **kw)
        except CapacityError as exc:
            refused.append(exc.request_index)
            if named:
                raise
            raise CapacityError(str(exc)) from None  # a backend that does not say which: one at a time

    backend.submit = submit
    cont = _play(backend, CompactionConfig(), sampling, seeds, 3, True)
    lock = _play(backend, CompactionConfig(), sampling, seeds, 3, False)
    assert_same(cont, lock)
    aborted = [t for t in cont if t.info.get("aborted")]
    assert aborted and len(aborted) < len(seeds) and refused  # the engine named the request it refused
    assert all(t.info["aborted"].startswith("CapacityError") and not t.info["truncated"] for t in aborted)


def test_backend_without_submit_plays_lockstep(tiny_tokenizer):
    def script(sid, i, ids):
        return "turn left" if len(ids) % 2 else "go forward"

    backend = ScriptedBackend(tiny_tokenizer, script)
    envs = [SeedLength(gym.make("AttnMatch-BabyAI-v0")) for _ in range(2)]
    agents = [CompactionAgent(backend) for _ in range(2)]
    trajs = run_episodes(envs, agents, [1, 2, 3])  # continuous=None: lock-step here
    assert max(backend.batch_sizes) == 2 and [len(t.turns) for t in trajs] == [3, 4, 5]
    with pytest.raises(InvalidArgumentError, match="continuous=True needs a backend with submit/advance"):
        run_episodes(envs, agents, [1], continuous=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"continuous": "yes"}, "continuous must be True, False or None"),
        ({"round_steps": 0}, "round_steps must be a positive int"),
        ({"round_steps": True}, "round_steps must be a positive int"),
        ({"merge_prefill": 1}, "merge_prefill must be a bool"),
    ],
)
def test_bad_settings_are_refused(tiny_tokenizer, kwargs, match):
    backend = ScriptedBackend(tiny_tokenizer)
    with pytest.raises(InvalidArgumentError, match=match):
        run_episodes([gym.make("AttnMatch-BabyAI-v0")], [CompactionAgent(backend)], [0], **kwargs)


def test_agents_on_different_backends_are_refused(tiny_tokenizer):
    agents = [CompactionAgent(ScriptedBackend(tiny_tokenizer)) for _ in range(2)]
    with pytest.raises(InvalidArgumentError, match="share one backend"):
        run_episodes([gym.make("AttnMatch-BabyAI-v0") for _ in range(2)], agents, [0])


def test_request_and_record(backend):
    agent = CompactionAgent(backend, sampling=_sampling(backend, 1.0))
    env = gym.make("AttnMatch-BabyAI-v0")
    obs, info = env.reset(seed=0)
    agent.reset(info["instruction"], seed=0)
    with pytest.raises(InvalidArgumentError, match="call request\\(\\) first"):
        agent.record(backend.step(agent.session_id, [1], SamplingParams(max_new_tokens=1)))
    agent.reset(info["instruction"], seed=0)
    other = CompactionAgent(backend)
    other.reset(info["instruction"], seed=1)
    req = agent.request(obs)
    with pytest.raises(InvalidArgumentError, match="result of session"):
        agent.record(backend.step(other.session_id, [1], SamplingParams(max_new_tokens=1)))
    text = agent.record(backend.step_batch([req])[0])
    assert text == agent.trajectory.turns[-1].action_text
    agent.close()
    other.close()

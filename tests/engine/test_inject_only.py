"""Periodic budget messages (``inject_budget_every``, the ``inject_only`` baseline; docs/engine.md).

References: the injected positions and texts are derived by walking the returned mask and
re-tokenizing the template by hand; sampled log-probs are checked against a plain float64 forward
of the whole sequence (nothing is compacted, so the plain model is the rollout's distribution) and
against the trainers' replay.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from compaction_gym.engine import CompactionConfig, Engine, SamplingParams
from compaction_gym.engine.engine import default_budget_frame
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.replay import replay_logprobs

PROMPT = list(range(5, 21))


@pytest.fixture(scope="module")
def eng(tiny_model_path):
    return Engine.from_pretrained(tiny_model_path, dtype=torch.float32, device="cpu", max_slots=3, capacity=2048)


def expected_message(eng: Engine, cfg: CompactionConfig, used: int) -> list[int]:
    total = cfg.max_total_tokens
    text = cfg.budget_message_template.format(used=used, total=total, remaining=total - used)
    prefix, suffix = cfg.budget_message_frame or default_budget_frame(eng.tokenizer)
    return eng.tokenizer.encode(prefix + text + suffix, add_special_tokens=False)


def check_injections(eng: Engine, cfg: CompactionConfig, token_ids, mask, logprobs, ranges, start_used: int = 0):
    """Walk the output: after every ``every``-th sampled token of the session (unless the output
    ends there) the message with ``used`` = that count follows, masked 0 with log-prob 0."""
    every, used, i, want = cfg.inject_budget_every, start_used, 0, []
    while i < len(token_ids):
        assert mask[i] == 1, f"position {i}: expected a sampled token"
        used, i = used + 1, i + 1
        if used % every == 0 and i < len(token_ids):
            msg = expected_message(eng, cfg, used)
            assert list(token_ids[i : i + len(msg)]) == msg
            assert list(mask[i : i + len(msg)]) == [0] * len(msg)
            assert list(logprobs[i : i + len(msg)]) == [0.0] * len(msg)
            want.append((i, i + len(msg)))
            i += len(msg)
    assert [tuple(r) for r in ranges] == want
    return used


def plain_logprobs(model, ids: list[int], temperature: float) -> torch.Tensor:
    """float64 log-softmax(logits / T) of each token under a plain forward of the whole sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits / temperature, -1)
    out = torch.zeros(len(ids), dtype=torch.float64)
    out[1:] = lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return out


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    total=st.integers(5, 48),
    every=st.integers(2, 17),
    temperature=st.sampled_from([0.0, 0.7, 1.0, 1.6]),
    seed=st.integers(0, 2**16),
)
def test_periodic_injection(eng, tiny_model, total, every, temperature, seed):
    cfg = CompactionConfig(max_total_tokens=total, inject_budget_every=every)
    r = eng.inject_generate(PROMPT, cfg, SamplingParams(temperature=temperature, ignore_eos=True, seed=seed, max_new_tokens=total))
    assert r.finish_reason == "budget"
    used = check_injections(eng, cfg, r.token_ids, r.completion_mask, r.logprobs, r.inject_ranges)
    assert used == total == sum(r.completion_mask)  # `used` counts sampled tokens only
    assert r.events == [] and r.kv_len == r.total_tokens - 1  # nothing compacted
    ids = PROMPT + r.token_ids
    ref = plain_logprobs(tiny_model, ids, temperature if temperature > 0 else 1.0)[len(PROMPT) :]
    mask = torch.tensor(r.completion_mask, dtype=torch.bool)
    got = torch.tensor(r.logprobs, dtype=torch.float64)
    if temperature > 0:  # the sampling distribution is plain softmax(logits / T): no top-k/top-p here
        assert (got[mask] - ref[mask]).abs().max() < 1e-4
    # the trainers' replay of the trajectory equals the rollout on every sampled token
    rs = eng.create_session(PROMPT, cfg, SamplingParams(temperature=temperature, ignore_eos=True, seed=seed, max_new_tokens=total))
    view = eng.session(rs.session_id)
    eng.close(rs.session_id)
    assert view.token_ids[len(PROMPT) :] == tuple(r.token_ids)  # same seed, same tokens
    if temperature > 0:  # replay divides by the trajectory's own sampling temperature
        replayed = replay_logprobs(tiny_model, view).double()
        vmask = torch.tensor(view.completion_mask, dtype=torch.bool)
        assert (replayed[vmask] - torch.tensor(view.logprobs, dtype=torch.float64)[vmask]).abs().max() < 1e-4


@pytest.mark.parametrize("chunk", [1, 3, 32])
def test_chunk_length_does_not_matter(tiny_model_path, chunk):
    """Decode chunks stop where the periodic message is due, so results equal the token-by-token loop."""
    results = []
    for steps in (1, chunk):
        e = Engine.from_pretrained(tiny_model_path, dtype=torch.float32, device="cpu", max_slots=2, capacity=512)
        e.runner.chunk_steps = steps
        cfg = CompactionConfig(max_total_tokens=40, inject_budget_every=7)
        r = e.inject_generate(PROMPT, cfg, SamplingParams(temperature=1.0, ignore_eos=True, seed=3, max_new_tokens=40))
        results.append((r.token_ids, r.logprobs, r.inject_ranges))
    assert results[0] == results[1]


def test_count_spans_turns_and_excludes_injected(eng):
    """The period counts the session's sampled tokens across steps; inputs and messages never count."""
    cfg = CompactionConfig(max_total_tokens=60, inject_budget_every=6)
    sp = SamplingParams(temperature=1.0, ignore_eos=True, seed=9, max_new_tokens=8)
    r = eng.create_session(PROMPT, cfg, sp)
    used = check_injections(eng, cfg, r.token_ids, r.completion_mask, r.logprobs, r.inject_ranges)
    for t in range(4):
        r = eng.step(r.session_id, [30 + t, 31 + t, 32 + t], sp.replace(seed=None))
        used = check_injections(eng, cfg, r.token_ids, r.completion_mask, r.logprobs, r.inject_ranges, used)
    view = eng.session(r.session_id)
    eng.close(r.session_id)
    assert view.generated_tokens == used == 40 == sum(view.completion_mask)


def test_with_kv_budget_compaction_replays(eng, tiny_model):
    """Periodic messages beside KV-budget events (and their own messages): replay still equals rollout."""
    cfg = CompactionConfig(
        mode="attention_matching", max_kv_len=64, compact_window=32, n_probe_queries=16,
        max_total_tokens=120, inject_budget_every=10, inject_budget_message=True,
    )  # fmt: skip
    r = eng.create_session(PROMPT, cfg, SamplingParams(temperature=1.0, ignore_eos=True, seed=4, max_new_tokens=120))
    view = eng.session(r.session_id)
    eng.close(r.session_id)
    assert len(view.events) >= 2 and view.generated_tokens == 120
    sampled_before = [sum(r.completion_mask[:a]) for a, _ in r.inject_ranges]
    assert {10 * k for k in range(1, 12)} <= set(sampled_before)  # every periodic message is there
    vmask = torch.tensor(view.completion_mask, dtype=torch.bool)
    diff = replay_logprobs(tiny_model, view).double()[vmask] - torch.tensor(view.logprobs, dtype=torch.float64)[vmask]
    assert diff.abs().max() < 1e-4


def test_bad_configs_name_the_field(eng):
    with pytest.raises(InvalidArgumentError, match="inject_budget_every"):
        CompactionConfig(inject_budget_every=0)
    with pytest.raises(InvalidArgumentError, match="inject_budget_every"):
        CompactionConfig(inject_budget_every=2.5)
    with pytest.raises(InvalidArgumentError, match="inject_budget_every needs max_total_tokens"):
        eng.create_session(PROMPT, CompactionConfig(inject_budget_every=4), SamplingParams(max_new_tokens=4))
    with pytest.raises(InvalidArgumentError, match="budget_message_template"):
        CompactionConfig(inject_budget_every=4, max_total_tokens=9, budget_message_template="{spent}")
    with pytest.raises(InvalidArgumentError, match="mode must be 'none'"):
        eng.inject_generate(PROMPT, CompactionConfig(mode="markovian", max_kv_len=64, max_total_tokens=9, inject_budget_every=3))
    with pytest.raises(InvalidArgumentError, match="inject_budget_every"):
        eng.inject_generate(PROMPT, CompactionConfig(max_total_tokens=9))
    assert eng.num_free_slots == eng.max_slots

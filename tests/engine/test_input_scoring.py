"""Scoring fed tokens (``score_input``): plain forward without compaction, replay with it.

References: a plain HF forward's log-softmax over the session's tokens (nothing compacted), and
``replay_logprobs(..., positions=...)`` of the session's trajectory (compaction between steps).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compaction_gym.engine import CompactionConfig, CreateRequest, Engine, SamplingParams, StepRequest
from compaction_gym.engine.types import StepResult
from compaction_gym.trainers.replay import replay_logprobs

FORCE = SamplingParams(max_new_tokens=0)
GEN = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True)


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g).tolist()


def plain_logprobs(model, tokens: list[int]) -> list[float]:
    """``out[p] = log_softmax(logits[p - 1])[tokens[p]]`` of one plain forward (``out[0]`` = NaN)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    lp = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(tokens[1:])[:, None]).squeeze(-1)
    return [math.nan, *lp.tolist()]


def check(result: StepResult, reference: list[float], start: int, tol: float) -> None:
    """``result.input_logprobs`` equal ``reference`` at the logical positions of its input."""
    got = result.input_logprobs
    assert got is not None and len(got) == result.prompt_len
    for i, lp in enumerate(got):
        ref = reference[start + i]
        if math.isnan(ref):
            assert lp is None
        else:
            assert lp is not None and abs(lp - ref) < tol, (start + i, lp, ref)


def plain_entropies(model, tokens: list[int]) -> list[float]:
    """``out[p]`` = entropy (nats, float64) of the plain forward's distribution at ``p - 1``."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([tokens])).logits[0].double(), -1)[:-1]
    return [math.nan, *(-(lp.exp() * lp).sum(-1)).tolist()]


def check_entropies(result: StepResult, reference: list[float], start: int) -> None:
    """``result.input_entropies`` equal ``reference`` where a log-prob exists (``None`` elsewhere)."""
    got = result.input_entropies
    assert got is not None and len(got) == result.prompt_len
    for i, (h, lp) in enumerate(zip(got, result.input_logprobs)):
        assert (h is None) == (lp is None)
        if h is not None:
            assert abs(h - reference[start + i]) < 1e-4, (start + i, h, reference[start + i])


@pytest.fixture
def chunked(tiny_model_path):
    """An engine whose prefill chunk (7) splits every input."""
    return Engine.from_pretrained(
        tiny_model_path, dtype=torch.float32, device="cpu", max_slots=4, capacity=512, prefill_chunk=7
    )


def test_uncompacted_scores_equal_plain_forward(chunked, tiny_model):
    """Several steps (forced and generating), chunk boundaries, a batch with other sessions."""
    r = chunked.create_session(ids(17, 0), None, FORCE, score_input=True)
    assert r.input_logprobs[0] is None
    results = [(r, 0)]
    other = chunked.create_session(ids(9, 1), None, GEN.replace(seed=1))
    steps = [
        (ids(12, 2), FORCE),
        (ids(1, 3), GEN.replace(seed=3)),
        (ids(15, 4), FORCE),
        ([], GEN),
        (ids(5, 5), FORCE),
    ]
    for new, sampling in steps:
        # the pending sampled token of the previous response is fed before `new` (not scored)
        start = len(chunked.session(r.session_id).token_ids)
        batch = chunked.step_batch(
            [
                CreateRequest(ids(11, start), None, GEN.replace(seed=start)),
                StepRequest(r.session_id, new, sampling, score_input=True),
                StepRequest(other.session_id, ids(3, start), GEN),
            ]
        )
        results.append((batch[1], start))
        chunked.close(batch[0].session_id)
        assert batch[0].input_logprobs is None and batch[2].input_logprobs is None
    reference = plain_logprobs(tiny_model, chunked.session(r.session_id).token_ids)
    entropies = plain_entropies(tiny_model, chunked.session(r.session_id).token_ids)
    for res, start in results:
        check(res, reference, start, 1e-5)
        check_entropies(res, entropies, start)
    assert results[4][0].input_logprobs == [] and results[4][0].input_entropies == []
    assert StepResult.from_dict(results[1][0].to_dict()).input_entropies == results[1][0].input_entropies


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(0, 23), min_size=1, max_size=5),
    first=st.integers(1, 20),
    prefill_chunk=st.integers(1, 16),
)
def test_scores_do_not_depend_on_how_the_text_is_split(
    tiny_model_path, tiny_model, sizes, first, prefill_chunk
):
    """Any split into calls and prefill chunks: the plain forward's log-probs (nothing compacted)."""
    engine = Engine.from_pretrained(
        tiny_model_path,
        dtype=torch.float32,
        device="cpu",
        max_slots=1,
        capacity=256,
        prefill_chunk=prefill_chunk,
    )
    tokens = ids(first + sum(sizes), 99)
    r = engine.create_session(tokens[:first], None, FORCE, score_input=True)
    got = list(r.input_logprobs)
    start = first
    for n in sizes:
        got += engine.step(r.session_id, tokens[start : start + n], FORCE, score_input=True).input_logprobs
        start += n
    reference = plain_logprobs(tiny_model, tokens)
    assert got[0] is None and all(x is not None for x in got[1:])
    assert max((abs(a - b) for a, b in zip(got[1:], reference[1:])), default=0.0) < 1e-5


def test_scoring_does_not_change_the_session(tiny_model_path):
    """Same tokens and cache with and without scoring (it only reads logits); the sampled tokens'
    log-probs agree to float32 rounding (the LM head then runs over every column, not just the last)."""
    views = []
    for score in (False, True):
        engine = Engine.from_pretrained(
            tiny_model_path, dtype=torch.float32, device="cpu", max_slots=2, capacity=512, prefill_chunk=5
        )
        cfg = CompactionConfig(mode="attention_matching", max_kv_len=48, compact_window=24)
        r = engine.create_session(ids(20, 7), cfg, GEN.replace(seed=7), score_input=score)
        engine.step(r.session_id, ids(30, 8), score_input=score)
        views.append((engine.session(r.session_id), engine.read_cache(r.session_id)))
    (a, ca), (b, cb) = views
    assert a.token_ids == b.token_ids and len(a.events) == len(b.events) > 0
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    assert all(torch.equal(x, y) for x, y in zip(ca, cb))


@pytest.mark.parametrize(
    "config",
    [
        CompactionConfig(mode="attention_matching", max_kv_len=48, compact_window=24, compute_beta=True),
        CompactionConfig(mode="streaming", max_kv_len=40, compact_window=16),
        CompactionConfig(mode="markovian", max_kv_len=40, compact_window=16),
        CompactionConfig(mode="snapkv", n_protect_turns=0),
    ],
    ids=["am+beta", "streaming", "markovian", "snapkv-turn"],
)
def test_compacted_scores_equal_replay(chunked, tiny_model, config):
    """Compaction fires between (and inside) steps: scores equal replaying the trajectory."""
    r = chunked.create_session(ids(12, 10), config, GEN.replace(seed=10), score_input=True)
    results = [(r, 0)]
    for t, (n, sampling) in enumerate([(20, FORCE), (9, GEN), (25, FORCE), (6, GEN), (30, FORCE)]):
        start = len(chunked.session(r.session_id).token_ids)
        sampling = sampling.replace(seed=t) if sampling.max_new_tokens else sampling
        res = chunked.step(r.session_id, ids(n, 11 + t), sampling, score_input=True)
        results.append((res, start))
    view = chunked.session(r.session_id)
    assert len(view.events) >= 2
    positions = [start + i for res, start in results for i in range(res.prompt_len) if start + i > 0]
    replayed = replay_logprobs(tiny_model, view, positions=positions)
    reference = [math.nan, *replayed[1:].double().tolist()]
    for res, start in results:
        check(res, reference, start, 1e-4)
    # and compaction changed them: they differ from a plain forward somewhere
    plain = plain_logprobs(tiny_model, view.token_ids)
    assert max(abs(plain[p] - reference[p]) for p in positions) > 1e-3


def test_step_result_round_trips_input_logprobs():
    r = StepResult("s", [1], [0.0], [1], "", "length", input_logprobs=[None, -1.5])
    assert StepResult.from_dict(r.to_dict()).input_logprobs == [None, -1.5]
    assert StepResult.from_dict({**r.to_dict(), "input_logprobs": None}).input_logprobs is None


@pytest.mark.gpu
def test_fast_runner_scores_like_the_generic_one(tiny_model_path):
    """CUDA: the fast runner's flat prefill scores inputs as the generic runner does, through
    KV-budget compaction and decode graphs, in a batch with a non-scoring session."""
    from compaction_gym.engine.fast import FastModelRunner

    cfg = CompactionConfig(mode="attention_matching", max_kv_len=96, compact_window=48, compute_beta=True)
    out = {}
    for fast in (False, True):
        eng = Engine.from_pretrained(
            tiny_model_path,
            dtype=torch.float32,
            device="cuda",
            max_slots=4,
            capacity=1024,
            prefill_chunk=40,
            fast=fast,
        )
        assert isinstance(eng.runner, FastModelRunner) == fast
        a = eng.create_session(ids(50, 20), cfg, FORCE, score_input=True)
        b = eng.create_session(ids(7, 21), cfg, GEN.replace(temperature=0.0, max_new_tokens=8))
        results = [a]
        for t in range(4):
            sampling = GEN.replace(temperature=0.0) if t % 2 else FORCE
            rs = eng.step_batch(
                [
                    StepRequest(a.session_id, ids(30 + t, 22 + t), sampling, score_input=True),
                    StepRequest(b.session_id, [5]),
                ]
            )
            results.append(rs[0])
            assert rs[1].input_logprobs is None
        out[fast] = results
    assert sum(len(r.events) for r in out[True]) > 0
    for r_gen, r_fast in zip(out[False], out[True]):
        assert len(r_gen.input_logprobs) == len(r_fast.input_logprobs) == r_gen.prompt_len
        for x, y in zip(r_gen.input_logprobs, r_fast.input_logprobs):
            assert (x is None) == (y is None) and (x is None or abs(x - y) < 1e-4), (x, y)


@pytest.mark.parametrize("rows_per_pass", [1, 7, 256])
def test_target_logprobs_in_passes_equal_float64(rows_per_pass):
    from compaction_gym.engine.model_runner import target_logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 33, generator=g, dtype=torch.float64) * 4
    targets = torch.randint(0, 33, (40,), generator=g)
    ref = torch.log_softmax(logits, -1)[torch.arange(40), targets]
    got = target_logprobs(logits.to(torch.bfloat16), targets, rows_per_pass)
    assert got.dtype == torch.float32 and got.shape == (40,)
    assert (
        got.double() - torch.log_softmax(logits.to(torch.bfloat16).double(), -1)[torch.arange(40), targets]
    ).abs().max() < 1e-5
    assert (target_logprobs(logits, targets, rows_per_pass).double() - ref).abs().max() < 1e-5
    assert target_logprobs(logits[:0], targets[:0]).shape == (0,)


def test_target_scores_entropy_equals_float64():
    from compaction_gym.engine.model_runner import target_scores

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(19, 29, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, 29, (19,), generator=g)
    lp = torch.log_softmax(logits, -1)
    _, ent = target_scores(logits, targets, rows_per_pass=4)
    assert (ent.double() + (lp.exp() * lp).sum(-1)).abs().max() < 1e-5


#: Session settings of the property below: β on (suffix, keys and repeat probes, refitted and kept
#: values) and the baselines whose selection reads probe positions or none.
SCORED_CONFIGS = {
    "am+beta": dict(mode="attention_matching", compute_beta=True),
    "am+beta-keys": dict(mode="attention_matching", compute_beta=True, queries="keys"),
    "am+beta-repeat-kept": dict(
        mode="attention_matching", compute_beta=True, queries="repeat", refit_values=False
    ),
    "am+beta-suffix+repeat": dict(mode="attention_matching", compute_beta=True, queries="suffix+repeat"),
    "h2o": dict(mode="h2o"),
    "tova": dict(mode="tova"),
    "knorm": dict(mode="knorm"),
    "markovian": dict(mode="markovian"),
}
#: Both fire several times over a 12-token prompt and 4 steps of 18-30 inputs (+ 5 sampled tokens).
SCORED_TRIGGERS = {"kv_budget": dict(max_kv_len=48, compact_window=24), "turn": dict(n_protect_turns=1)}


@pytest.fixture(scope="module")
def scoring_engines(tiny_model_path):
    """Two engines on the tiny model whose prefill chunks (5, 64) split inputs differently."""
    return {
        chunk: Engine.from_pretrained(
            tiny_model_path, dtype=torch.float32, device="cpu", max_slots=3, capacity=512, prefill_chunk=chunk
        )
        for chunk in (5, 64)
    }


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    name=st.sampled_from(sorted(SCORED_CONFIGS)),
    trigger=st.sampled_from(sorted(SCORED_TRIGGERS)),
    temperature=st.sampled_from([1.0, 2.0]),
    batched=st.booleans(),
    chunk=st.sampled_from([5, 64]),
)
def test_scores_equal_replay_property(
    scoring_engines, tiny_model, seed, name, trigger, temperature, batched, chunk
):
    """Whatever the mode, probe source, trigger, temperature, prefill chunk and batching: every scored
    input token's log-prob equals replaying the session's trajectory (several events per session)."""
    engine = scoring_engines[chunk]
    cfg = CompactionConfig(**SCORED_CONFIGS[name], **SCORED_TRIGGERS[trigger], n_probe_queries=8)
    sampling = GEN.replace(temperature=temperature, max_new_tokens=5)
    n_sessions = 2 if batched else 1
    firsts = [
        engine.create_session(ids(12, seed + k), cfg, FORCE, score_input=True) for k in range(n_sessions)
    ]
    scored = {r.session_id: [(r, 0)] for r in firsts}
    for t in range(4):
        requests, starts = [], []
        for k, sid in enumerate(scored):
            starts.append(len(engine.session(sid).token_ids))
            new = ids(18 + (seed + 3 * t + k) % 13, 100 * seed + 10 * t + k)
            requests.append(StepRequest(sid, new, sampling.replace(seed=seed + t + k), score_input=True))
        results = engine.step_batch(requests) if batched else [engine.step_batch([q])[0] for q in requests]
        for res, start in zip(results, starts):
            scored[res.session_id].append((res, start))
    for sid, pairs in scored.items():
        view = engine.session(sid)
        engine.close(sid)
        assert len(view.events) >= 2, "the property needs several compaction events per session"
        positions = [start + i for res, start in pairs for i in range(res.prompt_len) if start + i > 0]
        replayed = replay_logprobs(tiny_model, view, temperature=1.0, positions=positions)
        reference = [math.nan, *replayed[1:].double().tolist()]
        for res, start in pairs:
            check(res, reference, start, 1e-4)
        plain = plain_logprobs(tiny_model, view.token_ids)  # compaction did change what was scored
        assert max(abs(plain[p] - reference[p]) for p in positions) > 1e-3

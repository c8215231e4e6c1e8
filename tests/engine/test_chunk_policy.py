"""Where decode chunks end (``engine.chunk_policy``, docs/engine.md "Decode chunks end at pauses"):
the plan against a brute force over every cut set, the chunk lengths it gives, and a scheduler
whose chunks end at pauses giving the same sessions as one whose chunks run to their longest row."""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import pytest
import torch
from engine_helpers import make_prompt
from hypothesis import given, settings

from compaction_gym.engine import CompactionConfig, CreateRequest, Engine, SamplingParams, StepRequest
from compaction_gym.engine.chunk_policy import ChunkCosts, plan


def brute_cost(
    points: list[int], longest: int, cuts: tuple[int, ...], event_steps: float, restart_steps: float
) -> float:
    """A cut set's cost from its definition: each row waits for the first cut at or after its
    pause (or the chunk's end); the tail is the longest wait; one round of host work per point
    where rows are served; one chunk per cut, one to the end and one for the tail if any."""
    waits, served = [], set()
    for p in points:
        c = min([c for c in cuts if c >= p], default=longest)
        waits.append(c - p)
        served.add(c)
    chunks = len(cuts) + 1 + (max(waits) > 0)
    return max(waits) + event_steps * len(served) + restart_steps * chunks


@settings(max_examples=300, deadline=None)
@given(
    points=st.sets(st.integers(1, 30), min_size=1, max_size=7),
    extra=st.integers(1, 6),
    event_steps=st.floats(0, 30),
    restart_steps=st.floats(0, 30),
)
def test_the_plan_is_the_cheapest_cut_set(points, extra, event_steps, restart_steps):
    """Property: over pause points, chunk lengths and costs, the plan's cost is the minimum over
    every subset of the points as cuts (brute force), and its cuts cost that much."""
    points = sorted(points)
    longest = points[-1] + extra
    costs = (event_steps, restart_steps)
    cost, cuts = plan(points, longest, *costs)
    subsets = (c for r in range(len(points) + 1) for c in itertools.combinations(points, r))
    best = min(brute_cost(points, longest, c, *costs) for c in subsets)
    assert cost == pytest.approx(best, rel=1e-12, abs=1e-12)
    assert brute_cost(points, longest, tuple(cuts), *costs) == pytest.approx(best, rel=1e-12, abs=1e-12)
    assert cuts == sorted(set(cuts)) and set(cuts) <= set(points)


def test_chunks_end_at_the_plans_first_cut():
    costs = ChunkCosts()  # a round 1 step, a restart 0.5
    assert costs.chunk_steps([], 19) == 19 and costs.chunk_steps([19, 25], 19) == 19  # no pause inside
    assert costs.chunk_steps([5], 19) == 5  # one pause: served at the same round 14 steps earlier
    # a pause at every step from 3: running on costs a 16-step tail, a round and 2 chunks (19);
    # a cut at each, 16 rounds and 17 chunks (24.5); best: a round every 4 pauses (4 + 6 · 0.5 + 3)
    assert plan(list(range(3, 19)), 19, 1.0, 0.5) == (pytest.approx(10.0), [6, 10, 14, 18])
    assert costs.chunk_steps(list(range(3, 19)), 19) == 6
    assert costs.chunk_steps([9, 3, 3, 5], 19) == 3  # any order, repeats
    dear = ChunkCosts(event_steps=20.0, restart_steps=9.0)  # rounds dearer than any tail
    assert dear.chunk_steps(list(range(10, 19)), 19) == 19
    # one round only, at the last pause rather than after the chunk: 1 step of tail less, 1 chunk more
    assert ChunkCosts(event_steps=20.0, restart_steps=0.5).chunk_steps(list(range(3, 19)), 19) == 18


BUDGET = {"max_kv_len": 48, "compact_window": 24, "compact_target_ratio": 0.25, "n_probe_queries": 8}


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return Engine.from_pretrained(
        tiny_model_path, dtype=torch.float64, device="cpu", max_slots=4, capacity=512
    )


def play(engine: Engine, cut: bool, costs: ChunkCosts | None = None):
    """Four sessions whose KV-budget events fall inside their responses at different steps (β on,
    temperature 1.5): their views and the decode chunks' (rows, steps)."""
    chunks: list[tuple[int, int]] = []
    runner, scheduler = engine.runner, engine.scheduler
    decode_chunk, old = runner.decode_chunk, (scheduler.cut_chunks, scheduler.chunk_costs)

    def recording(rows, steps):
        chunks.append((len(rows), steps))
        return decode_chunk(rows, steps)

    runner.decode_chunk = recording
    scheduler.cut_chunks, scheduler.chunk_costs = cut, costs or ChunkCosts()
    cfg = CompactionConfig(mode="attention_matching", compute_beta=True, **BUDGET)
    sampling = SamplingParams(temperature=1.5, max_new_tokens=14, ignore_eos=True)
    try:
        created = engine.step_batch(
            [CreateRequest(make_prompt(n, seed=i), cfg, sampling.replace(seed=i)) for i, n in enumerate([11, 14, 17, 20])]
        )  # fmt: skip
        sids = [r.session_id for r in created]
        for turn in range(3):
            engine.step_batch(
                [StepRequest(s, make_prompt(5 + i, seed=50 + 10 * turn + i)) for i, s in enumerate(sids)]
            )
        views = [engine.session(s) for s in sids]
    finally:
        del runner.decode_chunk
        scheduler.cut_chunks, scheduler.chunk_costs = old
        for s in engine.session_ids:
            engine.close(s)
    return views, chunks


def test_chunks_that_end_at_pauses_give_the_same_sessions(engine):
    """The same tokens, log-probs and events (at the same tokens, the same kept rows) whether
    chunks end at pauses or run on; ending them removes the tail steps that only paused rows ran,
    and with every cut priced out the chunks are those that run on."""
    assert engine.scheduler.cut_chunks  # the default
    (on, chunks_on), (off, chunks_off) = play(engine, True), play(engine, False)
    for a, b in zip(on, off):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-9)
        assert len(a.events) == len(b.events) >= 2
        for ea, eb in zip(a.events, b.events):
            assert (ea.span, ea.logical_span, ea.kv_len_after) == (eb.span, eb.logical_span, eb.kv_len_after)
            assert torch.equal(ea.indices, eb.indices)
    full = len(on)
    assert any(rows < full for rows, _ in chunks_off)  # tails: chunks of paused rows alone
    assert all(rows == full for rows, _ in chunks_on)
    assert sum(s for _, s in chunks_on) < sum(s for _, s in chunks_off)
    assert play(engine, True, ChunkCosts(restart_steps=1e9))[1] == chunks_off  # every cut priced out
    assert play(engine, True)[1] == chunks_on  # the same chunks every run: no timing decides

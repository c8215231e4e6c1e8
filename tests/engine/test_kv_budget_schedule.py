"""``kv_budget_from``: which span each KV-budget event compacts, against a brute-force row simulation.

The reference keeps one entry per cache row (a raw logical position, or the logical range of the
compacted block the row belongs to) and applies the schedule of docs/engine.md ("Triggers") to that
list directly, without the engine's :class:`RowMap` or its planning arithmetic.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from engine_helpers import make_prompt
from hypothesis import example, given, settings

from compaction_gym.compaction.rowmap import RowMap, replace_blocks
from compaction_gym.engine import CompactionConfig, Engine, SamplingParams
from compaction_gym.errors import InvalidArgumentError

Row = tuple[str, int, int]  # ("raw", p, p + 1) or ("block", lo, hi)


def reference_events(
    feeds: list[int], protected: int, max_kv: int, window: int, target: int, schedule: str
) -> tuple[list[tuple[tuple[int, int], tuple[int, int], int, int]], int]:
    """``(span, logical_span, kv_before, kv_after)`` of every KV-budget event while feeding ``feeds``
    rows (the first feed is the protected prompt), and the final cache length.

    Also checks the budget contract on the way: after every feed the cache holds at most
    ``max_kv`` rows, or the feed itself did not fit (then at most ``protected + window + feed``).
    """
    rows: list[Row] = []
    events = []
    fed = 0
    for need in feeds:
        while len(rows) + need > max_kv and protected + window <= len(rows):
            start = protected
            if schedule == "raw":
                blocks = [i for i, r in enumerate(rows) if r[0] == "block"]
                if blocks and max(protected, blocks[-1] + 1) + window <= len(rows):
                    start = max(protected, blocks[-1] + 1)
            span = rows[start : start + window]
            log = (min(r[1] for r in span), max(r[2] for r in span))
            before = len(rows)
            rows[start : start + window] = [("block", *log)] * target
            events.append(((start, start + window), log, before, len(rows)))
        rows += [("raw", fed + i, fed + i + 1) for i in range(need)]
        fed += need
        assert len(rows) <= max(max_kv, protected + window + need), (len(rows), need)
    return events, len(rows)


@pytest.fixture(scope="module")
def sched_engine(tiny_model_path):
    return Engine.from_pretrained(
        tiny_model_path, dtype=torch.float32, device="cpu", max_slots=2, capacity=512
    )


MODES = {
    "h2o": {"mode": "h2o"},
    "attention_matching+beta": {"mode": "attention_matching", "compute_beta": True, "n_probe_queries": 16},
    "markovian": {"mode": "markovian"},
    "streaming": {"mode": "streaming"},
}


@pytest.mark.parametrize("schedule", ["prompt", "raw"])
@settings(max_examples=6, deadline=None)
@example(mode="h2o", prompt=16, window=32, ratio=0.25, turns=[(10, 20), (10, 20), (10, 20)], temperature=1.0)
@example(
    mode="attention_matching+beta",
    prompt=5,
    window=20,
    ratio=0.125,
    turns=[(40, 9), (3, 30)],
    temperature=2.0,
)
@given(
    mode=st.sampled_from(list(MODES)),
    prompt=st.integers(1, 24),
    window=st.sampled_from([12, 20, 32]),
    ratio=st.sampled_from([0.125, 0.25, 0.5]),
    turns=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30)), min_size=2, max_size=4),
    temperature=st.sampled_from([1.0, 2.0]),
)
def test_events_match_the_brute_force_schedule(
    sched_engine, schedule, mode, prompt, window, ratio, turns, temperature
):
    """Every event's span, logical span and lengths equal the row simulation's, over random prompt
    and turn lengths with several events per session; the budget holds (up to the current input)."""
    max_kv = 64
    cfg = CompactionConfig(
        **MODES[mode], max_kv_len=max_kv, compact_window=window, compact_target_ratio=ratio,
        n_compacts=1000, kv_budget_from=schedule,
    )  # fmt: skip
    sampling = SamplingParams(
        temperature=temperature, max_new_tokens=turns[0][1], ignore_eos=True, seed=prompt
    )
    r = sched_engine.create_session(make_prompt(prompt, seed=prompt), cfg, sampling)
    feeds = [prompt] + [1] * (turns[0][1] - 1)
    for i, (n_in, n_out) in enumerate(turns[1:]):
        r = sched_engine.step(
            r.session_id, make_prompt(n_in, seed=100 + i), sampling.replace(max_new_tokens=n_out, seed=None)
        )
        feeds += [1 + n_in] + [1] * (n_out - 1)  # the pending sampled token goes in with the input
    view = sched_engine.session(r.session_id)
    sched_engine.close(r.session_id)
    target = 0 if mode == "markovian" else max(1, math.floor(window * ratio))
    expected, kv_len = reference_events(feeds, prompt, max_kv, window, target, schedule)
    got = [(e.span, e.logical_span, e.kv_len_before, e.kv_len_after) for e in view.events]
    assert got == expected
    assert view.kv_len == kv_len and sum(feeds) == len(view.token_ids) - 1
    assert all(e.trigger == "kv_budget" and e.target == target for e in view.events)


def test_raw_schedule_leaves_earlier_blocks_alone(sched_engine):
    """The textbook case: each event compacts the next raw window until the blocks fill the room,
    then one prompt-anchored event merges them (and every block stands for disjoint tokens before)."""
    cfg = CompactionConfig(
        mode="h2o", max_kv_len=64, compact_window=16, compact_target_ratio=0.25, kv_budget_from="raw"
    )
    r = sched_engine.create_session(
        make_prompt(8, seed=3), cfg, SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True)
    )
    sched_engine.close(r.session_id)
    spans = [e.span for e in r.events]
    # blocks of 4 rows accumulate after the 8-row prompt: raw windows start at 8, 12, 16, ...
    raw = [(8 + 4 * i, 24 + 4 * i) for i in range(11)]
    assert spans[:11] == raw and spans[11] == (8, 24)
    logical = [e.logical_span for e in r.events[:11]]
    assert all(a[1] == b[0] for a, b in zip(logical, logical[1:]))  # disjoint, consecutive tokens
    assert r.events[11].logical_span == (8, logical[3][1])  # the fallback merges blocks 0..3


def test_prompt_is_the_default_and_bad_values_name_the_field():
    assert CompactionConfig(mode="h2o", max_kv_len=64).kv_budget_from == "prompt"
    with pytest.raises(InvalidArgumentError, match=r"CompactionConfig\.kv_budget_from must be one of"):
        CompactionConfig(mode="h2o", max_kv_len=64, kv_budget_from="oldest")
    with pytest.raises(InvalidArgumentError, match=r"CompactionConfig\.kv_budget_from must be a str"):
        CompactionConfig(mode="h2o", max_kv_len=64, kv_budget_from=1)


def test_chained_plans_match_the_events(sched_engine):
    """The scheduler plans an event batch in two calls (room for the budget message after the first
    events): the second plan starts from the first one's spans, and both equal what fires."""
    cfg = CompactionConfig(
        mode="h2o", max_kv_len=64, compact_window=12, compact_target_ratio=0.25, kv_budget_from="raw"
    )
    r = sched_engine.create_session(
        make_prompt(6, seed=4), cfg, SamplingParams(temperature=0, max_new_tokens=100, ignore_eos=True)
    )
    s = sched_engine.scheduler.get(r.session_id)
    compactor = sched_engine.scheduler.compactor
    assert len(s.events) >= 3 and s.row_map.blocks()
    first, kv = compactor.plan_room(s, 30)
    more, kv_after = compactor.plan_room(s, 60, kv, first)
    assert first and more
    events = compactor.make_room(s, 30) + compactor.make_room(s, 60)
    assert [e.span for e in events] == first + more
    assert sched_engine.cache.length(s.slot) == kv_after
    sched_engine.close(r.session_id)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.integers(1, 20), st.integers(0, 30), st.integers(1, 30), st.integers(0, 10)),
        min_size=1,
        max_size=12,
    )
)
def test_replace_blocks_matches_the_row_map(ops):
    """Planning's block arithmetic equals :meth:`RowMap.replace` on any append/replace sequence."""
    m, fed = RowMap(), 0
    for n, start, length, size in ops:
        m.append(fed, n)
        fed += n
        start = min(start, m.rows - 1)
        end = min(m.rows, start + length)
        size = min(size, end - start)
        want = replace_blocks(m.blocks(), start, end, size)
        m.replace(start, end, size, m.logical_span(start, end))
        assert [b for b in want if b[1] > b[0]] == m.blocks()

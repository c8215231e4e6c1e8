"""No shipped suite's budget can be overrun: for every budget, the longest protected prompt the
agent really sends plus the compaction window fits under ``max_kv_len``, and ``n_compacts`` covers
the longest episode (compaction_gym/leaderboard/budget_fit.py). The v1 BabyAI suites, kept for
their committed records, fail exactly where those records overran."""

from __future__ import annotations

import gzip
import json
from functools import cache
from pathlib import Path

import pytest

from compaction_gym.leaderboard import load_suite
from compaction_gym.leaderboard.budget_fit import budget_failures, prompt_lengths
from compaction_gym.leaderboard.suite import SUITES_DIR, Cell

RECORDS = Path(__file__).resolve().parents[2] / "benchmarks" / "leaderboard" / "records"
#: superseded suites kept so their committed records stay checkable (docs/leaderboard.md, "Suite versions").
SUPERSEDED = {"babyai-balrog", "babyai-memory"}
ENV_SUITES = sorted(
    p.stem
    for p in SUITES_DIR.glob("*.toml")
    if 'kind = "lm"' not in p.read_text() and p.stem not in SUPERSEDED
)


@cache
def _tokenizer(model: str):
    from transformers import AutoTokenizer

    from compaction_gym.models.registry import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(model))


@cache
def _prompts(suite: str) -> tuple[Cell, list[tuple[str, int, int, int | None]]]:
    """The suite's first LLM cell (every cell plays the same prompts) and its episodes' prompts."""
    cell = next(c for c in load_suite(suite).cells if c.trainer is None)
    return cell, list(prompt_lengths(cell, _tokenizer(cell.model)))


def _failures(suite: str) -> list[str]:
    _, episodes = _prompts(suite)
    longest = max(p for _, _, p, _ in episodes)
    steps = [s for *_, s in episodes]
    max_steps = None if None in steps else max(steps)
    out = []
    for c in load_suite(suite).cells:
        if c.trainer is None:
            out += budget_failures(c, longest, max_steps, c.capacity or 16384)
    return out


def test_the_env_suites_are_found():
    assert {"babyai-balrog-v2", "babyai-memory-v2", "recall"} <= set(ENV_SUITES)


@pytest.mark.parametrize("suite", ENV_SUITES)
def test_no_budget_of_a_shipped_suite_can_overrun(suite):
    assert _failures(suite) == []


@pytest.mark.parametrize("suite", ["babyai-balrog-v2", "babyai-memory-v2"])
def test_v2_keeps_v1s_episodes_and_prompts(suite):
    """v2 changes only the budgets' settings: the same episodes; and the prompt lengths computed
    here are the ones the committed v1 runs recorded (an independent reference for the helper)."""
    v1 = suite.removesuffix("-v2")
    cell, episodes = _prompts(suite)
    old = load_suite(v1).cell("none", "full")
    assert (cell.tasks, cell.seeds, cell.episodes, cell.model, cell.prompt) == (
        old.tasks,
        old.seeds,
        old.episodes,
        old.model,
        old.prompt,
    )
    recorded = {}
    with gzip.open(RECORDS / v1 / "none" / "full" / "audit.jsonl.gz", "rt") as fh:
        for line in fh:
            entry = json.loads(line)
            recorded[entry["info"]["eval_task_requested"], entry["seed"]] = entry["prompt_len"]
    assert {(t, s): p for t, s, p, _ in episodes} == recorded
    assert {s for *_, s in episodes} <= {64, 128}  # BabyAI's step limits (docs/envs.md)


def test_the_v1_suites_fail_where_their_records_overran():
    balrog = _failures("babyai-balrog")
    assert balrog and all("n_compacts 99" in f or "r0.25: protected prompt 186" in f for f in balrog)
    assert any("r0.25: protected prompt 186 + compact_window 184 > max_kv_len 369" in f for f in balrog)
    memory = _failures("babyai-memory")
    assert memory and all("n_compacts 99" in f for f in memory)


def test_budget_failures_names_each_condition():
    cell = load_suite("babyai-balrog-v2").cell("attention_matching", "r0.25")
    assert budget_failures(cell, 209, 128, 16384) == []  # 209 + 160 = 369
    assert (
        "protected prompt 210 + compact_window 160 > max_kv_len 369"
        in budget_failures(cell, 210, 128, 16384)[0]
    )
    # 160-row window at ratio 0.25 keeps 40 and frees 120: 10^6 events cover 10^6 * 120 rows
    assert budget_failures(cell, 186, 7324, 16384) == []  # 7324 * 16384 / 120 = 999,970
    (msg,) = budget_failures(cell, 186, 7325, 16384)
    assert "n_compacts 1000000 < 1000107 events" in msg  # ceil(7325 * 16384 / 120)
    assert budget_failures(load_suite("babyai-balrog-v2").cell("none", "full"), 10**6, 128, 16384) == []

"""The shipped suites load and cover every method; bad suite files are rejected by name."""

from __future__ import annotations

import pytest

from compaction_gym.engine.config import COMPACTION_MODES, PROBE_SOURCES
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.leaderboard import load_suite
from compaction_gym.leaderboard.suite import SUITES_DIR

SHIPPED = (
    "babyai-balrog",
    "babyai-memory",
    "babyai-balrog-v2",
    "babyai-memory-v2",
    "math-kv-budget",
    "recall",
)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_suite_covers_every_method(name):
    suite = load_suite(name)
    assert suite.name == name and (SUITES_DIR / f"{name}.toml") == suite.path
    modes = {c.compaction.mode for c in suite.cells}
    assert modes == set(COMPACTION_MODES)
    am = [c.compaction for c in suite.cells if c.compaction.mode == "attention_matching"]
    assert {c.compute_beta for c in am} == {True, False} and {c.queries for c in am} == set(PROBE_SOURCES)
    budgets = [c.budget for c in suite.cells if c.compaction.mode != "none"]
    assert any(b.kv_ratio is None for b in budgets) and any(b.kv_ratio is not None for b in budgets)
    for c in suite.cells:
        assert len(c.seeds) >= 3 and c.compaction.max_kv_len == c.budget.max_kv_len
        if c.budget.kv_ratio is not None:
            assert c.budget.max_kv_len == pytest.approx(
                c.budget.kv_ratio * suite.data["reference_kv_len"], abs=1
            )
    assert len({c.config_sha256() for c in suite.cells}) == len(suite.cells)


def test_memory_and_recall_suites():
    mem = load_suite("babyai-memory")
    assert (
        mem.cells[0].tasks == ["open", "putnext", "pick_up_seq_go_to"] and mem.cells[0].model == "babyai-tiny"
    )
    assert all(c.budget.max_kv_len <= 0.25 * 2200 for c in mem.cells if c.budget.max_kv_len)
    recall = load_suite("recall")
    assert recall.cells[0].env == "AttnMatch-Recall-v0" and recall.cells[0].model == "smollm2-135m-instruct"


BASE = """
name = "t"
env = "AttnMatch-BabyAI-GoTo-v0"
episodes = 2
seeds = [0, 10]
model = "tiny-random"
reference_kv_len = 1000
{extra}
[[methods]]
name = "m"
mode = "markovian"
budgets = [{budget}]
"""


@pytest.mark.parametrize(
    ("extra", "budget", "message"),
    [
        ("colour = 1", "{ max_kv_len = 64 }", "unknown keys \\['colour'\\]"),
        ("", "{ max_kv_len = 64, kv_ratio = 0.5 }", "exactly one of max_kv_len and kv_ratio"),
        ("", "{ kv_ratio = 1.5 }", "kv_ratio must be in"),
        ("", "{ max_kv_len = 64, compact_window = 64 }", "compact_window"),
        ("", "{ max_kv_len = 64, windw = 3 }", "unknown keys \\['windw'\\]"),
        (
            "",
            '{ kv_ratio = 0.25, compact_window = "160" }',
            "budgets\\[0\\]: compact_window must be an integer",
        ),
        ("", "{ kv_ratio = 0.25, compact_window = 250 }", "compact_window must be .* max_kv_len = 250"),
        ("", "{ max_kv_len = 64, compact_window = 0 }", "compact_window must be"),
    ],
)
def test_bad_suites_name_the_field(tmp_path, extra, budget, message):
    path = tmp_path / "bad.toml"
    path.write_text(BASE.format(extra=extra, budget=budget))
    with pytest.raises(InvalidArgumentError, match=message):
        load_suite(path)


def test_overlapping_seeds_and_unknown_names(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(BASE.format(extra="", budget="{ max_kv_len = 64 }").replace("[0, 10]", "[0, 1]"))
    with pytest.raises(InvalidArgumentError, match="overlap"):
        load_suite(path)
    with pytest.raises(InvalidArgumentError, match="known suites"):
        load_suite("no-such-suite")
    ok = tmp_path / "ok.toml"
    ok.write_text(BASE.format(extra="", budget="{ kv_ratio = 0.25 }"))
    suite = load_suite(ok)
    assert suite.cells[0].budget.label == "r0.25" and suite.cells[0].compaction.max_kv_len == 250
    assert suite.cells[0].compaction.compact_window == 125
    assert suite.cells[0].env_seeds(10) == [10, 11] and suite.cells[0].run_seed(11) == 10


def test_committed_records_match_the_shipped_suites():
    """A new CompactionConfig field must not orphan the committed records: its neutral value stays
    out of the hash (suite.NEUTRAL_LATER_FIELDS), any other value changes it."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "benchmarks" / "leaderboard" / "records"
    records = sorted(root.glob("*/*/*/submission.json"))
    assert records, "no committed records"
    for path in records:
        rec = json.loads(path.read_text())
        cell = load_suite(rec["suite"]["name"]).cell(rec["method"], rec["budget"]["label"])
        assert cell.config_sha256() == rec["config_sha256"], path


def test_neutral_later_fields_stay_out_of_the_hash_only_at_their_neutral_value():
    import dataclasses

    from compaction_gym.leaderboard.suite import NEUTRAL_LATER_FIELDS

    cell = next(c for c in load_suite("babyai-memory").cells if c.compaction.mode == "attention_matching")
    assert not NEUTRAL_LATER_FIELDS.keys() & cell.config()["compaction"].keys()
    others = {"refit_values": False, "inject_budget_every": 64, "kv_budget_from": "raw"}
    assert others.keys() == NEUTRAL_LATER_FIELDS.keys()
    for name, value in others.items():
        other = dataclasses.replace(cell, compaction=dataclasses.replace(cell.compaction, **{name: value}))
        assert other.config()["compaction"][name] == value
        assert other.config_sha256() != cell.config_sha256()


def test_a_suite_compaction_table_sets_kv_budget_from(tmp_path, write_tiny_suite):
    """``[compaction] kv_budget_from = "raw"`` reaches every compacting cell and changes its hash;
    the ``none`` cell (no KV-budget trigger, where it does nothing) keeps its hash and its records."""
    prompt_suite = load_suite(write_tiny_suite(tmp_path, "m"))
    raw_dir = tmp_path / "raw"
    raw_dir.mkdir()
    path = write_tiny_suite(raw_dir, "m")
    path.write_text(path.read_text() + '\n[compaction]\nkv_budget_from = "raw"\n')
    raw_suite = load_suite(path)
    for method in ("none", "attention_matching"):
        before, after = (next(c for c in s.cells if c.method == method) for s in (prompt_suite, raw_suite))
        assert after.compaction.kv_budget_from == "raw"
        assert "kv_budget_from" not in before.config()["compaction"]
        if method == "none":
            assert after.config_sha256() == before.config_sha256()
        else:
            assert after.config()["compaction"]["kv_budget_from"] == "raw"
            assert after.config_sha256() != before.config_sha256()
    path.write_text(path.read_text().replace('"raw"', '"newest"'))
    with pytest.raises(InvalidArgumentError, match="kv_budget_from"):
        load_suite(path)

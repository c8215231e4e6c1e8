"""An inject-only leaderboard method is a ``[[methods]]`` entry of a suite (docs/engine.md, "Triggers")."""

from __future__ import annotations

import pytest

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.leaderboard import load_suite

SUITE = """
name = "inject-demo"
env = "AttnMatch-Math-v0"
tasks = ["basic_arithmetic"]
episodes = 2
seeds = [0]
model = "smollm2-135m-instruct"
budgets = [{ max_kv_len = 256 }]

[sampling]
max_new_tokens = 512

[[methods]]
name = "none"
mode = "none"

[[methods]]
name = "inject_only"
mode = "none"
inject_budget_every = {every}
max_total_tokens = 512
"""


def test_inject_only_method_loads_as_a_full_budget_cell(tmp_path):
    path = tmp_path / "inject-demo.toml"
    path.write_text(SUITE.replace("{every}", "128"))
    cells = {c.method: c for c in load_suite(path).cells}
    inj = cells["inject_only"]
    assert inj.budget.label == "full" and inj.compaction.mode == "none"
    assert inj.compaction.inject_budget_every == 128 and inj.compaction.max_total_tokens == 512
    assert cells["none"].compaction.inject_budget_every is None
    assert inj.config_sha256() != cells["none"].config_sha256()


def test_bad_period_is_named(tmp_path):
    path = tmp_path / "inject-demo.toml"
    path.write_text(SUITE.replace("{every}", "0"))
    with pytest.raises(InvalidArgumentError, match="inject_only.*inject_budget_every"):
        load_suite(path)


def test_an_inject_only_method_listed_first_is_not_the_baseline(tmp_path):
    """Records pair against the plain full-KV cell, never against an inject-only one."""
    body = SUITE.replace("{every}", "128")
    plain = '[[methods]]\nname = "none"\nmode = "none"\n\n'
    inject = body[body.index('[[methods]]\nname = "inject_only"') :]
    path = tmp_path / "inject-first.toml"
    path.write_text(body[: body.index("[[methods]]")] + inject + "\n" + plain)
    suite = load_suite(path)
    assert [c.method for c in suite.cells][0] == "inject_only"
    assert suite.baseline is not None and suite.baseline.method == "none"

"""RSA as a leaderboard method (compaction_gym/leaderboard/rsa_cells.py): a tiny math suite end to end,
scores and tokens re-derived independently, compliance, determinism, and suite validation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gymnasium as gym
import pytest

import compaction_gym  # noqa: F401  (registers the env ids)
from compaction_gym.agents.rsa import majority
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.leaderboard import check_record, load_suite, run_suite, schema_errors
from compaction_gym.leaderboard.record import seal
from compaction_gym.leaderboard.store import sha256_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ENV_KWARGS = (
    "{ config = { min_terms = 2, max_terms = 2, min_digits = 1, max_digits = 1 }, "
    'require_answer_tag = false, answer_fallback = "last_number", instruction = "step_by_step" }'
)
#: 1 task × 2 seeds × 2 questions; the none row, RSA full and compacted, plain sampling at RSA's tokens.
SUITE = """
name = "tiny-math"
env = "AttnMatch-Math-v0"
tasks = ["chain_sum"]
episodes = 2
seeds = [0, 10]
model = "{model}"
prompt = "raw"
batch = 6
env_kwargs = {env_kwargs}
capacity = 512

[sampling]
max_new_tokens = 12

[compaction]
n_compacts = 1000000

[[methods]]
name = "none"
mode = "none"

[[methods]]
name = "rsa"
agent = "rsa"
population = 3
subset = 2
rounds = 1
sampling = {{ temperature = 1.0 }}
mode = "none"

[[methods]]
name = "rsa_am"
agent = "rsa"
population = 3
subset = 2
rounds = 1
score = "mean"
sampling = {{ temperature = 1.0 }}
mode = "attention_matching"
budgets = [{{ max_kv_len = {budget}, compact_window = 8 }}]

[[methods]]
name = "rsa_plain_tokens"
agent = "rsa"
variant = "plain_tokens"
population = 3
subset = 2
rounds = 1
sampling = {{ temperature = 1.0 }}
mode = "none"
"""
RSA_CELLS = ("rsa/full", "rsa_am/kv{budget}", "rsa_plain_tokens/full")


def write_suite(directory: Path, model: str, budget: int, **edits: str) -> Path:
    text = SUITE.format(model=model, env_kwargs=ENV_KWARGS, budget=budget)
    for old, new in edits.items():
        text = text.replace(old, new)
    path = directory / "tiny-math.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def math_backend(tiny_model_path):
    from compaction_gym.agents.evaluate import load_backend

    backend, _ = load_backend(str(tiny_model_path), 6, {"capacity": 512, "device": "cpu"})
    return backend


@pytest.fixture(scope="module")
def budget(math_backend, tiny_model_path, tmp_path_factory):
    """A KV budget a little above the aggregation prompts' shared prefix, so members compact."""
    suite = load_suite(write_suite(tmp_path_factory.mktemp("probe"), str(tiny_model_path), 64))
    env = gym.make(suite.cells[0].env, dataset="chain_sum", **suite.cells[0].env_kwargs)
    question, _ = env.reset(seed=0)
    from compaction_gym.agents.rsa import RSA, RSAConfig, aggregation_prompt

    rsa = RSA(math_backend.engine, RSAConfig(3, 2, 1))
    shared, _ = rsa.encode_prompt(*aggregation_prompt(question, ["1", "2"]))
    return len(shared) + 24


@pytest.fixture(scope="module")
def math_records(math_backend, tiny_model_path, budget, tmp_path_factory):
    suite_path = write_suite(tmp_path_factory.mktemp("suite"), str(tiny_model_path), budget)
    out = tmp_path_factory.mktemp("records")
    run_suite(load_suite(suite_path), output=out, backend=math_backend, progress=False, tensorboard=False)
    return out, suite_path


def _record(root: Path, cell: str) -> dict:
    return json.loads((root / "tiny-math" / cell / "submission.json").read_text())


def _lines(root: Path, cell: str) -> list[dict]:
    return [
        json.loads(x) for x in (root / "tiny-math" / cell / "trajectories.jsonl").read_text().splitlines()
    ]


def test_records_are_valid_and_compliant(math_records, budget):
    root, suite_path = math_records
    for cell in ("none/full", *(c.format(budget=budget) for c in RSA_CELLS)):
        rec = _record(root, cell)
        assert schema_errors(rec) == []
        assert rec["seeds"] == [0, 10] and len(rec["results"]["episodes"]) == 4
        assert check_record(root / "tiny-math" / cell, suite_path).failures == []
        if cell != "none/full":
            assert rec["config"]["rsa"]["agent"] == "rsa"
            assert rec["comparison_vs_none"]["n"] == 4  # paired with none on the same questions
            assert rec["results"]["tokens"]["mean"] > rec["results"]["tokens"]["generated_mean"] > 0


def test_scores_rederive_from_the_env(math_records, budget):
    """Each question's score is the env's verdict on the final population, recomputed here from
    fresh episodes of the same item (reasoning-gym's score_answer)."""
    root, suite_path = math_records
    suite = load_suite(suite_path)
    for cell, metric in (("rsa/full", "vote"), (f"rsa_am/kv{budget}", "mean")):
        for line, row in zip(_lines(root, cell), _record(root, cell)["results"]["episodes"], strict=True):
            env = gym.make(suite.cells[0].env, dataset="chain_sum", **suite.cells[0].env_kwargs)
            final = line["populations"][-1]
            scores = []
            for text in final:
                env.reset(seed=line["seed"])
                scores.append(env.step(text)[1])
            answers = [env.unwrapped.extract(t) for t in final]
            best = majority(answers)
            expected = (
                sum(scores) / len(scores) if metric == "mean" else (0.0 if best is None else scores[best])
            )
            assert row["progression"] == pytest.approx(100 * expected)
            assert line["final_answers"] == answers


def test_tokens_count_every_fed_and_sampled_token(math_records):
    """RSA's compute: each round's shared prefix once, every member's own input and samples."""
    root, _ = math_records
    for line, row in zip(
        _lines(root, "rsa/full"), _record(root, "rsa/full")["results"]["episodes"], strict=True
    ):
        turns = line["turns"]
        assert [t["round"] for t in turns] == [0, 0, 0, 1, 1, 1] and row["turns"] == 6
        shared = {t["round"]: t["input_range"][0] for t in turns}
        fed = sum(shared.values()) + sum(t["input_range"][1] - t["input_range"][0] for t in turns)
        sampled = sum(t["generated"] for t in turns)
        assert row["generated_tokens"] == sampled and row["tokens"] == fed + sampled
    for line in _lines(root, "rsa_plain_tokens/full"):  # plain sampling reaches RSA's sampled tokens
        rsa = next(x for x in _lines(root, "rsa/full") if x["seed"] == line["seed"])
        assert {t["round"] for t in line["turns"]} == {0} and len(line["turns"]) % 6 == 0
        assert line["compute"]["generated"] >= rsa["compute"]["generated"] or len(line["turns"]) == 6 * 64


def test_compacted_members_hold_the_budget(math_records, budget):
    root, _ = math_records
    lines = _lines(root, f"rsa_am/kv{budget}")
    assert sum(len(d["events"]) for d in lines) > 0  # compaction fired inside members
    for d in lines:
        for t in d["turns"]:
            assert t["peak_kv_len"] <= budget + t["input_range"][1] - t["input_range"][0]
        for ev in d["events"]:
            assert ev["logical_span"][0] >= ev["session_prompt_len"]


def test_a_compaction_into_a_members_prompt_fails_check(math_records, budget, tmp_path):
    root, suite_path = math_records
    cell = tmp_path / "tiny-math" / "rsa_am" / f"kv{budget}"
    shutil.copytree(root / "tiny-math", tmp_path / "tiny-math")
    lines = _lines(tmp_path, f"rsa_am/kv{budget}")
    ev = next(d for d in lines if d["events"])["events"][0]
    ev["logical_span"][0] = ev["session_prompt_len"] - 1
    (cell / "trajectories.jsonl").write_text("".join(json.dumps(d) + "\n" for d in lines))
    rec = json.loads((cell / "submission.json").read_text())
    rec["files"]["trajectories"]["sha256"] = sha256_file(cell / "trajectories.jsonl")
    (cell / "submission.json").write_text(json.dumps(seal(rec)))
    failures = check_record(cell, suite_path).failures
    assert any("compacted the protected prompt" in f for f in failures), failures


def test_rsa_cells_are_deterministic(math_records, math_backend, tiny_model_path, budget, tmp_path):
    root, _ = math_records
    again = tmp_path / "again"
    suite = load_suite(write_suite(tmp_path, str(tiny_model_path), budget))
    run_suite(
        suite,
        methods=["rsa", "rsa_am"],
        output=again,
        backend=math_backend,
        progress=False,
        tensorboard=False,
    )
    for cell in ("rsa/full", f"rsa_am/kv{budget}"):
        assert [_content(d) for d in _lines(root, cell)] == [_content(d) for d in _lines(again, cell)]
        assert _record(again, cell)["results"]["score"] == _record(root, cell)["results"]["score"]


def _content(line: dict) -> dict:
    """A question's line without its clock readings (wall time, event timings)."""
    events = [{k: v for k, v in ev.items() if k != "timings"} for ev in line["events"]]
    info = {k: v for k, v in line["info"].items() if k != "wall_time_s"}
    return line | {"events": events, "info": info}


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("sampling = { temperature = 1.0 }", "sampling = { temperature = 0.0 }", "temperature must be > 0"),
        ('variant = "plain_tokens"', 'variant = "best_of"', "variant must be one of"),
        ('score = "mean"', 'score = "median"', "score must be one of"),
        ("subset = 2", "subset = 4", "must not exceed population"),
        ("rounds = 1", "rounds = -1", "rounds must be an int >= 0"),
    ],
)
def test_bad_rsa_methods_raise_naming_the_key(tmp_path, old, new, message):
    path = write_suite(tmp_path, "tiny", 64)
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(InvalidArgumentError, match=message):
        load_suite(path)


def test_rsa_is_never_the_baseline(tmp_path):
    path = write_suite(tmp_path, "tiny", 64)
    suite = load_suite(path)
    assert suite.baseline.method == "none"
    path.write_text(path.read_text().replace('[[methods]]\nname = "none"\nmode = "none"\n', ""))
    assert load_suite(path).baseline is None  # RSA with mode none is not the full-KV episode row

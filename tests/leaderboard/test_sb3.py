"""The sb3_ppo reference row: suite parsing, the flat symbolic observation, a tiny training run
scored on the suite's own episodes, its record, compliance and rendering."""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.leaderboard import check_record, load_suite, run_suite, schema_errors

pytest.importorskip("stable_baselines3")

from compaction_gym.leaderboard.sb3 import (  # noqa: E402
    MISSION_WORDS,
    N_COLORS,
    N_OBJECTS,
    N_STATES,
    TRAIN_SEED_BASE,
    FlatObservation,
    TrainSeeds,
    symbolic_env,
)

SB3_METHOD = """
[[methods]]
name = "sb3_ppo"
agent = "sb3_ppo"
total_timesteps = 256
n_envs = 2
ppo = {{ n_steps = 64, batch_size = 64, n_epochs = 1 }}
"""


@pytest.fixture(scope="module")
def sb3_suite(tiny_suite_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("sb3suite") / "tiny.toml"
    path.write_text(tiny_suite_path.read_text() + SB3_METHOD.format())
    return path


@pytest.fixture(scope="module")
def sb3_records(sb3_suite, tiny_backend, tmp_path_factory):
    out = tmp_path_factory.mktemp("sb3records")
    run_suite(
        load_suite(sb3_suite), methods=["none", "sb3_ppo"], output=out, backend=tiny_backend, progress=False
    )
    return out


def _record(root: Path, cell: str) -> dict:
    return json.loads((root / "tiny" / cell / "submission.json").read_text())


def test_flat_observation_encodes_the_symbolic_view():
    import compaction_gym.envs  # noqa: F401

    raw = gym.make("AttnMatch-BabyAI-Symbolic-v0", task="pick_up_seq_go_to")
    obs, _ = raw.reset(seed=3)
    flat = FlatObservation(gym.make("AttnMatch-BabyAI-Symbolic-v0", task="pick_up_seq_go_to")).reset(seed=3)[
        0
    ]
    per_cell = N_OBJECTS + N_COLORS + N_STATES
    view = flat[: 49 * per_cell].reshape(7, 7, per_cell)  # MiniGrid's (x, y) layout, row-major
    decoded = np.stack(
        [
            view[..., :N_OBJECTS].argmax(-1),
            view[..., N_OBJECTS : N_OBJECTS + N_COLORS].argmax(-1),
            view[..., N_OBJECTS + N_COLORS :].argmax(-1),
        ],
        axis=-1,
    )
    assert (decoded == obs["image"]).all() and view.sum() == 49 * 3
    direction = flat[49 * per_cell : 49 * per_cell + 4]
    assert direction.argmax() == obs["direction"] and direction.sum() == 1
    words = flat[49 * per_cell + 4 :].reshape(-1, len(MISSION_WORDS)).argmax(-1)
    expected = obs["mission"].replace(",", " ,").split()
    assert [MISSION_WORDS[i] for i in words[: len(expected)]] == expected
    assert (words[len(expected) :] == 0).all()  # <pad>
    assert flat.shape == FlatObservation(raw).observation_space.shape


def test_training_resets_never_use_an_evaluation_seed():
    seen = []

    class Spy(gym.Wrapper):
        def reset(self, *, seed=None, options=None):
            seen.append(seed)
            return self.env.reset(seed=seed, options=options)

    env = TrainSeeds(Spy(symbolic_env("goto", {"max_steps": 2})), TRAIN_SEED_BASE)
    for _ in range(3):
        env.reset(seed=0)  # a seed passed by the trainer is ignored
    assert seen == [TRAIN_SEED_BASE, TRAIN_SEED_BASE + 1, TRAIN_SEED_BASE + 2]


def test_suite_rejects_bad_agent_methods(tiny_suite_path, tmp_path):
    base = tiny_suite_path.read_text()
    for extra, message in (
        ('\n[[methods]]\nname = "x"\nagent = "dqn"\n', "agent must be 'sb3_ppo'"),
        ('\n[[methods]]\nname = "x"\nagent = "sb3_ppo"\ntotal_timesteps = 0\n', "total_timesteps"),
        ('\n[[methods]]\nname = "x"\nagent = "sb3_ppo"\nmode = "h2o"\n', "unknown keys \\['mode'\\]"),
        ('\n[[methods]]\nname = "x"\nagent = "sb3_ppo"\nppo = { seed = 3 }\n', "ppo.seed"),
    ):
        path = tmp_path / "bad.toml"
        path.write_text(base + extra)
        with pytest.raises(InvalidArgumentError, match=message):
            load_suite(path)
    math = tmp_path / "math.toml"
    math.write_text(base.replace("AttnMatch-BabyAI-v0", "AttnMatch-Math-v0").replace('tasks = ["goto"]', "")
                    + '\n[[methods]]\nname = "x"\nagent = "sb3_ppo"\n')  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="needs a BabyAI suite env"):
        load_suite(math)


def test_sb3_record_plays_the_suites_episodes(sb3_records, sb3_suite):
    rec = _record(sb3_records, "sb3_ppo/full")
    assert schema_errors(rec) == []
    assert rec["method"] == "sb3_ppo" and rec["config"]["trainer"]["total_timesteps"] == 256
    assert rec["results"]["kv"] is None and rec["results"]["tokens"] is None
    assert rec["model"]["tokenizer_sha256"] is None
    assert sorted(rec["model"]["weights_sha256"]) == ["policy_seed0.zip", "policy_seed10.zip"]
    none = _record(sb3_records, "none/full")
    key = lambda e: (e["task"], e["seed"], e["env_seed"])  # noqa: E731
    assert [key(e) for e in rec["results"]["episodes"]] == [key(e) for e in none["results"]["episodes"]]
    # the very layouts the LLM played: same mission per env seed as the text env's trajectories
    cell = sb3_records / "tiny" / "sb3_ppo" / "full"
    lines = [json.loads(x) for x in (cell / "trajectories.jsonl").read_text().splitlines()]
    llm = {
        d["seed"]: d["instruction"]
        for d in map(json.loads, (sb3_records / "tiny/none/full/trajectories.jsonl").read_text().splitlines())
    }
    for line in lines:
        assert line["mission"] in llm[line["seed"]]
        # replaying the recorded actions in a fresh env reproduces the rewards and the outcome
        env = symbolic_env("goto", {"max_steps": 2})
        env.reset(seed=line["seed"])
        rewards = [float(env.step(a)[1]) for a in line["actions"]]
        assert rewards == line["rewards"]
        assert line["info"]["progression"] == float(any(r > 0 for r in rewards))
        assert len(line["actions"]) <= 2
    comp = rec["comparison_vs_none"]
    assert comp["n"] == 4 and comp["baseline_content_sha256"] == none["content_sha256"]
    assert check_record(cell).ok, check_record(cell).failures


def test_sb3_resume_neither_retrains_nor_replays(sb3_records, sb3_suite, tiny_backend):
    cell = sb3_records / "tiny" / "sb3_ppo" / "full"
    stamp = {p.name: p.stat().st_mtime_ns for p in cell.glob("policy_seed*.zip")}
    before = (cell / "submission.json").read_text()
    run_suite(load_suite(sb3_suite), methods=["sb3_ppo"], output=sb3_records, backend=tiny_backend,
              progress=False, on_episode=lambda c, e: pytest.fail("replayed an episode"))  # fmt: skip
    assert {p.name: p.stat().st_mtime_ns for p in cell.glob("policy_seed*.zip")} == stamp
    assert (cell / "submission.json").read_text() == before


def test_sb3_tampered_outcome_fails_check(sb3_records, tmp_path):
    import shutil

    from compaction_gym.leaderboard.record import seal
    from compaction_gym.leaderboard.store import sha256_file

    root = tmp_path / "r"
    shutil.copytree(sb3_records, root)
    cell = root / "tiny" / "sb3_ppo" / "full"
    lines = [json.loads(x) for x in (cell / "trajectories.jsonl").read_text().splitlines()]
    lines[0]["info"]["progression"] = 1.0 - lines[0]["info"]["progression"]
    (cell / "trajectories.jsonl").write_text("".join(json.dumps(d) + "\n" for d in lines))
    rec = json.loads((cell / "submission.json").read_text())
    rec["files"]["trajectories"]["sha256"] = sha256_file(cell / "trajectories.jsonl")
    (cell / "submission.json").write_text(json.dumps(seal(rec)))
    assert any("results.score" in f or "results.episodes" in f for f in check_record(cell).failures)


def test_show_lists_the_sb3_row_without_kv(sb3_records, tmp_path):
    from compaction_gym.leaderboard.report import show

    page, plots = show(sb3_records, tmp_path)
    row = next(line for line in page.splitlines() if "| sb3_ppo |" in line)
    assert row.count("n/a") == 6  # max KV, peak, mean KV, kept, compression, tokens
    assert {p.name for p in plots} == {"tiny_budget.png", "tiny_compression.png"}


def test_parallel_schedule_starts_training_right_after_none(sb3_suite):
    from compaction_gym.leaderboard.parallel import schedule
    from compaction_gym.leaderboard.runner import select_cells

    suite = load_suite(sb3_suite)
    cells, _ = select_cells(suite)
    plans = {"none/full": 1, "attention_matching/r0.5": 9, "sb3_ppo/full": 1}
    assert schedule(suite, cells, plans) == ["none/full", "sb3_ppo/full", "attention_matching/r0.5"]


def test_sb3_in_worker_processes_gives_the_serial_record(sb3_records, sb3_suite, tmp_path):
    """The sb3 cell through ``--jobs 2``: same policy (seeded, one thread, CPU) and episodes."""
    from compaction_gym.leaderboard.parallel import run_suite_parallel

    run_suite_parallel(
        load_suite(sb3_suite), jobs=2, methods=["none", "sb3_ppo"], output=tmp_path, progress=False
    )
    par, ser = _record(tmp_path, "sb3_ppo/full"), _record(sb3_records, "sb3_ppo/full")
    strip = lambda rows: [{k: v for k, v in r.items() if k != "wall_time_s"} for r in rows]  # noqa: E731
    assert strip(par["results"]["episodes"]) == strip(ser["results"]["episodes"])
    assert par["model"]["weights_sha256"].keys() == ser["model"]["weights_sha256"].keys()
    assert par["provenance"]["run"] == {"jobs": 2}
    assert check_record(tmp_path / "tiny" / "sb3_ppo" / "full").ok

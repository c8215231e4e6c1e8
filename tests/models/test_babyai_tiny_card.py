"""``benchmarks/recipes/babyai_tiny_card.py``: merging parallel evaluations and the opening-binding table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from compaction_gym.agents import Trajectory, Turn, read_jsonl, write_jsonl

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "recipes" / "babyai_tiny_card.py"


def _card():
    spec = importlib.util.spec_from_file_location("babyai_tiny_card", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _episode(task: str, seed: int, progression: float, obs: str = "a wall 1 step left", text: str = "") -> Trajectory:
    return Trajectory(
        token_ids=[1, 2, 3],
        completion_mask=[0, 0, 1],
        logprobs=[0.0, 0.0, -0.1],
        turns=[Turn((0, 2), (2, 3), obs, text)],
        rewards=[progression],
        success=progression > 0,
        info={"task": task, "eval_task": task, "progression": progression, "mission": "put the red ball next to the blue key"},
        seed=seed,
    )  # fmt: skip


def _run(root: Path, name: str, trajs: list[Trajectory], finished: bool = True) -> Path:
    d = root / name
    d.mkdir()
    write_jsonl(d / "trajectories.jsonl", trajs)
    if finished:
        tasks = {t.info["task"]: {"wall_time_s": 10.0} for t in trajs}
        summary = {"config": {"episodes_per_task": len(trajs), "prompt": "reasoning"}, "model": {"resolved": "m"},
                   "tasks": tasks}  # fmt: skip
        (d / "summary.json").write_text(json.dumps(summary))
    return d


def test_merge_concatenates_seed_chunks_and_tasks_in_canonical_order(tmp_path):
    card = _card()
    runs = [
        _run(tmp_path, "putnext_10", [_episode("putnext", 10, 0.0), _episode("putnext", 11, 1.0)]),
        _run(tmp_path, "putnext_0", [_episode("putnext", 0, 1.0), _episode("putnext", 1, 1.0), _episode("putnext", 2, 0.0)]),
        _run(tmp_path, "goto_0", [_episode("goto", 0, 1.0)]),
        # a partial rerun of seed 1 (fewer episodes of the task): the fuller run's episode wins
        _run(tmp_path, "putnext_1", [_episode("putnext", 1, 0.0)], finished=False),
    ]  # fmt: skip
    merged = card.merge_evals(runs, tmp_path / "merged")
    assert list(merged["tasks"]) == ["goto", "putnext"]  # BabyAI task order, not directory order
    assert merged["tasks"]["putnext"]["episodes"] == 5
    assert merged["tasks"]["putnext"]["progression"]["mean"] == 60.0  # seeds 0, 1 (fuller run), 2, 10, 11
    assert merged["tasks"]["putnext"]["wall_time_s"] == 20.0 and merged["seeds"] == [0, 1, 2, 10, 11]
    written = read_jsonl(tmp_path / "merged" / "trajectories.jsonl")
    assert [(t.info["task"], t.seed) for t in written] == [("goto", 0)] + [("putnext", s) for s in (0, 1, 2, 10, 11)]


def test_opening_binding_classifies_the_first_turn_claim(tmp_path):
    card = _card()
    obs = "a wall 2 steps left\na blue key 1 step right\na red ball 3 steps forward"

    def say(where: str) -> str:
        return f"<think>Next: pick up the red ball. It is {where}.</think><action>go forward</action>"

    trajs = [
        _episode("putnext", 0, 1.0, obs, say("3 steps forward")),  # right
        _episode("putnext", 1, 0.0, obs, say("1 step right")),  # the first listed object (the blue key)
        _episode("putnext", 2, 0.0, obs, say("not in view")),
        _episode("putnext", 3, 0.0, "a blue key 1 step right", say("1 step right")),  # only the other object
        _episode("putnext", 4, 0.0, "a wall 1 step left", say("2 steps left")),  # nothing in view: not counted
    ]
    table = card.opening_binding([_run(tmp_path, "run", trajs)])
    rows = [line.strip("| ").split(" | ") for line in table.splitlines()[2:]]
    assert [r[1:8] for r in rows] == [["1", "1", "**0 %**", "1", "0", "0", "0"], ["2+", "3", "**33 %**", "1", "0", "1", "0"]]

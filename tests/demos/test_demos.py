"""``compaction-gym demos``: templated reasoning, the noisy expert teacher, SFT targets, CLI."""

from __future__ import annotations

import json

import gymnasium as gym
import pytest

import compaction_gym  # noqa: F401  (registers the env ids)
from compaction_gym.demos.cli import parse_script_arguments
from compaction_gym.demos.recorder import demo_sequence
from compaction_gym.envs.babyai.reasoning import babyai_reasoning, demo_text, mission_goals
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.wrappers.expert_demos import ExpertDemoWrapper


@pytest.mark.parametrize(
    "mission, before, after",
    [
        ("go to the red ball", ("go to", "red", "ball"), ("go to", "red", "ball")),
        ("pick up a blue key", ("pick up", "blue", "key"), ("pick up", "blue", "key")),
        ("open the door", ("pick up", None, "key"), ("open", None, "door")),
        ("open the purple door", ("pick up", "purple", "key"), ("open", "purple", "door")),
        (
            "put the green box next to the grey key",
            ("pick up", "green", "box"),
            ("put it next to", "grey", "key"),
        ),
        (
            "pick up the green box, then go to the blue ball",
            ("pick up", "green", "box"),
            ("go to", "blue", "ball"),
        ),
        (
            "go to the blue ball after you pick up the green box",
            ("pick up", "green", "box"),
            ("go to", "blue", "ball"),
        ),
    ],
)
def test_mission_goals(mission, before, after):
    assert mission_goals(mission) == (before, after)


def test_mission_goals_rejects_other_missions():
    with pytest.raises(InvalidArgumentError, match="not a BALROG BabyAI mission"):
        mission_goals("fetch a coffee")


def test_reasoning_names_the_nearest_matching_object_and_switches_goal_when_carrying():
    obs = "a wall 2 steps left\na red key 3 steps forward\na red key 1 step right\na blue box 1 step left"
    assert babyai_reasoning("pick up the red key", obs) == "Next: pick up the red key. It is 1 step right."
    carrying = "You carry a red key\na locked red door 2 steps right and 1 step forward"
    assert (
        babyai_reasoning("open the door", carrying)
        == "Next: open the red door. It is 2 steps right and 1 step forward."
    )
    assert babyai_reasoning("open the red door", "a wall 1 step left") == (
        "Next: pick up the red key. It is not in view."
    )
    assert demo_text("R.", "toggle") == "<think>R.</think><action>toggle</action>"


def test_noisy_teacher_is_deterministic_and_records_noise_turns():
    def play(seed: int) -> tuple[list[str], list[int], bool]:
        env = ExpertDemoWrapper(gym.make("AttnMatch-BabyAI-v0", task="open", action_parsing="tag"), noise=0.3)
        env.reset(seed=seed)
        texts, done, info = [], False, {}
        while not done:
            texts.append(env.teacher_text())
            _, _, terminated, truncated, info = env.step(texts[-1])
            done = terminated or truncated
        return texts, info["demo_noise_turns"], info["progression"] > 0

    texts, noise, solved = play(123)
    assert (texts, noise) == play(123)[:2]
    assert solved and noise and all(t.startswith("<think>Next: ") for t in texts)
    assert all(i < len(texts) for i in noise)


def test_demo_sequence_masks_noise_turns():
    from compaction_gym.agents.trajectory import Trajectory, Turn

    traj = Trajectory(
        token_ids=list(range(12)),
        completion_mask=[0] * 12,
        logprobs=[0.0] * 12,
        prompt_len=2,
        turns=[
            Turn((2, 4), (4, 6), "o", "a"),
            Turn((6, 8), (8, 10), "o", "a"),
            Turn((10, 11), (11, 12), "o", "a"),
        ],
        info={"demo_noise_turns": [1]},
    )
    ids, mask = demo_sequence(traj)
    assert ids == list(range(12))
    assert mask == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1]


def test_train_seeds_must_avoid_eval_seeds(tmp_path):
    import argparse

    cfg = tmp_path / "d.toml"
    cfg.write_text('model = "m"\nseed = 5\n')
    with pytest.raises(InvalidArgumentError, match="overlaps the evaluation seeds"):
        parse_script_arguments(argparse.Namespace(config=str(cfg)))
    cfg.write_text('model = "m"\nbogus = 1\n')
    with pytest.raises(InvalidArgumentError, match="unknown keys"):
        parse_script_arguments(argparse.Namespace(config=str(cfg)))


def record_compacted_demos(model, out, task: str) -> int:
    """``demos``: 2 noisy episodes of ``task`` through sessions compacted at 256 rows."""
    from compaction_gym.cli import main

    return main(
        ["demos", "--model", str(model), "--output-dir", str(out), "--tasks", task,
         "--episodes-per-task", "2", "--batch", "2", "--noise", "0.2", "--max-kv-len", "256",
         "--compact-window", "128", "--threads", "1", "--device", "cpu"]
    )  # fmt: skip


def test_demos_command_writes_trajectories_trees_and_manifest(tiny_model_path, tmp_path):
    from compaction_gym.agents import read_jsonl
    from compaction_gym.trainers.tree_sft.tree import Tree

    out = tmp_path / "demos"
    assert record_compacted_demos(tiny_model_path, out, "goto") == 0
    trajs = read_jsonl(out / "trajectories.jsonl")
    manifest = json.loads((out / "manifest.json").read_text())
    assert [t.seed for t in trajs] == [100000, 100001] and manifest["seeds"]["goto"] == [100000, 100001, 2]
    assert all(t.success and t.prompt_format == "reasoning" and t.events for t in trajs)
    rows = [json.loads(line) for line in (out / "trees.jsonl").read_text().splitlines()]
    assert len(rows) == manifest["trees"] == 2
    tree = Tree.from_dict(rows[0])
    assert tree.num_leaves == 1 and sum(sum(n.loss_mask) for n in tree.nodes) > 0


def test_workers_record_the_same_trees_as_one_process(tiny_model_path, tmp_path):
    from compaction_gym.cli import main

    rows = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        rc = main(
            ["demos", "--model", str(tiny_model_path), "--output-dir", str(out), "--tasks", "goto",
             "pickup", "--episodes-per-task", "2", "--batch", "1", "--noise", "0.2",
             "--threads", "1", "--device", "cpu", "--workers", str(workers)]
        )  # fmt: skip
        assert rc == 0
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["seeds"] == {"goto": [100000, 100001, 2], "pickup": [100002, 100003, 2]}
        rows[workers] = (out / "trees.jsonl").read_text()
    assert rows[1] == rows[2] and rows[1].count("\n") == 4


def test_max_turns_cuts_episodes_into_kept_opening_demos(tiny_model_path, tmp_path):
    """``--max-turns``: every episode stops after that many turns, is flagged ``demo_cut`` and is
    kept for SFT (targets on its non-noise outputs); the teacher's texts are the whole episode's
    first turns."""
    from compaction_gym.agents import read_jsonl
    from compaction_gym.cli import main

    env = ExpertDemoWrapper(gym.make("AttnMatch-BabyAI-v0", task="putnext", action_parsing="tag"), max_turns=3)
    env.reset(seed=100000)
    full = ExpertDemoWrapper(gym.make("AttnMatch-BabyAI-v0", task="putnext", action_parsing="tag"))
    full.reset(seed=100000)
    for turn in range(3):
        text = env.teacher_text()
        assert text == full.teacher_text()
        _, _, terminated, truncated, info = env.step(text)
        full.step(text)
        assert not terminated and truncated == (turn == 2) and info["demo_cut"] == (turn == 2)
    with pytest.raises(InvalidArgumentError, match="max_turns must be >= 1"):
        ExpertDemoWrapper(gym.make("AttnMatch-BabyAI-v0", task="goto"), max_turns=0)

    out = tmp_path / "openings"
    rc = main(
        ["demos", "--model", str(tiny_model_path), "--output-dir", str(out), "--tasks", "putnext",
         "--episodes-per-task", "3", "--batch", "3", "--max-turns", "2", "--group-size", "3",
         "--threads", "1", "--device", "cpu"]
    )  # fmt: skip
    assert rc == 0
    trajs = read_jsonl(out / "trajectories.jsonl")
    manifest = json.loads((out / "manifest.json").read_text())
    assert [len(t.turns) for t in trajs] == [2, 2, 2] and all(t.info["demo_cut"] and not t.success for t in trajs)
    assert manifest["episodes_kept"] == 3 and manifest["trees"] == 1 and manifest["tasks"]["putnext"]["cut"] == 3
    assert manifest["target_tokens"] == sum(sum(demo_sequence(t)[1]) for t in trajs) > 0


def test_trees_depend_on_the_tokenizer_not_the_weights(tiny_model_path, tmp_path):
    """The recipe records every stage's demos with the base model: the trees (token ids and target
    masks) come from the seeds, the teacher and the tokenizer, so other weights give the same file."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    other = tmp_path / "other_weights"
    shutil.copytree(tiny_model_path, other)
    model = AutoModelForCausalLM.from_pretrained(other)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    model.save_pretrained(other)
    trees = {}
    for name, path in (("base", tiny_model_path), ("other", other)):
        out = tmp_path / name
        assert record_compacted_demos(path, out, "open") == 0
        trees[name] = (out / "trees.jsonl").read_text()
    assert trees["base"] == trees["other"] and trees["base"].count("\n") == 2

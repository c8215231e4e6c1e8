"""``compaction-gym eval``: summary schema, BALROG statistics, model resolution."""

from __future__ import annotations

import json
import math

import pytest

from compaction_gym.agents import Trajectory, read_jsonl
from compaction_gym.agents.evaluate import default_tasks, task_env_kwargs
from compaction_gym.cli import main
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.evaluation import SUMMARY_SCHEMA, summarize
from compaction_gym.models.registry import MODEL_REGISTRY, register_model, resolve_model

STAT_KEYS = {
    "episodes": int,
    "progression": dict,
    "success_rate": float,
    "reward_mean": float,
    "turns_mean": float,
    "tokens_mean": float,
    "generated_tokens_mean": float,
    "peak_kv_mean": float,
    "peak_kv_max": int,
    "compaction_events_mean": float,
    "invalid_action_rate": (float, type(None)),
    "aborted": int,
    "episode_wall_time_mean_s": float,
    "wall_time_s": float,
}


def check_stats(stats: dict) -> None:
    assert set(stats) == set(STAT_KEYS)
    for key, kind in STAT_KEYS.items():
        assert isinstance(stats[key], kind), (key, stats[key])
    assert set(stats["progression"]) == {"mean", "se"}


def test_eval_babyai_writes_the_documented_summary(tiny_model_path, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["eval", "--model", str(tiny_model_path), "--task", "goto", "--task", "pickup", "--episodes", "2"]
    argv += [
        "--max-steps",
        "2",
        "--max-new-tokens",
        "3",
        "--mode",
        "attention_matching",
        "--max-kv-len",
        "448",
    ]
    argv += ["--compact-window", "96", "--batch", "2", "--seed", "5", "--output", str(out), "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for word in ("goto", "pickup", "overall", "progression %", "peak KV", "compactions"):
        assert word in printed

    summary = json.loads((out / "summary.json").read_text())  # strict JSON: no NaN
    assert summary["schema"] == SUMMARY_SCHEMA and summary["env"] == "AttnMatch-BabyAI-v0"
    assert list(summary["tasks"]) == ["goto", "pickup"] and summary["tasks_requested"] == ["goto", "pickup"]
    for stats in [*summary["tasks"].values(), summary["overall"]]:
        check_stats(stats)
    assert summary["tasks"]["goto"]["episodes"] == 2 and summary["overall"]["episodes"] == 4
    assert summary["tasks"]["goto"]["turns_mean"] == 2.0
    assert summary["overall"]["compaction_events_mean"] > 0
    cfg = summary["config"]
    assert cfg["compaction"]["mode"] == "attention_matching" and cfg["compaction"]["max_kv_len"] == 448
    assert cfg["sampling"]["max_new_tokens"] == 3 and cfg["sampling"]["temperature"] == 0.0
    assert cfg["prompt"] == "balrog" and cfg["episodes_per_task"] == 2 and cfg["batch"] == 2
    assert summary["env_kwargs"] == {"max_steps": 2, "action_parsing": "balrog"}
    assert summary["seed"] == 5 and summary["seeds"] == [5, 6]
    assert summary["model"]["resolved"] == str(tiny_model_path)
    prov = summary["provenance"]
    assert {
        "started_at",
        "wall_time_s",
        "git_revision",
        "git_dirty",
        "versions",
        "platform",
        "device",
        "argv",
    } <= set(prov)
    assert "torch" in prov["versions"] and summary["trajectories"] == "trajectories.jsonl"

    trajs = read_jsonl(out / "trajectories.jsonl")
    assert len(trajs) == 4
    assert sorted((t.info["eval_task"], t.seed) for t in trajs) == [
        ("goto", 5),
        ("goto", 6),
        ("pickup", 5),
        ("pickup", 6),
    ]
    for t in trajs:
        t.validate()
        assert len(t.turns) == 2 and t.compaction["mode"] == "attention_matching"
    goto = [t for t in trajs if t.info["eval_task"] == "goto"]
    assert summary["tasks"]["goto"]["tokens_mean"] == pytest.approx(sum(t.num_tokens for t in goto) / 2)


def test_eval_math_is_single_step(tiny_model_path, tmp_path):
    out = tmp_path / "math"
    argv = ["eval", "--env", "AttnMatch-Math-v0", "--model", str(tiny_model_path), "--episodes", "2"]
    argv += ["--max-new-tokens", "4", "--output", str(out), "--no-progress"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["tasks"]) == ["basic_arithmetic"]
    stats = summary["tasks"]["basic_arithmetic"]
    check_stats(stats)
    assert stats["turns_mean"] == 1.0 and stats["episodes"] == 2 and summary["config"]["prompt"] == "raw"
    assert all(len(t.turns) == 1 for t in read_jsonl(out / "trajectories.jsonl"))


def test_eval_reports_bad_configs_cleanly(tiny_model_path, capsys):
    """One line on stderr, exit 2 (docs/eval.md)."""
    assert main(["eval", "--model", str(tiny_model_path), "--max-kv-len", "64", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mode='none' contradicts" in err[0]
    assert main(["eval", "--model", "./no/such/model", "--no-progress"]) == 2
    assert "does not exist" in capsys.readouterr().err


def _traj(progression: float) -> Trajectory:
    return Trajectory(info={"progression": progression}, success=progression > 0, total_reward=progression)


def test_summary_follows_balrog_statistics():
    by_task = {"a": [_traj(p) for p in (1, 0, 1, 1)], "b": [_traj(0), _traj(0)]}
    s = summarize(by_task, {"a": 2.0, "b": 1.0})
    # a: mean 75 %, population std = sqrt(0.1875) = 0.4330 -> SE = 43.30 / 2
    assert s["tasks"]["a"]["progression"]["mean"] == pytest.approx(75.0)
    assert s["tasks"]["a"]["progression"]["se"] == pytest.approx(100 * math.sqrt(0.1875) / 2)
    assert s["tasks"]["b"]["progression"] == {"mean": 0.0, "se": 0.0}
    # overall: mean of task means; SE = sqrt(sum SE^2) / n_tasks
    assert s["overall"]["progression"]["mean"] == pytest.approx(37.5)
    assert s["overall"]["progression"]["se"] == pytest.approx(100 * math.sqrt(0.1875) / 2 / 2)
    assert s["overall"]["episodes"] == 6 and s["overall"]["wall_time_s"] == 3.0
    assert s["overall"]["success_rate"] == pytest.approx(0.5)


def test_tasks_and_env_kwargs():
    assert default_tasks("AttnMatch-BabyAI-v0") == ["goto", "pickup", "open", "putnext", "pick_up_seq_go_to"]
    assert default_tasks("AttnMatch-BabyAI-GoTo-v0") == [None]
    assert default_tasks("AttnMatch-Math-v0") == [None]
    assert task_env_kwargs("AttnMatch-BabyAI-v0", "open") == {"task": "open"}
    assert task_env_kwargs("AttnMatch-Math-v0", "chain_sum") == {"dataset": "chain_sum"}
    assert task_env_kwargs("AttnMatch-RGMix-v0", "countdown") == {"weights": {"countdown": 1.0}}
    with pytest.raises(InvalidArgumentError, match="unknown env id"):
        task_env_kwargs("Nope-v0", "x")


def test_resolve_model(tiny_model_path, tmp_path):
    assert resolve_model(tiny_model_path) == str(tiny_model_path)
    assert resolve_model("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(InvalidArgumentError, match="without config.json"):
        resolve_model(tmp_path)
    register_model("unit-test-model", lambda: str(tiny_model_path))
    try:
        assert resolve_model("unit-test-model") == str(tiny_model_path)
    finally:
        MODEL_REGISTRY.pop("unit-test-model")
    assert "tiny-random" in MODEL_REGISTRY


def test_tiny_random_is_built_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPACTION_GYM_CACHE", str(tmp_path))
    path = resolve_model("tiny-random")
    assert (tmp_path / "models" / "tiny-random" / "config.json").exists() and path.endswith("tiny-random")
    stamp = (tmp_path / "models" / "tiny-random" / "config.json").stat().st_mtime_ns
    assert resolve_model("tiny-random") == path
    assert (tmp_path / "models" / "tiny-random" / "config.json").stat().st_mtime_ns == stamp


def test_eval_expert_policy_is_a_sanity_row(tiny_model_path, tmp_path):
    out = tmp_path / "expert"
    argv = [
        "eval",
        "--model",
        str(tiny_model_path),
        "--task",
        "pickup",
        "--episodes",
        "2",
        "--policy",
        "expert",
    ]
    argv += ["--mode", "markovian", "--max-kv-len", "448", "--compact-window", "96", "--output", str(out)]
    assert main([*argv, "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    stats = summary["tasks"]["pickup"]
    assert stats["progression"] == {"mean": 100.0, "se": 0.0} and stats["compaction_events_mean"] > 0
    assert stats["generated_tokens_mean"] == 0.0 and summary["config"]["policy"] == "expert"
    assert all(turn.forced for t in read_jsonl(out / "trajectories.jsonl") for turn in t.turns)
    assert (
        main(["eval", "--env", "AttnMatch-Math-v0", "--model", str(tiny_model_path), "--policy", "expert"])
        == 2
    )


def test_eval_names_what_is_wrong_with_contradictory_or_incomplete_inputs(tiny_model_path, tmp_path, capsys):
    """A per-task env id with another --task, and a model folder without tokenizer files, are one
    clear line each (not a silent run of the wrong task, nor 'no chat template')."""
    import shutil

    assert main(["eval", "--model", str(tiny_model_path), "--env", "AttnMatch-BabyAI-GoTo-v0", "--task", "open",
                 "--no-progress"]) == 2  # fmt: skip
    assert "always runs task 'goto'" in capsys.readouterr().err
    bare = tmp_path / "weights-only"
    bare.mkdir()
    for f in tiny_model_path.iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, bare / f.name)
    assert main(["eval", "--model", str(bare), "--episodes", "1", "--no-progress"]) == 2
    assert "no tokenizer files" in capsys.readouterr().err

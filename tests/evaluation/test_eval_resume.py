"""`compaction-gym eval --output DIR` resumes an interrupted run and refuses to mix runs."""

from __future__ import annotations

import json

import pytest

from compaction_gym.agents import rollout
from compaction_gym.engine.config import SamplingParams
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.evaluation import evaluate

ENV = "AttnMatch-BabyAI-v0"
KW = dict(tasks=["goto", "pickup"], episodes=3, seed=5, env_kwargs={"max_steps": 3}, progress=False,
          sampling=SamplingParams(temperature=0.0, max_new_tokens=4))  # fmt: skip


def _episodes(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _key(d):
    return (d["info"]["eval_task_requested"], d["seed"])


def test_interrupted_run_resumes_without_losing_or_repeating_episodes(tiny_model_path, tmp_path, monkeypatch):
    full = evaluate(str(tiny_model_path), ENV, output=tmp_path / "full", **KW)
    out = tmp_path / "resumed"
    played: list[int] = []
    real = rollout.run_episodes

    def interrupted(envs, agents, seeds, **kwargs):
        played.extend(seeds)
        if len(played) > 3:  # the second task's episodes never finish
            raise KeyboardInterrupt
        return real(envs, agents, seeds, **kwargs)

    monkeypatch.setattr(rollout, "run_episodes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        evaluate(str(tiny_model_path), ENV, output=out, **KW)
    first = _episodes(out / "trajectories.jsonl")
    assert len(first) == 3 and not (out / "summary.json").exists()
    with (out / "trajectories.jsonl").open("a") as f:
        f.write('{"token_ids": [1, 2')  # a line torn by the interruption
    played.clear()

    def counting(envs, agents, seeds, **kwargs):
        played.extend(seeds)
        return real(envs, agents, seeds, **kwargs)

    monkeypatch.setattr(rollout, "run_episodes", counting)
    resumed = evaluate(str(tiny_model_path), ENV, output=out, **KW)
    assert sorted(played) == [5, 6, 7]  # only the missing task's episodes played
    episodes = _episodes(out / "trajectories.jsonl")
    assert sorted(map(_key, episodes)) == sorted(map(_key, _episodes(tmp_path / "full" / "trajectories.jsonl")))
    assert len({_key(e) for e in episodes}) == len(episodes) == 6
    for task in ("goto", "pickup"):
        for field in ("episodes", "progression", "tokens_mean"):
            assert resumed["tasks"][task].get(field) == full["tasks"][task].get(field), (task, field)
    assert json.loads((out / "summary.json").read_text())["overall"] == resumed["overall"]


def test_a_folder_of_another_run_is_refused_unless_overwritten(tiny_model_path, tmp_path):
    out = tmp_path / "run"
    evaluate(str(tiny_model_path), ENV, output=out, **KW)
    other = {**KW, "seed": 100}
    with pytest.raises(InvalidArgumentError, match="seed"):
        evaluate(str(tiny_model_path), ENV, output=out, **other)
    assert len(_episodes(out / "trajectories.jsonl")) == 6  # nothing lost
    evaluate(str(tiny_model_path), ENV, output=out, overwrite=True, **other)
    assert {e["seed"] for e in _episodes(out / "trajectories.jsonl")} == {100, 101, 102}

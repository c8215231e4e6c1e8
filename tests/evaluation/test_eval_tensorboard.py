"""`compaction-gym eval` writes TensorBoard event files whose values re-derive from trajectories.jsonl."""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.evaluation import evaluate

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KW = dict(
    tasks=["goto", "pickup"], episodes=2, seed=3, env_kwargs={"max_steps": 3}, progress=False,
    sampling=SamplingParams(temperature=0.0, max_new_tokens=4),
    compaction=CompactionConfig(mode="attention_matching", n_protect_turns=1),
)  # fmt: skip


def read_events(log_dir) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def scalars(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def expected_episode(d: dict) -> dict[str, float]:
    """An episode's numbers from its JSON line, written out plainly."""
    info = d["info"]
    progression = info["progression"] if info.get("progression") is not None else float(d["success"])
    return {
        "progression": float(progression),
        "tokens": float(len(d["token_ids"])),
        "generated_tokens": float(sum(d["completion_mask"])),
        "turns": float(len(d["turns"])),
        "peak_kv_len": float(max([d["prompt_len"], *(t["peak_kv_len"] for t in d["turns"])])),
        "final_kv_len": float(d["turns"][-1]["kv_len"]),
        "compaction_events": float(len(d["events"])),
        "compaction_time_s": sum(e["timings"]["total"] for e in d["events"]),
        "reward": float(d["total_reward"]),
    }


def test_eval_logs_what_its_trajectories_hold(tiny_model_path, tmp_path):
    out = tmp_path / "run"
    summary = evaluate(str(tiny_model_path), "AttnMatch-BabyAI-v0", output=out,
                       engine_kwargs={"record_mass": True}, **KW)  # fmt: skip
    lines = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    events = [e for d in lines for e in d["events"]]
    assert len(lines) == 4 and events and all("mass_kept" in e for e in events)
    acc = read_events(out / "tensorboard")
    for key in expected_episode(lines[0]):
        got = scalars(acc, f"episode/{key}")
        want = [(i, expected_episode(d)[key]) for i, d in enumerate(lines)]  # completion order = file order
        assert [s for s, _ in got] == [s for s, _ in want], key
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), key
    per_event = {
        "kv_ratio": [e["kv_len_after"] / e["kv_len_before"] for e in events],
        "span_ratio": [e["target"] / (e["span"][1] - e["span"][0]) for e in events],
        "latency_s": [e["timings"]["total"] for e in events],
        "mass_kept": [e["mass_kept"] for e in events],
        "kv_len_before": [e["kv_len_before"] for e in events],
    }
    for key, want in per_event.items():
        got = scalars(acc, f"compaction/{key}")
        assert [s for s, _ in got] == list(range(len(events))), key
        assert [v for _, v in got] == pytest.approx(want, rel=1e-6), key
        hist = acc.Histograms(f"compaction/{key}")[0].histogram_value
        assert (hist.num, hist.min, hist.max) == (len(want), pytest.approx(min(want)), pytest.approx(max(want)))
        assert hist.sum == pytest.approx(sum(want), rel=1e-6)
    for label, stats in {**summary["tasks"], "overall": summary["overall"]}.items():
        assert scalars(acc, f"summary/{label}/progression") == [(0, pytest.approx(stats["progression"]["mean"]))]
        assert scalars(acc, f"summary/{label}/tokens_mean") == [(0, pytest.approx(stats["tokens_mean"]))]
        assert scalars(acc, f"summary/{label}/peak_kv_max") == [(0, stats["peak_kv_max"])]
    files = sorted((out / "tensorboard").iterdir())
    evaluate(str(tiny_model_path), "AttnMatch-BabyAI-v0", output=out, engine_kwargs={"record_mass": True}, **KW)
    assert sorted((out / "tensorboard").iterdir()) == files  # a finished run re-run logs nothing twice


def test_no_tensorboard_writes_none(tiny_model_path, tmp_path):
    evaluate(str(tiny_model_path), "AttnMatch-BabyAI-v0", output=tmp_path / "run", tensorboard=False,
             **{**KW, "tasks": ["goto"], "episodes": 1})  # fmt: skip
    assert (tmp_path / "run" / "trajectories.jsonl").exists()
    assert not (tmp_path / "run" / "tensorboard").exists()


def test_the_flags_reach_the_run():
    from compaction_gym.cli import make_parser
    from compaction_gym.evaluation.cli import load_configs

    cfg, _, _ = load_configs(make_parser().parse_args(["eval", "--no-tensorboard", "--record-mass"]))
    assert cfg.tensorboard is False and cfg.engine_kwargs() == {"record_mass": True}
    cfg, _, _ = load_configs(make_parser().parse_args(["eval"]))
    assert cfg.tensorboard is True and cfg.engine_kwargs() == {}

"""Trajectory records: lossless JSON(L) round trips and invariant checks."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from compaction_gym.agents import Trajectory, Turn, read_jsonl, write_jsonl
from compaction_gym.agents.trajectory import jsonable
from compaction_gym.compaction.events import CompactionEvent
from compaction_gym.engine.config import CompactionConfig, SamplingParams


def _event(index: int) -> CompactionEvent:
    g = torch.Generator().manual_seed(index)
    return CompactionEvent(
        index=index,
        trigger="kv_budget",
        mode="attention_matching",
        span=(10, 42),
        logical_span=(10, 42 + index),
        indices=torch.sort(torch.randint(10, 42, (2, 3, 8), generator=g), dim=-1).values,
        target=8,
        probe_source="suffix",
        probe_logical_range=(42, 60),
        probe_seed=None,
        compute_beta=True,
        kv_len_before=64,
        kv_len_after=40,
        logical_len=64 + index,
        position_offset=24 + index,
        timings={"total": 0.001 * (index + 1)},
    )


def make_trajectory() -> Trajectory:
    """A hand-built, valid trajectory: prompt 5, two turns (one sampled, one forced)."""
    ids = list(range(100, 120))
    mask = [0] * 5 + [0] * 3 + [1] * 4 + [0] * 3 + [0] * 5
    logprobs = [0.0] * 8 + [-0.1, -1.0 / 3.0, -2.5e-7, -12.75] + [0.0] * 8
    return Trajectory(
        token_ids=ids,
        completion_mask=mask,
        logprobs=logprobs,
        prompt_len=5,
        turns=[
            Turn(
                (5, 8),
                (8, 12),
                "a wall 1 step forward",
                "turn left",
                "turn left",
                0.0,
                False,
                "Obs",
                "stop",
                11,
                12,
            ),
            Turn(
                (12, 15),
                (15, 20),
                "a wall 2 steps left",
                "go forward",
                "go forward",
                0.859375,
                True,
                "Obs2",
                "forced",
                20,
                20,
                True,
            ),
        ],
        events=[_event(0), _event(1)],
        rewards=[0.0, 0.859375],
        total_reward=0.859375,
        success=True,
        info={
            "mission": "go to the red ball",
            "step": np.int64(2),
            "flags": (True, None),
            "nested": {"x": [1.5]},
        },
        compaction=CompactionConfig(mode="attention_matching", max_kv_len=64, compute_beta=True).to_dict(),
        sampling=jsonable(SamplingParams(temperature=0.7, seed=3, stop_token_ids=(7,)).to_dict()),
        model="tiny",
        instruction="You are an agent ...",
        prompt_format="balrog",
        env_id="AttnMatch-BabyAI-GoTo-v0",
        seed=3,
        metrics={"wall_time_s": 0.25, "peak_kv_len": 20},
    )


def test_make_trajectory_is_valid():
    make_trajectory().validate()


def test_json_round_trip_is_lossless():
    traj = make_trajectory()
    d = traj.to_dict()
    text = json.dumps(d)
    back = Trajectory.from_dict(json.loads(text))
    assert back.to_dict() == d
    assert json.dumps(back.to_dict()) == text
    assert back.token_ids == traj.token_ids and back.logprobs == traj.logprobs  # exact floats
    assert back.turns == traj.turns
    assert back.events == traj.events
    assert torch.equal(back.events[1].indices, traj.events[1].indices)
    assert back.turns[0].input_range == (5, 8) and isinstance(back.turns[0].input_range, tuple)
    assert back.info["step"] == 2 and back.info["flags"] == [True, None]
    # configs rebuild
    assert CompactionConfig.from_dict(back.compaction) == CompactionConfig.from_dict(traj.compaction)
    assert SamplingParams.from_dict(back.sampling).stop_token_ids == (7,)


def test_jsonl_round_trip(tmp_path):
    trajs = [make_trajectory(), make_trajectory()]
    trajs[1].seed = None
    trajs[1].logprobs[8] = -1e-300  # tiny values survive
    path = tmp_path / "sub" / "t.jsonl"
    assert write_jsonl(path, trajs[:1]) == 1
    assert write_jsonl(path, trajs[1:], append=True) == 1
    back = read_jsonl(path)
    assert [b.to_dict() for b in back] == [t.to_dict() for t in trajs]
    assert len(path.read_text().splitlines()) == 2


def test_read_jsonl_names_the_bad_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(make_trajectory().to_dict()) + "\n\n" + '{"token_ids": []}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:3"):
        read_jsonl(path)


def test_schema_version_is_checked():
    d = make_trajectory().to_dict()
    d["schema_version"] = 99
    with pytest.raises(ValueError, match="schema_version 99"):
        Trajectory.from_dict(d)


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda t: t.completion_mask.pop(), "same length"),
        (lambda t: t.logprobs.__setitem__(0, -1.0), "non-sampled"),
        (lambda t: t.completion_mask.__setitem__(9, 2), "0 or 1"),
        (lambda t: setattr(t.turns[1], "input_range", (3, 8)), "out of order"),
        (lambda t: setattr(t, "prompt_len", 99), "prompt_len"),
    ],
)
def test_validate_catches(breakage, message):
    traj = make_trajectory()
    breakage(traj)
    with pytest.raises(ValueError, match=message):
        traj.validate()


def test_derived_views():
    traj = make_trajectory()
    assert traj.num_tokens == 20 and traj.num_generated == 4 and traj.peak_kv_len == 20
    assert [m["role"] for m in traj.messages()] == ["user", "user", "assistant", "user", "assistant"]
    assert traj.messages()[4]["content"] == "go forward"


def test_jsonable_handles_numpy_and_objects():
    out = jsonable({"a": np.float32(0.5), 1: np.arange(3), "s": {2}, "c": CompactionConfig()})
    assert out == {"a": 0.5, "1": [0, 1, 2], "s": [2], "c": CompactionConfig().to_dict()}
    json.dumps(out)


def test_jsonl_round_trip_keeps_recorded_beta(tmp_path):
    """Events of format 2 (recorded β, key-probe rows) survive JSONL; lines written before it still load."""
    traj = make_trajectory()
    g = torch.Generator().manual_seed(3)
    traj.events[0] = dataclasses.replace(
        traj.events[0], probe_source="keys", probe_rows=(30, 40), beta=torch.randn(2, 3, 8, generator=g)
    )
    path = tmp_path / "t.jsonl"
    write_jsonl(path, [traj])
    (back,) = read_jsonl(path)
    assert torch.equal(back.events[0].beta, traj.events[0].beta) and back.events[0].beta.dtype == torch.float32
    assert back.events[0].probe_rows == (30, 40) and back.events[1].beta is None
    assert back.to_dict() == traj.to_dict()
    # a line written before format 2: events without version / probe_rows / beta
    old = traj.to_dict()
    old["events"] = [{k: v for k, v in e.items() if k not in ("version", "probe_rows", "beta")} for e in old["events"]]
    path.write_text(json.dumps(old) + "\n")
    (legacy,) = read_jsonl(path)
    assert all(e.beta is None and e.probe_rows is None for e in legacy.events)
    assert all(torch.equal(a.indices, b.indices) for a, b in zip(legacy.events, traj.events))

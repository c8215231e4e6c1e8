"""``agents.tensorboard``: any trajectories logged by ``TrajectoryLogger`` read back (EventAccumulator)
as the numbers computed here from their fields (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from compaction_gym.agents import Trajectory, Turn
from compaction_gym.agents.tensorboard import TrajectoryLogger
from compaction_gym.compaction.events import CompactionEvent
from compaction_gym.errors import InvalidArgumentError


@st.composite
def trajectories(draw) -> Trajectory:
    prompt = draw(st.integers(1, 50))
    n_turns = draw(st.integers(0, 4))
    turns, pos, peak = [], prompt, prompt
    for _ in range(n_turns):
        a = pos + draw(st.integers(1, 20))
        b = a + draw(st.integers(1, 20))
        peak = draw(st.integers(1, b))
        turns.append(Turn((pos, a), (a, b), "obs", "act", reward=draw(st.floats(-1, 1)), kv_len=draw(st.integers(1, b)),
                          peak_kv_len=peak, invalid_action=draw(st.booleans())))  # fmt: skip
        pos = b
    events = []
    for i in range(draw(st.integers(0, 3))):
        span = draw(st.integers(1, 40))
        target = draw(st.integers(0, span))
        before = draw(st.integers(span, 200))
        events.append(CompactionEvent(
            index=i, trigger="kv_budget", mode="h2o", span=(0, span), logical_span=(0, span),
            indices=torch.zeros(1, 1, target, dtype=torch.long), target=target, probe_source="keys",
            probe_logical_range=None, probe_seed=None, compute_beta=False, kv_len_before=before,
            kv_len_after=before - span + target, logical_len=before + 10, position_offset=10 + span - target,
            timings={"total": draw(st.floats(1e-4, 2.0))},
            mass_kept=draw(st.none() | st.floats(0.0, 1.5)),
        ))  # fmt: skip
    return Trajectory(
        token_ids=[1] * pos, completion_mask=[0] * pos, logprobs=[0.0] * pos, prompt_len=prompt, turns=turns,
        events=events, total_reward=sum(t.reward for t in turns), success=draw(st.booleans()),
        info=draw(st.sampled_from([{}, {"progression": 1.0}, {"score": 0.25}, {"aborted": True}])),
    )  # fmt: skip


def _read(log_dir) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(trajs=st.lists(trajectories(), min_size=1, max_size=4), start=st.integers(0, 5))
def test_logged_values_are_the_trajectories(tmp_path_factory, trajs, start):
    log_dir = tmp_path_factory.mktemp("tb")
    with TrajectoryLogger(log_dir, episode_step=start) as tb:
        for traj in trajs:
            tb.log_episode(traj)
        tb.log_histograms(trajs, step=7)
    acc = _read(log_dir)

    def points(tag):
        return [(e.step, e.value) for e in acc.Scalars(tag)]

    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731  (scalars are stored as float32)
    steps = list(range(start, start + len(trajs)))
    info_prog = [t.info.get("progression", t.info.get("score", float(t.success))) for t in trajs]
    assert points("episode/progression") == list(zip(steps, map(f32, info_prog)))
    assert points("episode/tokens") == [(s, float(len(t.token_ids))) for s, t in zip(steps, trajs)]
    assert points("episode/peak_kv_len") == [
        (s, float(max([t.prompt_len, *(u.peak_kv_len for u in t.turns)]))) for s, t in zip(steps, trajs)
    ]
    assert points("episode/final_kv_len") == [
        (s, float(t.turns[-1].kv_len if t.turns else t.prompt_len)) for s, t in zip(steps, trajs)
    ]
    assert points("episode/invalid_actions") == [(s, float(sum(u.invalid_action for u in t.turns))) for s, t in zip(steps, trajs)]
    assert points("episode/aborted") == [(s, float("aborted" in t.info)) for s, t in zip(steps, trajs)]
    events = [e for t in trajs for e in t.events]
    tags = acc.Tags()
    if not events:
        assert not any(tag.startswith("compaction/") for tag in tags["scalars"] + tags["histograms"])
        return
    ratios = [e.target / (e.span[1] - e.span[0]) for e in events]
    assert points("compaction/span_ratio") == [(i, f32(r)) for i, r in enumerate(ratios)]
    assert points("compaction/latency_s") == [(i, f32(e.timings["total"])) for i, e in enumerate(events)]
    hist = acc.Histograms("compaction/span_ratio")[0]
    assert hist.step == 7 and hist.histogram_value.num == len(ratios)
    assert hist.histogram_value.sum == pytest.approx(sum(ratios), rel=1e-9, abs=1e-12)
    masses = [e.mass_kept for e in events if e.mass_kept is not None]
    if masses:
        assert [v for _, v in points("compaction/mass_kept")] == [f32(m) for m in masses]
    else:
        assert "compaction/mass_kept" not in tags["scalars"]


def test_a_logger_needs_somewhere_to_write():
    with pytest.raises(InvalidArgumentError, match="log_dir"):
        TrajectoryLogger()

"""`compaction-gym plot episode|mass`: the plotted data is the trajectory's, checked point by point."""

from __future__ import annotations

import json

import pytest

from compaction_gym.agents import read_jsonl
from compaction_gym.cli import main
from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.evaluation import evaluate
from compaction_gym.plots.episode import kv_timeline, plot_episode, plot_mass, read_trajectory

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RUNS = {
    # an event after every turn but the first (turn-based Attention Matching)
    "turns": CompactionConfig(mode="attention_matching", n_protect_turns=1),
    # KV-budget H2O: back-to-back events at one logical position
    "budget": CompactionConfig(mode="h2o", max_kv_len=600, compact_window=200),
    "none": CompactionConfig(),
}


@pytest.fixture(scope="module")
def runs(tiny_model_path, tmp_path_factory):
    """``{name: trajectories.jsonl}`` of two 5-step BabyAI episodes per compaction config (mass recorded)."""
    root = tmp_path_factory.mktemp("plots")
    for name, comp in RUNS.items():
        evaluate(str(tiny_model_path), "AttnMatch-BabyAI-v0", tasks=["goto"], episodes=2, seed=1,
                 env_kwargs={"max_steps": 5}, progress=False, compaction=comp, output=root / name,
                 sampling=SamplingParams(temperature=0.0, max_new_tokens=40), tensorboard=False,
                 engine_kwargs={"record_mass": True})  # fmt: skip
    return {name: root / name / "trajectories.jsonl" for name in RUNS}


def values_at(xs, ys, x: float) -> list[float]:
    """The line's y values at ``x``: every corner there (an event's drop is vertical: a turn-based
    event fires at its turn's end, a KV-budget one when the next input arrives, both at the same
    logical position), else the slanted segment's value."""
    at = [y for xi, y in zip(xs, ys) if xi == x]
    if at:
        return at
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 < x1 and x0 <= x <= x1:
            return [y0 + (y1 - y0) * (x - x0) / (x1 - x0)]
    raise AssertionError(f"x={x} not on the line")


@pytest.mark.parametrize("name", list(RUNS))
def test_the_kv_line_passes_through_every_turn_and_event(runs, name):
    for traj in read_jsonl(runs[name]):
        xs, ys = kv_timeline(traj)
        assert (xs[0], ys[0]) == (0, 0) and all(b >= a for a, b in zip(xs, xs[1:]))
        for turn in traj.turns:  # the last sampled token of a turn is not in the cache yet
            assert turn.kv_len in values_at(xs, ys, turn.output_range[1] - 1)
        assert max(ys) == traj.peak_kv_len
        corners = {(x, y) for x, y in zip(xs, ys)}
        for e in traj.events:
            assert {(e.logical_len, e.kv_len_before), (e.logical_len, e.kv_len_after)} <= corners
        assert ys[-1] == traj.turns[-1].kv_len
        if len(traj.turns) > 1:  # one turn (solved at once) never compacts
            assert (len(traj.events) > 0) == (name != "none")
        if name == "none":
            assert xs == [0, traj.num_tokens - 1] and ys == xs


def test_plot_episode_draws_the_trajectorys_kv_lengths(runs):
    traj = read_jsonl(runs["budget"])[0]
    ax = plot_episode(traj).axes[0]
    line = ax.lines[0]
    xs, ys = kv_timeline(traj)
    assert list(line.get_xdata()) == xs and list(line.get_ydata()) == ys
    assert max(ys) == traj.peak_kv_len
    markers = ax.collections[0].get_offsets()
    assert [tuple(map(float, p)) for p in markers] == [(e.logical_len, e.kv_len_after) for e in traj.events]
    budget = [ln for ln in ax.lines if ln.get_label() == "max_kv_len"]
    assert len(budget) == 1 and list(budget[0].get_ydata()) == [600, 600]


def test_plot_mass_draws_each_events_recorded_mass(runs):
    trajs = read_jsonl(runs["turns"])
    with_events = [t for t in trajs if t.events]
    lines = plot_mass(trajs).axes[0].lines
    assert with_events and len(lines) == len(with_events) + 1  # + the dotted 1.0
    for traj, line in zip(with_events, lines):
        assert list(line.get_xdata()) == [e.index for e in traj.events]
        assert list(line.get_ydata()) == [e.mass_kept for e in traj.events]
        assert all(0 < m < 1.5 for m in line.get_ydata())
    with pytest.raises(InvalidArgumentError, match="mass_kept"):
        plot_mass(read_jsonl(runs["none"]))


def test_the_command_writes_pngs(runs, tmp_path, capsys):
    png = tmp_path / "ep.png"
    assert main(["plot", "episode", str(runs["turns"]), "--index", "1", "--output", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", "mass", str(runs["budget"])]) == 0
    assert (runs["budget"].parent / "trajectories_mass.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["plot", "episode", str(runs["turns"]), "--index", "2"]) == 2
    assert "index 2 is past the end" in capsys.readouterr().err


def test_read_trajectory_reads_one_line_and_names_bad_input(runs, tmp_path):
    lines = [json.loads(x) for x in runs["turns"].read_text().splitlines()]
    assert read_trajectory(runs["turns"], 1).token_ids == lines[1]["token_ids"]
    with pytest.raises(InvalidArgumentError, match="index"):
        read_trajectory(runs["turns"], -1)
    with pytest.raises(InvalidArgumentError, match="trajectories"):
        read_trajectory(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nope": 1}\n')
    with pytest.raises(InvalidArgumentError, match="bad.jsonl:1"):
        read_trajectory(bad)

"""``leaderboard run --jobs N`` (worker processes) and ``leaderboard cells`` (the plan)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compaction_gym.cli import main
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.leaderboard import check_record, load_suite
from compaction_gym.leaderboard.parallel import run_suite_parallel, schedule
from compaction_gym.leaderboard.plan import cell_plan, estimate_seconds, format_plan
from compaction_gym.leaderboard.runner import select_cells

CELLS = ("none/full", "attention_matching/r0.5")


def _record(root: Path, cell: str) -> dict:
    return json.loads((root / "tiny" / cell / "submission.json").read_text())


def _strip(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "wall_time_s"} for r in rows]


def test_two_jobs_give_the_serial_records(tiny_suite_path, tiny_records, tmp_path):
    """--jobs 2 (two spawned workers, one cell each) plays exactly the serial run's episodes."""
    suite = load_suite(tiny_suite_path)
    paths = run_suite_parallel(suite, jobs=2, output=tmp_path, progress=False)
    assert sorted(str(p.relative_to(tmp_path)) for p in paths) == sorted(
        f"tiny/{c}/submission.json" for c in CELLS
    )
    for cell in CELLS:
        par, ser = _record(tmp_path, cell), _record(tiny_records, cell)
        assert par["results"]["score"] == ser["results"]["score"]
        assert par["results"]["per_seed"] == ser["results"]["per_seed"]
        assert _strip(par["results"]["episodes"]) == _strip(ser["results"]["episodes"])
        assert par["config_sha256"] == ser["config_sha256"]
        assert par["provenance"]["run"] == {"jobs": 2} and ser["provenance"]["run"] == {"jobs": 1}
        assert check_record(tmp_path / "tiny" / cell).ok, check_record(tmp_path / "tiny" / cell).failures
    comp, ref = (
        _record(tmp_path, CELLS[1])["comparison_vs_none"],
        _record(tiny_records, CELLS[1])["comparison_vs_none"],
    )
    assert comp["baseline_content_sha256"] == _record(tmp_path, CELLS[0])["content_sha256"]
    assert {k: v for k, v in comp.items() if k != "baseline_content_sha256"} == {
        k: v for k, v in ref.items() if k != "baseline_content_sha256"
    }
    # resumable as a serial run: a finished output plays nothing and keeps every record
    before = {c: (tmp_path / "tiny" / c / "submission.json").read_text() for c in CELLS}
    run_suite_parallel(suite, jobs=2, output=tmp_path, progress=False)
    assert {c: (tmp_path / "tiny" / c / "submission.json").read_text() for c in CELLS} == before


def test_plan_counts_episodes_on_disk(tiny_suite_path, tiny_records, tmp_path):
    suite = load_suite(tiny_suite_path)
    cells, seeds = select_cells(suite)
    fresh = cell_plan(cells, seeds, tmp_path)
    assert [(p.cell.key, p.planned, p.on_disk, p.to_play, p.has_record) for p in fresh] == [
        ("none/full", 4, 0, 4, False),
        ("attention_matching/r0.5", 4, 0, 4, False),
    ]
    assert estimate_seconds(fresh) is None and "no timings yet" in format_plan(fresh)
    done = cell_plan(cells, seeds, tiny_records)
    assert all(p.to_play == 0 and p.has_record and p.seconds_per_episode > 0 for p in done)
    assert estimate_seconds(done) == 0.0
    # a torn line and one seed's subset: only complete lines count, nothing is rewritten
    partial = tmp_path / "tiny" / "none" / "full"
    partial.mkdir(parents=True)
    lines = (tiny_records / "tiny" / "none" / "full" / "trajectories.jsonl").read_text().splitlines()
    (partial / "trajectories.jsonl").write_text(lines[0] + "\n" + lines[1][:40])
    (partial / "cell.json").write_text(json.dumps({"wall_time_s": 10.0}))
    plan = cell_plan(cells, [0], tmp_path)
    assert [(p.planned, p.on_disk, p.to_play) for p in plan] == [(2, 1, 1), (2, 0, 2)]
    assert (partial / "trajectories.jsonl").read_text().endswith(lines[1][:40])
    # pace 10 s/episode (own or the mean of the timed cells): 3 episodes, 2 jobs, longest cell 20 s
    assert estimate_seconds(plan, jobs=1) == pytest.approx(30.0)
    assert estimate_seconds(plan, jobs=2) == pytest.approx(20.0)


def test_cells_command_and_schedule(tiny_suite_path, tiny_records, capsys):
    assert main(["leaderboard", "cells", str(tiny_suite_path), "--output", str(tiny_records)]) == 0
    out = capsys.readouterr().out
    assert "attention_matching/r0.5" in out and "2 cells, 0 of 8 episodes to play" in out
    suite = load_suite(tiny_suite_path)
    cells, _ = select_cells(suite)
    # none first even when others have more to play, then the most work, then the smaller budget
    assert schedule(suite, cells, {"none/full": 1, "attention_matching/r0.5": 4}) == list(CELLS)
    with pytest.raises(InvalidArgumentError, match="--jobs"):
        run_suite_parallel(suite, jobs=0, output=tiny_records)


def test_parallel_refuses_a_cell_of_another_config(tiny_suite_path, tmp_path):
    suite = load_suite(tiny_suite_path)
    cell = tmp_path / "tiny" / "none" / "full"
    cell.mkdir(parents=True)
    (cell / "cell.json").write_text(json.dumps({"config": {}, "config_sha256": "0" * 64}))
    with pytest.raises(InvalidArgumentError, match="another config"):
        run_suite_parallel(suite, jobs=2, output=tmp_path, progress=False)


def test_time_limit_stops_the_workers_and_says_what_is_left(tiny_suite_path, tmp_path, capsys):
    import multiprocessing as mp

    code = main(["leaderboard", "run", str(tiny_suite_path), "--output", str(tmp_path), "--time-limit", "0",
                 "--no-progress"])  # fmt: skip
    assert code == 3
    assert "0 of 2 cells done, 2 unfinished" in capsys.readouterr().err
    assert mp.active_children() == []
    assert (tmp_path / "tiny" / "none" / "full" / "cell.json").exists()
    assert not list(tmp_path.rglob("submission.json"))

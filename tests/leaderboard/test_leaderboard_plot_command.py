"""`compaction-gym plot leaderboard` draws the curves `leaderboard show` draws (report.plot, reused)."""

from __future__ import annotations

from compaction_gym.cli import main
from compaction_gym.leaderboard.report import load_records, plot


def test_plot_leaderboard_reuses_the_report_curves(tiny_records, tmp_path, capsys):
    assert main(["plot", "leaderboard", str(tiny_records), "--output", str(tmp_path / "cmd")]) == 0
    want = plot("tiny", load_records(tiny_records)["tiny"], _mkdir(tmp_path / "direct"))
    assert [p.name for p in want] == ["tiny_budget.png", "tiny_compression.png"]
    for p in want:
        assert (tmp_path / "cmd" / p.name).read_bytes() == p.read_bytes()
    assert main(["plot", "leaderboard", str(tmp_path / "empty")]) == 2
    assert "no leaderboard record" in capsys.readouterr().err


def _mkdir(path):
    path.mkdir()
    return path

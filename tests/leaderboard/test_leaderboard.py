"""End to end: run a tiny suite, records and their schema, show, resume, and compliance failures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from compaction_gym.cli import main
from compaction_gym.leaderboard import check_record, load_suite, run_suite, schema_errors
from compaction_gym.leaderboard.record import seal
from compaction_gym.leaderboard.store import sha256_file
from compaction_gym.provenance import source_tree

CELLS = ("none/full", "attention_matching/r0.5")


def _record(root: Path, cell: str) -> dict:
    return json.loads((root / "tiny" / cell / "submission.json").read_text())


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_writes_valid_records(tiny_records):
    for cell in CELLS:
        rec = _record(tiny_records, cell)
        assert schema_errors(rec) == []
        assert rec["seeds"] == [0, 10] and len(rec["results"]["episodes"]) == 4
        assert [(e["seed"], e["env_seed"]) for e in rec["results"]["episodes"]] == [
            (0, 0),
            (0, 1),
            (10, 10),
            (10, 11),
        ]
        assert rec["model"]["weights_sha256"] and rec["model"]["tokenizer_sha256"]
        assert {"git_revision", "versions", "hardware", "wall_time_s"} <= set(rec["provenance"])
        assert rec["provenance"]["source_tree"] == source_tree()  # the code that ran, from disk
        assert rec["files"]["trajectories"]["lines"] == 4
        assert (tiny_records / "tiny" / cell / "run.log").read_text().count("episode ") == 4
        assert check_record(tiny_records / "tiny" / cell).ok, check_record(
            tiny_records / "tiny" / cell
        ).failures
        per_seed = [s["score"]["mean"] for s in rec["results"]["per_seed"]]
        assert rec["results"]["across_seeds"]["mean"] == pytest.approx(sum(per_seed) / 2)
    am = _record(tiny_records, CELLS[1])
    assert am["budget"] == {"label": "r0.5", "max_kv_len": 448, "kv_ratio": 0.5, "compact_window": 96}
    assert am["results"]["compaction_events_mean"] > 0
    assert am["results"]["kv"]["peak_max"] < _record(tiny_records, CELLS[0])["results"]["kv"]["peak_max"]
    comp = am["comparison_vs_none"]
    assert (
        comp["n"] == 4
        and comp["baseline_content_sha256"] == _record(tiny_records, CELLS[0])["content_sha256"]
    )
    assert _record(tiny_records, CELLS[0])["comparison_vs_none"] is None


def test_schema_rejects_bad_records(tiny_records):
    good = _record(tiny_records, CELLS[1])
    assert schema_errors(good) == []
    missing = {k: v for k, v in good.items() if k != "config_sha256"}
    assert any("config_sha256" in e for e in schema_errors(missing))
    bad_episode = json.loads(json.dumps(good))
    bad_episode["results"]["episodes"][0]["progression"] = 140.0
    assert any("progression" in e or "episodes/0" in e for e in schema_errors(bad_episode))
    bad_hash = {**good, "content_sha256": "not-a-hash"}
    assert any("content_sha256" in e for e in schema_errors(bad_hash))
    bad_p = json.loads(json.dumps(good))
    bad_p["comparison_vs_none"]["t_pvalue"] = 1.5
    assert schema_errors(bad_p)
    assert schema_errors({**good, "surprise": 1})


def test_show_renders_tables_and_plots(tiny_records, tmp_path, capsys):
    assert main(["leaderboard", "show", "--records", str(tiny_records), "--output", str(tmp_path)]) == 0
    page = capsys.readouterr().out
    assert "| 1 |" in page and "attention_matching" in page and "r0.5" in page and "yes" in page
    for name in ("tiny_budget.png", "tiny_compression.png", "leaderboard.md"):
        assert (tmp_path / name).stat().st_size > 1000 or name.endswith(".md")
    assert (tmp_path / "tiny_budget.png").read_bytes()[:4] == b"\x89PNG"
    assert (
        main(
            [
                "leaderboard",
                "show",
                "--records",
                str(tiny_records),
                "--output",
                str(tmp_path),
                "--format",
                "html",
            ]
        )
        == 0
    )
    html = (tmp_path / "leaderboard.html").read_text()
    assert "<table>" in html and "data:image/png;base64," in html
    assert main(["leaderboard", "check", "--records", str(tiny_records)]) == 0


class Interrupt(Exception):
    pass


def test_resume_after_interruption_loses_and_duplicates_nothing(
    tiny_suite_path, tiny_backend, tiny_records, tmp_path
):
    suite = load_suite(tiny_suite_path)
    seen = []

    def stop_after_three(cell, traj):
        seen.append((cell.key, traj.seed))
        if len(seen) == 3:
            raise Interrupt

    with pytest.raises(Interrupt):
        run_suite(suite, methods=["attention_matching"], output=tmp_path, backend=tiny_backend, progress=False,
                  on_episode=stop_after_three)  # fmt: skip
    cell = tmp_path / "tiny" / "attention_matching" / "r0.5"
    assert len(_lines(cell / "trajectories.jsonl")) == 3 and not (cell / "submission.json").exists()
    with (cell / "trajectories.jsonl").open("a") as fh:  # a torn line, as a crash mid-write leaves
        fh.write('{"seed": 11, "info": {"eval_ta')
    played = []
    run_suite(suite, methods=["attention_matching"], output=tmp_path, backend=tiny_backend, progress=False,
              on_episode=lambda c, t: played.append(t.seed))  # fmt: skip
    assert len(played) == 1  # only the missing episode
    lines = _lines(cell / "trajectories.jsonl")
    assert sorted(d["seed"] for d in lines) == [0, 1, 10, 11]
    resumed = _record(tmp_path, CELLS[1])["results"]["episodes"]
    reference = _record(tiny_records, CELLS[1])["results"]["episodes"]
    strip = lambda rows: [{k: v for k, v in r.items() if k != "wall_time_s"} for r in rows]  # noqa: E731
    assert strip(resumed) == strip(reference)
    # a re-run of a finished cell plays nothing and keeps the record
    before = (cell / "submission.json").read_text()
    run_suite(suite, methods=["attention_matching"], output=tmp_path, backend=tiny_backend, progress=False,
              on_episode=lambda c, t: pytest.fail("replayed a finished episode"))  # fmt: skip
    assert (cell / "submission.json").read_text() == before


@pytest.fixture
def tampered(tiny_records, tmp_path):
    """A private copy of the records to edit."""
    root = tmp_path / "records"
    shutil.copytree(tiny_records, root)
    return root / "tiny" / "attention_matching" / "r0.5"


def _save(cell: Path, rec: dict, reseal: bool) -> None:
    (cell / "submission.json").write_text(json.dumps(seal(rec) if reseal else rec))


def test_edited_score_fails(tampered):
    rec = json.loads((tampered / "submission.json").read_text())
    rec["results"]["score"]["mean"] = 99.0
    _save(tampered, rec, reseal=False)
    failures = check_record(tampered).failures
    assert any("content hash" in f for f in failures) and any("results.score" in f for f in failures)
    _save(tampered, rec, reseal=True)  # a forger who re-hashes is still caught by the trajectories
    assert any("results.score" in f for f in check_record(tampered).failures)


def test_wrong_seeds_fail(tampered):
    rec = json.loads((tampered / "submission.json").read_text())
    rec["seeds"] = [0, 1]
    _save(tampered, rec, reseal=True)
    assert any("seeds [0, 1] are not the suite's" in f for f in check_record(tampered).failures)
    lines = (tampered / "trajectories.jsonl").read_text().splitlines()
    (tampered / "trajectories.jsonl").write_text("\n".join(lines[:3] + [lines[0]]) + "\n")
    failures = check_record(tampered).failures
    assert any("trajectories.jsonl differs" in f for f in failures)
    assert any("1 missing, 1 extra or duplicated" in f for f in failures)


def _rewrite_trajectories(cell: Path, edit) -> None:
    lines = _lines(cell / "trajectories.jsonl")
    edit(lines)
    (cell / "trajectories.jsonl").write_text("".join(json.dumps(d) + "\n" for d in lines))
    rec = json.loads((cell / "submission.json").read_text())
    rec["files"]["trajectories"]["sha256"] = sha256_file(cell / "trajectories.jsonl")
    _save(cell, rec, reseal=True)


def test_budget_overrun_fails(tampered):
    def overrun(lines):
        turn = lines[0]["turns"][1]
        turn["peak_kv_len"] = 448 + (turn["input_range"][1] - turn["input_range"][0]) + 1

    _rewrite_trajectories(tampered, overrun)
    failures = check_record(tampered).failures
    assert any(f.startswith("budget overrun: env_seed 0 turn 1") for f in failures), failures


def test_event_beyond_the_context_fails(tampered):
    def future(lines):
        ev = next(d for d in lines if d["events"])["events"][0]
        ev["logical_span"][1] = ev["logical_len"] + 5

    _rewrite_trajectories(tampered, future)
    assert any("ends after the context" in f for f in check_record(tampered).failures)


def test_config_must_match_the_suite_file(tampered, tiny_suite_path, tmp_path):
    edited = tmp_path / "edited.toml"
    edited.write_text(tiny_suite_path.read_text().replace("max_new_tokens = 3", "max_new_tokens = 4"))
    assert any(
        "config hash does not match the suite file" in f for f in check_record(tampered, edited).failures
    )
    assert (
        main(["leaderboard", "check", "--records", str(tampered.parents[1])]) == 0
    )  # against its own suite file it passes


def test_smoke_run_is_marked_incomplete_then_resumes(tiny_suite_path, tiny_backend, tmp_path):
    suite = load_suite(tiny_suite_path)
    run_suite(
        suite, methods=["none"], output=tmp_path, backend=tiny_backend, progress=False, limit_episodes=1
    )
    cell = tmp_path / "tiny" / "none" / "full"
    assert [e["env_seed"] for e in _record(tmp_path, "none/full")["results"]["episodes"]] == [0, 10]
    assert any("2 missing" in f for f in check_record(cell).failures)
    run_suite(suite, methods=["none"], output=tmp_path, backend=tiny_backend, progress=False)
    assert check_record(cell).ok and len(_record(tmp_path, "none/full")["results"]["episodes"]) == 4
    with pytest.raises(Exception, match="unknown \\['kv9'\\]"):
        run_suite(suite, budgets=["kv9"], output=tmp_path, backend=tiny_backend, progress=False)


def test_edited_p_value_fails(tampered):
    rec = json.loads((tampered / "submission.json").read_text())
    rec["comparison_vs_none"]["sign_pvalue"] = 0.001
    _save(tampered, rec, reseal=True)
    assert any("comparison_vs_none does not match" in f for f in check_record(tampered).failures)


def test_wall_time_survives_an_interruption(tiny_suite_path, tiny_backend, tmp_path):
    suite = load_suite(tiny_suite_path)

    def stop(cell, traj):
        raise Interrupt

    with pytest.raises(Interrupt):
        run_suite(
            suite, methods=["none"], output=tmp_path, backend=tiny_backend, progress=False, on_episode=stop
        )
    cell = tmp_path / "tiny" / "none" / "full"
    first = json.loads((cell / "cell.json").read_text())["wall_time_s"]
    assert first > 0
    run_suite(suite, methods=["none"], output=tmp_path, backend=tiny_backend, progress=False)
    assert _record(tmp_path, "none/full")["provenance"]["wall_time_s"] > first


def test_pairing_leaves_a_record_alone_up_to_float_noise(tiny_records, tiny_suite_path, tmp_path):
    """Re-pairing must not re-seal committed records over last-bit differences (summation order)."""
    from compaction_gym.leaderboard.runner import attach_comparisons

    root = tmp_path / "records"
    shutil.copytree(tiny_records, root)
    path = root / "tiny" / "attention_matching" / "r0.5" / "submission.json"
    rec = json.loads(path.read_text())
    assert rec["comparison_vs_none"] is not None
    rec["comparison_vs_none"]["mean_diff"] *= 1 + 1e-15
    noisy = json.dumps(seal(rec))
    path.write_text(noisy)
    suite = load_suite(tiny_suite_path)
    attach_comparisons(suite, root)
    assert path.read_text() == noisy
    rec["comparison_vs_none"]["mean_diff"] += 1.0  # a real change is written
    path.write_text(json.dumps(seal(rec)))
    attach_comparisons(suite, root)
    assert (
        json.loads(path.read_text())["comparison_vs_none"]["mean_diff"]
        != rec["comparison_vs_none"]["mean_diff"]
    )

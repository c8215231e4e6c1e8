"""Stale records (docs/leaderboard.md, "Stale records"): new records carry the compaction revision,
records from before it are stale iff a later revision changed their method, ``check`` reports them
without failing, ``show`` marks them, and the runner refuses to resume a stale cell."""

from __future__ import annotations

import json
import shlex
import shutil
from datetime import datetime
from pathlib import Path

import pytest

from compaction_gym.cli import main
from compaction_gym.compaction.revisions import COMPACTION_REVISION, revision
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.leaderboard import check_record, load_suite, run_suite
from compaction_gym.leaderboard.parallel import run_suite_parallel
from compaction_gym.leaderboard.record import seal
from compaction_gym.leaderboard.report import DOC_BEGIN, DOC_END
from compaction_gym.leaderboard.runner import attach_comparisons
from compaction_gym.leaderboard.staleness import STALE_MARK, record_stale, stale_records
from compaction_gym.leaderboard.suite import DEFAULT_OUTPUT, SUITES_DIR

AM, NONE = "attention_matching/r0.5", "none/full"
#: a start time before revision 2 (the first committed records')
OLD = "2026-11-24T07:27:11+00:00"


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def age(cell: Path, started_at: str = OLD) -> None:
    """Make a cell look made by the code before ``compaction_revision`` existed, started at
    ``started_at``: the field dropped from its record (resealed) and ``cell.json``."""
    state = _json(cell / "cell.json")
    state.pop("compaction_revision", None)
    (cell / "cell.json").write_text(json.dumps({**state, "started_at": started_at}))
    if (cell / "submission.json").exists():
        rec = _json(cell / "submission.json")
        rec["provenance"].pop("compaction_revision")
        rec["provenance"]["started_at"] = started_at
        (cell / "submission.json").write_text(json.dumps(seal(rec)))


@pytest.fixture
def aged(tiny_records, tiny_suite_path, tmp_path):
    """A copy of the tiny records, both cells made before revision 2 (and paired again: the
    ``none`` record's hash changed)."""
    root = tmp_path / "records"
    shutil.copytree(tiny_records, root)
    for cell in (AM, NONE):
        age(root / "tiny" / cell)
    attach_comparisons(load_suite(tiny_suite_path), root)
    return root


def test_new_records_carry_the_current_revision(tiny_records, capsys):
    for cell in (AM, NONE):
        assert (
            _json(tiny_records / "tiny" / cell / "submission.json")["provenance"]["compaction_revision"] == 2
        )
        assert _json(tiny_records / "tiny" / cell / "cell.json")["compaction_revision"] == COMPACTION_REVISION
    assert stale_records(tiny_records) == []
    assert main(["leaderboard", "check", "--records", str(tiny_records)]) == 0
    assert f"0 stale records (compaction revision {COMPACTION_REVISION})" in capsys.readouterr().out


def test_a_record_without_the_field_is_stale_iff_its_method_is_affected(aged):
    am, none = (_json(aged / "tiny" / c / "submission.json") for c in (AM, NONE))
    assert "compaction_revision" not in am["provenance"] and check_record(aged / "tiny" / AM).ok
    assert record_stale(am) is revision(2)
    assert record_stale(none) is None  # no compaction: no revision changed it
    keep = json.loads(json.dumps(am))  # the same record, Attention Matching keeping the values
    keep["config"]["compaction"]["refit_values"] = False
    assert record_stale(keep) is None
    # without the field, a record started once revision 2 was in force holds
    assert record_stale({**am, "provenance": {**am["provenance"], "started_at": revision(2).date}}) is None
    # an explicit revision wins over the start time
    assert record_stale({**am, "provenance": {**am["provenance"], "compaction_revision": 2}}) is None
    assert [(s.suite, s.method, s.budget, s.made_at) for s in stale_records(aged)] == [
        ("tiny", "attention_matching", "r0.5", 1)
    ]


def test_check_reports_stale_records_and_their_rerun_without_failing(aged, tiny_suite_path, capsys):
    assert main(["leaderboard", "check", "--records", str(aged)]) == 0  # compliance alone decides
    out = capsys.readouterr().out
    assert "2 records, 0 failing" in out
    assert "1 stale records" in out and "tiny: attention_matching/r0.5 (r1)" in out
    report = out.split("1 stale records")[1]
    assert "made before revision 2 (2026-11-25, 3e2e58d)" in report and "none/full" not in report
    assert _json(aged / "tiny" / AM / "compliance.json")["ok"] is True  # not written into compliance
    # the printed command re-runs the stale cell (the tiny suite is not bundled: named by its file)
    command = out.split("re-run them with:\n")[1].strip()
    remove, run = command.split(" && ")
    assert shlex.split(remove) == ["rm", "-r", str(aged / "tiny" / AM)]
    argv = shlex.split(run)
    assert argv[:4] == ["compaction-gym", "leaderboard", "run", str(tiny_suite_path)]
    shutil.rmtree(aged / "tiny" / AM)
    assert main([*argv[1:], "--no-progress", "--no-tensorboard"]) == 0
    capsys.readouterr()
    assert _json(aged / "tiny" / AM / "submission.json")["provenance"]["compaction_revision"] == 2
    assert stale_records(aged) == [] and check_record(aged / "tiny" / AM).ok
    main(["leaderboard", "check", "--records", str(aged)])
    assert "0 stale records" in capsys.readouterr().out


def test_a_failing_record_still_fails_check(aged, capsys):
    rec = _json(aged / "tiny" / AM / "submission.json")
    rec["results"]["score"]["mean"] = 99.0  # edited: compliance fails, staleness is reported beside
    (aged / "tiny" / AM / "submission.json").write_text(json.dumps(rec))
    assert main(["leaderboard", "check", "--records", str(aged)]) == 1
    assert "1 stale records" in capsys.readouterr().out


def test_show_marks_stale_scores(aged, tmp_path, capsys):
    assert main(["leaderboard", "show", "--records", str(aged), "--output", str(tmp_path / "page")]) == 0
    page = capsys.readouterr().out
    rows = {r.split(" | ")[1]: r for r in page.splitlines() if r.startswith("| ") and " | tiny" not in r}
    assert f" {STALE_MARK} |" in rows["attention_matching"].split(" | r0.5 | ")[1]
    assert STALE_MARK not in rows["none"]
    note = f"{STALE_MARK} stale: made before compaction revision 2 (2026-11-25, 3e2e58d)"
    assert note in page
    doc = tmp_path / "doc.md"
    doc.write_text(f"# page\n\n{DOC_BEGIN}\nold\n{DOC_END}\ntail\n")
    args = ["leaderboard", "show", "--records", str(aged), "--format", "md", "--update-doc", str(doc)]
    assert main(args) == 0
    text = doc.read_text()
    assert note in text and f" {STALE_MARK} |" in text and text.endswith("tail\n")
    assert (
        main(["leaderboard", "show", "--records", str(aged), "--output", str(tmp_path), "--format", "html"])
        == 0
    )
    assert note in (tmp_path / "leaderboard.html").read_text()


def test_show_of_current_records_has_no_mark(tiny_records, tmp_path, capsys):
    assert main(["leaderboard", "show", "--records", str(tiny_records), "--output", str(tmp_path)]) == 0
    assert STALE_MARK not in capsys.readouterr().out


class Interrupt(Exception):
    pass


def test_the_runner_refuses_to_resume_a_stale_cell(tiny_suite_path, tiny_backend, tmp_path):
    suite = load_suite(tiny_suite_path)
    seen = []

    def stop_after_one_am_episode(cell, traj):
        seen.append(cell.key)
        if cell.key == AM:
            raise Interrupt

    with pytest.raises(Interrupt):
        run_suite(suite, output=tmp_path, backend=tiny_backend, progress=False, tensorboard=False,
                  on_episode=stop_after_one_am_episode)  # fmt: skip
    am, none = tmp_path / "tiny" / AM, tmp_path / "tiny" / NONE
    assert seen.count(NONE) == 4 and not (am / "submission.json").exists()
    # both cells as the code before revision 2 left them; none's record has lost an episode
    age(am)
    age(none)
    lines = (none / "trajectories.jsonl").read_text().splitlines()
    (none / "trajectories.jsonl").write_text("\n".join(lines[:3]) + "\n")
    (none / "submission.json").unlink()
    before = (am / "trajectories.jsonl").read_text()
    played = []
    with pytest.raises(InvalidArgumentError, match=r"compaction revision 1.*Delete that directory") as err:
        run_suite(suite, output=tmp_path, backend=tiny_backend, progress=False, tensorboard=False,
                  on_episode=lambda c, t: played.append(c.key))  # fmt: skip
    assert str(am) in str(err.value)
    # the none cell ran first and resumed (no revision changed it); the stale cell played nothing
    assert played == [NONE] and (am / "trajectories.jsonl").read_text() == before
    assert _json(none / "submission.json")["provenance"]["compaction_revision"] == 2
    assert _json(none / "cell.json")["compaction_revision"] == 2
    assert main(["leaderboard", "run", str(tiny_suite_path), "--output", str(tmp_path), "--no-progress",
                 "--no-tensorboard"]) == 2  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="compaction revision 1"):  # before any worker starts
        run_suite_parallel(suite, jobs=2, output=tmp_path, progress=False, tensorboard=False)
    # the fix the message names: a fresh cell
    shutil.rmtree(am)
    run_suite(suite, methods=["attention_matching"], output=tmp_path, backend=tiny_backend, progress=False,
              tensorboard=False)  # fmt: skip
    assert _json(am / "submission.json")["provenance"]["compaction_revision"] == 2
    assert check_record(am).ok and stale_records(tmp_path) == []


def test_a_stale_cell_without_episodes_starts_at_the_current_revision(
    tiny_suite_path, tiny_backend, tmp_path
):
    suite = load_suite(tiny_suite_path)
    run_suite(suite, methods=["attention_matching"], output=tmp_path, backend=tiny_backend, progress=False,
              tensorboard=False, limit_episodes=1)  # fmt: skip
    am = tmp_path / "tiny" / AM
    for name in ("trajectories.jsonl", "submission.json", "audit.jsonl.gz"):
        (am / name).unlink(missing_ok=True)
    age(am)  # a cell.json from before revision 2, no episodes: nothing to mix
    run_suite(suite, methods=["attention_matching"], output=tmp_path, backend=tiny_backend, progress=False,
              tensorboard=False)  # fmt: skip
    assert _json(am / "cell.json")["compaction_revision"] == 2 and check_record(am).ok


#: the shipped suites' methods the C2 change (revision 2) affected, by name (issue 22)
AFFECTED = {
    "attention_matching",
    "attention_matching_beta",
    "attention_matching_keys",
    "attention_matching_random",
    "rsa_attention_matching",
}


def test_committed_records_stale_exactly_where_c2_is_refitted():
    """Committed records of the methods that refit C2 are stale iff they started before revision 2
    landed (the re-run cells hold), no other (methods and date named independently of the code)."""
    records = [_json(p) for p in sorted(DEFAULT_OUTPUT.rglob("submission.json"))]
    if not records:
        pytest.skip("no committed records in this checkout")
    stale = {(s.suite, s.method, s.budget) for s in stale_records(DEFAULT_OUTPUT)}
    landed = datetime.fromisoformat("2026-11-25T20:07:46+00:00")
    for rec in records:
        key = (rec["suite"]["name"], rec["method"], rec["budget"]["label"])
        before = datetime.fromisoformat(rec["provenance"]["started_at"]) < landed
        assert (key in stale) == (rec["method"] in AFFECTED and before), key
    assert any(rec["method"].endswith("_repeat_keep") for rec in records)  # the keep methods: held


@pytest.mark.parametrize("suite", sorted(p.stem for p in SUITES_DIR.glob("*.toml")))
def test_shipped_suites_affected_methods(suite):
    from compaction_gym.compaction.revisions import stale_since
    from compaction_gym.leaderboard.lm_suite import LM_KIND, load_lm_suite, suite_kind

    cells = (load_lm_suite if suite_kind(suite) == LM_KIND else load_suite)(suite).cells
    for cell in cells:
        affected = stale_since(cell.config()["compaction"], 1) is not None
        assert affected == (cell.method.split("+")[0] in AFFECTED), cell.key


LM_SUITE = """
kind = "lm"
name = "lm-rev"
model = "{model}"
text = "text.txt"
text_sha256 = "{sha}"
max_tokens = 96
chunk = 16
score_after = 32
seeds = [0]
budgets = [{{ max_kv_len = 40 }}]

[[methods]]
name = "none"
mode = "none"

[[methods]]
name = "attention_matching"
mode = "attention_matching"
"""


def _strip_revision(path: Path) -> None:
    """Score lines as the lm runner wrote them before ``compaction_revision`` (revision 1)."""
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({k: v for k, v in d.items() if k != "compaction_revision"}) + "\n"
                            for d in lines))  # fmt: skip


@pytest.mark.usefixtures("one_torch_thread")
def test_the_lm_runner_refuses_stale_scores(tiny_model_path, tiny_model, tiny_tokenizer, tmp_path):
    import hashlib

    from compaction_gym.leaderboard.lm_runner import run_lm_suite
    from compaction_gym.leaderboard.lm_suite import load_lm_suite

    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. A lazy dog sleeps. " * 10)
    suite_path = tmp_path / "lm-rev.toml"
    sha = hashlib.sha256(text.read_bytes()).hexdigest()
    suite_path.write_text(LM_SUITE.format(model=tiny_model_path, sha=sha))
    suite, out = load_lm_suite(suite_path), tmp_path / "records"
    paths = run_lm_suite(suite, output=out, model_and_tokenizer=(tiny_model, tiny_tokenizer))
    assert [_json(p)["provenance"]["compaction_revision"] for p in paths] == [2, 2]
    am, none = out / "lm-rev" / "attention_matching" / "kv40", out / "lm-rev" / "none" / "full"
    assert all(_json(p)["events"] > 0 for p in [am / "scores.jsonl"])
    _strip_revision(am / "scores.jsonl")
    _strip_revision(none / "scores.jsonl")
    with pytest.raises(InvalidArgumentError, match="compaction revision 1") as err:
        run_lm_suite(suite, output=out, model_and_tokenizer=(tiny_model, tiny_tokenizer))
    assert str(am) in str(err.value)
    shutil.rmtree(am)  # the fix; none's revision-1 lines still hold (no revision changed them)
    paths = run_lm_suite(suite, output=out, model_and_tokenizer=(tiny_model, tiny_tokenizer))
    assert len(paths) == 2 and stale_records(out) == [] and all(check_record(p).ok for p in paths)

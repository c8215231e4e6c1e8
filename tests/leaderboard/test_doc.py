"""``leaderboard show --format md --update-doc DOC``: the generated block of a docs page."""

from __future__ import annotations

from pathlib import Path

from compaction_gym.cli import main
from compaction_gym.leaderboard.report import DOC_BEGIN, DOC_END


def _doc(tmp_path: Path, middle: str = "stale text") -> Path:
    doc = tmp_path / "docs" / "page.md"
    doc.parent.mkdir()
    doc.write_text(f"# Page\n\nintro\n\n{DOC_BEGIN}\n{middle}\n{DOC_END}\n\n## After\n\nkept\n")
    return doc


def test_update_doc_rewrites_only_the_block(tiny_records, tmp_path, capsys):
    doc = _doc(tmp_path)
    argv = ["leaderboard", "show", "--records", str(tiny_records), "--update-doc", str(doc)]
    assert main(argv) == 0
    text = doc.read_text()
    assert text.startswith("# Page\n\nintro\n\n" + DOC_BEGIN) and text.endswith(
        DOC_END + "\n\n## After\n\nkept\n"
    )
    assert "stale text" not in text
    block = text[text.index(DOC_BEGIN) + len(DOC_BEGIN) : text.index(DOC_END)]
    assert "### tiny" in block and "| attention_matching | r0.5 |" in block
    assert "2 records (2 compliant); seeds [0, 10]; run on cpu with --jobs 1" in block
    for name in ("tiny_budget.png", "tiny_compression.png"):  # linked relative to the page
        assert f"](img/leaderboard/{name})" in block
        assert (doc.parent / "img" / "leaderboard" / name).read_bytes()[:4] == b"\x89PNG"
    assert main(argv) == 0 and doc.read_text() == text  # regenerating is idempotent
    capsys.readouterr()


def test_update_doc_needs_the_markers_and_md(tiny_records, tmp_path, capsys):
    doc = tmp_path / "plain.md"
    doc.write_text("# no block here\n")
    assert main(["leaderboard", "show", "--records", str(tiny_records), "--update-doc", str(doc)]) == 2
    assert "has no block" in capsys.readouterr().err and doc.read_text() == "# no block here\n"
    args = [
        "leaderboard",
        "show",
        "--records",
        str(tiny_records),
        "--update-doc",
        str(doc),
        "--format",
        "html",
    ]
    assert main(args) == 2 and "--update-doc needs --format md" in capsys.readouterr().err


def test_update_doc_without_records_says_how_to_make_them(tmp_path, capsys):
    doc = _doc(tmp_path)
    assert main(["leaderboard", "show", "--records", str(tmp_path / "none"), "--update-doc", str(doc)]) == 0
    assert "No records under" in doc.read_text() and "intro" in doc.read_text()
    capsys.readouterr()


def test_run_line_names_the_source_tree_where_git_does_not_describe_the_code(tiny_records):
    """A record run on a copy whose ``.git`` lags: the run line shows its source tree, not the
    revision; a record whose tree is the revision's, or one from before ``source_tree``, shows git."""
    import copy
    import json

    from compaction_gym.leaderboard.compliance import CheckResult
    from compaction_gym.leaderboard.record import schema_errors
    from compaction_gym.leaderboard.report import how_run

    rec = json.loads(next(Path(tiny_records).glob("tiny/*/*/submission.json")).read_text())
    tree, rev = "a" * 40, "b" * 40

    def line(**prov):
        r = copy.deepcopy(rec)
        r["provenance"] = {**{k: v for k, v in r["provenance"].items() if "source_tree" not in k}, **prov}
        assert schema_errors(r) == []
        return how_run([(r, CheckResult(Path("x")))])

    assert line(git_revision=rev).endswith(f"; git {'b' * 10}")  # an old record: no source_tree
    assert line(git_revision=rev, source_tree=tree, git_source_tree=tree).endswith(f"; git {'b' * 10}")
    assert line(git_revision=rev, git_dirty=True, source_tree=tree, git_source_tree="c" * 40).endswith(
        f"; source tree {'a' * 10}"
    )
    assert line(git_revision=None, source_tree=tree, git_source_tree=None).endswith(
        f"; source tree {'a' * 10}"
    )
    r = copy.deepcopy(rec)
    r["provenance"]["source_tree"] = "not a hash"
    assert any("source_tree" in e for e in schema_errors(r))

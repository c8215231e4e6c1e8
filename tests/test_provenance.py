"""``source_tree``: the git tree id of the package's files on disk, checked against git itself."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from compaction_gym import provenance
from compaction_gym.provenance import PACKAGE_DIR, ROOT, git_tree_hash, source_files, source_tree

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command")


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    out = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _git_tree_of(folder: Path, tmp: Path) -> str:
    """The reference: ``folder`` committed to a fresh repository by git (``add -A``, ``write-tree``)."""
    repo = tmp / "repo"
    shutil.copytree(
        folder, repo / folder.name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    return _git(repo, "rev-parse", f"{_git(repo, 'write-tree')}:{folder.name}")


def _tree(tmp: Path) -> Path:
    pkg = tmp / "pkg"
    (pkg / "sub" / "deeper").mkdir(parents=True)
    (pkg / "__pycache__").mkdir()
    files = {
        "a.py": "x = 1\n",
        "sub.py": "# a file named like a folder: git sorts it before 'sub/'\n",
        "sub/b.py": "y = 2\n",
        "sub/deeper/c.json": '{"z": 3}\n',
        "sub-x.txt": "'-' sorts before '/'\n",
        "run.sh": "#!/bin/sh\necho hi\n",
        "__pycache__/a.cpython-311.pyc": "bytecode",
        "sub/b.pyc": "bytecode",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    (pkg / "run.sh").chmod(0o755)
    return pkg


def test_tree_hash_equals_gits(tmp_path):
    pkg = _tree(tmp_path)
    files = source_files(pkg)
    assert {p.relative_to(pkg).as_posix() for p in files} == {
        "a.py",
        "sub.py",
        "sub/b.py",
        "sub/deeper/c.json",
        "sub-x.txt",
        "run.sh",
    }
    assert git_tree_hash(pkg, files) == _git_tree_of(pkg, tmp_path)


def test_tree_hash_is_stable_under_file_order_and_changes_with_any_file(tmp_path):
    pkg = _tree(tmp_path)
    files = source_files(pkg)
    base = git_tree_hash(pkg, files)
    for seed in range(5):
        shuffled = list(files)
        random.Random(seed).shuffle(shuffled)
        assert git_tree_hash(pkg, shuffled) == base
    seen = {base}
    (pkg / "sub" / "deeper" / "c.json").write_text('{"z": 4}\n')  # a content change deep down
    seen.add(git_tree_hash(pkg, source_files(pkg)))
    (pkg / "run.sh").chmod(0o644)  # the executable bit, as git records it
    seen.add(git_tree_hash(pkg, source_files(pkg)))
    (pkg / "new.py").write_text("")  # a new file
    seen.add(git_tree_hash(pkg, source_files(pkg)))
    (pkg / "__pycache__" / "new.cpython-311.pyc").write_text("ignored")  # bytecode: no change
    assert git_tree_hash(pkg, source_files(pkg)) in seen
    assert len(seen) == 4
    assert git_tree_hash(pkg, source_files(pkg)) == _git_tree_of(pkg, tmp_path / "again")


def test_the_package_files_are_the_ones_git_tracks_and_hash_as_git_does(tmp_path):
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = _git(
        ROOT, "ls-files", "--cached", "--others", "--exclude-standard", PACKAGE_DIR.name
    ).splitlines()
    on_disk = {p for p in listed if (ROOT / p).exists()}
    assert {p.relative_to(ROOT).as_posix() for p in source_files()} == on_disk
    assert source_tree() == _git_tree_of(PACKAGE_DIR, tmp_path)
    clean = _git(ROOT, "status", "--porcelain", "--untracked-files=all", PACKAGE_DIR.name) == ""
    assert (source_tree() == provenance.git_source_tree()) == clean


def test_a_process_names_the_code_it_loaded_not_later_edits(monkeypatch):
    """``code_identity`` is taken once (a run calls it before its first episode): files edited on
    disk while the run goes on do not change the records it writes."""
    trees = iter(["a" * 40, "b" * 40])
    monkeypatch.setattr(provenance, "source_tree", lambda: next(trees))
    provenance.code_identity.cache_clear()
    try:
        assert provenance.code_identity()["source_tree"] == "a" * 40
        assert provenance.provenance()["source_tree"] == "a" * 40  # not "b": no second look at the disk
    finally:
        provenance.code_identity.cache_clear()

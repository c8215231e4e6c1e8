"""Crash-safe files: atomic writes, fsync'd appends, resume reads that dedupe and drop torn lines."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compaction_gym.leaderboard.store import append_jsonl, read_episodes, write_json_atomic


@settings(max_examples=60, deadline=None)
@given(keys=st.lists(st.integers(0, 6), max_size=20), torn=st.integers(0, 30))
def test_read_episodes_keeps_the_first_of_each_key(tmp_path_factory, keys, torn):
    path = tmp_path_factory.mktemp("store") / "t.jsonl"
    rows = [{"k": k, "i": i} for i, k in enumerate(keys)]
    append_jsonl(path, rows)
    tail = json.dumps({"k": 99, "i": -1})[:torn] if torn else ""
    with path.open("a") as fh:
        fh.write(tail)
    expected, seen = [], set()
    for r in rows:  # brute force: first occurrence wins, file order kept
        if r["k"] not in seen:
            seen.add(r["k"])
            expected.append(r)
    if tail and len(tail) == len(json.dumps({"k": 99, "i": -1})):
        expected.append({"k": 99, "i": -1})  # a complete line without its newline still counts
    got = read_episodes(path, lambda r: r["k"])
    assert got == expected
    assert [json.loads(line) for line in path.read_text().splitlines()] == expected  # file rewritten clean
    append_jsonl(path, [{"k": 100, "i": 0}])
    assert read_episodes(path, lambda r: r["k"])[-1] == {"k": 100, "i": 0}


def test_atomic_write_keeps_the_old_file_when_interrupted(tmp_path, monkeypatch):
    import os

    path = tmp_path / "r.json"
    write_json_atomic(path, {"a": 1})

    def crash(src, dst):
        raise KeyboardInterrupt  # interrupted between writing the temporary file and the rename

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        write_json_atomic(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1} and [p.name for p in tmp_path.iterdir()] == ["r.json"]
    monkeypatch.undo()
    write_json_atomic(path, {"a": 3})
    assert json.loads(path.read_text()) == {"a": 3}

"""The audit trail (``audit.jsonl.gz``): records are checkable without their full trajectories."""

from __future__ import annotations

import gzip
import json
import shutil

import pytest

from compaction_gym.agents.trajectory import Trajectory
from compaction_gym.leaderboard import check_record
from compaction_gym.leaderboard.audit import AUDIT_FILE, audit_bytes, read_audit, write_audit
from compaction_gym.leaderboard.record import episode_row, seal
from compaction_gym.leaderboard.store import sha256_file

CELL = ("tiny", "attention_matching", "r0.5")


@pytest.fixture
def cell(tiny_records, tmp_path):
    root = tmp_path / "records"
    shutil.copytree(tiny_records, root)
    return root.joinpath(*CELL)


def _reseal_audit(cell, entries):
    write_audit(cell / AUDIT_FILE, entries)
    rec = json.loads((cell / "submission.json").read_text())
    rec["files"]["audit"]["sha256"] = sha256_file(cell / AUDIT_FILE)
    (cell / "submission.json").write_text(json.dumps(seal(rec)))


def test_audit_matches_the_trajectories_independently(cell):
    rec = json.loads((cell / "submission.json").read_text())
    assert rec["files"]["audit"]["sha256"] == sha256_file(cell / AUDIT_FILE)
    trajs = [json.loads(x) for x in (cell / "trajectories.jsonl").read_text().splitlines()]
    audit = read_audit(cell / AUDIT_FILE)
    assert len(audit) == len(trajs) == rec["files"]["audit"]["lines"]
    events = 0
    for entry, d in zip(audit, trajs, strict=True):
        traj = Trajectory.from_dict(d)
        assert entry["row"] == json.loads(json.dumps(episode_row(traj)))
        assert [t["peak_kv_len"] for t in entry["turns"]] == [t.peak_kv_len for t in traj.turns]
        assert [e["span"] for e in entry["events"]] == [list(e["span"]) for e in d["events"]]
        events += len(entry["events"])
    assert events > 0  # the AM cell compacts: the causality checks have something to read
    # reproducible bytes: no timestamp in the gzip header
    assert audit_bytes(audit) == (cell / AUDIT_FILE).read_bytes()
    assert gzip.decompress((cell / AUDIT_FILE).read_bytes()).count(b"\n") == len(trajs)


def test_record_without_trajectories_passes_from_its_audit(cell):
    assert check_record(cell).ok, check_record(cell).failures
    (cell / "trajectories.jsonl").unlink()
    assert check_record(cell).ok, check_record(cell).failures


def test_missing_both_fails(cell):
    (cell / "trajectories.jsonl").unlink()
    (cell / AUDIT_FILE).unlink()
    assert any("missing trajectories.jsonl and audit.jsonl.gz" in f for f in check_record(cell).failures)


def test_edited_audit_fails(cell):
    entries = read_audit(cell / AUDIT_FILE)
    entries[0]["row"]["progression"] = 100.0 - entries[0]["row"]["progression"]
    write_audit(cell / AUDIT_FILE, entries)  # the record still names the old sha
    assert any("audit.jsonl.gz differs" in f for f in check_record(cell).failures)
    _reseal_audit(cell, entries)  # a forger who re-hashes is caught by the trajectories...
    assert any("does not re-derive from trajectories.jsonl" in f for f in check_record(cell).failures)
    (cell / "trajectories.jsonl").unlink()  # ...and, without them, by the record's statistics
    assert any(f.startswith("results.") for f in check_record(cell).failures)


def test_audit_rules_without_trajectories(cell):
    (cell / "trajectories.jsonl").unlink()
    entries = read_audit(cell / AUDIT_FILE)
    turn = entries[0]["turns"][1]
    turn["peak_kv_len"] = 448 + (turn["input_range"][1] - turn["input_range"][0]) + 1
    ev = next(e for e in entries if e["events"])["events"][0]
    ev["logical_span"][1] = ev["logical_len"] + 5
    _reseal_audit(cell, entries)
    failures = check_record(cell).failures
    assert any(f.startswith("budget overrun: env_seed 0 turn 1") for f in failures), failures
    assert any("ends after the context" in f for f in failures), failures
    assert any("row peak_kv" in f for f in failures), failures  # the row no longer matches its turns

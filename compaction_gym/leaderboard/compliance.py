"""``leaderboard check``: compliance of every record with the rules of ``docs/leaderboard.md``.

A record passes when: it matches its schema; its content hash holds (not edited after the run);
its trajectories file (or, where the trajectories are not shipped, its audit trail) is the one it
was computed from and every number re-derives from it; its
config hash matches the suite file as it is now; its seeds and episodes are exactly the suite's;
the measured KV never exceeded the claimed budget (the engine's contract: by at most the input of
the step that crossed it, ``docs/engine.md``); every compaction event used only tokens already in
context. A failing record is reported with its reasons (``compliance.json``), never deleted.
Language-modelling records have their own rules (:mod:`compaction_gym.leaderboard.lm_compliance`).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compaction_gym.errors import CompactionGymError
from compaction_gym.leaderboard.audit import (
    AUDIT_FILE,
    audit_entries,
    read_audit,
    row_failures,
    rows_from_trajectories,
)
from compaction_gym.leaderboard.lm_compliance import check_lm_record
from compaction_gym.leaderboard.lm_record import LM_RECORD_SCHEMA
from compaction_gym.leaderboard.record import (
    RECORD_FILE,
    TRAJECTORIES_FILE,
    finite,
    results,
    schema_errors,
)
from compaction_gym.leaderboard.record_checks import json_close, paired_failures, sealed_ok, suite_and_cell
from compaction_gym.leaderboard.store import sha256_file
from compaction_gym.leaderboard.suite import load_suite

COMPLIANCE_FILE = "compliance.json"


@dataclass
class CheckResult:
    """The verdict on one record: ``failures`` lists every broken rule (empty: compliant)."""

    path: Path
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self, root: str | Path | None = None) -> dict[str, Any]:
        """The verdict as JSON; ``record`` relative to ``root`` when given, so a verdict written
        next to its record reads the same in every checkout."""
        record = self.path.relative_to(root) if root is not None else self.path
        return {"record": str(record), "ok": self.ok, "failures": self.failures}


def kv_failures(trajs: list[dict[str, Any]], max_kv_len: int | None) -> list[str]:
    """Turns whose peak KV exceeded ``max_kv_len`` by more than the turn's input."""
    if max_kv_len is None:
        return []
    out = []
    for d in trajs:
        for i, turn in enumerate(d["turns"]):
            start, end = turn["input_range"]
            allowed = max_kv_len + (end - start)
            if turn["peak_kv_len"] > allowed:
                out.append(
                    f"budget overrun: env_seed {d['seed']} turn {i} peak KV {turn['peak_kv_len']} > "
                    f"max_kv_len {max_kv_len} + input {end - start}"
                )
    return out


def event_failures(trajs: list[dict[str, Any]], protect_prompt: bool) -> list[str]:
    """Compaction events that reach past the context they fired in (or before the protected prompt).

    An RSA question's events carry their member's ``session`` and its protected ``session_prompt_len``:
    each session is checked on its own (``leaderboard.rsa_cells``)."""
    out = []
    for d in trajs:
        last: dict[Any, int] = {}
        for ev in d.get("events", []):
            session, prompt_len = ev.get("session"), ev.get("session_prompt_len", d["prompt_len"])
            where = f"env_seed {d['seed']} event {ev['index']}"
            s0, s1 = ev["span"]
            l0, l1 = ev["logical_span"]
            if not 0 <= s0 < s1 <= ev["kv_len_before"]:
                out.append(f"{where}: span {ev['span']} is not inside the {ev['kv_len_before']} cached rows")
            if not 0 <= l0 < l1 <= ev["logical_len"]:
                out.append(
                    f"{where}: logical span {ev['logical_span']} ends after the context ({ev['logical_len']})"
                )
            probe = ev.get("probe_logical_range")
            if probe is not None and probe[1] > ev["logical_len"]:
                out.append(f"{where}: probes {probe} come from beyond the context ({ev['logical_len']})")
            if ev["kv_len_after"] > ev["kv_len_before"]:
                out.append(f"{where}: the cache grew ({ev['kv_len_before']} -> {ev['kv_len_after']})")
            if ev["logical_len"] < last.get(session, 0):
                out.append(
                    f"{where}: fired at {ev['logical_len']}, before the previous event ({last[session]})"
                )
            if protect_prompt and l0 < prompt_len:
                out.append(f"{where}: compacted the protected prompt (logical start {l0} < {prompt_len})")
            last[session] = ev["logical_len"]
    return out


def comparison_failures(path: Path, record: dict[str, Any], suite: Any) -> list[str]:
    """The paired comparison must re-derive from the ``none`` record it names (a sibling cell)."""
    from compaction_gym.leaderboard.record import comparison

    def recompute(baseline: dict[str, Any], _: Path) -> dict[str, Any] | None:
        return comparison(record["results"]["episodes"], baseline["results"]["episodes"])

    return paired_failures(path, record, suite.baseline, recompute)


def _episodes(
    path: Path, record: dict[str, Any], fail: list[str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None] | None:
    """The record's episodes (trajectory dicts or audit lines, which the KV and event checks read
    alike) and their rows; ``None`` when neither file is there. Failures go to ``fail``."""
    files = record["files"]
    traj_path = path.parent / files["trajectories"]["path"]
    audit = files.get("audit")
    audit_path = path.parent / audit["path"] if audit else None
    if audit_path is not None and audit_path.exists() and sha256_file(audit_path) != audit["sha256"]:
        fail.append(f"{AUDIT_FILE} differs from the one the record was computed from")
    if traj_path.exists():
        if sha256_file(traj_path) != files["trajectories"]["sha256"]:
            fail.append("trajectories.jsonl differs from the one the record was computed from")
        trajs = [json.loads(line) for line in traj_path.read_text().splitlines() if line.strip()]
        try:
            rows = rows_from_trajectories(trajs)
        except (KeyError, TypeError, ValueError, CompactionGymError) as exc:
            fail.append(f"trajectories unreadable: {exc}")
            return trajs, None
        derived = json.loads(json.dumps(audit_entries(trajs, rows)))
        if audit_path is not None and audit_path.exists() and read_audit(audit_path) != derived:
            fail.append(f"{AUDIT_FILE} does not re-derive from trajectories.jsonl")
        return trajs, rows
    if audit_path is None or not audit_path.exists():
        fail.append(f"missing {TRAJECTORIES_FILE}" + (f" and {AUDIT_FILE}" if audit else ""))
        return None
    try:
        entries = read_audit(audit_path)
    except (OSError, ValueError) as exc:
        fail.append(f"{AUDIT_FILE} unreadable: {exc}")
        return None
    for entry in entries:
        fail.extend(row_failures(entry)[:5])
    return entries, [e["row"] for e in entries]


def check_record(path: str | Path, suite_file: str | Path | None = None) -> CheckResult:
    """Check the record ``path`` (a ``submission.json`` or its directory) against every rule."""
    path = Path(path)
    if path.is_dir():
        path = path / RECORD_FILE
    result = CheckResult(path)
    fail = result.failures
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        fail.append(f"unreadable record: {exc}")
        return result
    if isinstance(record, dict) and record.get("schema") == LM_RECORD_SCHEMA:
        check_lm_record(path, fail, suite_file)  # a language-modelling record: its own rules
        return result
    if not sealed_ok(record, schema_errors(record), fail):
        return result
    # the files: the full trajectories when present, else the audit trail (docs/leaderboard.md)
    loaded = _episodes(path, record, fail)
    if loaded is None:
        return result
    trajs, rows = loaded
    # the config
    suite, cell = suite_and_cell(record, suite_file, load_suite, fail)
    # seeds and episodes
    if cell is not None:
        if record["seeds"] != cell.seeds:
            fail.append(f"seeds {record['seeds']} are not the suite's {cell.seeds}")
        expected = Counter((str(t), e) for t in cell.tasks for s in cell.seeds for e in cell.env_seeds(s))
        got = Counter((str(d["info"].get("eval_task_requested")), int(d["seed"])) for d in trajs)
        if got != expected:
            extra, missing = got - expected, expected - got
            fail.append(
                f"episodes are not the suite's: {sum(missing.values())} missing, {sum(extra.values())} extra or duplicated"
            )
    # numbers re-derive from the episodes
    if cell is not None and rows is not None:
        try:
            recomputed = finite(results(cell, rows))
        except (KeyError, TypeError, ValueError, CompactionGymError) as exc:
            fail.append(f"episodes unreadable: {exc}")
        else:
            for key in ("score", "tasks", "per_seed", "across_seeds", "kv", "tokens", "episodes"):
                if not json_close(recomputed[key], record["results"][key]):
                    fail.append(f"results.{key} does not match the episodes")
    # budget and events
    if cell is not None:
        fail.extend(comparison_failures(path, record, suite))
    over = kv_failures(trajs, record["budget"]["max_kv_len"])
    fail.extend(over[:5] + ([f"... {len(over) - 5} more budget overruns"] if len(over) > 5 else []))
    fail.extend(event_failures(trajs, bool(record["config"]["compaction"].get("protect_prompt", True)))[:5])
    return result


def find_records(root: str | Path) -> list[Path]:
    """Every ``submission.json`` under ``root``, sorted."""
    return sorted(Path(root).rglob(RECORD_FILE))


def check_all(root: str | Path, *, write: bool = True) -> list[CheckResult]:
    """Check every record under ``root``; with ``write`` each verdict goes to ``compliance.json``
    next to its record."""
    from compaction_gym.leaderboard.store import write_json_atomic

    out = []
    for path in find_records(root):
        res = check_record(path)
        if write:
            write_json_atomic(path.parent / COMPLIANCE_FILE, res.to_dict(Path(root)))
        out.append(res)
    return out

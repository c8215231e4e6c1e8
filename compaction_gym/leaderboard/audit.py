"""A record's audit trail (``audit.jsonl.gz``): per episode, what ``leaderboard check`` reads.

Full trajectories (token ids, log-probs, text) run to ~1 GB for one BabyAI suite, too much to
commit. The audit keeps, per episode, its record row, the task it was asked for, its prompt
length, every turn's input range and peak KV, and every compaction event's spans — enough to
re-derive the record's statistics and to check the budget and causality rules. It is derived from
the trajectories when the record is written (its sha256 is in the record), and ``check``
re-derives it from ``trajectories.jsonl`` whenever that file is present (``docs/leaderboard.md``).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from compaction_gym.atomic import write_atomic
from compaction_gym.leaderboard.record import episode_rows

AUDIT_FILE = "audit.jsonl.gz"

#: Event fields the causality checks read (``compliance.event_failures``).
EVENT_FIELDS = (
    "index",
    "span",
    "logical_span",
    "kv_len_before",
    "kv_len_after",
    "logical_len",
    "probe_logical_range",
)
#: Kept too where an event has them: the session an RSA member's event fired in, and that session's
#: protected prompt (``leaderboard.rsa_cells``; absent from episode trajectories, so their audits are unchanged).
SESSION_FIELDS = ("session", "session_prompt_len")


def audit_entry(d: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """One episode's audit line from its trajectory dict ``d`` and its record ``row``."""
    return {
        "row": row,
        "seed": int(d["seed"]),
        "prompt_len": int(d.get("prompt_len", 0)),
        "info": {"eval_task_requested": d["info"].get("eval_task_requested")},
        # an agent without a KV cache (the sb3 reference row) has no turns to audit
        "turns": [
            {"input_range": list(t["input_range"]), "peak_kv_len": int(t["peak_kv_len"])}
            for t in d.get("turns", [])
            if isinstance(t, dict) and "input_range" in t
        ],
        "events": [
            {k: ev.get(k) for k in EVENT_FIELDS} | {k: ev[k] for k in SESSION_FIELDS if k in ev}
            for ev in d.get("events", [])
        ],
    }


def audit_entries(
    trajectories: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    return [audit_entry(d, row) for d, row in zip(trajectories, rows, strict=True)]


def audit_bytes(entries: Sequence[dict[str, Any]]) -> bytes:
    """The gzip'd JSON lines, byte-for-byte reproducible (no timestamp in the gzip header)."""
    text = "".join(json.dumps(e, allow_nan=False, sort_keys=True) + "\n" for e in entries)
    return gzip.compress(text.encode(), compresslevel=9, mtime=0)


def write_audit(path: str | Path, entries: Sequence[dict[str, Any]]) -> None:
    write_atomic(path, audit_bytes(entries))


def read_audit(path: str | Path) -> list[dict[str, Any]]:
    return [
        json.loads(line) for line in gzip.decompress(Path(path).read_bytes()).decode().splitlines() if line
    ]


def row_failures(entry: dict[str, Any]) -> list[str]:
    """An audit line whose row disagrees with its own turns and events."""
    row, out = entry["row"], []
    where = f"env_seed {entry['seed']}"
    if row.get("peak_kv") is None:  # no KV cache (sb3): nothing to cross-check but the seed
        return (
            [f"{where}: row env_seed {row['env_seed']} != the episode's seed"]
            if row["env_seed"] != entry["seed"]
            else []
        )
    peak = max([entry["prompt_len"], *(t["peak_kv_len"] for t in entry["turns"])])
    if row["peak_kv"] != peak:
        out.append(f"{where}: row peak_kv {row['peak_kv']} != the turns' peak {peak}")
    if row["turns"] != len(entry["turns"]):
        out.append(f"{where}: row turns {row['turns']} != {len(entry['turns'])} audited turns")
    if row["compaction_events"] != len(entry["events"]):
        out.append(f"{where}: row events {row['compaction_events']} != {len(entry['events'])} audited events")
    if row["env_seed"] != entry["seed"]:
        out.append(f"{where}: row env_seed {row['env_seed']} != the episode's seed")
    return out


def rows_from_trajectories(trajectories: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The record rows of trajectories-file lines (engine trajectories or sb3 episodes)."""
    return episode_rows(trajectories)

"""A leaderboard record (``submission.json``): one (suite, method, budget), its episodes and statistics.

Schema: ``record.schema.json`` next to this module (validated with ``jsonschema``); fields and
statistics are described in ``docs/leaderboard.md`` ("Record format", "Statistics").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from compaction_gym.agents.evaluate import episode_progression
from compaction_gym.agents.trajectory import Trajectory
from compaction_gym.evaluation.stats import combined_se, mean, paired_comparison, pop_se, sample_se
from compaction_gym.evaluation.summary import finite
from compaction_gym.leaderboard.suite import Cell, sha256_json

RECORD_SCHEMA = "compaction-gym/leaderboard-record/v1"
SCHEMA_PATH = Path(__file__).with_name("record.schema.json")
RECORD_FILE = "submission.json"
TRAJECTORIES_FILE = "trajectories.jsonl"
LOG_FILE = "run.log"


@cache
def load_schema(path: Path) -> dict[str, Any]:
    """A JSON schema file, read once."""
    return json.loads(path.read_text())


def record_schema() -> dict[str, Any]:
    return load_schema(SCHEMA_PATH)


def json_schema_errors(schema: dict[str, Any], record: Any) -> list[str]:
    """Every violation of ``schema`` (draft 2020-12) by ``record``, as ``path: message``, sorted by
    path (empty when valid)."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema)
    return [
        f"{'/'.join(str(p) for p in err.absolute_path) or '<root>'}: {err.message}"
        for err in sorted(validator.iter_errors(record), key=lambda e: list(e.absolute_path))
    ]


def schema_errors(record: Any) -> list[str]:
    """Every violation of the record schema, as ``path: message`` (empty when valid)."""
    return json_schema_errors(record_schema(), record)


def episode_row(traj: Trajectory) -> dict[str, Any]:
    """The per-episode numbers a record lists (progression in percent)."""
    kv_after = [t.kv_len for t in traj.turns]
    tokens = traj.num_tokens
    return {
        "task": str(traj.info["eval_task"]),
        "seed": int(traj.info["leaderboard_seed"]),
        "env_seed": int(traj.seed),
        "progression": 100.0 * episode_progression(traj),
        "success": bool(traj.success),
        "reward": float(traj.total_reward),
        "turns": len(traj.turns),
        "tokens": tokens,
        "generated_tokens": traj.num_generated,
        "peak_kv": traj.peak_kv_len,
        "mean_kv": mean(kv_after) if kv_after else float(traj.prompt_len),
        "kv_retained": traj.peak_kv_len / tokens if tokens else 1.0,
        "compaction_events": len(traj.events),
        "aborted": "aborted" in traj.info,
        "wall_time_s": float(traj.metrics.get("wall_time_s", 0.0)),
    }


def episode_rows(lines: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The record rows of trajectories-file lines: an engine ``Trajectory`` each, an sb3
    episode (``kind = "sb3_ppo"``: no tokens or KV), or an RSA question (``kind = "rsa"``)."""
    out = []
    for d in lines:
        if d.get("kind") == "sb3_ppo":
            from compaction_gym.leaderboard.sb3 import episode_row as sb3_row

            out.append(sb3_row(d))
        elif d.get("kind") == "rsa":
            from compaction_gym.leaderboard.rsa_cells import episode_row as rsa_row

            out.append(rsa_row(d))
        else:
            out.append(episode_row(Trajectory.from_dict(d)))
    return out


def _mean_or_none(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    """Mean of ``key`` over ``rows``; ``None`` when any row has none (an agent without a KV cache)."""
    xs = [r[key] for r in rows]
    return None if any(x is None for x in xs) else mean(xs)


def _balrog(rows: Sequence[dict[str, Any]], tasks: Sequence[str]) -> dict[str, Any]:
    """BALROG statistics: per task mean ± population SE; overall the mean of task means,
    SE √(Σ SE²)/n_tasks."""
    per_task = {}
    for task in tasks:
        xs = [r["progression"] for r in rows if r["task"] == task]
        per_task[task] = {"mean": mean(xs), "se": pop_se(xs), "episodes": len(xs)}
    present = [s for s in per_task.values() if s["episodes"]]
    return {
        "score": {
            "mean": mean([s["mean"] for s in present]),
            "se": combined_se([s["se"] for s in present]),
        },
        "tasks": per_task,
    }


def comparison(rows: Sequence[dict[str, Any]], baseline: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Paired comparison of progression against ``baseline``'s episodes with the same
    ``(task, env_seed)``; ``None`` with fewer than 2 pairs."""
    base = {(r["task"], r["env_seed"]): r["progression"] for r in baseline}
    pairs = [
        (r["progression"], base[(r["task"], r["env_seed"])])
        for r in rows
        if (r["task"], r["env_seed"]) in base
    ]
    if len(pairs) < 2:
        return None
    return paired_comparison([a for a, _ in pairs], [b for _, b in pairs]).to_dict()


def results(cell: Cell, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ``results`` block of a record from its episode rows (sorted by task, seed, env seed)."""
    order = {str(t): i for i, t in enumerate(cell.tasks)}
    rows = sorted(rows, key=lambda r: (order.get(r["task"], len(order)), r["seed"], r["env_seed"]))
    labels = list(dict.fromkeys([*(str(t) for t in cell.tasks if t is not None), *(r["task"] for r in rows)]))
    pooled = _balrog(rows, labels)
    per_seed = [{"seed": s, **_balrog([r for r in rows if r["seed"] == s], labels)} for s in cell.seeds]
    seed_scores = [p["score"]["mean"] for p in per_seed]
    no_kv = any(r["peak_kv"] is None for r in rows)
    kv = None if no_kv else {
        "peak_max": max((r["peak_kv"] for r in rows), default=0),
        "peak_mean": mean([r["peak_kv"] for r in rows]),
        "mean_mean": mean([r["mean_kv"] for r in rows]),
        "budget": cell.budget.max_kv_len,
        "kv_retained_mean": mean([r["kv_retained"] for r in rows]),
        "compression_ratio": 1.0 - mean([r["kv_retained"] for r in rows]),
    }  # fmt: skip
    tokens = None if any(r["tokens"] is None for r in rows) else {
        "mean": mean([r["tokens"] for r in rows]),
        "generated_mean": _mean_or_none(rows, "generated_tokens"),
        "total": sum(r["tokens"] for r in rows),
    }  # fmt: skip
    return {
        **pooled,
        "per_seed": per_seed,
        "across_seeds": {"mean": mean(seed_scores), "se": sample_se(seed_scores), "n": len(seed_scores)},
        "kv": kv,
        "tokens": tokens,
        "turns_mean": mean([r["turns"] for r in rows]),
        "compaction_events_mean": mean([r["compaction_events"] for r in rows]),
        "aborted": sum(1 for r in rows if r["aborted"]),
        "episodes": rows,
    }


def seal(record: dict[str, Any]) -> dict[str, Any]:
    """Strict-JSON ``record`` with its ``content_sha256`` (sha256 of the canonical JSON of
    everything else) set."""
    body = finite({k: v for k, v in record.items() if k != "content_sha256"})
    return {**body, "content_sha256": sha256_json(body)}


def content_hash_ok(record: dict[str, Any]) -> bool:
    body = {k: v for k, v in record.items() if k != "content_sha256"}
    return record.get("content_sha256") == sha256_json(body)

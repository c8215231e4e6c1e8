"""Records of language-modelling suites: bits per byte (lower is better) from per-position scores.

A cell's ``scores.jsonl`` holds one line per seed: the text's token ids and UTF-8 bytes per token,
and per position the model's log-prob, its distribution's entropy, the KV rows attended to, and
the scored NLL (the mixer's when the cell has one). Everything in ``results`` re-derives from it
(docs/leaderboard.md, "Language-modelling suites").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from compaction_gym.evaluation.stats import mean, paired_comparison, sample_se
from compaction_gym.leaderboard.lm_suite import LmCell
from compaction_gym.leaderboard.record import json_schema_errors, load_schema

LM_RECORD_SCHEMA = "compaction-gym/leaderboard-lm-record/v1"
LM_SCHEMA_PATH = Path(__file__).with_name("lm_record.schema.json")
SCORES_FILE = "scores.jsonl"
METRIC = "bits_per_byte"
DIRECTION = "lower"


def lm_record_schema() -> dict[str, Any]:
    return load_schema(LM_SCHEMA_PATH)


def lm_schema_errors(record: Any) -> list[str]:
    """Every violation of the lm record schema, as ``path: message`` (empty when valid)."""
    return json_schema_errors(lm_record_schema(), record)


def bits_per_byte(nll: Sequence[float], n_bytes: Sequence[int]) -> float:
    """``Σ NLL / (ln 2 · Σ bytes)`` in float64 (NLL in nats)."""
    return math.fsum(float(x) for x in nll) / (math.log(2) * math.fsum(float(b) for b in n_bytes))


def seed_result(line: dict[str, Any], score_after: int) -> dict[str, Any]:
    """The numbers of one seed's line over the scored positions ``[max(1, score_after), n)``."""
    n = len(line["token_ids"])
    scored = range(max(1, score_after), n)
    nll = [float(line["nll"][p]) for p in scored]
    nb = [int(line["bytes"][p]) for p in scored]
    kv = [int(line["kv_seen"][p]) for p in scored]
    mean_kv = math.fsum(kv) / len(kv)
    mean_context = math.fsum(p + 1 for p in scored) / len(kv)
    return {
        "seed": int(line["seed"]),
        "bits_per_byte": bits_per_byte(nll, nb),
        "mean_nll": math.fsum(nll) / len(nll),
        "n_scored": len(nll),
        "n_bytes": sum(nb),
        "bytes_per_token": sum(nb) / len(nb),
        "mean_kv": mean_kv,
        "max_kv": max(kv),
        "compression": mean_context / mean_kv,
        "events": int(line["events"]),
    }


def lm_results(cell: LmCell, lines: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ``results`` block: per seed, and over seeds (mean, sample SE) — sorted by seed."""
    per_seed = [seed_result(d, cell.score_after) for d in sorted(lines, key=lambda d: int(d["seed"]))]
    scores = [s["bits_per_byte"] for s in per_seed]
    se = sample_se(scores) if len(scores) > 1 else None
    return {
        "metric": METRIC,
        "direction": DIRECTION,
        "score": {"mean": mean(scores), "se": se},
        "across_seeds": {"mean": mean(scores), "se": se, "n": len(scores)},
        "per_seed": per_seed,
        "n_tokens": len(lines[0]["token_ids"]) if lines else 0,
        "score_after": max(1, cell.score_after),
        "kv": {
            "budget": cell.budget.max_kv_len,
            "max_seen": max(s["max_kv"] for s in per_seed),
            "mean_mean": mean([s["mean_kv"] for s in per_seed]),
            "compression": mean([s["compression"] for s in per_seed]),
        },
    }


def position_bits(lines: Sequence[dict[str, Any]], score_after: int) -> list[float]:
    """Per scored position, the NLL in bits scaled by tokens / bytes, averaged over seeds: their
    mean is the bits per byte, so a paired mean difference is a bits-per-byte gap."""
    n = len(lines[0]["token_ids"])
    scored = range(max(1, score_after), n)
    nb = math.fsum(int(lines[0]["bytes"][p]) for p in scored)
    scale = len(scored) / (math.log(2) * nb)
    return [math.fsum(float(d["nll"][p]) for d in lines) / len(lines) * scale for p in scored]


def lm_comparison(
    lines: Sequence[dict[str, Any]], baseline: Sequence[dict[str, Any]], score_after: int
) -> dict[str, Any] | None:
    """Paired comparison per scored position against the full-cache baseline: ``mean_diff`` is
    this cell's bits per byte minus the baseline's (negative is better); ``wins`` count positions
    where this cell's NLL is lower. ``None`` when the texts differ or fewer than 2 positions."""
    if not lines or not baseline or lines[0]["token_ids"] != baseline[0]["token_ids"]:
        return None
    x, y = position_bits(lines, score_after), position_bits(baseline, score_after)
    if len(x) < 2:
        return None
    comp = paired_comparison(x, y).to_dict()
    comp["wins"], comp["losses"] = comp["losses"], comp["wins"]  # lower is better
    comp["direction"] = DIRECTION
    return comp

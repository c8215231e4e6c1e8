"""Rules both kinds of record check share (:mod:`.compliance` for env records,
:mod:`.lm_compliance` for language-modelling ones; docs/leaderboard.md, "Compliance"): the schema
and content hash, the suite and cell a record names and its config hashes, and the paired
comparison with the ``none`` record.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compaction_gym.errors import CompactionGymError
from compaction_gym.evaluation.summary import finite
from compaction_gym.leaderboard.record import RECORD_FILE, content_hash_ok
from compaction_gym.leaderboard.suite import C, CellBase, SuiteFile, sha256_json


def json_close(a: Any, b: Any, *, abs_tol: float = 1e-9) -> bool:
    """Equal JSON values, floats to 1e-9 relative or ``abs_tol`` absolute (``None`` only equals
    ``None``; a recomputed NaN ``a`` only a NaN ``b``)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_close(a[k], b[k], abs_tol=abs_tol) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_close(x, y, abs_tol=abs_tol) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        if isinstance(a, float) and math.isnan(a):
            return isinstance(b, float) and math.isnan(b)
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=abs_tol)
    return a == b


def sealed_ok(record: dict[str, Any], errors: list[str], fail: list[str]) -> bool:
    """Append ``schema: …`` per schema error in ``errors`` and return ``False``; else append a
    failure when the content hash does not hold and return ``True`` (checking may go on)."""
    if errors:
        fail.extend(f"schema: {e}" for e in errors)
        return False
    if not content_hash_ok(record):
        fail.append("content hash mismatch: the record was edited after the run")
    return True


def suite_and_cell(
    record: dict[str, Any],
    suite_file: str | Path | None,
    load: Callable[[str | Path], SuiteFile[C]],
    fail: list[str],
    changed: str = "the suite or the record changed",
) -> tuple[SuiteFile[C] | None, C | None]:
    """The record's suite (``suite_file``, else the file it names, else by name) and cell, loaded by
    ``load``; appends a failure when either is not found or a config hash does not hold
    (the record's own, then the suite's, whose failure names what may have ``changed``)."""
    suite: SuiteFile[C] | None = None
    cell: C | None = None
    try:
        root = Path(__file__).resolve().parents[2]
        spec = suite_file or (root / record["suite"]["file"])
        suite = load(spec if Path(spec).is_file() else record["suite"]["name"])
        cell = suite.cell(record["method"], record["budget"]["label"])
    except CompactionGymError as exc:
        fail.append(f"config: suite or cell not found: {exc}")
    if sha256_json(record["config"]) != record["config_sha256"]:
        fail.append("config hash does not match the record's config")
    if cell is not None and cell.config_sha256() != record["config_sha256"]:
        fail.append(f"config hash does not match the suite file ({changed})")
    return suite, cell


def paired_failures(
    path: Path,
    record: dict[str, Any],
    base: CellBase | None,
    recompute: Callable[[dict[str, Any], Path], dict[str, Any] | None],
    source: str = "episodes",
    rerun: str = "re-run `leaderboard run` to refresh",
) -> list[str]:
    """The record's ``comparison_vs_none`` must re-derive, by ``recompute(base record, its folder)``,
    from the record of ``base`` it names (a sibling cell); ``source`` names what it is computed from."""
    comp = record["comparison_vs_none"]
    if comp is None:
        return []
    base_path = path.parents[2] / base.method / base.budget.label / RECORD_FILE if base is not None else None
    if base_path is None or not base_path.exists():
        return ["comparison_vs_none: the none record it was computed against is missing"]
    baseline = json.loads(base_path.read_text())
    if baseline.get("content_sha256") != comp.get("baseline_content_sha256"):
        return [f"comparison_vs_none is stale: the none record changed ({rerun})"]
    again = recompute(baseline, base_path.parent)
    if again is None or not json_close(
        finite({**again, "baseline_content_sha256": baseline["content_sha256"]}), comp
    ):
        return [f"comparison_vs_none does not match the {source} of this record and the none record"]
    return []

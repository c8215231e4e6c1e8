"""``leaderboard show`` for language-modelling suites: rows ranked by bits per byte, lowest first,
and a bits-per-byte-vs-budget plot (docs/leaderboard.md, "Language-modelling suites")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compaction_gym.leaderboard.compliance import CheckResult
from compaction_gym.leaderboard.lm_record import LM_RECORD_SCHEMA
from compaction_gym.leaderboard.report_parts import (
    comparison_cells,
    dash,
    records_by_method,
    save_plot,
    score_errorbar,
    stale_mark,
)

LM_COLUMNS = (
    "rank", "method", "budget", "bits/byte", "seeds SE", "Δ bpb vs none [95% CI]", "p (t / W / sign)",
    "better / worse tokens", "mean NLL", "bytes/token", "mean KV", "compression", "mixer", "wall s", "compliant",
)  # fmt: skip


def is_lm(record: dict[str, Any]) -> bool:
    return record.get("schema") == LM_RECORD_SCHEMA


def _f(x: Any, fmt: str = ".4f") -> str:
    return dash(x, fmt)


def lm_rows(entries: list[tuple[dict[str, Any], CheckResult]]) -> list[list[str]]:
    """Table rows ranked by bits per byte, lowest first (compliant records first among equals)."""
    ranked = sorted(entries, key=lambda e: (e[0]["results"]["score"]["mean"], not e[1].ok, e[0]["method"]))
    out = []
    for i, (rec, verdict) in enumerate(ranked, 1):
        res, comp = rec["results"], rec.get("comparison_vs_none")
        seeds = res["per_seed"]
        delta, p = comparison_cells(comp, "+.4f", "+.4f", ".3g")
        wins = f"{comp['wins']} / {comp['losses']}" if comp else "–"
        out.append(
            [
                str(i),
                rec["method"],
                rec["budget"]["label"],
                _f(res["score"]["mean"]) + stale_mark(rec),
                _f(res["score"]["se"]),
                delta,
                p,
                wins,
                _f(sum(s["mean_nll"] for s in seeds) / len(seeds)),
                _f(seeds[0]["bytes_per_token"], ".3f"),
                _f(res["kv"]["mean_mean"], ".0f"),
                f"{res['kv']['compression']:.2f}x",
                "yes" if rec["config"]["mixer"] else "no",
                _f(rec["provenance"]["wall_time_s"], ".0f"),
                "yes" if verdict.ok else "NO: " + "; ".join(verdict.failures[:2]),
            ]
        )
    return out


def lm_plot(suite: str, entries: list[tuple[dict[str, Any], CheckResult]], out_dir: Path) -> list[Path]:
    """``SUITE_budget.png``: bits per byte against the KV budget per method (error bars: SE over
    seeds); full-cache methods as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_method = records_by_method(entries)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    for method, recs in sorted(by_method.items()):
        sized = sorted(
            (r for r in recs if r["budget"]["max_kv_len"]), key=lambda r: r["budget"]["max_kv_len"]
        )
        if not sized:
            ax.axhline(
                recs[0]["results"]["score"]["mean"], linestyle="--", linewidth=1, label=f"{method} (full)"
            )
            continue
        xs = [r["budget"]["max_kv_len"] for r in sized]
        score_errorbar(ax, xs, sized, method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV budget (max_kv_len, rows)")
    ax.set_ylabel("bits per byte (lower is better)")
    ax.set_title(f"{suite}: bits per byte vs KV budget")
    return [save_plot(fig, ax, out_dir / f"{suite}_budget.png")]

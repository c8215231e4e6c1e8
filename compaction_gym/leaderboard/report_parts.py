"""Pieces both leaderboard reports share (:mod:`.report` for env suites, :mod:`.lm_report` for
language-modelling ones; docs/leaderboard.md, "Show"): number cells, a paired comparison's cells,
the stale mark and footnotes, records grouped by method, a method's score-with-SE line, and the
figure's finish."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from compaction_gym.leaderboard.compliance import CheckResult
from compaction_gym.leaderboard.staleness import STALE_MARK, record_stale, stale_note


def dash(x: Any, fmt: str) -> str:
    """``x`` formatted by ``fmt``; ``–`` for ``None``."""
    return "–" if x is None else format(x, fmt)


def comparison_cells(comp: dict[str, Any] | None, diff: str, ci: str, p: str) -> tuple[str, str]:
    """The ``Δ [95% CI]`` and ``p (t / W / sign)`` cells of a paired comparison (``–`` without one)."""
    if not comp:
        return "–", "–"
    lo, hi = comp["ci95"]
    delta = f"{format(comp['mean_diff'], diff)} [{dash(lo, ci)}, {dash(hi, ci)}]"
    return delta, " / ".join(format(comp[k], p) for k in ("t_pvalue", "wilcoxon_pvalue", "sign_pvalue"))


def stale_mark(record: dict[str, Any]) -> str:
    """`` †`` after a stale record's score (docs/leaderboard.md, "Stale records"), else nothing."""
    return f" {STALE_MARK}" if record_stale(record) is not None else ""


def stale_notes(records: dict[str, list[tuple[dict[str, Any], CheckResult]]]) -> dict[str, str]:
    """``{suite: footnote}`` for the suites with stale records."""
    notes = {suite: stale_note([rec for rec, _ in entries]) for suite, entries in records.items()}
    return {suite: note for suite, note in notes.items() if note}


def records_by_method(entries: list[tuple[dict[str, Any], CheckResult]]) -> dict[str, list[dict[str, Any]]]:
    """The records of ``entries`` grouped by method (in their order)."""
    by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec, _ in entries:
        by_method[rec["method"]].append(rec)
    return by_method


def score_errorbar(ax: Any, xs: list[float], recs: list[dict[str, Any]], label: str) -> None:
    """One method's line: each record's mean score at ``xs``, error bars its SE (0 when none)."""
    ys = [r["results"]["score"]["mean"] for r in recs]
    es = [r["results"]["score"]["se"] or 0.0 for r in recs]
    ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=label)


def save_plot(fig: Any, ax: Any, path: Path) -> Path:
    """Grid, legend, tight layout; write ``path`` and close the figure."""
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path

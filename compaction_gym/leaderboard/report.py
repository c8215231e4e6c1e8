"""``leaderboard show``: ranked tables (markdown, HTML) and plots of a records directory.

Per suite: one row per record, ranked by score; score ± SE (BALROG), the across-seed SE, the
paired difference to ``none`` with its 95 % CI and p-values, measured KV (peak and mean),
retained fraction and compression ratio, tokens, wall time, and the compliance verdict. Plots
(PNG, matplotlib): score against the KV budget per method with error bars, and score against the
measured compression ratio (``docs/leaderboard.md``, "Show").
"""

from __future__ import annotations

import base64
import html
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from compaction_gym.leaderboard.compliance import CheckResult, check_record, find_records
from compaction_gym.leaderboard.report_parts import (
    comparison_cells,
    dash,
    records_by_method,
    save_plot,
    score_errorbar,
    stale_mark,
    stale_notes,
)

COLUMNS = (
    "rank", "method", "budget", "max KV", "score %", "seeds SE", "Δ vs none [95% CI]", "p (t / W / sign)",
    "peak KV (mean / max)", "mean KV", "KV kept", "compression", "tokens", "wall s", "compliant",
)  # fmt: skip


def _f(x: Any, fmt: str = ".1f") -> str:
    return dash(x, fmt)


def load_records(root: str | Path) -> dict[str, list[tuple[dict[str, Any], CheckResult]]]:
    """``{suite: [(record, verdict)]}`` for every record under ``root`` (failing ones included)."""
    out: dict[str, list[tuple[dict[str, Any], CheckResult]]] = defaultdict(list)
    for path in find_records(root):
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        out[str(record.get("suite", {}).get("name", "?"))].append((record, check_record(path)))
    return dict(out)


def rows(entries: list[tuple[dict[str, Any], CheckResult]]) -> list[list[str]]:
    """Table rows ranked by score (compliant records first among equals)."""
    ranked = sorted(
        entries, key=lambda e: (-(e[0]["results"]["score"]["mean"] or 0.0), not e[1].ok, e[0]["method"])
    )
    out = []
    for i, (rec, verdict) in enumerate(ranked, 1):
        res, comp = rec["results"], rec.get("comparison_vs_none")
        kv, tokens = res["kv"], res["tokens"]
        no_kv = kv is None  # an agent without a KV cache (the sb3_ppo reference row)
        delta, p = comparison_cells(comp, "+.1f", ".1f", ".3f")
        out.append(
            [
                str(i),
                rec["method"],
                rec["budget"]["label"],
                "n/a"
                if no_kv
                else _f(rec["budget"]["max_kv_len"], "d")
                if rec["budget"]["max_kv_len"]
                else "full",
                f"{_f(res['score']['mean'])} ± {_f(res['score']['se'])}{stale_mark(rec)}",
                _f(res["across_seeds"]["se"]),
                delta,
                p,
                *(
                    ["n/a"] * 4
                    if no_kv
                    else [
                        f"{_f(kv['peak_mean'], '.0f')} / {kv['peak_max']}",
                        _f(kv["mean_mean"], ".0f"),
                        f"{_f(100 * kv['kv_retained_mean'], '.0f')} %",
                        _f(kv["compression_ratio"], ".2f"),
                    ]
                ),
                "n/a" if tokens is None else _f(tokens["mean"], ".0f"),
                _f(rec["provenance"]["wall_time_s"]),
                "yes" if verdict.ok else "NO: " + "; ".join(verdict.failures[:2]),
            ]
        )
    return out


def markdown(
    tables: dict[str, list[list[str]]],
    columns: dict[str, tuple[str, ...]] | None = None,
    notes: dict[str, str] | None = None,
) -> str:
    """One table per suite (``columns`` per suite; default :data:`COLUMNS`), each followed by its
    footnote in ``notes`` if any (stale records)."""
    parts = []
    for suite, body in tables.items():
        cols = (columns or {}).get(suite, COLUMNS)
        parts.append(f"## {suite}\n")
        parts.append("| " + " | ".join(cols) + " |")
        parts.append("|" + "---|" * len(cols))
        parts.extend("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body)
        parts.append("")
        if suite in (notes or {}):
            parts += [(notes or {})[suite], ""]
    return "\n".join(parts)


def plot(suite: str, entries: list[tuple[dict[str, Any], CheckResult]], out_dir: Path) -> list[Path]:
    """``SUITE_budget.png`` (score vs max KV per method, error bars = SE; ``none`` as a line) and
    ``SUITE_compression.png`` (score vs measured compression ratio). Returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_method = records_by_method(entries)
    paths = []
    for kind, xlabel in (
        ("budget", "KV budget (max_kv_len, rows)"),
        ("compression", "compression ratio (1 − peak KV / tokens)"),
    ):
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
        for method, recs in sorted(by_method.items()):
            if kind == "budget":
                recs = sorted(
                    (r for r in recs if r["budget"]["max_kv_len"]), key=lambda r: r["budget"]["max_kv_len"]
                )
                if not recs:  # the full-KV baseline (or a row without KV): a line across
                    full = by_method[method][0]["results"]["score"]
                    if by_method[method][0]["results"]["kv"] is None and full["mean"] is not None:
                        ax.axhline(full["mean"], color="tab:brown", linestyle=":", linewidth=1.2,
                                   label=f"{method} (no KV)")  # fmt: skip
                    elif full["mean"] is not None:
                        ax.axhline(
                            full["mean"],
                            color="black",
                            linestyle="--",
                            linewidth=1,
                            label=f"{method} (full KV)",
                        )
                        if full["se"]:
                            ax.axhspan(
                                full["mean"] - full["se"], full["mean"] + full["se"], color="grey", alpha=0.15
                            )
                    continue
                xs = [r["budget"]["max_kv_len"] for r in recs]
            else:
                recs = sorted(
                    (r for r in recs if r["results"]["kv"] is not None),
                    key=lambda r: r["results"]["kv"]["compression_ratio"],
                )
                if not recs:
                    continue
                xs = [r["results"]["kv"]["compression_ratio"] for r in recs]
            score_errorbar(ax, xs, recs, method)
        ax.set_ylim(-3, 103)
        if kind == "budget":
            ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("score (progression %, mean ± SE)")
        ax.set_title(f"{suite}: score vs {'KV budget' if kind == 'budget' else 'compression ratio'}")
        paths.append(save_plot(fig, ax, out_dir / f"{suite}_{kind}.png"))
    return paths


def html_page(
    tables: dict[str, list[list[str]]],
    plots: dict[str, list[Path]],
    columns: dict[str, tuple[str, ...]] | None = None,
    notes: dict[str, str] | None = None,
) -> str:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>compaction-gym leaderboard</title>",
        "<style>body{font-family:sans-serif}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
        "padding:2px 6px;text-align:right}td:nth-child(2),td:nth-child(3){text-align:left}.no{color:#b00}</style>",
        "</head><body><h1>compaction-gym leaderboard</h1>",
    ]
    for suite, body in tables.items():
        parts.append(f"<h2>{html.escape(suite)}</h2><table><tr>")
        parts.extend(f"<th>{html.escape(c)}</th>" for c in (columns or {}).get(suite, COLUMNS))
        parts.append("</tr>")
        for row in body:
            cls = " class='no'" if row[-1].startswith("NO") else ""
            parts.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>")
        parts.append("</table>")
        if suite in (notes or {}):
            parts.append(f"<p>{html.escape((notes or {})[suite])}</p>")
        for p in plots.get(suite, []):
            data = base64.b64encode(p.read_bytes()).decode()
            parts.append(f"<p><img alt='{html.escape(p.name)}' src='data:image/png;base64,{data}'></p>")
    parts.append("</body></html>")
    return "\n".join(parts)


#: the block of a markdown page that ``show --update-doc`` rewrites (everything between the two).
DOC_BEGIN = "<!-- leaderboard:begin (generated by `compaction-gym leaderboard show --update-doc`; edits are overwritten) -->"
DOC_END = "<!-- leaderboard:end -->"


def code_id(prov: dict[str, Any]) -> tuple[str, str]:
    """What names the code a record ran: ``("git", revision)`` when the package's source tree on
    disk was the revision's (or the record predates ``source_tree``), else ``("source tree",
    tree)``: a copied checkout whose ``.git`` lagged (docs/leaderboard.md, "Provenance")."""
    tree = prov.get("source_tree")
    if tree is None or tree == prov.get("git_source_tree"):
        return "git", str(prov.get("git_revision") or "?")[:10]
    return "source tree", str(tree)[:10]


def how_run(entries: list[tuple[dict[str, Any], CheckResult]]) -> str:
    """One line on how a suite's records were made: devices, GPUs, workers, code (git revisions,
    or source trees where git does not describe the code that ran), compliance."""
    prov = [rec["provenance"] for rec, _ in entries]
    devices = sorted({str(p["hardware"].get("gpu") or p["hardware"].get("device") or "?") for p in prov})
    jobs = sorted({int((p.get("run") or {}).get("jobs", 1)) for p in prov})
    ids = sorted({code_id(p) for p in prov})
    code = "; ".join(
        f"{kind} {', '.join(v for k, v in ids if k == kind)}" for kind in dict.fromkeys(k for k, _ in ids)
    )
    seeds = sorted({s for rec, _ in entries for s in rec["seeds"]})
    ok = sum(v.ok for _, v in entries)
    return (
        f"{len(entries)} records ({ok} compliant); seeds {seeds}; run on {', '.join(devices)} with "
        f"--jobs {'/'.join(map(str, jobs))}; {code}"
    )


def doc_section(root: str | Path, doc: str | Path, img_dir: str | Path) -> tuple[str, list[Path]]:
    """The markdown block ``--update-doc`` puts in ``doc``: per suite how it was run, the ranked
    table and the two plots (written to ``img_dir``, linked relative to ``doc``)."""
    import os

    img = Path(img_dir)
    img.mkdir(parents=True, exist_ok=True)
    records = load_records(root)
    if not records:
        shown = os.path.relpath(root) if Path(root).resolve().is_relative_to(Path.cwd()) else str(root)
        return (
            f"No records under `{shown}` yet: run `compaction-gym leaderboard run SUITE`, then "
            "`compaction-gym leaderboard show --format md --update-doc docs/leaderboard.md`.\n",
            [],
        )
    parts, written = [], []
    for suite, entries in sorted(records.items()):
        paths = plot(suite, entries, img)
        written += paths
        table = markdown({suite: rows(entries)}, notes=stale_notes({suite: entries}))
        body = table.replace(f"## {suite}\n", "", 1).strip("\n")
        parts.append(f"### {suite}\n\n{how_run(entries)}.\n\n{body}\n")
        links = [os.path.relpath(p, Path(doc).resolve().parent) for p in paths]
        parts.append(" ".join(f"![{Path(x).stem}]({x})" for x in links) + "\n")
    return "\n".join(parts), written


def update_doc(doc: str | Path, section: str) -> None:
    """Replace the text between :data:`DOC_BEGIN` and :data:`DOC_END` in ``doc`` (atomically).

    Raises:
        InvalidArgumentError: ``doc`` lacks either marker (named), or has them out of order.
    """
    from compaction_gym.atomic import write_atomic
    from compaction_gym.errors import InvalidArgumentError

    path = Path(doc)
    text = path.read_text() if path.exists() else ""
    start, end = text.find(DOC_BEGIN), text.find(DOC_END)
    if start < 0 or end < start:
        raise InvalidArgumentError(
            f"--update-doc: {path} has no block {DOC_BEGIN!r} ... {DOC_END!r} (add both lines where the "
            "leaderboard goes)"
        )
    head, tail = text[: start + len(DOC_BEGIN)], text[end:]
    write_atomic(path, f"{head}\n\n{section.strip()}\n\n{tail}")


def show(root: str | Path, out_dir: str | Path | None = None, fmt: str = "md") -> tuple[str, list[Path]]:
    """Render every suite under ``root``: returns the page (markdown or HTML) and the plots written
    to ``out_dir`` (default ``root``); the page is also written there as ``leaderboard.md|html``."""
    from compaction_gym.atomic import write_atomic

    out = Path(out_dir) if out_dir is not None else Path(root)
    out.mkdir(parents=True, exist_ok=True)
    from compaction_gym.leaderboard.lm_report import LM_COLUMNS, is_lm, lm_plot, lm_rows

    records = load_records(root)
    lm = {suite for suite, entries in records.items() if entries and is_lm(entries[0][0])}
    tables = {s: (lm_rows if s in lm else rows)(entries) for s, entries in sorted(records.items())}
    plots = {s: (lm_plot if s in lm else plot)(s, entries, out) for s, entries in sorted(records.items())}
    columns = dict.fromkeys(lm, LM_COLUMNS)
    notes = stale_notes(records)
    if fmt == "html":
        page = html_page(tables, plots, columns, notes)
    else:
        page = "# compaction-gym leaderboard\n\n" + markdown(tables, columns, notes)
        for paths in plots.values():
            page += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in paths) + "\n"
    write_atomic(out / f"leaderboard.{fmt}", page)
    return page, [p for ps in plots.values() for p in ps]

"""The rich table that ``compaction-gym eval`` prints (one row per task, then overall)."""

from __future__ import annotations

from typing import Any


def render_table(summary: dict[str, Any], console: Any = None) -> None:
    """Print the per-task table (rich)."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        console.width = max(console.width, 100)  # the table needs ~95 columns; never wrap cells
    cfg = summary["config"]["compaction"]
    title = f"{summary['env']} · {summary['model']['spec']} · mode={cfg['mode']}"
    if summary["config"].get("policy") == "expert":
        title += " · policy=expert"
    if cfg.get("max_kv_len"):
        title += f" max_kv_len={cfg['max_kv_len']}"
    if cfg.get("n_protect_turns", -1) >= 0:
        title += f" n_protect_turns={cfg['n_protect_turns']}"
    table = Table(title=title)
    for col in ("task", "episodes", "progression %", "turns", "tokens", "peak KV", "compactions", "wall s"):
        table.add_column(col, justify="left" if col == "task" else "right", no_wrap=True)

    def row(name: str, s: dict[str, Any], style: str | None = None) -> None:
        p = s["progression"]
        table.add_row(
            name,
            str(s["episodes"]),
            f"{p['mean']:.1f} ± {p['se']:.1f}",
            f"{s['turns_mean']:.1f}",
            f"{s['tokens_mean']:.0f}",
            f"{s['peak_kv_mean']:.0f}",
            f"{s['compaction_events_mean']:.1f}",
            f"{s['wall_time_s']:.1f}",
            style=style,
        )

    for name, stats in summary["tasks"].items():
        row(name, stats)
    if len(summary["tasks"]) > 1:
        row("overall", summary["overall"], style="bold")
    console.print(table)
    aborted = summary["overall"]["aborted"]
    if aborted:
        console.print(
            f"[yellow]{aborted} episode(s) aborted: the session outgrew the engine's capacity[/yellow]"
        )

"""Tutorial 6: running and reading the leaderboard.

A leaderboard *suite* is a TOML file: an env, its tasks, episodes and seeds, a model, and a grid of
(method, KV budget) cells (docs/leaderboard.md). This script writes a small suite, runs it
(resumable: re-running plays only what is missing), checks every record for compliance, then reads
the records and the rendered tables and plots. The same steps on the command line::

    compaction-gym leaderboard run SUITE.toml --output RECORDS
    compaction-gym leaderboard check --records RECORDS
    compaction-gym leaderboard show --records RECORDS

Run it (CPU, about 20 s)::

    python docs/tutorials/t06_leaderboard.py --output runs/leaderboard-tutorial
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from compaction_gym.leaderboard import check_all, load_suite, run_suite
from compaction_gym.leaderboard.report import show

SUITE = """
name = "tutorial"
description = "babyai-tiny on BabyAI goto and pickup: full KV against two compaction methods at 320 KV rows"
env = "AttnMatch-BabyAI-v0"
tasks = ["goto", "pickup"]
episodes = {episodes}        # env seeds S .. S+episodes-1 for run seed S, in every task
seeds = [0, 100]             # two run seeds: the across-seed spread of the score
model = "babyai-tiny"
prompt = "reasoning"
batch = {episodes}
capacity = 8192
env_kwargs = {{ max_episode_steps = 12 }}   # a failing episode stops after 12 actions
budgets = [{{ max_kv_len = 320, compact_window = 128 }}]

[sampling]
temperature = 0.0
max_new_tokens = 64

[compaction]
compact_target_ratio = 0.25

[[methods]]
name = "none"                # the full-KV baseline every other record is compared against
mode = "none"

[[methods]]
name = "attention_matching_beta"
mode = "attention_matching"
compute_beta = true

[[methods]]
name = "markovian"
mode = "markovian"
"""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run, check and show the suite; return the records (by method), verdicts and the page."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=2, help="episodes per task and run seed")
    parser.add_argument("--output", default=None, help="records folder (default: a temporary one)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.output or tmp)
        root.mkdir(parents=True, exist_ok=True)
        suite_file = root / "tutorial.toml"
        suite_file.write_text(SUITE.format(episodes=args.episodes))

        # Run: one record (submission.json) per cell, under root/SUITE/METHOD/BUDGET/.
        suite = load_suite(suite_file)
        print("cells:", ", ".join(c.key for c in suite.cells))
        paths = run_suite(suite, output=root, progress=False)

        # Check: schema, content hash, results re-derived from the trajectories, KV budget kept,
        # events causal. A verdict per record (compliance.json beside it).
        verdicts = {str(v.path): v for v in check_all(root)}

        # Read: records are plain JSON.
        records = {}
        for path in paths:
            record = json.loads(Path(path).read_text())
            records[record["method"]] = record
            res, cmp = record["results"], record["comparison_vs_none"]
            line = (f"{record['method']:24} {record['budget']['label']:5} score {res['score']['mean']:5.1f} "
                    f"± {res['score']['se']:4.1f}  peak KV max {res['kv']['peak_max']:5d}  "
                    f"compression {res['kv']['compression_ratio']:.2f}")
            if cmp:
                line += f"  Δ vs none {cmp['mean_diff']:+.1f} (sign test p={cmp['sign_pvalue']:.2f})"
            print(line)

        # Show: ranked markdown tables and score-vs-budget / score-vs-compression plots.
        page, plots = show(root)
        print("\n".join(line for line in page.splitlines() if line.startswith("|")))
        print("plots:", ", ".join(p.name for p in plots))
        plot_names = [p.name for p in plots]
    return {"records": records, "verdicts": verdicts, "page": page, "plots": plot_names}


if __name__ == "__main__":
    main()

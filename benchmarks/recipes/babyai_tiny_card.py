"""Assets of the babyai-tiny model card: the loss curve plot, the training log and evaluation tables.

    python benchmarks/recipes/babyai_tiny_card.py --install runs/babyai-tiny/sft3 \\
        --demos runs/babyai-tiny/demos --demos runs/babyai-tiny/demos2 \\
        --demos runs/babyai-tiny/demos3 --demos runs/babyai-tiny/demos3_replay \\
        --trainer-state runs/babyai-tiny/sft/trainer_state.json --trainer-state runs/babyai-tiny/sft2/trainer_state.json \\
        --trainer-state runs/babyai-tiny/sft3/trainer_state.json \\
        --eval runs/babyai-tiny/eval/full --eval runs/babyai-tiny/eval/mem_markovian ... \\
        --out compaction_gym/models/babyai-tiny

Writes ``OUT/loss_curve.png``, ``OUT/training_log.jsonl`` (the trainer's log history) and prints
markdown tables (per task; one row per evaluation directory) to paste into the card; ``--binding
DIR`` prints how often the first turn's reasoning finds its object (``opening_binding``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def write_training_log(states: list[dict], out: Path) -> list[dict]:
    """The trainers' ``log_history`` (one per stage, steps continued across stages, each entry tagged
    with its ``stage``) as JSON lines; returns the entries with a loss."""
    history, offset = [], 0
    for stage, state in enumerate(states, 1):
        for entry in state.get("log_history", []):
            history.append({**entry, "stage": stage, "step": entry.get("step", 0) + offset})
        offset += state.get("global_step", 0)
    with (out / "training_log.jsonl").open("w") as fh:
        for entry in history:
            fh.write(json.dumps(entry) + "\n")
    return [e for e in history if "loss" in e]


def plot_loss(steps: list[dict], out: Path) -> None:
    """Training loss and token accuracy against the optimizer step (stage boundaries dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=110)
    x = [e["step"] for e in steps]
    ax.plot(x, [float(e["loss"]) for e in steps], color="tab:blue", label="loss")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (token mean over targets)", color="tab:blue")
    low, high = ax.get_ylim()
    boundaries = [b for a, b in zip(steps, steps[1:]) if a["stage"] != b["stage"]]
    for i, b in enumerate(boundaries):
        ax.axvline(b["step"], color="grey", linestyle="--", linewidth=0.8)
        y = high * (low / high) ** (0.06 * (i % 2))  # alternate heights: close boundaries stay legible
        ax.text(b["step"], y, f" stage {b['stage']}", va="top", fontsize=8, color="grey")
    acc = [float(e["mean_token_accuracy"]) for e in steps if "mean_token_accuracy" in e]
    if len(acc) == len(x):
        ax2 = ax.twinx()
        ax2.plot(x, acc, color="tab:orange", label="token accuracy")
        ax2.set_ylabel("target-token accuracy", color="tab:orange")
        ax2.set_ylim(0, 1)
    ax.set_title("babyai-tiny: tree SFT on expert demonstrations")
    fig.tight_layout()
    fig.savefig(out / "loss_curve.png")


def eval_table(dirs: list[Path]) -> str:
    """Markdown: one row per evaluation summary (progression % ± SE per task and overall)."""
    summaries = [json.loads((d / "summary.json").read_text()) for d in dirs]
    tasks = list(summaries[0]["tasks"])
    head = "| run | " + " | ".join(tasks) + " | overall | peak KV | compactions |"
    rows = [head, "|" + "---|" * (len(tasks) + 4)]
    for d, s in zip(dirs, summaries):
        cfg = s["config"]["compaction"]
        name = cfg["mode"] + (f" (max_kv_len {cfg['max_kv_len']})" if cfg.get("max_kv_len") else "")
        cells = [
            f"{s['tasks'][t]['progression']['mean']:.1f} ± {s['tasks'][t]['progression']['se']:.1f}"
            for t in tasks
        ]
        o = s["overall"]
        rows.append(
            f"| {name} [{d.name}] | " + " | ".join(cells)
            + f" | **{o['progression']['mean']:.1f} ± {o['progression']['se']:.1f}** | {o['peak_kv_mean']:.0f}"
            + f" | {o['compaction_events_mean']:.1f} |"
        )  # fmt: skip
    return "\n".join(rows)


def opening_binding(dirs: list[Path]) -> str:
    """Markdown: how often the first turn's reasoning names the right position for its object.

    For each episode's first turn with at least one object in view, the model's ``It is ...`` is
    compared with the template's (the nearest object of the sub-goal's colour and kind, or "not in
    view"); a wrong claim is classed as the *first listed* object's position, another listed
    object's, "not in view", or other. Cheap to produce: ``compaction-gym eval --max-steps 1``.
    """
    import re

    from compaction_gym.agents import read_jsonl
    from compaction_gym.envs.babyai.reasoning import babyai_reasoning
    from compaction_gym.envs.babyai.text import OBJECT_KINDS

    rows = ["| run | objects in view | episodes | right | first listed | other listed | not in view | other |"]
    rows.append("|---|---|---|---|---|---|---|---|")
    for d in dirs:
        counts: dict[int, dict[str, int]] = {}
        for traj in read_jsonl(d / "trajectories.jsonl"):
            turn = traj.turns[0]
            objects = [
                line for line in turn.observation.split("\n") if not line.startswith(("a wall", "You carry"))
            ]
            if not objects:
                continue
            claim = re.search(r"It is (.*?)\.</think>", turn.action_text or "")
            expected = babyai_reasoning(traj.info["mission"], turn.observation).split("It is ", 1)[1][:-1]
            where = [re.sub(rf"^a (?:\w+ )?\w+ (?:{'|'.join(OBJECT_KINDS)}) ", "", o) for o in objects]
            got = claim.group(1) if claim else None
            kind = (
                "right" if got == expected else "first listed" if got == where[0]
                else "other listed" if got in where else "not in view" if got == "not in view" else "other"
            )  # fmt: skip
            c = counts.setdefault(min(len(objects), 2), {})
            c[kind] = c.get(kind, 0) + 1
        for n, c in sorted(counts.items()):
            total = sum(c.values())
            cells = [f"{c.get(k, 0)}" for k in ("first listed", "other listed", "not in view", "other")]
            rows.append(
                f"| {d.name} | {n if n < 2 else '2+'} | {total} | **{100 * c.get('right', 0) / total:.0f} %** | "
                + " | ".join(cells) + " |"
            )  # fmt: skip
    return "\n".join(rows)


MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def merge_evals(dirs: list[Path], out: Path) -> dict:
    """One evaluation from runs of the same model and config run in parallel processes over
    different tasks and/or seed ranges: trajectories of each task concatenated in seed order,
    statistics recomputed, the first summary's config kept.

    A (task, seed) found in several runs is taken from the run with the most episodes of that task;
    a run stopped before writing ``summary.json`` contributes its trajectories (its wall times are
    unknown and count as 0).
    """
    from compaction_gym.agents import read_jsonl, write_jsonl
    from compaction_gym.evaluation import summarize

    summaries = {
        d: json.loads((d / "summary.json").read_text()) for d in dirs if (d / "summary.json").exists()
    }
    if not summaries:
        raise SystemExit("merge_evals: no run has a summary.json")
    configs = {json.dumps({**s["config"], "episodes_per_task": None}, sort_keys=True) for s in summaries.values()}
    if len(configs) != 1 or len({s["model"]["resolved"] for s in summaries.values()}) != 1:
        raise SystemExit("merge_evals: the runs differ in model or config")
    runs: list[tuple[Path, dict[str, list]]] = []
    for d in dirs:
        by_task: dict[str, list] = {}
        for traj in read_jsonl(d / "trajectories.jsonl"):
            by_task.setdefault(traj.info.get("eval_task") or traj.info["task"], []).append(traj)
        runs.append((d, by_task))
    chosen: dict[str, dict[int, tuple[int, object]]] = {}
    wall: dict[str, float] = {}
    for d, by_task in runs:
        for task, trajs in by_task.items():
            wall[task] = wall.get(task, 0.0) + (summaries[d]["tasks"][task]["wall_time_s"] if d in summaries else 0.0)
            for traj in trajs:
                best = chosen.setdefault(task, {}).get(traj.seed)
                if best is None or len(trajs) > best[0]:
                    chosen[task][traj.seed] = (len(trajs), traj)
    from compaction_gym.envs.registration import BABYAI_TASK_IDS

    order = {task: i for i, task in enumerate(BABYAI_TASK_IDS)}
    tasks = sorted(chosen, key=lambda t: (order.get(t, len(order)), t))
    merged_runs = {task: [chosen[task][s][1] for s in sorted(chosen[task])] for task in tasks}
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "trajectories.jsonl", [t for trajs in merged_runs.values() for t in trajs])
    first = next(iter(summaries.values()))
    merged = {**first, **summarize(merged_runs, wall), "merged_from": [str(d) for d in dirs]}
    merged["tasks_requested"] = list(merged_runs)
    merged["seeds"] = sorted({t.seed for trajs in merged_runs.values() for t in trajs})
    (out / "summary.json").write_text(json.dumps(merged, indent=2) + "\n")
    return merged


#: (demos configs, SFT config) of each training stage
RECIPES = (
    (("benchmarks/recipes/babyai_tiny_demos.toml",), "benchmarks/recipes/babyai_tiny.toml"),
    (("benchmarks/recipes/babyai_tiny_stage2_demos.toml",), "benchmarks/recipes/babyai_tiny_stage2.toml"),
    (
        (
            "benchmarks/recipes/babyai_tiny_stage3_demos.toml",
            "benchmarks/recipes/babyai_tiny_stage3_replay_demos.toml",
        ),
        "benchmarks/recipes/babyai_tiny_stage3.toml",
    ),
)


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def install(sft_dir: Path, demos: list[Path], out: Path) -> dict:
    """Copy the trained model's files into ``out`` and write ``compaction_gym.json`` (agent defaults
    and the provenance of every stage: recipe hashes, data hash, seeds, episodes).

    ``demos`` holds the demos manifests (``manifest.json`` or a directory holding one) in the order
    of :data:`RECIPES`' demos configs; stages past the last manifest are left out."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        shutil.copy2(sft_dir / name, out / name)
    manifests = [json.loads((p / "manifest.json" if p.is_dir() else p).read_text()) for p in demos]
    stages = []
    for demos_configs, sft_config in RECIPES:
        if len(manifests) < len(demos_configs):
            break
        used, manifests = manifests[: len(demos_configs)], manifests[len(demos_configs) :]
        stages.append(
            {
                "demos": [
                    {
                        "config": config,
                        "config_sha256": _sha256(Path(config)),
                        "trees_sha256": manifest["trees_sha256"],
                        "train_seeds": manifest["seeds"],
                        "episodes": manifest["episodes_kept"],
                    }
                    for config, manifest in zip(demos_configs, used)
                ],
                "sft_config": sft_config,
                "sft_config_sha256": _sha256(Path(sft_config)),
            }
        )
    meta = {
        "prompt": "reasoning",
        "max_new_tokens": 64,
        "env": "AttnMatch-BabyAI-v0",
        "recipe": stages,
        "eval_seeds": "< 10000",
        "model_sha256": _sha256(out / "model.safetensors"),
    }
    (out / "compaction_gym.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trainer-state", type=Path, action="append", default=[], help="trainer_state.json of each SFT stage"
    )
    parser.add_argument("--eval", type=Path, action="append", default=[], help="eval output directory")
    parser.add_argument(
        "--binding", type=Path, action="append", default=[],
        help="eval output directory: table of the first turn's object binding (see opening_binding)",
    )  # fmt: skip
    parser.add_argument(
        "--merge", type=Path, action="append", default=[], help="eval dirs to merge into --merged"
    )
    parser.add_argument("--merged", type=Path, help="where --merge writes the merged evaluation")
    parser.add_argument("--out", type=Path, default=Path("compaction_gym/models/babyai-tiny"))
    parser.add_argument("--install", type=Path, help="SFT output dir whose model files are copied into --out")
    parser.add_argument(
        "--demos", type=Path, action="append", default=[], help="each stage's demos dir or manifest.json"
    )
    args = parser.parse_args()
    if args.merge:
        merged = merge_evals(args.merge, args.merged)
        print(f"merged {len(args.merge)} runs: {merged['overall']['episodes']} episodes -> {args.merged}")
    if args.install:
        print(json.dumps(install(args.install, args.demos, args.out), indent=1))
    if args.trainer_state:
        steps = write_training_log([json.loads(p.read_text()) for p in args.trainer_state], args.out)
        plot_loss(steps, args.out)
        print(f"{len(steps)} logged steps; final loss {steps[-1]['loss']}")
    if args.eval:
        print(eval_table(args.eval))
    if args.binding:
        print(opening_binding(args.binding))


if __name__ == "__main__":
    main()

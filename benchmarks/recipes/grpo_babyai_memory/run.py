#!/usr/bin/env python3
"""GRPO of babyai-tiny on the memory-dependent BabyAI variant, in bounded wall time (issue 24).

One script for the recipe in ``recipe.toml`` beside it (docs/grpo.md, "Recipe: babyai-tiny on the
memory variant"):

* ``train --variant V --out DIR``: :class:`CompactionGRPOTrainer` for at most ``max_minutes``
  (TensorBoard under ``DIR/runs``, ``DIR/log_history.jsonl``, checkpoints), the model saved to
  ``DIR/model`` with the recipe's config hashes in its ``compaction_gym.json``, then the held-out
  evaluation (``DIR/eval.json``) and the curves (``DIR/curves.png``);
* ``eval --model M --out DIR``: the held-out evaluation alone (the baseline);
* ``plot --run DIR [--run DIR ...] --png FILE``: curves of one or several runs from their logs;
* ``all --out DIR --minutes M``: the baseline evaluation and every variant as parallel processes
  (spread round-robin over the visible GPUs, the host's cores split between them), then ``DIR/summary.json``, ``DIR/curves.png`` and
  a ``DIR/results.tar.gz`` of the small files; the best variant's weights in 15 MB parts.

Held-out evaluation: greedy, every task's seeds ``eval_seed_start + i`` played at once through the
engine (one ``step_batch`` per turn over ``eval_chunk × tasks`` episodes), under each of
``eval_modes``; BALROG statistics (``compaction_gym.evaluation.summary.summarize``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
from pathlib import Path
from typing import Any

_T0 = time.monotonic()  # the process's start: the training budget counts from here
HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "recipe.toml"

#: Top-level recipe keys (besides the [compaction], [training] and [variants] tables) and their types.
RECIPE_KEYS: dict[str, type | tuple[type, ...]] = {
    "model": str,
    "tasks": list,
    "train_seed_start": int,
    "train_episodes": int,
    "eval_seed_start": int,
    "eval_seeds": int,
    "eval_chunk": int,
    "eval_modes": list,
    "eval_capacity": int,
    "eval_fast": bool,
    "max_minutes": (int, float),
    "eval_minutes": (int, float),
    "device": str,
    "seed": int,
}
TABLES = ("compaction", "training")
#: Curves drawn per run: (log key, panel title).
CURVES: tuple[tuple[str, str], ...] = (
    ("reward", "reward (env, mean)"),
    ("rollout/success", "success rate"),
    ("kl", "KL to the SFT model"),
    ("replay/max_abs_logprob_diff", "replay mismatch (max |Δ log p|)"),
    ("rollout/compaction_events", "compaction events / episode"),
    ("rollout/peak_kv_len", "peak KV rows (mean)"),
    ("rollout/turns", "turns / episode"),
    ("loss", "loss"),
)


def _error(message: str) -> Exception:
    from compaction_gym.errors import InvalidArgumentError

    return InvalidArgumentError(message)


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------------------------------ config
def load_recipe(path: str | Path = DEFAULT_CONFIG, variant: str | None = None) -> dict[str, Any]:
    """The recipe file merged with ``[variants.<variant>]`` (its tables update the base tables).

    Returns the resolved recipe plus ``config`` (the file), ``config_sha256`` (its bytes),
    ``variant``, ``variants`` (the file's variant names) and ``resolved_sha256`` (sha256 of the
    resolved recipe as canonical JSON: what the run actually used).

    Raises:
        InvalidArgumentError: an unknown key or variant, a wrong type, or train seeds overlapping
            the held-out seeds — named.
    """
    path = Path(path)
    raw_bytes = path.read_bytes()
    raw = tomllib.loads(raw_bytes.decode())
    variants = raw.pop("variants", {})
    if not isinstance(variants, dict) or not all(isinstance(v, dict) for v in variants.values()):
        raise _error(f"{path}: [variants] must hold one table per variant")
    _check_keys(raw, str(path))
    if variant is None:
        variant = next(iter(variants), None)
    if variant is not None and variant not in variants:
        raise _error(f"{path}: unknown variant {variant!r}; variants: {sorted(variants)}")
    resolved: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for table in TABLES:
        resolved.setdefault(table, {})
    if variant is not None:
        override = variants[variant]
        _check_keys(override, f"{path} [variants.{variant}]")
        for key, value in override.items():
            if key in TABLES:
                resolved[key] = {**resolved[key], **value}
            else:
                resolved[key] = value
    missing = sorted(set(RECIPE_KEYS) - set(resolved))
    if missing:
        raise _error(f"{path}: missing keys {missing}")
    _check_seeds(resolved)
    return {
        **resolved,
        "config": str(path),
        "config_sha256": _sha256_bytes(raw_bytes),
        "variant": variant,
        "variants": list(variants),
        "resolved_sha256": resolved_sha256(resolved),
    }


def resolved_sha256(recipe: dict[str, Any]) -> str:
    """sha256 of the resolved recipe's settings (not its bookkeeping keys) as canonical JSON."""
    settings = {k: v for k, v in recipe.items() if k in RECIPE_KEYS or k in TABLES}
    return _sha256_bytes(json.dumps(settings, sort_keys=True).encode())


def _check_keys(table: dict[str, Any], where: str) -> None:
    for key, value in table.items():
        if key in TABLES:
            if not isinstance(value, dict):
                raise _error(f"{where}: {key} must be a table, got {value!r}")
            continue
        if key not in RECIPE_KEYS:
            raise _error(
                f"{where}: unknown key {key!r}; recipe keys: {sorted(RECIPE_KEYS)} and tables {TABLES}"
            )
        expected = RECIPE_KEYS[key]
        if (isinstance(value, bool) and expected is not bool) or not isinstance(value, expected):
            raise _error(f"{where}: {key} must be {expected}, got {value!r}")


def _check_seeds(recipe: dict[str, Any]) -> None:
    from compaction_gym.envs.registration import BABYAI_TASK_IDS

    for task in recipe["tasks"]:
        if task not in BABYAI_TASK_IDS:
            raise _error(f"tasks: unknown BabyAI task {task!r}; tasks: {sorted(BABYAI_TASK_IDS)}")
    import dataclasses

    from compaction_gym.engine import CompactionConfig
    from compaction_gym.trainers import CompactionGRPOConfig

    fields = {f.name for f in dataclasses.fields(CompactionGRPOConfig) if f.init}
    unknown = sorted(set(recipe["training"]) - fields)
    if unknown:
        raise _error(f"[training]: unknown CompactionGRPOConfig fields {unknown}")
    try:
        CompactionConfig.from_dict(recipe["compaction"])
    except Exception as exc:
        raise _error(f"[compaction]: {exc}") from exc
    for mode in recipe["eval_modes"]:
        if mode == "none":
            continue
        try:
            CompactionConfig.from_dict({**recipe["compaction"], "mode": mode})
        except Exception as exc:
            raise _error(f"eval_modes: {mode!r} is not a compaction mode ({exc})") from exc
    for key in ("train_episodes", "eval_seeds", "eval_chunk"):
        if recipe[key] < 1:
            raise _error(f"{key} must be >= 1, got {recipe[key]}")
    train = range(recipe["train_seed_start"], recipe["train_seed_start"] + recipe["train_episodes"])
    held = range(recipe["eval_seed_start"], recipe["eval_seed_start"] + recipe["eval_seeds"])
    if train.start < held.stop and held.start < train.stop:
        raise _error(
            f"train_seed_start: train seeds [{train.start}, {train.stop}) overlap the held-out seeds "
            f"[{held.start}, {held.stop})"
        )


def train_rows(recipe: dict[str, Any]) -> dict[str, list]:
    """The episode dataset's columns: ``env`` (task key) cycling through the tasks, ``env_seed``."""
    tasks, n, first = recipe["tasks"], recipe["train_episodes"], recipe["train_seed_start"]
    envs = [tasks[i % len(tasks)] for i in range(n)]
    seeds = [first + i for i in range(n)]
    return {"prompt": [f"{e} seed={s}" for e, s in zip(envs, seeds)], "env": envs, "env_seed": seeds}


def train_seed_ranges(recipe: dict[str, Any]) -> dict[str, list[int]]:
    """Per task ``[first, last, count]`` of the training seeds (model metadata)."""
    rows = train_rows(recipe)
    out: dict[str, list[int]] = {}
    for env, seed in zip(rows["env"], rows["env_seed"]):
        first, _, count = out.get(env, [seed, seed, 0])
        out[env] = [first, seed, count + 1]
    return out


def grpo_config(recipe: dict[str, Any], out: Path, *, use_cpu: bool) -> Any:
    """The run's :class:`CompactionGRPOConfig` (``[training]`` + the compaction table + out dir)."""
    import importlib.util

    from compaction_gym.trainers import CompactionGRPOConfig

    training = dict(recipe["training"])
    if "report_to" not in training:
        has_tb = any(importlib.util.find_spec(m) for m in ("tensorboard", "tensorboardX"))
        training["report_to"] = "tensorboard" if has_tb else "none"
    return CompactionGRPOConfig(
        str(out),
        compaction=dict(recipe["compaction"]),
        num_episodes=recipe["train_episodes"],
        episode_seed=recipe["train_seed_start"],
        seed=recipe["seed"],
        use_cpu=use_cpu,
        **training,
    )


def _device(recipe: dict[str, Any]) -> str:
    import torch

    dev = recipe["device"]
    if dev == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return dev


# ------------------------------------------------------------------------------------------ training
class WallBudget:
    """A ``TrainerCallback`` that stops training (and saves) before ``minutes`` after ``start`` have passed.

    ``start`` (a ``time.monotonic()`` value, default: now) lets the budget include the process's
    start-up. After each optimizer step it stops when another step of the mean duration so far
    would end past the budget, so a run ends within about one step of its budget.
    """

    def __new__(cls, minutes: float, start: float | None = None):
        from transformers import TrainerCallback

        class _WallBudget(TrainerCallback):
            def __init__(self) -> None:
                self.budget_s = 60.0 * minutes
                self.start = time.monotonic() if start is None else start
                self.stopped_by_budget = False

            def on_train_begin(self, args, state, control, **kwargs):
                self.first_step_at = time.monotonic()

            def on_step_end(self, args, state, control, **kwargs):
                now = time.monotonic()
                begun = getattr(self, "first_step_at", self.start)
                per_step = (now - begun) / max(1, state.global_step)
                if now - self.start + per_step > self.budget_s:
                    self.stopped_by_budget = True
                    control.should_training_stop = True
                    control.should_save = True
                return control

        return _WallBudget()


class JsonlLog:
    """A ``TrainerCallback`` appending each log record (with ``step`` and wall time) to a JSONL file."""

    def __new__(cls, path: Path):
        from transformers import TrainerCallback

        class _JsonlLog(TrainerCallback):
            def __init__(self) -> None:
                self.path = path
                self.start = time.monotonic()
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("")

            def on_log(self, args, state, control, logs=None, **kwargs):
                record = {
                    "step": state.global_step,
                    "wall_s": round(time.monotonic() - self.start, 2),
                    **(logs or {}),
                }
                with self.path.open("a") as f:
                    f.write(json.dumps(record, default=float) + "\n")

        return _JsonlLog()


def train(
    recipe: dict[str, Any],
    out: Path,
    *,
    max_minutes: float | None = None,
    start: float | None = None,
    model: Any = None,
) -> dict[str, Any]:
    """Train one variant within ``max_minutes`` (default the recipe's) from ``start`` (default: now,
    a ``time.monotonic()`` value); save the model with metadata.

    Returns ``{"steps", "episodes", "train_s", "stopped_by_budget", "model_dir", "weights_changed"}``.
    ``model``: a loaded policy instead of ``recipe["model"]`` (tests).
    """
    import torch
    from datasets import Dataset

    from compaction_gym.envs.registration import BABYAI_TASK_IDS
    from compaction_gym.models.registry import load_model, resolve_model
    from compaction_gym.trainers import CompactionGRPOTrainer

    out.mkdir(parents=True, exist_ok=True)
    device = _device(recipe)
    base_dir = resolve_model(recipe["model"])
    loaded_model, tokenizer = load_model(base_dir, dtype=torch.float32, device=device)
    model = model if model is not None else loaded_model
    model.train()
    args = grpo_config(recipe, out, use_cpu=device == "cpu")
    budget = WallBudget(recipe["max_minutes"] if max_minutes is None else max_minutes, start)
    start = time.monotonic()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = CompactionGRPOTrainer(
        model,
        args,
        env={task: BABYAI_TASK_IDS[task] for task in recipe["tasks"]},
        train_dataset=Dataset.from_dict(train_rows(recipe)),
        processing_class=tokenizer,
        callbacks=[budget, JsonlLog(out / "log_history.jsonl")],
    )
    result = trainer.train()
    train_s = time.monotonic() - start
    changed = any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    model_dir = out / "model"
    trainer.save_model(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    generation = args.per_device_train_batch_size * args.steps_per_generation
    info = {
        "steps": int(result.global_step),
        "episodes": int(result.global_step) * generation // max(1, args.num_iterations),
        "train_s": round(train_s, 1),
        "stopped_by_budget": budget.stopped_by_budget,
        "model_dir": str(model_dir),
        "weights_changed": bool(changed),
    }
    write_metadata(base_dir, model_dir, recipe, info)
    trainer.rollouts.close()
    return info


def write_metadata(base_dir: Path, model_dir: Path, recipe: dict[str, Any], info: dict[str, Any]) -> dict:
    """``compaction_gym.json`` of the trained model: the base model's, plus this GRPO stage in ``recipe``
    (config path and sha256, variant, resolved-config sha256, train / held-out seeds, steps)."""
    from compaction_gym.models import METADATA_FILE
    from compaction_gym.provenance import provenance

    base_file = Path(base_dir) / METADATA_FILE
    meta = json.loads(base_file.read_text()) if base_file.is_file() else {}
    stage = {
        "grpo": {
            "config": _repo_relative(recipe["config"]),
            "config_sha256": recipe["config_sha256"],
            "variant": recipe["variant"],
            "resolved_sha256": resolved_sha256(recipe),
            "compaction": recipe["compaction"],
            "training": recipe["training"],
            "train_seeds": train_seed_ranges(recipe),
            "held_out_seeds": [
                recipe["eval_seed_start"],
                recipe["eval_seed_start"] + recipe["eval_seeds"] - 1,
            ],
            "base_model": recipe["model"],
            "base_model_sha256": _file_sha256(Path(base_dir) / "model.safetensors"),
            **{k: info[k] for k in ("steps", "episodes", "train_s")},
            "provenance": provenance(),
        }
    }
    meta["recipe"] = [*meta.get("recipe", []), stage]
    meta["model_sha256"] = _file_sha256(model_dir / "model.safetensors")
    (model_dir / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _file_sha256(path: Path) -> str | None:
    return _sha256_bytes(path.read_bytes()) if path.is_file() else None


def _repo_relative(path: str) -> str:
    p = Path(path).resolve()
    root = HERE.parent.parent.parent
    return str(p.relative_to(root)) if p.is_relative_to(root) else str(p)


# ------------------------------------------------------------------------------------------ evaluation
def evaluate_held_out(
    model: Any,
    tokenizer: Any,
    recipe: dict[str, Any],
    *,
    minutes: float | None = None,
    on_unit: Any = None,
) -> dict[str, Any]:
    """Greedy held-out evaluation under each of ``eval_modes``, chunk by chunk within ``minutes``.

    Chunk ``k`` plays seeds ``eval_seed_start + [k·c, (k+1)·c)`` of every task (``c = eval_chunk``),
    all tasks' episodes at once on one engine, once per mode in ``eval_modes`` order. A (chunk, mode)
    unit starts only if the same mode's last unit would still fit in the budget (the first unit
    always runs), so the first modes are the ones kept when time runs out. Returns
    ``{mode: summarize(...) + {"seeds": [...]}}`` (the seeds each mode played) and ``eval_s``;
    ``on_unit(result so far)`` is called after each unit (partial results survive a kill).
    """
    import torch

    from compaction_gym.engine import CompactionConfig, SamplingParams
    from compaction_gym.envs.registration import BABYAI_TASK_IDS
    from compaction_gym.trainers.rollouts import EnvRollouts, EpisodeSpec

    budget = 60.0 * (recipe["eval_minutes"] if minutes is None else minutes)
    start = time.monotonic()
    tasks, chunk, modes = recipe["tasks"], recipe["eval_chunk"], recipe["eval_modes"]
    seeds = list(range(recipe["eval_seed_start"], recipe["eval_seed_start"] + recipe["eval_seeds"]))
    sampling = SamplingParams(
        temperature=0.0, max_new_tokens=int(recipe["training"].get("max_turn_tokens", 64))
    )
    envs = {task: BABYAI_TASK_IDS[task] for task in tasks}
    by_mode: dict[str, dict[str, list]] = {m: {t: [] for t in tasks} for m in modes}
    played: dict[str, list[int]] = {m: [] for m in modes}
    unit_s: dict[str, float] = {}
    was_training = model.training
    for lo in range(0, len(seeds), chunk):
        part = seeds[lo : lo + chunk]
        for mode in modes:
            elapsed = time.monotonic() - start
            if unit_s and elapsed + unit_s.get(mode, max(unit_s.values())) > budget:
                continue
            t0 = time.monotonic()
            compaction = (
                CompactionConfig()
                if mode == "none"
                else CompactionConfig.from_dict({**recipe["compaction"], "mode": mode})
            )
            capacity = (
                recipe["eval_capacity"] if mode == "none" else max(2048, 4 * (compaction.max_kv_len or 0))
            )
            specs = [EpisodeSpec(t, s, 0) for t in tasks for s in part]
            rollouts = EnvRollouts(
                model, tokenizer, envs, compaction=compaction, sampling=sampling, prompt="reasoning",
                max_slots=len(specs), capacity=min(capacity, recipe["eval_capacity"]),
                fast=bool(recipe["eval_fast"]) and torch.cuda.is_available(),
            )  # fmt: skip
            for spec, traj in zip(specs, rollouts.run(specs)):
                by_mode[mode][spec.env].append(traj)
            rollouts.close()
            del rollouts
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            played[mode] += part
            unit_s[mode] = time.monotonic() - t0
            if on_unit is not None:
                on_unit(_eval_result(by_mode, played, start))
    model.train(was_training)
    return _eval_result(by_mode, played, start)


def _eval_result(
    by_mode: dict[str, dict[str, list]], played: dict[str, list[int]], start: float
) -> dict[str, Any]:
    from compaction_gym.agents.evaluate import episode_progression
    from compaction_gym.evaluation.summary import finite, summarize

    out: dict[str, Any] = {
        mode: {
            **finite(summarize({t: v for t, v in per_task.items() if v})),
            "seeds": list(played[mode]),
            # per task, each played seed's progression (%), in `seeds` order: paired comparisons
            # between models evaluated on the same seeds (docs/grpo.md)
            "progression_by_seed": {
                t: [round(100.0 * episode_progression(traj), 4) for traj in v]
                for t, v in per_task.items()
                if v
            },
        }
        for mode, per_task in by_mode.items()
        if played[mode]
    }
    out["eval_s"] = round(time.monotonic() - start, 1)
    return out


def eval_table(result: dict[str, Any], tasks: list[str]) -> str:
    """A markdown table: one row per mode, progression ± SE per task and overall."""
    head = (
        "| mode | " + " | ".join(tasks) + " | overall | seeds / task | peak KV (mean / max) | events / ep |"
    )
    lines = [head, "|" + "---|" * (len(tasks) + 5)]
    for mode, s in result.items():
        if not isinstance(s, dict) or "overall" not in s:
            continue
        cells = []
        for t in tasks:
            p = s["tasks"].get(t, {}).get("progression", {})
            cells.append(f"{p.get('mean', float('nan')):.1f} ± {p.get('se', float('nan')):.1f}")
        o = s["overall"]
        cells.append(f"**{o['progression']['mean']:.1f} ± {o['progression']['se']:.1f}**")
        cells.append(str(len(s["seeds"])))
        cells.append(f"{o['peak_kv_mean']:.0f} / {o['peak_kv_max']}")
        cells.append(f"{o['compaction_events_mean']:.1f}")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ plots
def read_log(run: Path) -> list[dict[str, Any]]:
    """A run's ``log_history.jsonl`` records (training steps only)."""
    file = run / "log_history.jsonl"
    if not file.is_file():
        return []
    rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    return [r for r in rows if "train_runtime" not in r]


def _pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or ``None`` (with a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot: matplotlib is not installed; nothing drawn (run `plot` later)", file=sys.stderr)
        return None
    return plt


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and the ``window - 1`` before it (fewer at the start)."""
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1))
        for i in range(len(values))
    ]


def plot_runs(runs: list[Path], png: Path, smooth: int = 5) -> bool:
    """Curves of :data:`CURVES` for each run: every step faint, the trailing mean of ``smooth`` steps
    bold (each step plays only a few env seeds, so one step's reward is mostly its seeds'
    difficulty); ``False`` without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    cols = 4
    rows = math.ceil(len(CURVES) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for (key, title), ax in zip(CURVES, axes.flat):
        for color, run in enumerate(runs):
            pts = [(r["step"], r[key]) for r in read_log(run) if isinstance(r.get(key), int | float)]
            if pts:
                steps, values = zip(*pts)
                ax.plot(steps, values, marker=".", lw=0.8, alpha=0.3, color=f"C{color}")
                label = f"{run.name} (mean of {smooth} steps)" if smooth > 1 else run.name
                ax.plot(steps, trailing_mean(list(values), smooth), lw=2, color=f"C{color}", label=label)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def plot_held_out(summary: dict[str, Any], png: Path) -> bool:
    """Bars of each run's held-out overall progression (± SE) per evaluation mode, the baseline
    first; ``False`` without matplotlib or without any evaluation."""
    plt = _pyplot()
    if plt is None:
        return False
    runs = {name: run["eval"] for name, run in summary["runs"].items() if run.get("eval")}
    modes = list(
        dict.fromkeys(
            m for ev in runs.values() for m, s in ev.items() if isinstance(s, dict) and "overall" in s
        )
    )
    if not runs or not modes:
        return False
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(runs), 3.4))
    width = 0.8 / len(modes)
    for k, mode in enumerate(modes):
        xs, means, ses = [], [], []
        for i, ev in enumerate(runs.values()):
            if mode in ev:
                xs.append(i + (k - (len(modes) - 1) / 2) * width)
                means.append(ev[mode]["overall"]["progression"]["mean"])
                ses.append(ev[mode]["overall"]["progression"]["se"])
        ax.bar(xs, means, width, yerr=ses, capsize=3, label=mode, color=f"C{k}")
    labels = []
    for name, ev in runs.items():
        step = ev.get("evaluated_step")
        labels.append(f"{name}\n(step {step})" if step is not None else f"{name}\n(SFT model)")
    ax.set_xticks(range(len(runs)), labels, fontsize=8)
    ax.set_ylabel("held-out progression (%)")
    seeds = max(len(ev[m]["seeds"]) for ev in runs.values() for m in modes if m in ev)
    ax.set_title(f"held-out evaluation, {seeds} seeds per task (± SE)", fontsize=9)
    ax.set_ylim(0, 105)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------ commands
def _threads(n: int | None) -> None:
    import torch

    if n:
        torch.set_num_threads(n)


def cmd_train(a: argparse.Namespace) -> int:
    _threads(a.threads)
    recipe = load_recipe(a.config, a.variant)
    for key in ("max_minutes", "eval_minutes", "eval_seeds", "eval_chunk"):
        if getattr(a, key) is not None:
            recipe[key] = getattr(a, key)
    if a.max_steps is not None:
        recipe["training"] = {**recipe["training"], "max_steps": a.max_steps}
    if a.fast:
        recipe["training"] = {**recipe["training"], "engine_fast": True}
        recipe["eval_fast"] = True
    out = Path(a.out)
    info = train(recipe, out, start=_T0)
    print(json.dumps({"variant": recipe["variant"], **info}), flush=True)
    (out / "train.json").write_text(json.dumps({**info, "recipe": _public(recipe)}, indent=2) + "\n")
    plot_runs([out], out / "curves.png")
    model_dir, step = Path(info["model_dir"]), info["steps"]
    if a.peers:
        model_dir, step = equal_steps_model(out, info, recipe, [Path(p) for p in a.peers], a.peer_wait)
    if recipe["eval_minutes"] > 0:
        _evaluate_into(model_dir, recipe, out, extra={"evaluated_step": step, "trained_steps": info["steps"]})
    return 0


def equal_steps_model(
    out: Path, info: dict[str, Any], recipe: dict[str, Any], peers: list[Path], wait_s: float
) -> tuple[Path, int]:
    """The model to evaluate so that parallel variants are compared at the same number of steps.

    Waits (at most ``wait_s``) for every peer run directory's ``train.json``, takes the smallest
    step count ``S`` among them and this run, and returns this run's ``checkpoint-S`` copied to
    ``out/model-step{S}`` (its metadata saying ``steps = S``) — or the final model when this run has
    no more steps than ``S``, or no such checkpoint (then ``S`` is this run's own count).
    """
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all((p / "train.json").is_file() for p in peers):
        time.sleep(2.0)
    steps = [
        json.loads((p / "train.json").read_text())["steps"] for p in peers if (p / "train.json").is_file()
    ]
    common = min([info["steps"], *steps])
    final = Path(info["model_dir"])
    checkpoint = out / f"checkpoint-{common}"
    if common >= info["steps"] or common < 1 or not (checkpoint / "model.safetensors").is_file():
        return final, info["steps"]
    from compaction_gym.models.registry import resolve_model

    dest = out / f"model-step{common}"
    shutil.copytree(
        checkpoint, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.pt", "*.pth", "*.bin")
    )
    per_step = info["episodes"] // max(1, info["steps"])
    write_metadata(
        Path(resolve_model(recipe["model"])),
        dest,
        recipe,
        {**info, "steps": common, "episodes": common * per_step},
    )
    print(f"equal steps: evaluating {dest} (step {common} of {info['steps']})", flush=True)
    return dest, common


def cmd_eval(a: argparse.Namespace) -> int:
    _threads(a.threads)
    recipe = load_recipe(a.config, a.variant)
    for key in ("eval_minutes", "eval_seeds", "eval_chunk"):
        if getattr(a, key) is not None:
            recipe[key] = getattr(a, key)
    from compaction_gym.models.registry import resolve_model

    if a.fast:
        recipe["eval_fast"] = True
    _evaluate_into(resolve_model(a.model or recipe["model"]), recipe, Path(a.out))
    return 0


def _evaluate_into(
    model_dir: Path, recipe: dict[str, Any], out: Path, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    import torch

    from compaction_gym.models.registry import load_model

    model, tokenizer = load_model(model_dir, dtype=torch.float32, device=_device(recipe))
    out.mkdir(parents=True, exist_ok=True)

    def write(result: dict[str, Any], final: bool = False) -> None:
        result = {**result, **(extra or {}), "model": str(model_dir), "complete": final}
        tmp = out / "eval.json.tmp"
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(out / "eval.json")

    result = evaluate_held_out(model, tokenizer, recipe, on_unit=write)
    write(result, final=True)
    table = eval_table(result, recipe["tasks"])
    (out / "eval.md").write_text(f"{table}\n\nheld-out evaluation of {model_dir}: {result['eval_s']} s\n")
    print(table, flush=True)
    return result


def cmd_plot(a: argparse.Namespace) -> int:
    drawn = plot_runs([Path(r) for r in a.run], Path(a.png))
    if a.summary:
        png = Path(a.png).with_name(Path(a.png).stem + "_held_out.png")
        drawn = plot_held_out(json.loads(Path(a.summary).read_text()), png) and drawn
    return 0 if drawn else 1


def cmd_all(a: argparse.Namespace) -> int:
    """Baseline evaluation + every variant as parallel processes, then the summary and the bundle."""
    start = time.monotonic()
    recipe = load_recipe(a.config)
    variants = a.variants or recipe["variants"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    eval_minutes = a.eval_minutes if a.eval_minutes is not None else recipe["eval_minutes"]
    train_minutes = a.minutes - eval_minutes - a.slack_minutes
    if train_minutes <= 0:
        raise _error(
            f"minutes: {a.minutes} leaves no training time after eval_minutes {eval_minutes} + slack"
        )
    jobs = len(variants) + (0 if a.no_baseline else 1)
    threads = max(1, (os.cpu_count() or 2) // jobs)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    common = ["--config", str(a.config), "--threads", str(threads), "--eval-minutes", str(eval_minutes)]
    if a.eval_seeds is not None:
        common += ["--eval-seeds", str(a.eval_seeds)]
    if a.fast:
        common += ["--fast"]
    gpus = visible_gpus(a.gpus)
    procs = {}
    logs = contextlib.ExitStack()

    def env_for(index: int) -> dict[str, str]:
        # process i on GPU i mod n: several GPUs of one host train the variants side by side
        return {**env, "CUDA_VISIBLE_DEVICES": gpus[index % len(gpus)]} if gpus else env

    if not a.no_baseline:
        # the base model's evaluation (same seeds; every mode any variant evaluates) runs beside the
        # training processes, with the whole window
        modes_from = max(recipe["variants"], key=lambda v: len(load_recipe(a.config, v)["eval_modes"]))
        cmd = [sys.executable, __file__, "eval", *common, "--variant", modes_from, "--out", str(out / "baseline"),
               "--eval-minutes", str(a.minutes - a.slack_minutes)]  # fmt: skip
        procs["baseline"] = subprocess.Popen(
            cmd,
            env=env_for(len(procs)),
            stdout=logs.enter_context((out / "baseline.log").open("w")),
            stderr=subprocess.STDOUT,
        )
    for v in variants:
        cmd = [sys.executable, __file__, "train", *common, "--variant", v, "--out", str(out / v),
               "--max-minutes", str(train_minutes)]  # fmt: skip
        if not a.unequal_steps:
            cmd += ["--peers", *[str(out / w) for w in variants]]
        if a.max_steps is not None:
            cmd += ["--max-steps", str(a.max_steps)]
        procs[v] = subprocess.Popen(
            cmd,
            env=env_for(len(procs)),
            stdout=logs.enter_context((out / f"{v}.log").open("w")),
            stderr=subprocess.STDOUT,
        )
    deadline = start + 60.0 * (a.minutes - a.slack_minutes / 2)
    codes: dict[str, int | None] = {}
    for name, p in procs.items():
        try:
            codes[name] = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()  # past the wall budget: keep what it wrote (checkpoints, partial eval.json)
            try:
                codes[name] = p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[name] = p.wait()
            print(f"all: {name} stopped at the wall budget", file=sys.stderr)
    logs.close()
    summary: dict[str, Any] = {"exit_codes": codes, "config_sha256": recipe["config_sha256"], "runs": {}}
    for name in procs:
        run: dict[str, Any] = {}
        for f in ("train.json", "eval.json"):
            if (out / name / f).is_file():
                run[f.removesuffix(".json")] = json.loads((out / name / f).read_text())
        summary["runs"][name] = run
    # a process stopped at the wall budget after writing its results still counts as done
    summary["complete"] = {
        name: bool(run.get("eval", {}).get("complete")) and (name == "baseline" or "train" in run)
        for name, run in summary["runs"].items()
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_runs([out / v for v in variants], out / "curves.png")
    plot_held_out(summary, out / "held_out.png")
    _bundle(out, variants, summary)
    print(json.dumps({"complete": summary["complete"], "exit_codes": codes}), flush=True)
    return 0 if all(summary["complete"].values()) else 1


def visible_gpus(requested: int | None) -> list[str]:
    """The CUDA device ids ``all`` spreads its processes over: the first ``requested`` of those
    visible (``CUDA_VISIBLE_DEVICES`` or every device), all of them when ``requested`` is None;
    ``[]`` without CUDA (then the processes keep the parent's environment)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = (
        [d.strip() for d in visible.split(",") if d.strip()][:count]
        if visible
        else [str(i) for i in range(count)]
    )
    if requested is not None:
        if requested < 1:
            raise _error(f"gpus: must be >= 1, got {requested}")
        ids = ids[:requested]
    return ids


def _bundle(out: Path, variants: list[str], summary: dict[str, Any]) -> None:
    """``results.tar.gz`` (logs, evals, curves, TensorBoard, metadata; no weights) and the best
    variant's weights (held-out attention-matching progression) split in 15 MB parts."""
    with tarfile.open(out / "results.tar.gz", "w:gz") as tar:
        for path in sorted(out.rglob("*")):
            rel = path.relative_to(out)
            if path.is_dir() or path.name == "results.tar.gz" or ".part-" in path.name:
                continue
            if "checkpoint-" in str(rel) or path.suffix in (".safetensors", ".pt", ".bin"):
                continue
            tar.add(path, arcname=str(rel))

    def score(name: str) -> float:
        ev = summary["runs"].get(name, {}).get("eval", {})
        return ev.get("attention_matching", {}).get("overall", {}).get("progression", {}).get("mean") or -1.0

    best = max(variants, key=score, default=None)
    evaluated = summary["runs"].get(str(best), {}).get("eval", {}).get("model")
    weights = Path(evaluated or out / str(best) / "model") / "model.safetensors"
    if best is None or not weights.is_file():
        return
    data = weights.read_bytes()
    part = 15 * 1024 * 1024
    for i in range(0, len(data), part):
        (out / f"{best}.safetensors.part-{i // part:02d}").write_bytes(data[i : i + part])
    shutil.copy(weights.parent / "compaction_gym.json", out / f"{best}.compaction_gym.json")


def _public(recipe: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in recipe.items() if k != "variants"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--config", default=str(DEFAULT_CONFIG), help="recipe TOML (default: recipe.toml here)"
        )
        p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
        p.add_argument("--eval-minutes", dest="eval_minutes", type=float, default=None)
        p.add_argument(
            "--eval-seeds", dest="eval_seeds", type=int, default=None, help="held-out seeds per task"
        )
        p.add_argument("--eval-chunk", dest="eval_chunk", type=int, default=None)
        p.add_argument(
            "--fast",
            action="store_true",
            help="the engine's CUDA fast path for rollouts (engine_fast) and evaluation (eval_fast)",
        )

    p = sub.add_parser("train", help="train one variant, save, evaluate")
    common(p)
    p.add_argument("--variant", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--max-minutes", dest="max_minutes", type=float, default=None, help="training wall budget")
    p.add_argument("--max-steps", dest="max_steps", type=int, default=None)
    p.add_argument(
        "--peers",
        nargs="*",
        default=None,
        help="run dirs of parallel variants: evaluate at their common step count",
    )
    p.add_argument(
        "--peer-wait", dest="peer_wait", type=float, default=90.0, help="seconds to wait for peers"
    )
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("eval", help="held-out evaluation of a model (default: the recipe's base model)")
    common(p)
    p.add_argument("--variant", default=None, help="whose eval_modes to use")
    p.add_argument("--model", default=None)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_eval)
    p = sub.add_parser("plot", help="curves of runs from their log_history.jsonl")
    p.add_argument("--run", action="append", required=True)
    p.add_argument("--png", required=True)
    p.add_argument("--summary", default=None, help="an `all` run's summary.json: also PNG_held_out.png")
    p.set_defaults(func=cmd_plot)
    p = sub.add_parser("all", help="baseline + every variant in parallel, then summary and bundle")
    common(p)
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, required=True, help="wall budget of the whole command")
    p.add_argument("--slack-minutes", dest="slack_minutes", type=float, default=1.0)
    p.add_argument("--variants", nargs="*", default=None)
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument(
        "--unequal-steps",
        dest="unequal_steps",
        action="store_true",
        help="evaluate each variant's final model (default: every variant at their common step count)",
    )
    p.add_argument("--max-steps", dest="max_steps", type=int, default=None)
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="spread the processes over the first N visible GPUs (default: all)",
    )
    p.set_defaults(func=cmd_all)
    a = parser.parse_args(argv)
    for key in ("max_minutes", "eval_chunk"):
        if not hasattr(a, key):
            setattr(a, key, None)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())

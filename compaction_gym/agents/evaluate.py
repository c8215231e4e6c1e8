"""``compaction-gym eval``: run an agent on an env for N episodes per task and summarise.

Writes ``OUTPUT/trajectories.jsonl`` (one :class:`~compaction_gym.agents.Trajectory` per line, in
completion order, streamed as episodes end) and ``OUTPUT/summary.json`` (schema in
``docs/eval.md`` and :func:`summarize`), and prints a table. BabyAI statistics follow BALROG:
per task, mean progression × 100 with SE = population std × 100 / √n; overall, the mean over
tasks with SE = √(Σ SE²) / n_tasks.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym

from compaction_gym.agents.agent import CompactionAgent
from compaction_gym.agents.prompts import PROMPT_FORMATS, get_prompt_format
from compaction_gym.agents.rollout import run_episodes
from compaction_gym.agents.trajectory import Trajectory, jsonable, write_jsonl
from compaction_gym.engine.config import COMPACTION_MODES, PROBE_SOURCES, CompactionConfig, SamplingParams
from compaction_gym.errors import CompactionGymError, InvalidArgumentError
from compaction_gym.models.registry import model_defaults, resolve_model
from compaction_gym.provenance import provenance

SUMMARY_SCHEMA = "compaction-gym/eval-summary/v1"
BABYAI_ENTRY = "compaction_gym.envs.babyai.env:BabyAITextEnv"
#: task label per episode, read from ``info`` when the env picks the task itself.
TASK_INFO_KEYS = ("task", "dataset")
#: who chooses the actions: the model, or the BabyAI expert bot (teacher-forced into the session).
POLICIES = ("model", "expert")
#: ``--model`` when none is given: the agent shipped in the package (``compaction_gym.models``).
DEFAULT_MODEL = "babyai-tiny"


# ---------------------------------------------------------------------------- env plumbing
def _entry_point(env_id: str) -> str:
    try:
        spec = gym.spec(env_id)
    except gym.error.Error as exc:
        raise InvalidArgumentError(f"unknown env id {env_id!r}: {exc}") from exc
    return spec.entry_point if isinstance(spec.entry_point, str) else ""


def is_babyai(env_id: str) -> bool:
    """Whether ``env_id`` is one of our BabyAI text envs."""
    return _entry_point(env_id) == BABYAI_ENTRY


def default_tasks(env_id: str) -> list[str | None]:
    """BALROG's five tasks for the mixed BabyAI id; one unnamed task (labels from ``info``) otherwise."""
    from compaction_gym.envs.registration import BABYAI_TASK_IDS

    if is_babyai(env_id) and "task" not in (gym.spec(env_id).kwargs or {}):
        return list(BABYAI_TASK_IDS)
    return [None]


def task_env_kwargs(env_id: str, task: str | None) -> dict[str, Any]:
    """The ``gym.make`` keyword arguments that pin ``task`` on ``env_id``."""
    if task is None:
        return {}
    entry = _entry_point(env_id)
    if entry == BABYAI_ENTRY:
        return {"task": task}
    if entry.endswith(":MathEnv"):
        return {"dataset": task}
    if entry.endswith(":RGMixEnv"):
        return {"weights": {task: 1.0}}
    raise InvalidArgumentError(f"--task is not supported for {env_id!r}; drop it or use a BabyAI or math env")


def default_prompt(env_id: str, model: str | None = None) -> str:
    """The prompt format a BabyAI model declares (``compaction_gym.json``, e.g. the bundled
    ``babyai-tiny``: ``reasoning``), else ``balrog`` for BabyAI, ``raw`` otherwise (math questions
    carry their own answer format)."""
    if not is_babyai(env_id):
        return "raw"
    return model_defaults(model).get("prompt", "balrog")


def _max_new_tokens(prompt: str, model: str | None) -> int:
    """The model's declared per-turn budget when it runs its own prompt format, else the format's."""
    declared = model_defaults(model)
    if declared.get("prompt") == prompt and "max_new_tokens" in declared:
        return int(declared["max_new_tokens"])
    return get_prompt_format(prompt).max_new_tokens


# ---------------------------------------------------------------------------- statistics
def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


def _pop_se(xs: Sequence[float]) -> float:
    if not xs:
        return float("nan")
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs)) / math.sqrt(len(xs))


def episode_progression(traj: Trajectory) -> float:
    """BabyAI: BALROG's progression (0 or 1); math: the scorer's score; else ``success``."""
    for key in ("progression", "score"):
        if key in traj.info and traj.info[key] is not None:
            return float(traj.info[key])
    return float(traj.success)


def _episode_stats(trajs: Sequence[Trajectory]) -> dict[str, Any]:
    prog = [100.0 * episode_progression(t) for t in trajs]
    return {
        "episodes": len(trajs),
        "progression": {"mean": _mean(prog), "se": _pop_se(prog)},
        "success_rate": _mean([float(t.success) for t in trajs]),
        "reward_mean": _mean([t.total_reward for t in trajs]),
        "turns_mean": _mean([len(t.turns) for t in trajs]),
        "tokens_mean": _mean([t.num_tokens for t in trajs]),
        "generated_tokens_mean": _mean([t.num_generated for t in trajs]),
        "peak_kv_mean": _mean([t.peak_kv_len for t in trajs]),
        "peak_kv_max": max((t.peak_kv_len for t in trajs), default=0),
        "compaction_events_mean": _mean([len(t.events) for t in trajs]),
        "invalid_action_rate": _mean([float(turn.invalid_action) for t in trajs for turn in t.turns]),
        "aborted": sum(1 for t in trajs if "aborted" in t.info),
        "episode_wall_time_mean_s": _mean([float(t.metrics.get("wall_time_s", 0.0)) for t in trajs]),
    }


def summarize(
    by_task: dict[str, list[Trajectory]], wall_times: dict[str, float] | None = None
) -> dict[str, Any]:
    """Per-task statistics and BALROG's overall aggregate.

    Returns:
        ``{"tasks": {task: stats}, "overall": stats}`` where ``stats`` holds ``episodes``,
        ``progression`` (``{"mean", "se"}``, percent), ``success_rate``, ``reward_mean``,
        ``turns_mean``, ``tokens_mean``, ``generated_tokens_mean``, ``peak_kv_mean``,
        ``peak_kv_max``, ``compaction_events_mean``, ``invalid_action_rate``, ``aborted``,
        ``episode_wall_time_mean_s`` and ``wall_time_s``. Overall progression is the mean of
        the task means, its SE ``√(Σ SE²) / n_tasks``; the other overall fields pool episodes.
    """
    wall_times = wall_times or {}
    tasks = {}
    for task, trajs in by_task.items():
        tasks[task] = {**_episode_stats(trajs), "wall_time_s": float(wall_times.get(task, 0.0))}
    everything = [t for trajs in by_task.values() for t in trajs]
    overall = {**_episode_stats(everything), "wall_time_s": float(sum(wall_times.values()))}
    if tasks:
        ses = [s["progression"]["se"] for s in tasks.values()]
        overall["progression"] = {
            "mean": _mean([s["progression"]["mean"] for s in tasks.values()]),
            "se": math.sqrt(sum(se * se for se in ses)) / len(ses),
        }
    return {"tasks": tasks, "overall": overall}


# ---------------------------------------------------------------------------- the run
def evaluate(
    model: str | None = None,
    env: str = "AttnMatch-BabyAI-v0",
    *,
    tasks: Sequence[str] | None = None,
    compaction: CompactionConfig | None = None,
    sampling: SamplingParams | None = None,
    prompt: str | None = None,
    episodes: int = 10,
    seed: int = 0,
    output: str | Path | None = None,
    batch: int = 1,
    env_kwargs: dict[str, Any] | None = None,
    backend: Any = None,
    engine_kwargs: dict[str, Any] | None = None,
    progress: bool = True,
    policy: str = "model",
) -> dict[str, Any]:
    """Run ``episodes`` episodes per task and return (and write) the summary.

    Args:
        model: model directory, registered name (``tiny-random``) or hub id; loaded into a
            :class:`~compaction_gym.backends.LocalBackend` unless ``backend`` is given.
        env: env id (``AttnMatch-BabyAI-v0`` runs BALROG's five tasks; a per-task id or
            ``tasks`` narrows it; ``AttnMatch-Math-v0`` / ``AttnMatch-RGMix-v0`` are single-step).
        tasks: task names (BabyAI tasks; math dataset names).
        compaction, sampling: the agent's configs (default: no compaction; greedy with the prompt
            format's ``max_new_tokens``).
        prompt: ``balrog`` / ``reasoning`` / ``raw`` (default: ``balrog`` for BabyAI, ``raw`` else).
        episodes: episodes per task; episode ``i`` uses env seed ``seed + i`` in every task and
            method, so runs pair up across methods.
        output: directory for ``trajectories.jsonl`` and ``summary.json`` (nothing written if ``None``).
        batch: episodes played concurrently (one ``step_batch`` per turn across them).
        env_kwargs: extra ``gym.make`` arguments (e.g. ``{"max_steps": 16}``).
        backend: an existing backend (then ``model`` only labels the run).
        engine_kwargs: ``Engine.from_pretrained`` arguments (``device``, ``dtype``, ``capacity``).
        progress: show a progress bar.
        policy: ``model`` (the agent acts) or ``expert`` (BabyAI only: the expert bot's actions are
            teacher-forced through the same sessions, a sanity row that also records
            demonstrations with real compaction events).

    Returns:
        The summary dict (see ``docs/eval.md``).
    """
    from tqdm.auto import tqdm

    if episodes < 1:
        raise InvalidArgumentError(f"episodes must be >= 1, got {episodes}")
    if batch < 1:
        raise InvalidArgumentError(f"batch must be >= 1, got {batch}")
    if policy not in POLICIES:
        raise InvalidArgumentError(f"policy must be one of {POLICIES}, got {policy!r}")
    if policy == "expert" and not is_babyai(env):
        raise InvalidArgumentError(f"policy='expert' needs a BabyAI env, got {env!r}")
    teacher = None
    if policy == "expert":
        from compaction_gym.envs.babyai.expert import expert_action as teacher
    if model is None and backend is None:
        raise InvalidArgumentError("pass --model (a directory, registered name or hub id) or a backend")
    task_list = list(tasks) if tasks else default_tasks(env)
    prompt_name = prompt or default_prompt(env, None if backend is not None else model)
    fmt = get_prompt_format(prompt_name)
    compaction = compaction if compaction is not None else CompactionConfig()
    sampling = (
        sampling
        if sampling is not None
        else SamplingParams(temperature=0.0, max_new_tokens=_max_new_tokens(fmt.name, model))
    )
    base_kwargs = dict(env_kwargs or {})
    if is_babyai(env):
        base_kwargs.setdefault("action_parsing", fmt.action_parsing)
    resolved = None
    if backend is None:
        from compaction_gym.backends import LocalBackend

        resolved = resolve_model(model)
        engine_kwargs = dict(engine_kwargs or {})
        engine_kwargs.setdefault("max_slots", batch)
        backend = LocalBackend.from_pretrained(resolved, **engine_kwargs)
    model_label = str(model) if model is not None else str(getattr(backend, "name", ""))

    out_dir = Path(output) if output is not None else None
    traj_path = None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        traj_path = out_dir / "trajectories.jsonl"
        traj_path.write_text("")
    started = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    t_start = time.perf_counter()
    by_task: dict[str, list[Trajectory]] = {}
    wall: dict[str, float] = {}
    bar = tqdm(total=len(task_list) * episodes, desc="eval", unit="ep", disable=not progress, file=sys.stderr)
    agents = [
        CompactionAgent(backend, compaction=compaction, sampling=sampling, prompt=fmt, model_name=model_label)
        for _ in range(min(batch, episodes))
    ]
    try:
        for task in task_list:
            kwargs = {**base_kwargs, **task_env_kwargs(env, task)}
            envs = [gym.make(env, **kwargs) for _ in agents]

            def on_episode(index: int, traj: Trajectory, task: str | None = task) -> None:
                label = task or next((str(traj.info[k]) for k in TASK_INFO_KEYS if k in traj.info), "all")
                traj.info["eval_task"], traj.info["eval_episode"] = label, index
                by_task.setdefault(label, []).append(traj)
                if traj_path is not None:
                    write_jsonl(traj_path, [traj], append=True)
                bar.update(1)
                bar.set_postfix(
                    task=label,
                    progression=f"{_mean([100 * episode_progression(t) for t in by_task[label]]):.1f}",
                )

            t0 = time.perf_counter()
            try:
                seeds = [seed + i for i in range(episodes)]
                run_episodes(envs, agents, seeds, teacher=teacher, on_episode=on_episode)
            finally:
                for e in envs:
                    e.close()
            elapsed = time.perf_counter() - t0
            if task is not None:
                wall[task] = elapsed
            else:  # labels come from info: share the time by episode count
                n = sum(len(v) for k, v in by_task.items() if k not in wall)
                for k, v in by_task.items():
                    if k not in wall:
                        wall[k] = elapsed * len(v) / max(n, 1)
    finally:
        bar.close()
        for agent in agents:
            agent.close()
    for trajs in by_task.values():
        trajs.sort(key=lambda t: t.info["eval_episode"])

    summary: dict[str, Any] = {
        "schema": SUMMARY_SCHEMA,
        "env": env,
        "env_kwargs": jsonable(base_kwargs),
        "tasks_requested": task_list,
        **summarize(by_task, wall),
        "config": {
            "compaction": compaction.to_dict(),
            "sampling": jsonable(sampling.to_dict()),
            "prompt": fmt.name,
            "policy": policy,
            "episodes_per_task": episodes,
            "batch": batch,
        },
        "model": {"spec": model_label, "resolved": resolved, "backend": type(backend).__name__},
        "seed": seed,
        "seeds": [seed + i for i in range(episodes)],
        "provenance": {
            "started_at": started,
            "wall_time_s": time.perf_counter() - t_start,
            **provenance(),
            "device": str(getattr(getattr(backend, "engine", None), "device", "")),
            "argv": sys.argv,
        },
        "trajectories": "trajectories.jsonl" if out_dir is not None else None,
    }
    summary = _finite(jsonable(summary))
    if out_dir is not None:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    return summary


def _finite(value: Any) -> Any:
    """Strict JSON: non-finite floats (means of nothing) become ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


# ---------------------------------------------------------------------------- rendering
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


# ---------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``eval`` flags (shared with scripts that wrap :func:`evaluate`)."""
    g = parser.add_argument_group("run")
    g.add_argument("--env", default="AttnMatch-BabyAI-v0", help="env id (default: %(default)s)")
    g.add_argument(
        "--task", action="append", help="task to run (repeatable; BabyAI task or math dataset); default: all"
    )
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="model directory, registered name (babyai-tiny, smollm2-135m-instruct, tiny-random) or hub id (default: %(default)s, "
        "bundled)",
    )
    g.add_argument("--episodes", type=int, default=10, help="episodes per task (default: %(default)s)")
    g.add_argument(
        "--seed", type=int, default=0, help="episode i uses env seed SEED+i (default: %(default)s)"
    )
    g.add_argument("--output", help="directory for trajectories.jsonl and summary.json")
    g.add_argument("--batch", type=int, default=1, help="episodes played concurrently (default: %(default)s)")
    g.add_argument("--max-steps", type=int, help="env step limit (BabyAI default: BALROG's 64/128)")
    g.add_argument("--env-kwargs", type=json.loads, default={}, help="extra gym.make kwargs as JSON")
    g.add_argument(
        "--policy",
        choices=POLICIES,
        default="model",
        help="model: the agent acts; expert: BabyAI's expert bot, teacher-forced through the same "
        "compacted session (sanity row; its trajectories are demonstrations) (default: %(default)s)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    c = parser.add_argument_group("compaction")
    c.add_argument(
        "--mode", choices=COMPACTION_MODES, default="none", help="compaction mode (default: %(default)s)"
    )
    c.add_argument(
        "--max-kv-len", type=int, help="KV-budget trigger: compact when the cache reaches this length"
    )
    c.add_argument(
        "--compact-window", type=int, help="tokens compacted per KV-budget event (default: max_kv_len/2)"
    )
    c.add_argument(
        "--ratio", type=float, default=0.25, help="kept fraction of a compacted span (default: %(default)s)"
    )
    c.add_argument(
        "--n-protect-turns", type=int, default=-1, help="turn-based trigger: keep the last k turns raw"
    )
    c.add_argument(
        "--compute-beta", action="store_true", help="fit the attention-mass bias β (attention_matching)"
    )
    c.add_argument(
        "--queries", choices=PROBE_SOURCES, default="suffix", help="probe queries (default: %(default)s)"
    )
    s = parser.add_argument_group("sampling")
    s.add_argument(
        "--prompt",
        choices=sorted(PROMPT_FORMATS),
        help="prompt format (default: balrog for BabyAI, raw else)",
    )
    s.add_argument("--max-new-tokens", type=int, help="tokens per turn (default: the prompt format's)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    e = parser.add_argument_group("engine")
    e.add_argument("--device", help="cuda / cpu (default: cuda when available)")
    e.add_argument(
        "--dtype", help="float32 / bfloat16 / ... (default: float32 on CPU, checkpoint dtype on GPU)"
    )
    e.add_argument("--capacity", type=int, help="KV rows per session slot (default: engine's)")


def register(subparsers: Any) -> None:
    """Add ``eval`` to the ``compaction-gym`` command."""
    parser = subparsers.add_parser(
        "eval",
        help="run an agent on an env for N episodes and summarise",
        description="Run an LLM agent (embedded engine) on an env for N episodes per task; write "
        "trajectories.jsonl and summary.json and print a per-task table.",
    )
    add_arguments(parser)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run ``compaction-gym eval`` from parsed arguments; returns the exit code."""
    from rich.console import Console

    console = Console()
    console.width = max(console.width, 100)
    try:
        compaction = CompactionConfig(
            mode=args.mode,
            max_kv_len=args.max_kv_len,
            compact_window=args.compact_window,
            compact_target_ratio=args.ratio,
            n_protect_turns=args.n_protect_turns,
            compute_beta=args.compute_beta,
            queries=args.queries,
        )
        env_id = args.env
        fmt = get_prompt_format(args.prompt or default_prompt(env_id, args.model))
        sampling = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_new_tokens=args.max_new_tokens
            if args.max_new_tokens is not None
            else _max_new_tokens(fmt.name, args.model),
        )
        if compaction.enabled and not (compaction.kv_budget or compaction.turn_based):
            console.print(
                f"[yellow]warning: --mode {args.mode} without --max-kv-len or --n-protect-turns never compacts[/yellow]"
            )
        env_kwargs = dict(args.env_kwargs)
        if args.max_steps is not None:
            env_kwargs["max_steps"] = args.max_steps
        engine_kwargs = {
            k: v
            for k, v in (("device", args.device), ("dtype", args.dtype), ("capacity", args.capacity))
            if v
        }
        summary = evaluate(
            args.model,
            env_id,
            tasks=args.task,
            compaction=compaction,
            sampling=sampling,
            prompt=fmt.name,
            episodes=args.episodes,
            seed=args.seed,
            output=args.output,
            batch=args.batch,
            env_kwargs=env_kwargs,
            engine_kwargs=engine_kwargs,
            progress=not args.no_progress,
            policy=args.policy,
        )
    except CompactionGymError as exc:
        console.print(f"[red]compaction-gym eval: {exc}[/red]")
        return 2
    render_table(summary, console)
    if args.output:
        console.print(
            f"wrote {Path(args.output) / 'summary.json'} and {Path(args.output) / 'trajectories.jsonl'}"
        )
    return 0

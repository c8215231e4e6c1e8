"""``compaction-gym train demos``: expert-bot BabyAI demonstrations recorded through compacted sessions.

Each episode is played by minigrid's BabyAI bot, teacher-forced into a persistent
:class:`~compaction_gym.agents.CompactionAgent` session (``run_episodes(..., teacher=...)``, one
batched engine call per turn), so the trajectories carry the session's real token stream and its
compaction events. The assistant text of every turn is the ``reasoning`` prompt format's answer: a
one-line templated reasoning (the current sub-goal and where its object is, read off the
observation), then the action::

    <think>Next: pick up the green key. It is 1 step right and 2 steps forward.</think><action>go forward</action>

With ``noise > 0`` (DART-style) some turns play a random movement instead of the bot's action; the
bot replans from the new state, and those turns are masked out of the SFT targets, so the model
learns to recover from states the bot alone never visits. With ``max_turns`` every episode is cut
after that many turns and kept as a partial demonstration: many cheap examples of the opening
decisions (which visible object the mission means), where a whole episode gives only one.

Outputs in ``--output-dir``: ``trajectories.jsonl`` (every episode, :class:`Trajectory` records),
``trees.jsonl`` (tree rows for ``compaction-gym train sft``: successful episodes, targets on the
non-noise outputs) and ``manifest.json`` (seeds, configs, counts, the trees file's sha256).
Train seeds start at ``--seed`` (one disjoint block per task) and must not fall below
``--eval-seed-limit``: ``compaction-gym eval --seed 0`` episodes use seeds below it.

Example::

    compaction-gym train demos --config benchmarks/recipes/babyai_tiny_demos.toml
    compaction-gym train demos --model runs/base --episodes-per-task 20 --output-dir runs/demos
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from compaction_gym.envs.babyai.text import OBJECT_COLORS, OBJECT_KINDS
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.script_args import (
    add_dataclass_arguments,
    add_script_command,
    load_script_arguments,
    run_script,
    script_parser,
)

#: Movements a noisy turn draws from (never pick up / drop / toggle: those can end an episode badly).
NOISE_ACTIONS: tuple[str, ...] = ("turn left", "turn right", "go forward")
DEMOS_SCHEMA = "compaction-gym/demos-manifest/v1"

_OBJ = rf"(?:the|a) (?:({'|'.join(OBJECT_COLORS)}) )?({'|'.join(OBJECT_KINDS)})"
_MISSIONS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("putnext", re.compile(rf"^put {_OBJ} next to {_OBJ}$")),
    ("seq_before", re.compile(rf"^pick up {_OBJ}, then go to {_OBJ}$")),
    ("seq_after", re.compile(rf"^go to {_OBJ} after you pick up {_OBJ}$")),
    ("goto", re.compile(rf"^go to {_OBJ}$")),
    ("pickup", re.compile(rf"^pick up {_OBJ}$")),
    ("open", re.compile(rf"^open {_OBJ}$")),
)
_SEEN = re.compile(r"^a (?:(?:open|closed|locked) )?(\w+) (ball|box|key|door) (\d.*)$")

Goal = tuple[str, str | None, str]  # (verb, color or None, object type)


# -- the templated reasoning ------------------------------------------------------------------------
def mission_goals(mission: str) -> tuple[Goal, Goal]:
    """The sub-goal before and after picking something up, from a ``MixedTrainLocal`` mission.

    ``go to X`` / ``pick up X``: the same goal twice; ``open the D door``: pick up the D key, then
    open the door; ``put X next to Y``: pick up X, then put it next to Y; the sequence task: pick up
    X, then go to Y.

    Raises:
        InvalidArgumentError: a mission outside the five BALROG tasks.
    """
    for kind, pattern in _MISSIONS:
        m = pattern.match(mission)
        if m is None:
            continue
        g = m.groups()
        if kind == "goto":
            return ("go to", g[0], g[1]), ("go to", g[0], g[1])
        if kind == "pickup":
            return ("pick up", g[0], g[1]), ("pick up", g[0], g[1])
        if kind == "open":
            return ("pick up", g[0], "key"), ("open", g[0], "door")
        if kind == "putnext":
            return ("pick up", g[0], g[1]), ("put it next to", g[2], g[3])
        if kind == "seq_before":
            return ("pick up", g[0], g[1]), ("go to", g[2], g[3])
        return ("pick up", g[2], g[3]), ("go to", g[0], g[1])  # "go to Y after you pick up X"
    raise InvalidArgumentError(f"not a BALROG BabyAI mission: {mission!r}")


def _distance(where: str) -> int:
    return sum(int(n) for n in re.findall(r"\d+", where))


def babyai_reasoning(mission: str, observation: str) -> str:
    """The one-line reasoning of a demonstration turn: the current sub-goal and where its object is.

    Example:
        >>> babyai_reasoning("pick up the green key", "a wall 2 steps left\\na green key 1 step right")
        'Next: pick up the green key. It is 1 step right.'
        >>> babyai_reasoning("open the blue door", "You carry a blue key\\na wall 1 step left")
        'Next: open the blue door. It is not in view.'
    """
    lines = observation.split("\n")
    before, after = mission_goals(mission)
    verb, color, kind = after if any(line.startswith("You carry ") for line in lines) else before
    seen = []
    for line in lines:
        m = _SEEN.match(line)
        if m and m.group(2) == kind and (color is None or m.group(1) == color):
            seen.append((_distance(m.group(3)), m.group(1), m.group(3)))
    if seen:
        _, seen_color, where = min(seen)
        return f"Next: {verb} the {seen_color} {kind}. It is {where}."
    name = f"{color} {kind}" if color else kind
    return f"Next: {verb} the {name}. It is not in view."


def demo_text(reasoning: str, action: str) -> str:
    """The assistant text of one turn in the ``reasoning`` format."""
    return f"<think>{reasoning}</think><action>{action}</action>"


# -- the expert teacher -----------------------------------------------------------------------------
class ExpertDemoWrapper(gym.Wrapper):
    """A BabyAI text env that also plays the expert teacher, with optional DART-style noise.

    :meth:`teacher_text` is the teacher for :func:`~compaction_gym.agents.run_episodes`: the bot's
    action (or, with probability ``noise``, another movement) with its templated reasoning. The
    bot is asked every turn, so it follows the episode and replans after a noisy action.
    ``info["demo_noise_turns"]`` lists the turns (0-based) that played noise.

    Args:
        env: a BabyAI text env (``gym.make("AttnMatch-BabyAI-v0", task=...)``).
        noise: probability that a turn plays a random action of ``noise_actions`` (not the bot's).
        noise_actions: the actions noise draws from.
        noise_seed: with the episode seed, seeds the noise stream (deterministic per episode).
        max_turns: truncate the episode after this many turns (``info["demo_cut"]`` is then True).
    """

    def __init__(
        self,
        env: gym.Env,
        *,
        noise: float = 0.0,
        noise_actions: Sequence[str] = NOISE_ACTIONS,
        noise_seed: int = 0,
        max_turns: int | None = None,
    ) -> None:
        super().__init__(env)
        if not 0.0 <= noise < 1.0:
            raise InvalidArgumentError(f"noise must be in [0, 1), got {noise}")
        if max_turns is not None and max_turns < 1:
            raise InvalidArgumentError(f"max_turns must be >= 1 (or None), got {max_turns}")
        self.max_turns = max_turns
        self.noise = float(noise)
        self.noise_actions = tuple(noise_actions)
        self.noise_seed = int(noise_seed)
        self._rng = np.random.default_rng(noise_seed)
        self._obs = ""
        self._mission = ""
        self._turn = 0
        self._pending = False
        self._noise_turns: list[int] = []

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        obs, info = self.env.reset(seed=seed, options=options)
        if seed is not None:
            self._rng = np.random.default_rng([self.noise_seed, seed])
        self._obs, self._mission = obs, info["mission"]
        self._turn, self._pending, self._noise_turns = 0, False, []
        return obs, info

    def teacher_text(self) -> str:
        """This turn's assistant text: templated reasoning, then the (possibly noisy) action."""
        from compaction_gym.envs.babyai.expert import expert_action

        action = expert_action(self.env)
        self._pending = self.noise > 0 and bool(self._rng.random() < self.noise)
        if self._pending:
            others = [a for a in self.noise_actions if a != action]
            action = others[int(self._rng.integers(len(others)))]
        return demo_text(babyai_reasoning(self._mission, self._obs), action)

    def step(self, action: str):
        obs, reward, terminated, truncated, info = self.env.step(action)
        if self._pending:
            self._noise_turns.append(self._turn)
        self._turn, self._pending, self._obs = self._turn + 1, False, obs
        info["demo_noise_turns"] = list(self._noise_turns)
        info["demo_cut"] = bool(
            self.max_turns is not None and self._turn >= self.max_turns and not (terminated or truncated)
        )
        return obs, reward, terminated, truncated or info["demo_cut"], info


def expert_teacher(env: gym.Env) -> str:
    """``run_episodes`` teacher: ``env.teacher_text()`` of an :class:`ExpertDemoWrapper`."""
    return env.teacher_text()


def expert_corpus(tasks: Sequence[str], seeds: Sequence[int], prompt: str = "reasoning") -> list[str]:
    """Texts of expert episodes as the agent frames them (instruction, user messages, outputs), for
    training a tokenizer before any model exists."""
    from compaction_gym.agents.prompts import get_prompt_format

    fmt = get_prompt_format(prompt)
    texts: list[str] = []
    for task in tasks:
        env = ExpertDemoWrapper(gym.make("AttnMatch-BabyAI-v0", task=task))
        for seed in seeds:
            obs, info = env.reset(seed=seed)
            texts.append(info["instruction"])
            done = False
            while not done:
                texts.append(fmt.user_message(obs))
                text = env.teacher_text()
                texts.append(text)
                obs, _, terminated, truncated, _ = env.step(text)
                done = terminated or truncated
        env.close()
    return texts


# -- trees for SFT ----------------------------------------------------------------------------------
def demo_sequence(traj: Any) -> tuple[list[int], list[int]]:
    """The whole session as one training sequence: targets on every turn's output except noise turns
    (the output includes the end-of-message token, so the model learns to stop)."""
    noise = set(traj.info.get("demo_noise_turns") or [])
    mask = [0] * len(traj.token_ids)
    for i, turn in enumerate(traj.turns):
        if i not in noise:
            c, d = turn.output_range
            mask[c:d] = [1] * (d - c)
    return list(traj.token_ids), mask


def merge_tree_files(inputs: Sequence[str | Path], output: str | Path, group_size: int = 1) -> int:
    """Concatenate tree-row files, regrouping their branches ``group_size`` per tree (in file order).

    Returns:
        The number of trees written.
    """
    from compaction_gym.trainers.tree.builders import tree_from_sequences
    from compaction_gym.trainers.tree.tree import Tree

    branches: list[tuple[list[int], list[int]]] = []
    for name in inputs:
        with Path(name).open() as fh:
            for line in fh:
                if line.strip():
                    tree = Tree.from_dict(json.loads(line))
                    for leaf in tree.leaves:
                        path = tree.root_path(leaf)
                        branches.append(
                            (
                                [t for n in path for t in tree.nodes[n].token_ids],
                                [m for n in path for m in tree.nodes[n].loss_mask],
                            )
                        )
    n = 0
    with Path(output).open("w") as fh:
        for i in range(0, len(branches), group_size):
            fh.write(json.dumps(tree_from_sequences(branches[i : i + group_size]).to_dict()) + "\n")
            n += 1
    return n


# -- command line -----------------------------------------------------------------------------------
@dataclass
class DemosScriptArguments:
    """Arguments of ``compaction-gym train demos`` (also the keys of its ``--config`` TOML file)."""

    model: str | None = field(
        default=None,
        metadata={"help": "model directory or registered name whose tokenizer/engine records the sessions"},
    )
    output_dir: str = field(default="runs/demos", metadata={"help": "where the demos are written"})
    tasks: list[str] = field(
        default_factory=lambda: ["goto", "pickup", "open", "putnext", "pick_up_seq_go_to"],
        metadata={"help": "BabyAI tasks (one or more: --tasks putnext open)"},
    )
    episodes_per_task: int = field(default=100, metadata={"help": "episodes per task"})
    seed: int = field(default=100_000, metadata={"help": "first train seed; task k uses a block of its own"})
    eval_seed_limit: int = field(
        default=10_000, metadata={"help": "seeds below this are reserved for evaluation"}
    )
    noise: float = field(default=0.0, metadata={"help": "probability of a random movement turn (masked)"})
    noise_seed: int = field(default=0, metadata={"help": "seeds the noise stream"})
    keep_failed: bool = field(default=False, metadata={"help": "also train on episodes that failed"})
    max_turns: int | None = field(
        default=None,
        metadata={"help": "cut every episode after this many turns and keep it (opening-turn demos)"},
    )
    prompt: str = field(default="reasoning", metadata={"help": "agent prompt format"})
    mode: str = field(default="attention_matching", metadata={"help": "compaction mode of the sessions"})
    max_kv_len: int | None = field(default=512, metadata={"help": "KV-budget trigger length"})
    compact_window: int | None = field(default=256, metadata={"help": "tokens compacted per event"})
    ratio: float = field(default=0.25, metadata={"help": "kept fraction of a compacted span"})
    batch: int = field(default=8, metadata={"help": "episodes recorded concurrently"})
    group_size: int = field(default=1, metadata={"help": "episodes merged into one tree (shared prefix)"})
    threads: int | None = field(default=None, metadata={"help": "torch CPU threads (per worker)"})
    workers: int = field(
        default=1, metadata={"help": "processes recording shards in parallel (same episodes for any count)"}
    )
    device: str | None = field(default=None, metadata={"help": "engine device (default: cuda if available)"})
    time_limit_s: float | None = field(
        default=None,
        metadata={
            "help": "stop starting new episodes after this many seconds (manifest records the seeds played)"
        },
    )
    corpus_episodes: int = field(
        default=40, metadata={"help": "with [init]: expert episodes per task for the tokenizer corpus"}
    )
    init: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "TOML only: build a fresh base model at --model first (BaseModelConfig fields)"},
    )

    def compaction(self) -> Any:
        """The recording sessions' :class:`~compaction_gym.engine.config.CompactionConfig`."""
        from compaction_gym.engine.config import CompactionConfig

        return CompactionConfig(
            mode=self.mode,
            max_kv_len=self.max_kv_len,
            compact_window=self.compact_window,
            compact_target_ratio=self.ratio,
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`DemosScriptArguments` field (``init`` is TOML-only) plus ``--config``."""
    add_dataclass_arguments(parser, DemosScriptArguments, skip=("init",))


def parse_script_arguments(args: argparse.Namespace) -> DemosScriptArguments:
    """Merge defaults < ``--config`` TOML < flags, and validate."""
    script = load_script_arguments(DemosScriptArguments, args)
    from compaction_gym.envs.registration import BABYAI_TASK_IDS

    bad = [t for t in script.tasks if t not in BABYAI_TASK_IDS]
    if bad:
        raise InvalidArgumentError(f"unknown tasks {bad}; valid: {list(BABYAI_TASK_IDS)}")
    if not script.model:
        raise InvalidArgumentError("--model is required (a flag or the config key 'model')")
    if min(script.episodes_per_task, script.batch, script.group_size, script.workers) < 1:
        raise InvalidArgumentError("--episodes-per-task, --batch, --group-size and --workers must be >= 1")
    if script.max_turns is not None and script.max_turns < 1:
        raise InvalidArgumentError(f"--max-turns must be >= 1, got {script.max_turns}")
    if script.seed < script.eval_seed_limit:
        raise InvalidArgumentError(
            f"--seed {script.seed} overlaps the evaluation seeds [0, {script.eval_seed_limit}); "
            f"use --seed >= {script.eval_seed_limit}"
        )
    return script


def register_train(subparsers: argparse._SubParsersAction) -> None:
    """Add ``demos`` to ``compaction-gym train``."""
    add_script_command(
        subparsers,
        "demos",
        help="record expert-bot BabyAI demonstrations through compacted sessions (SFT data)",
        doc=__doc__,
        add_arguments=add_arguments,
        run=run,
    )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``compaction-gym train demos``."""
    return run_script("compaction-gym train demos", args, parse_script_arguments, main)


def task_seeds(script: DemosScriptArguments) -> dict[str, list[int]]:
    """The train seeds of each task: disjoint blocks from ``script.seed`` upwards."""
    n = script.episodes_per_task
    return {task: [script.seed + k * n + i for i in range(n)] for k, task in enumerate(script.tasks)}


class DemoRecorder:
    """One process's engine, teacher-forced agents and expert envs (one set per task)."""

    def __init__(self, script: DemosScriptArguments, model: str) -> None:
        from compaction_gym.agents import CompactionAgent
        from compaction_gym.engine.config import SamplingParams
        from compaction_gym.servers.backend import LocalBackend

        self.script = script
        self.backend = LocalBackend.from_pretrained(model, max_slots=script.batch, device=script.device)
        self.compaction = script.compaction()
        sampling = SamplingParams(temperature=0.0, max_new_tokens=0)
        self.agents = [
            CompactionAgent(self.backend, compaction=self.compaction, sampling=sampling, prompt=script.prompt)
            for _ in range(script.batch)
        ]
        self._envs: dict[str, list[gym.Env]] = {}

    def play(self, task: str, seeds: Sequence[int], on_episode: Any = None) -> list[Any]:
        """Record the episodes of ``seeds`` (in seed order), ``batch`` at a time."""
        from compaction_gym.agents import run_episodes

        if task not in self._envs:
            self._envs[task] = [
                ExpertDemoWrapper(
                    gym.make("AttnMatch-BabyAI-v0", task=task, action_parsing="tag"),
                    noise=self.script.noise,
                    noise_seed=self.script.noise_seed,
                    max_turns=self.script.max_turns,
                )
                for _ in self.agents
            ]
        envs = self._envs[task]
        return run_episodes(
            envs, self.agents[: len(envs)], list(seeds), teacher=expert_teacher, on_episode=on_episode
        )

    def close(self) -> None:
        for envs in self._envs.values():
            for env in envs:
                env.close()
        for agent in self.agents:
            agent.close()


_WORKER_RECORDER: DemoRecorder | None = None


def _worker_init(script: DemosScriptArguments, model: str) -> None:
    import torch

    global _WORKER_RECORDER
    torch.set_num_threads(script.threads or 1)
    _WORKER_RECORDER = DemoRecorder(script, model)


def _worker_play(shard: tuple[str, list[int]], deadline: float | None) -> list[dict[str, Any]]:
    # plain dicts: trajectories may hold tensors, which multiprocessing would share through file
    # descriptors (thousands of episodes exhaust the descriptor limit)
    if deadline is not None and time.time() > deadline:
        return []
    assert _WORKER_RECORDER is not None
    return [t.to_dict() for t in _WORKER_RECORDER.play(*shard)]


def record_demos(script: DemosScriptArguments, model: str) -> dict[str, list[Any]]:
    """Every task's trajectories, in seed order; ``script.workers`` processes share the shards.

    Shards are ``4 * batch`` consecutive seeds of one task; with ``time_limit_s`` no shard starts
    after the deadline (the manifest records the seeds actually played). Episodes are deterministic
    per seed, so the token streams do not depend on ``workers``.
    """
    from tqdm.auto import tqdm

    seeds = task_seeds(script)
    size = 4 * script.batch
    shards = [(task, s[i : i + size]) for task, s in seeds.items() for i in range(0, len(s), size)]
    deadline = None if script.time_limit_s is None else time.time() + script.time_limit_s
    played: dict[str, list[Any]] = {task: [] for task in seeds}
    bar = tqdm(total=sum(len(s) for s in seeds.values()), desc="demos", unit="ep", file=sys.stderr)
    if script.workers <= 1:
        recorder = DemoRecorder(script, model)
        try:
            for task, shard in shards:
                if deadline is not None and time.time() > deadline:
                    break
                played[task] += recorder.play(task, shard, on_episode=lambda _i, _t: bar.update(1))
        finally:
            recorder.close()
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        from compaction_gym.agents import Trajectory

        with ProcessPoolExecutor(
            script.workers,
            mp_context=mp.get_context("spawn"),
            initializer=_worker_init,
            initargs=(script, model),
        ) as pool:
            futures = [pool.submit(_worker_play, shard, deadline) for shard in shards]
            for (task, _), future in zip(shards, futures):
                trajs = [Trajectory.from_dict(d) for d in future.result()]
                played[task] += trajs
                bar.update(len(trajs))
    bar.close()
    return {task: trajs for task, trajs in played.items() if trajs}


def main(script: DemosScriptArguments) -> dict[str, Any]:
    """Build the base model if asked, record the demos, write trajectories, trees and the manifest."""
    import torch

    from compaction_gym.agents import write_jsonl
    from compaction_gym.agents.evaluate import _git, _versions
    from compaction_gym.agents.models import resolve_model
    from compaction_gym.trainers.tree.builders import tree_from_sequences

    if script.threads:
        torch.set_num_threads(script.threads)
    out = Path(script.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if script.init and not (Path(script.model) / "config.json").exists():
        from compaction_gym.models.build import BaseModelConfig, build_base_model

        # the tokenizer corpus comes from seeds above every demo seed: train-side, never eval
        first = script.seed + len(script.tasks) * script.episodes_per_task
        corpus = expert_corpus(script.tasks, range(first, first + script.corpus_episodes), script.prompt)
        build_base_model(script.model, corpus, BaseModelConfig(**script.init))
        print(f"built base model at {script.model}", file=sys.stderr)
    resolved = resolve_model(script.model)
    t0 = time.perf_counter()
    by_task = record_demos(script, resolved)
    traj_path, trees_path = out / "trajectories.jsonl", out / "trees.jsonl"
    traj_path.write_text("")
    stats: dict[str, dict[str, Any]] = {}
    kept: list[Any] = []
    for task, trajs in by_task.items():
        write_jsonl(traj_path, trajs, append=True)
        ok = [t for t in trajs if t.success]
        cut = [t for t in trajs if t.info.get("demo_cut")]
        kept += trajs if script.keep_failed else [t for t in trajs if t.success or t.info.get("demo_cut")]
        stats[task] = {
            "episodes": len(trajs),
            "success_rate": len(ok) / len(trajs),
            "cut": len(cut),
            "turns_mean": float(np.mean([len(t.turns) for t in trajs])),
            "tokens_mean": float(np.mean([t.num_tokens for t in trajs])),
            "tokens_max": int(max(t.num_tokens for t in trajs)),
            "noise_turns": int(sum(len(t.info.get("demo_noise_turns", [])) for t in trajs)),
            "compaction_events_mean": float(np.mean([len(t.events) for t in trajs])),
            "peak_kv_max": int(max(t.peak_kv_len for t in trajs)),
        }

    n_trees = 0
    with trees_path.open("w") as fh:
        for i in range(0, len(kept), script.group_size):
            tree = tree_from_sequences([demo_sequence(t) for t in kept[i : i + script.group_size]])
            fh.write(json.dumps(tree.to_dict()) + "\n")
            n_trees += 1
    manifest = {
        "schema": DEMOS_SCHEMA,
        "args": dataclasses.asdict(script),
        "model": {"spec": script.model, "resolved": resolved},
        "seeds": {task: [t[0].seed, t[-1].seed, len(t)] for task, t in by_task.items()},
        "eval_seed_limit": script.eval_seed_limit,
        "tasks": stats,
        "episodes_kept": len(kept),
        "trees": n_trees,
        "target_tokens": int(sum(sum(demo_sequence(t)[1]) for t in kept)),
        "total_tokens": int(sum(t.num_tokens for t in kept)),
        "trees_sha256": hashlib.sha256(trees_path.read_bytes()).hexdigest(),
        "compaction": script.compaction().to_dict(),
        "wall_time_s": time.perf_counter() - t0,
        "git_revision": _git("rev-parse", "HEAD"),
        "versions": _versions(),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps({k: manifest[k] for k in ("episodes_kept", "trees", "target_tokens", "total_tokens")}))
    return manifest


def make_parser() -> argparse.ArgumentParser:
    """A standalone parser (``python -m compaction_gym.trainers.demos``)."""
    return script_parser("compaction-gym train demos", __doc__, add_arguments)


if __name__ == "__main__":
    sys.exit(run(make_parser().parse_args()))

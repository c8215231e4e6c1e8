"""Recording expert demonstrations (the ``compaction-gym demos`` command; see :mod:`compaction_gym.demos`)."""


from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from compaction_gym.demos.demos_config import DemosConfig
from compaction_gym.provenance import provenance
from compaction_gym.wrappers.expert_demos import ExpertDemoWrapper, expert_teacher

DEMOS_SCHEMA = "compaction-gym/demos-manifest/v1"


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
    from compaction_gym.trainers.tree_sft.builders import tree_from_sequences
    from compaction_gym.trainers.tree_sft.tree import Tree

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



def task_seeds(script: DemosConfig) -> dict[str, list[int]]:
    """The train seeds of each task: disjoint blocks from ``script.seed`` upwards."""
    n = script.episodes_per_task
    return {task: [script.seed + k * n + i for i in range(n)] for k, task in enumerate(script.tasks)}


class DemoRecorder:
    """One process's engine, teacher-forced agents and expert envs (one set per task)."""

    def __init__(self, script: DemosConfig, model: str) -> None:
        from compaction_gym.agents import CompactionAgent
        from compaction_gym.backends import LocalBackend
        from compaction_gym.engine.config import SamplingParams

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


def _worker_init(script: DemosConfig, model: str) -> None:
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


def record_demos(script: DemosConfig, model: str) -> dict[str, list[Any]]:
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


def main(script: DemosConfig) -> dict[str, Any]:
    """Build the base model if asked, record the demos, write trajectories, trees and the manifest."""
    import torch

    from compaction_gym.agents import write_jsonl
    from compaction_gym.models.registry import resolve_model
    from compaction_gym.trainers.tree_sft.builders import tree_from_sequences

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
        **provenance(),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps({k: manifest[k] for k in ("episodes_kept", "trees", "target_tokens", "total_tokens")}))
    return manifest

"""GRPO rollouts: lock-step vs continuous batching of the same episodes (issue 24 / 28).

Plays the same BabyAI episodes twice as :class:`~compaction_gym.trainers.rollouts.EnvRollouts`
(the GRPO trainer's rollout path) plays them at the settings of ``benchmarks/recipes/grpo_babyai_memory``:
babyai-tiny, the ``reasoning`` prompt, temperature 1, up to 64 sampled tokens a turn, KV-budget
Attention Matching (``max_kv_len`` 384, window 192, ratio 0.25), groups of episodes that share an
env seed and differ in their sampling seed, all played at once on one engine:

* **lock-step**: one ``step_batch`` per turn across the episodes (every turn waits for the
  longest reply in the batch);
* **continuous**: each episode's next turn is submitted as soon as its env has stepped, and the
  engine advances everything in flight one decode round (``--round-steps`` tokens) at a time;
* **continuous, merged**: the same, with the submitted inputs fed in the next round's forward
  beside the other episodes' decode step (``run_episodes(..., merge_prefill=True)``).

Printed per schedule: model forwards (every batched forward of the model: prefills, decode steps,
budget messages; on the fast path a decode chunk counts its steps), of them feeds (forwards outside
decode chunks), decode chunks, wall time, process CPU time (on a shared CPU box the comparable
one), and the ratios lock-step / schedule. The trajectories are compared with lock-step's: episodes
whose token ids differ, and the largest log-prob difference before the first differing token
(float32 rounds differently in batches of other sizes; at T = 1 a draw that lands within ~1e-5 of
a token boundary then picks another token and the episode goes its own way; ``--control``
measures the same between lock-step in one batch and in two halves).

Usage:
    python benchmarks/bench_rollouts.py --episodes 8 --group 4 --control       # CPU
    python benchmarks/bench_rollouts.py --episodes 32 --group 8 --device cuda  # the recipe's step
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

#: the recipe's rollout settings (benchmarks/recipes/grpo_babyai_memory/recipe.toml)
COMPACTION = {
    "mode": "attention_matching",
    "max_kv_len": 384,
    "compact_window": 192,
    "compact_target_ratio": 0.25,
}


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="babyai-tiny")
    p.add_argument("--tasks", default="putnext,pick_up_seq_go_to", help="BabyAI tasks, comma-separated")
    p.add_argument("--episodes", type=int, default=8, help="episodes played at once (groups cycle the tasks)")
    p.add_argument("--group", type=int, default=4, help="episodes per env seed (GRPO num_generations)")
    p.add_argument("--seed-start", type=int, default=500000, help="first env seed (the recipe's train seeds)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--mode", default="attention_matching", help="compaction mode (the recipe: attention_matching)"
    )
    p.add_argument("--round-steps", type=int, default=1, help="decode steps per continuous round")
    p.add_argument("--device", default="cpu")
    p.add_argument("--fast", action="store_true", help="the engine's CUDA fast path")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    p.add_argument(
        "--control", action="store_true", help="also lock-step in two half batches (float32 rounding alone)"
    )
    return p


class ForwardCounter:
    """Counts the runner's forwards: decode steps (inside decode chunks; on the fast path a chunk's
    graph replays) and feeds (prefills of inputs and budget messages, outside them)."""

    def __init__(self, runner: Any, fast: bool) -> None:
        self.decode = self.feeds = self.chunks = 0
        self._inside = False
        forward, decode_chunk = runner.forward, runner.decode_chunk

        def counted_forward(*args: Any, **kwargs: Any) -> Any:
            if self._inside:
                self.decode += 1
            else:
                self.feeds += 1
            return forward(*args, **kwargs)

        def counted_chunk(rows: Any, steps: int) -> Any:
            self.chunks += 1
            self._inside = True
            try:
                out = decode_chunk(rows, steps)
            finally:
                self._inside = False
            if fast:  # graph replays: the chunk's longest row
                self.decode += max(len(tokens) for tokens, _ in out)
            return out

        runner.forward, runner.decode_chunk = counted_forward, counted_chunk

    @property
    def forwards(self) -> int:
        return self.decode + self.feeds

    def reset(self) -> None:
        self.decode = self.feeds = self.chunks = 0


def play(
    rollouts: Any, specs: list, counter: ForwardCounter, continuous: bool, round_steps: int, merge: bool
) -> tuple:
    """The specs played as ``EnvRollouts.run`` plays them (one chunk), with this schedule."""
    from compaction_gym.agents import CompactionAgent, run_episodes

    envs = [rollouts.envs[s.env]() for s in specs]
    agents = [
        CompactionAgent(
            rollouts.backend, rollouts.tokenizer, compaction=rollouts.compaction,
            sampling=rollouts.sampling.replace(seed=s.sampling_seed), prompt=rollouts.prompt,
        )
        for s in specs
    ]  # fmt: skip
    counter.reset()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    with rollouts.generating():
        trajs = run_episodes(
            envs,
            agents,
            [s.seed for s in specs],
            continuous=continuous,
            round_steps=round_steps,
            merge_prefill=merge,
        )
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    for env in envs:
        env.close()
    return trajs, wall, counter.forwards, counter.chunks, counter.feeds, cpu


def compare(ref: list, got: list) -> tuple[int, float]:
    """Episodes whose token ids differ, and the largest log-prob difference before each first differing token."""
    differ, lp = 0, 0.0
    for x, y in zip(ref, got):
        n = min(len(x.token_ids), len(y.token_ids))
        first = next((k for k in range(n) if x.token_ids[k] != y.token_ids[k]), n)
        differ += x.token_ids != y.token_ids
        lp = max([lp, *(abs(p - q) for p, q in zip(x.logprobs[:first], y.logprobs[:first]))])
    return differ, lp


def main(argv: list[str] | None = None) -> int:
    a = make_parser().parse_args(argv)
    torch.set_num_threads(a.threads)
    from compaction_gym.engine import CompactionConfig, SamplingParams
    from compaction_gym.envs.registration import BABYAI_TASK_IDS
    from compaction_gym.models.registry import load_model
    from compaction_gym.trainers.rollouts import EnvRollouts, group_specs

    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    model, tokenizer = load_model(a.model, dtype=torch.float32, device=torch.device(a.device))
    compaction = CompactionConfig.from_dict({**COMPACTION, "mode": a.mode})
    sampling = SamplingParams(temperature=a.temperature, top_k=0, top_p=1.0, max_new_tokens=a.max_new_tokens)
    n_groups = -(-a.episodes // a.group)
    specs = group_specs(
        [(tasks[i % len(tasks)], a.seed_start + i) for i in range(n_groups)], a.group, base_seed=24
    )
    specs = specs[: a.episodes]
    rollouts = EnvRollouts(
        model, tokenizer, {t: BABYAI_TASK_IDS[t] for t in tasks}, compaction=compaction, sampling=sampling,
        prompt="reasoning", max_slots=len(specs), capacity=4096, fast=a.fast,
    )  # fmt: skip
    counter = ForwardCounter(rollouts.engine.runner, a.fast)
    print(
        f"{a.model} on {a.device}{' (fast path)' if a.fast else ''}, {torch.get_num_threads()} thread(s); "
        f"{len(specs)} episodes ({', '.join(tasks)}; groups of {a.group}), T={a.temperature}, "
        f"max_new_tokens={a.max_new_tokens}, {a.mode}; continuous rounds of {a.round_steps} step(s)"
    )
    runs = {
        "lock-step": play(rollouts, specs, counter, False, a.round_steps, False),
        "continuous": play(rollouts, specs, counter, True, a.round_steps, False),
        "merged": play(rollouts, specs, counter, True, a.round_steps, True),
    }
    if a.control:  # lock-step in two halves: how much float32 batch rounding alone moves the episodes
        half = len(specs) // 2
        x, y = (play(rollouts, part, counter, False, 1, False) for part in (specs[:half], specs[half:]))
        runs["lock-step/2"] = tuple(u + v for u, v in zip(x, y))
    lock = runs["lock-step"]
    trajs = lock[0]
    print(
        f"per episode: {sum(len(t.turns) for t in trajs) / len(trajs):.1f} turns, "
        f"{sum(t.num_generated for t in trajs) / len(trajs):.0f} sampled tokens, "
        f"{sum(len(t.events) for t in trajs) / len(trajs):.1f} compaction events; "
        f"longest episode {max(len(t.turns) for t in trajs)} turns"
    )
    print(
        f"{'schedule':<12} {'forwards':>9} {'of them feeds':>14} {'decode chunks':>14} {'wall s':>8} {'cpu s':>8} "
        f"{'fwd ratio':>10} {'wall ratio':>11} {'cpu ratio':>10}  trajectories vs lock-step"
    )
    for name, (got, wall, forwards, chunks, feeds, cpu) in runs.items():
        differ, lp = compare(lock[0], got)
        print(
            f"{name:<12} {forwards:>9} {feeds:>14} {chunks:>14} {wall:>8.2f} {cpu:>8.2f} "
            f"{lock[2] / max(1, forwards):>9.2f}x {lock[1] / max(1e-9, wall):>10.2f}x {lock[5] / max(1e-9, cpu):>9.2f}x  "
            f"{differ} of {len(got)} differ, max |d log p| before {lp:.1e}"
        )
    rollouts.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Tutorial 1: a compacted agent in ``gym.make("AttnMatch-BabyAI-v0")``, comparing compaction modes.

The bundled ``babyai-tiny`` agent plays the same BabyAI episodes several times: once with the full
KV cache, then with its cache capped at ``--max-kv-len`` rows and compacted by Attention Matching
(with and without the β bias), markovian deletion and StreamingLLM. Every mode sees the same env
seeds, so the rows pair up episode by episode.

Run it (CPU, about 20 s)::

    python docs/tutorials/t01_gym_modes.py
    python docs/tutorials/t01_gym_modes.py --task pick_up_seq_go_to --episodes 8 --max-kv-len 384
"""

from __future__ import annotations

import argparse
from typing import Any

import gymnasium as gym

import compaction_gym  # noqa: F401  (registers the AttnMatch-* env ids)
from compaction_gym.agents import CompactionAgent, run_episodes
from compaction_gym.backends import LocalBackend
from compaction_gym.engine import CompactionConfig, SamplingParams

# name -> the CompactionConfig fields of that mode (the budget is added below)
MODES: dict[str, dict[str, Any]] = {
    "full KV": {"mode": "none"},
    "attention matching + beta": {"mode": "attention_matching", "compute_beta": True},
    "attention matching": {"mode": "attention_matching", "compute_beta": False},
    "markovian": {"mode": "markovian"},
    "streaming": {"mode": "streaming"},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="open", help="a BabyAI task (goto, pickup, open, putnext, pick_up_seq_go_to)")
    parser.add_argument("--episodes", type=int, default=3, help="episodes per mode (env seeds 0..N-1)")
    parser.add_argument("--max-kv-len", type=int, default=512, help="the KV budget that triggers compaction")
    parser.add_argument("--modes", nargs="+", default=list(MODES)[:4], choices=list(MODES))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Play the episodes in every mode; return ``{mode: {success, turns, tokens, peak_kv, events,
    trajectories, config}}``."""
    args = parse_args(argv)
    # One embedded engine serves every episode; each episode holds one session (one KV slot).
    backend = LocalBackend.from_pretrained("babyai-tiny", max_slots=args.episodes)
    results: dict[str, dict[str, Any]] = {}
    for name in args.modes:
        fields = dict(MODES[name])
        if fields["mode"] != "none":
            # Compact the oldest `compact_window` rows after the protected prompt to a quarter of
            # their length whenever the cache reaches max_kv_len rows.
            fields.update(max_kv_len=args.max_kv_len, compact_window=args.max_kv_len // 2, compact_target_ratio=0.25)
        compaction = CompactionConfig(**fields)
        # babyai-tiny was trained on the "reasoning" format: <think>...</think><action>...</action>,
        # so the env parses the action from the tag.
        envs = [gym.make("AttnMatch-BabyAI-v0", task=args.task, action_parsing="tag") for _ in range(args.episodes)]
        agents = [
            CompactionAgent(
                backend,
                compaction=compaction,
                sampling=SamplingParams(temperature=0.0, max_new_tokens=64),
                prompt="reasoning",
            )
            for _ in range(args.episodes)
        ]
        # One step_batch per turn over all episodes in flight.
        trajectories = run_episodes(envs, agents, seeds=list(range(args.episodes)))
        n = len(trajectories)
        results[name] = {
            "success": sum(t.success for t in trajectories) / n,
            "turns": sum(len(t.turns) for t in trajectories) / n,
            "tokens": sum(t.num_tokens for t in trajectories) / n,
            "peak_kv": max(t.peak_kv_len for t in trajectories),
            "events": sum(len(t.events) for t in trajectories) / n,
            "trajectories": trajectories,
            "config": compaction,
        }
        for env in envs:
            env.close()
    print(f"task {args.task}, {args.episodes} episodes per mode, budget {args.max_kv_len} KV rows")
    print(f"{'mode':28} {'success':>8} {'turns':>6} {'tokens':>7} {'peak KV':>8} {'events':>7}")
    for name, r in results.items():
        print(
            f"{name:28} {r['success']:8.0%} {r['turns']:6.1f} {r['tokens']:7.0f} {r['peak_kv']:8d} {r['events']:7.1f}"
        )
    return results


if __name__ == "__main__":
    main()

"""Tutorial 3: GRPO with compaction replay, from your own script.

Each GRPO sample is a whole BabyAI episode played by the policy itself, its KV cache compacted by
Attention Matching whenever it reaches ``max_kv_len`` rows. The loss needs the log-probabilities
the policy gave its own samples under that *compacted* cache, so the trainer replays every
episode's compaction events on its own K/V (docs/grpo.md, "Replay").

The script shows the three places you plug in:

* a reward function of your own (it receives each episode's ``trajectory``);
* a subclass of :class:`~compaction_gym.trainers.CompactionGRPOTrainer` (itself a subclass of
  TRL's ``GRPOTrainer``), here to keep the replay mismatch of every step;
* the config: env, compaction, GRPO group size, TRL's usual training arguments.

Run it (CPU, the bundled babyai-tiny, about 30 s)::

    python docs/tutorials/t03_grpo.py
    python docs/tutorials/t03_grpo.py --max-steps 50 --episode-steps 32   # a real run (GPU)
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import torch

from compaction_gym import models
from compaction_gym.trainers import CompactionGRPOConfig, CompactionGRPOTrainer, env_reward


def concise(completions: list[Any], trajectory: list[Any], **kwargs: Any) -> list[float]:
    """A custom reward: -0.001 per generated token (shorter thoughts, same actions)."""
    return [-0.001 * traj.num_generated for traj in trajectory]


class MismatchTrackingTrainer(CompactionGRPOTrainer):
    """A user subclass: remember every logged step's replay mismatch and rollout statistics."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[dict[str, float]] = []

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        super().log(logs, *args, **kwargs)  # GRPOTrainer adds its rollout/replay metrics here
        entry = self.state.log_history[-1] if self.state.log_history else {}
        if "reward" in entry:
            self.steps.append(dict(entry))


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    """Train for ``--max-steps`` steps; return the logged entries of each step."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--episode-steps", type=int, default=6, help="env steps per episode")
    parser.add_argument("--max-kv-len", type=int, default=448)
    parser.add_argument("--output-dir", default=None, help="default: a temporary folder")
    args = parser.parse_args(argv)

    model, tokenizer = models.load("babyai-tiny")  # 4.9 M parameters, float32 on the CPU
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as tmp:
        config = CompactionGRPOConfig(
            output_dir=args.output_dir or tmp,
            env_id="AttnMatch-BabyAI-GoTo-v0",
            env_kwargs={"max_episode_steps": args.episode_steps},
            prompt_format="reasoning",  # babyai-tiny's format: <think>...</think><action>...</action>
            max_turn_tokens=64,
            compaction={  # the sessions' CompactionConfig
                "mode": "attention_matching",
                "max_kv_len": args.max_kv_len,
                "compact_window": 128,
                "compact_target_ratio": 0.25,
                "compute_beta": True,
            },
            grad_through_compaction=True,  # gradients flow through the compacted blocks (C1/C2)
            num_generations=4,  # episodes per env seed: one GRPO group
            per_device_train_batch_size=4,
            gradient_accumulation_steps=1,
            learning_rate=1e-5,
            temperature=1.5,  # babyai-tiny is confident: sample wider for different episodes
            top_k=0,  # replay scores the full softmax: keep the sampler's support untruncated
            top_p=1.0,
            beta=0.0,  # no KL to a reference model
            max_steps=args.max_steps,
            bf16=False,  # float32 end to end: the replay matches the sampler to ~1e-6
            use_cpu=not cuda,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
        )
        trainer = MismatchTrackingTrainer(
            model, config, reward_funcs=[env_reward, concise], processing_class=tokenizer
        )
        trainer.train()
    for s in trainer.steps:
        print(
            f"step {s['step']}: reward {s['reward']:+.3f} (std {s['reward_std']:.3f}), "
            f"success {s['rollout/success']:.2f}, events/episode {s['rollout/compaction_events']:.1f}, "
            f"replay max |Δ logprob| {s.get('replay/max_abs_logprob_diff', float('nan')):.1e}"
        )
    return trainer.steps


if __name__ == "__main__":
    main()

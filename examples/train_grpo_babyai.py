"""Train an LLM agent on BabyAI with GRPO, its KV cache compacted by Attention Matching.

Each GRPO sample is a whole episode of ``AttnMatch-BabyAI-GoTo-v0``: the agent's session lives in
one persistent KV cache that is compacted whenever it reaches ``max_kv_len`` (so the policy acts
from a compacted memory), rollouts run on the embedded engine with the policy's own weights, and
every log-prob the loss needs is computed by *replaying* the episode's compaction events, so the
importance ratios compare the right distributions. The reward is the env's episode reward plus a
small bonus for answering with a valid action (a custom reward function: they receive each
episode's ``trajectory``).

Run (CPU, the tiny random model, a minute)::

    python examples/train_grpo_babyai.py --model tiny-random --max-steps 3

and with a real model on a GPU::

    python examples/train_grpo_babyai.py --model Qwen/Qwen3-0.6B --max-steps 200 --lora-r 16

Watch ``tensorboard --logdir runs/grpo-babyai``: ``train/reward``, ``train/rollout/success``,
``train/rollout/compaction_events`` and ``train/replay/max_abs_logprob_diff`` (the gap between
the sampler's and the replayed log-probs: ~1e-6 in float32, bf16 rounding on a GPU).
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from compaction_gym.models.registry import resolve_model
from compaction_gym.trainers import CompactionGRPOConfig, CompactionGRPOTrainer, env_reward


def valid_action(completions, trajectory, **kwargs) -> list[float]:
    """0.1 × the fraction of turns whose output held a valid BabyAI action."""
    return [
        0.1 * sum(not t.invalid_action for t in traj.turns) / max(1, len(traj.turns)) for traj in trajectory
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-random", help="path, hub id or 'tiny-random'")
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--lora-r", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    parser.add_argument("--output-dir", default="runs/grpo-babyai")
    args = parser.parse_args()

    path = resolve_model(args.model)
    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if cuda else torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)

    config = CompactionGRPOConfig(
        output_dir=args.output_dir,
        env_id="AttnMatch-BabyAI-GoTo-v0",
        env_kwargs={"max_episode_steps": 32 if cuda else 3},
        prompt_format="balrog",  # the action is the whole answer, as in BALROG
        max_turn_tokens=16 if cuda else 6,
        compaction={  # the session's CompactionConfig
            "mode": "attention_matching",
            "max_kv_len": 2048 if cuda else 448,
            "compact_window": 1024 if cuda else 96,
            "compact_target_ratio": 0.25 if cuda else 0.125,
            "compute_beta": True,
        },
        grad_through_compaction=True,  # gradients flow through C1/C2 (the default)
        num_generations=8 if cuda else 2,  # episodes per env seed (one GRPO group)
        per_device_train_batch_size=8 if cuda else 2,
        gradient_accumulation_steps=2,
        learning_rate=1e-5 if args.lora_r == 0 else 1e-4,
        beta=0.0,  # no KL to a reference model
        max_steps=args.max_steps,
        bf16=cuda,
        use_cpu=not cuda,
        engine_fast=cuda and args.lora_r == 0,  # fused CUDA rollouts (not with PEFT)
        report_to="tensorboard",
        save_strategy="no",
    )
    peft_config = None
    if args.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules="all-linear")
    trainer = CompactionGRPOTrainer(
        model,
        config,
        reward_funcs=[env_reward, valid_action],
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    trainer.train()
    trainer.save_model(args.output_dir)
    for entry in trainer.state.log_history:
        if "reward" in entry:
            print(
                f"step {entry['step']}: reward {entry['reward']:.3f}, success {entry['rollout/success']:.2f}, "
                f"events/episode {entry['rollout/compaction_events']:.1f}, "
                f"replay max |Δ| {entry.get('replay/max_abs_logprob_diff', float('nan')):.1e}"
            )


if __name__ == "__main__":
    main()

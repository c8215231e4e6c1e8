"""Tutorial 5: top-K generalized Jensen–Shannon self-distillation.

The student is the policy acting in its own (compacted) BabyAI episodes; the teacher is the same
policy reading the same tokens after a *reprompt* that carries a successful sibling episode's
solution or the env's feedback. The loss is the top-K GJS divergence between the two per token
(docs/gjs.md): no reward model, a dense per-token signal.

1. the divergence itself on two small distributions, against its definition;
2. ``GJSDistillationTrainer`` (built on the GRPO trainer: same rollouts, same replay) for a few steps
   on ``babyai-tiny``.

Run it (CPU, about 30 s)::

    python docs/tutorials/t05_gjs.py
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import torch

from compaction_gym import models
from compaction_gym.trainers import (
    GJSDistillationConfig,
    GJSDistillationTrainer,
    GJSLossConfig,
    divergence_mode,
    topk_gjs,
)


def gjs_by_hand(t: torch.Tensor, s: torch.Tensor, alpha: float) -> float:
    """GJS_α(T, S) = α·KL(T‖M) + (1−α)·KL(S‖M), M = α·T + (1−α)·S, over the whole support (float64)."""
    t, s = t.double(), s.double()
    m = alpha * t + (1 - alpha) * s
    return float(alpha * (t * (t / m).log()).sum() + (1 - alpha) * (s * (s / m).log()).sum())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Compare the loss with its definition, then distill; return both and the logged steps."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--episode-steps", type=int, default=6)
    args = parser.parse_args(argv)

    # 1. The divergence. With k = vocabulary size and support="union" it is the full GJS.
    torch.manual_seed(0)
    teacher = torch.randn(8).softmax(-1)
    student = torch.randn(8).softmax(-1)
    full = GJSLossConfig(k=8, alpha=0.5, support="union", tail=False)
    ours = topk_gjs(student.log().unsqueeze(0), teacher.log().unsqueeze(0), **full.to_dict()).item()
    print(f"GJS(alpha=0.5): topk_gjs {ours:.8f}, by hand {gjs_by_hand(teacher, student, 0.5):.8f}")
    # The trainer's default: the teacher's top 20 tokens, the rest lumped into one tail bucket.
    cfg = GJSLossConfig(k=20, alpha=0.5, support="teacher", tail=True)
    print("logged as", f"distill/{divergence_mode(cfg)}")

    # 2. Self-distillation on BabyAI.
    model, tokenizer = models.load("babyai-tiny")
    with tempfile.TemporaryDirectory() as out:
        config = GJSDistillationConfig(
            output_dir=out,
            env_id="AttnMatch-BabyAI-GoTo-v0",
            env_kwargs={"max_episode_steps": args.episode_steps},
            prompt_format="reasoning",
            max_turn_tokens=64,
            compaction={"mode": "attention_matching", "max_kv_len": 448, "compact_window": 128, "compute_beta": True},
            num_generations=4,  # a group: the teacher of a failed episode reads a successful sibling
            per_device_train_batch_size=4,
            temperature=1.5,
            top_k=0,
            top_p=1.0,
            gjs_k=cfg.k, gjs_alpha=cfg.alpha, gjs_support=cfg.support,
            distillation_coef=1.0, policy_loss_coef=0.0,  # pure distillation (add GRPO with > 0)
            learning_rate=1e-5, max_steps=args.max_steps, bf16=False,
            use_cpu=not torch.cuda.is_available(), report_to="none", save_strategy="no",
        )
        trainer = GJSDistillationTrainer(model, config, processing_class=tokenizer)
        trainer.train()
    steps = [e for e in trainer.state.log_history if "distill/loss" in e]
    key = f"distill/{trainer.divergence_mode}"
    for e in steps:
        print(f"step {e['step']}: {key} {e[key]:.4f}, teacher had a context for "
              f"{e['distill/context_fraction']:.0%} of episodes, success {e['rollout/success']:.2f}")
    return {"topk_gjs": ours, "by_hand": gjs_by_hand(teacher, student, 0.5), "steps": steps, "key": key}


if __name__ == "__main__":
    main()

"""GRPO through compacted sessions learns: a reward the random tiny model earns half of the time
rises over a short run, for gradients through C1/C2 and detached alike, with replay exact on
every step (issue 24's smoke evidence that the trainer's gradient has the right sign)."""

from __future__ import annotations

import pytest
import torch
from replay_helpers import even_tokens
from transformers import AutoModelForCausalLM, AutoTokenizer

#: several Attention Matching events with β per episode: one after every turn but the last one
COMPACTION = {"mode": "attention_matching", "n_protect_turns": 1, "compute_beta": True, "n_probe_queries": 32}
STEPS = 12


def even_mass(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """Mean next-token probability of even token ids over every position of ``ids`` (what the
    reward pays for, measured on fixed text rather than on the run's own samples)."""
    with torch.no_grad():
        probs = torch.softmax(model(ids).logits.double(), dim=-1)
    return probs[..., 0::2].sum(-1).mean().item()


@pytest.mark.parametrize("grad_through_compaction", [True, False])
def test_grpo_through_compaction_raises_the_reward(tiny_model_path, tmp_path, grad_through_compaction):
    from compaction_gym.trainers.grpo.grpo_trainer import CompactionGRPOConfig, CompactionGRPOTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    probe = torch.randint(3, len(tokenizer), (4, 48), generator=torch.Generator().manual_seed(1))
    before = even_mass(model, probe)
    args = CompactionGRPOConfig(
        str(tmp_path / "run"),
        env_id="AttnMatch-BabyAI-v0",
        env_kwargs={"max_episode_steps": 3},
        compaction=COMPACTION,
        grad_through_compaction=grad_through_compaction,
        max_turn_tokens=6,
        temperature=1.0,
        num_generations=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        beta=0.0,
        num_episodes=8 * STEPS,
        bf16=False,
        use_cpu=True,
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        seed=0,
    )
    trainer = CompactionGRPOTrainer(model, args, reward_funcs=[even_tokens], processing_class=tokenizer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == STEPS
    rewards = [h["reward"] for h in logs]
    assert min(h["rollout/compaction_events"] for h in logs) >= 1  # every batch sampled from compacted caches
    assert max(h["replay/max_abs_logprob_diff"] for h in logs) < 1e-4
    # the run's own episodes earn more at the end than at the start (a random model: ~0.5)
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.1, rewards  # measured 0.47 -> 0.98 and 0.52 -> 0.99 over 12 steps
    # and the policy itself moved toward what the reward pays for, on text it never sampled
    # (measured 0.503 -> 0.560 through C1/C2, 0.667 detached)
    assert even_mass(model, probe) > before + 0.03

"""CompactionGRPOTrainer on AttnMatch-BabyAI-v0 with the tiny model: rollouts, replayed log-probs,
TensorBoard logs, LoRA + reference model through the CLI, and config validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from replay_helpers import even_tokens
from transformers import AutoModelForCausalLM, AutoTokenizer

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.replay_attention import REPLAY_ATTENTION

ENV_KWARGS = {"max_episode_steps": 3}
#: Turn-based β compaction: an event after turns 2 and 3, so turn 3 is sampled from a compacted cache.
COMPACTION = {"mode": "attention_matching", "n_protect_turns": 1, "compute_beta": True, "n_probe_queries": 32}


def tensorboard_scalars(root: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(root.rglob("events.out.tfevents*"))
    assert files, f"no TensorBoard event file under {root}"
    acc = EventAccumulator(str(files[-1].parent))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_three_step_grpo_run(tiny_model_path, tmp_path):
    from compaction_gym.trainers.grpo.grpo_trainer import (
        CompactionGRPOConfig,
        CompactionGRPOTrainer,
        env_reward,
    )

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = CompactionGRPOConfig(
        str(tmp_path / "run"),
        env_id="AttnMatch-BabyAI-v0",
        env_kwargs=ENV_KWARGS,
        compaction=COMPACTION,
        max_turn_tokens=6,
        num_generations=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=3,
        learning_rate=1e-3,
        num_episodes=16,
        bf16=False,
        use_cpu=True,
        save_strategy="no",
        report_to="tensorboard",
    )
    trainer = CompactionGRPOTrainer(
        model,
        args,
        reward_funcs=[env_reward, even_tokens],
        processing_class=AutoTokenizer.from_pretrained(tiny_model_path),
    )
    assert trainer.rollouts.engine.model is trainer.model  # the engine runs the policy itself: no copy
    trainer.train()
    assert trainer.state.global_step == 3
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed  # a reward that varies inside groups moved the weights
    assert model.config._attn_implementation == REPLAY_ATTENTION and trainer.rollouts.engine.model.training

    scalars = tensorboard_scalars(tmp_path / "run")
    diff = scalars["train/replay/max_abs_logprob_diff"]
    assert len(diff) == 3 and max(diff) < 1e-4  # replay reproduces the sampler on every step
    assert max(scalars["train/replay/mean_kl"]) < 1e-8
    assert min(scalars["train/rollout/compaction_events"]) >= 1
    assert scalars["train/rollout/turns"] == [3.0, 3.0, 3.0]
    # per-event metrics, per rollout batch: the last step's equal its episodes' events
    events = [e for t in trainer._rollout_trajectories for e in t.events]
    assert scalars["train/compaction/kv_len_before"][-1] == pytest.approx(
        sum(e.kv_len_before for e in events) / len(events), rel=1e-6
    )
    assert scalars["train/compaction/kv_len_after"][-1] == pytest.approx(
        sum(e.kv_len_after for e in events) / len(events), rel=1e-6
    )
    assert all(0 < f < 1 for f in scalars["train/compaction/kept_fraction"])
    assert len(scalars["train/compaction/event_time_s"]) == 3
    assert all(torch.isfinite(torch.tensor(scalars["train/loss"])))
    assert "train/rewards/even_tokens/mean" in scalars and "train/rewards/env_reward/mean" in scalars


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "cispo", "sapo", "vespo", "luspo"])
def test_every_trl_loss_type_runs(tiny_model_path, tmp_path, loss_type):
    from compaction_gym.trainers import CompactionGRPOConfig, CompactionGRPOTrainer

    args = CompactionGRPOConfig(
        str(tmp_path),
        env_id="AttnMatch-BabyAI-GoTo-v0",
        env_kwargs={"max_episode_steps": 2},
        compaction={"mode": "markovian", "n_protect_turns": 0},
        max_turn_tokens=4,
        num_generations=2,
        per_device_train_batch_size=2,
        max_steps=1,
        loss_type=loss_type,
        num_episodes=2,
        bf16=False,
        use_cpu=True,
        save_strategy="no",
        report_to="none",
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    trainer = CompactionGRPOTrainer(
        model, args, reward_funcs=even_tokens, processing_class=AutoTokenizer.from_pretrained(tiny_model_path)
    )
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    assert torch.isfinite(torch.tensor(log["loss"])) and log["replay/max_abs_logprob_diff"] < 1e-4


def test_grpo_cli_lora_reference_and_old_logprobs(tiny_model_path, tmp_path, capsys):
    """``compaction-gym train grpo`` from a TOML file: LoRA, a KL term against the reference (the
    adapter disabled), and old log-probs computed at generation time (steps_per_generation = 2 with
    gradient_accumulation_steps = 1), all through replay."""
    from compaction_gym.cli import main

    out = tmp_path / "lora"
    config = tmp_path / "grpo.toml"
    config.write_text(
        f'model = "{tiny_model_path}"\nenv = "AttnMatch-BabyAI-GoTo-v0"\nenv_max_steps = 3\nmax_turn_tokens = 6\n'
        "num_generations = 2\nper_device_train_batch_size = 2\nlora_r = 4\nbeta = 0.1\nlearning_rate = 1e-3\n"
        f'output_dir = "{out}"\nreport_to = "none"\n'
        "[compaction]\n"
        'mode = "attention_matching"\nmax_kv_len = 448\ncompact_window = 96\ncompact_target_ratio = 0.125\n'
        "compute_beta = true\nn_probe_queries = 32\n"
        "[training]\nsteps_per_generation = 2\nnum_episodes = 8\n"
    )
    assert main(["train", "grpo", "--config", str(config), "--max-steps", "2"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 2
    assert summary["replay/max_abs_logprob_diff"] < 1e-4
    assert (out / "adapter_config.json").exists()


def test_config_validation(tmp_path):
    from compaction_gym.trainers.grpo.grpo_config import CompactionGRPOConfig

    def make(**kwargs):
        return CompactionGRPOConfig(str(tmp_path), bf16=False, use_cpu=True, **kwargs)

    args = make(compaction='{"mode": "markovian", "n_protect_turns": 0}', max_turn_tokens=5, top_k=7)
    assert args.compaction_config.mode == "markovian" and args.compaction_config.turn_based
    assert args.sampling_params.max_new_tokens == 5 and args.sampling_params.top_k == 7
    assert args.report_to == ["tensorboard"] and args.disable_dropout and args.grad_through_compaction
    with pytest.raises(InvalidArgumentError, match="prompt_format must be one of"):
        make(prompt_format="chatty")
    with pytest.raises(InvalidArgumentError, match="unknown CompactionConfig field"):
        make(compaction={"mode": "attention_matching", "max_kv": 5})
    with pytest.raises(InvalidArgumentError, match="use_reentrant=False"):
        make(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(InvalidArgumentError, match="max_turn_tokens must be >= 1"):
        make(max_turn_tokens=0)
    assert args.engine_continuous and not make(engine_continuous=False).engine_continuous
    with pytest.raises(InvalidArgumentError, match="engine_continuous must be true or false"):
        make(engine_continuous="yes")


def test_inference_replays_take_their_own_batch_size(tiny_model_path, tmp_path):
    """The reference pass (no gradient) replays the whole generation batch at once when
    ``replay_inference_batch_size`` says so; the policy pass keeps TRL's micro-batches."""
    from compaction_gym.trainers.grpo.grpo_trainer import CompactionGRPOConfig, CompactionGRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    args = CompactionGRPOConfig(
        str(tmp_path / "run"), env_id="AttnMatch-BabyAI-v0", env_kwargs=ENV_KWARGS, compaction=COMPACTION,
        max_turn_tokens=6, num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=1, beta=0.05, replay_inference_batch_size=4, num_episodes=8, bf16=False, use_cpu=True,
        save_strategy="no", report_to="none",
    )  # fmt: skip
    trainer = CompactionGRPOTrainer(
        model,
        args,
        reward_funcs=[even_tokens],
        processing_class=AutoTokenizer.from_pretrained(tiny_model_path),
    )
    calls = []
    replay = trainer._replay

    def recording(m, trajectories, **kwargs):
        calls.append((len(trajectories), torch.is_grad_enabled(), m is trainer.ref_model))
        return replay(m, trajectories, **kwargs)

    trainer._replay = recording
    trainer.train()
    assert (4, False, True) in calls  # the reference replay: the generation batch of 4 in one call
    assert all(n == 2 for n, grad, _ in calls if grad)  # the policy's micro-batches
    with pytest.raises(InvalidArgumentError, match="replay_inference_batch_size must be >= 1"):
        CompactionGRPOConfig(str(tmp_path), bf16=False, use_cpu=True, replay_inference_batch_size=0)
    with pytest.raises(InvalidArgumentError, match="replay_method must be one of"):
        CompactionGRPOConfig(str(tmp_path), bf16=False, use_cpu=True, replay_method="layers")


@pytest.mark.parametrize("inference_batch", [None, 1])
def test_a_step_with_one_pass_replay(tiny_model_path, tmp_path, monkeypatch, inference_batch):
    """``replay_method="one_pass"`` reaches every replay call of a step, and the replayed log-probs
    match the sampler's (the step's logged mismatch). A pass in chunks builds each next chunk's plan
    during the chunk before it (``prefetch``), which the next chunk's call then finds kept."""
    from compaction_gym.trainers.grpo import grpo_trainer as module
    from compaction_gym.trainers.grpo.grpo_trainer import CompactionGRPOConfig, CompactionGRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    args = CompactionGRPOConfig(
        str(tmp_path / "run"), env_id="AttnMatch-BabyAI-v0", env_kwargs=ENV_KWARGS, compaction=COMPACTION,
        max_turn_tokens=6, num_generations=2, per_device_train_batch_size=2, max_steps=1, beta=0.05,
        num_episodes=4, bf16=False, use_cpu=True, save_strategy="no", report_to="none", replay_method="one_pass",
        replay_inference_batch_size=inference_batch,
    )  # fmt: skip
    methods, calls = [], []
    real = module.replay_logprobs_batch

    def recording(model, trajectories, **kwargs):
        methods.append(kwargs["method"])
        calls.append((torch.is_grad_enabled(), list(trajectories), kwargs.get("prefetch")))
        return real(model, trajectories, **kwargs)

    monkeypatch.setattr(module, "replay_logprobs_batch", recording)
    trainer = CompactionGRPOTrainer(
        model,
        args,
        reward_funcs=[even_tokens],
        processing_class=AutoTokenizer.from_pretrained(tiny_model_path),
    )
    trainer.train()
    assert methods and set(methods) == {"one_pass"}
    # the reference pass planned the episodes; the policy pass over the same two reused that plan
    stats = trainer._plan_cache.stats
    if inference_batch is None:
        assert (
            stats.simulations_built == 2 and stats.device_plans_built == 1 and stats.device_plans_reused >= 1
        )
        assert all(prefetch is None for _, _, prefetch in calls)
    else:  # the reference pass in chunks of one: the first call prefetched the second's plan
        no_grad = [(chunk, prefetch) for grad, chunk, prefetch in calls if not grad]
        assert [len(chunk) for chunk, _ in no_grad[:2]] == [1, 1]
        assert no_grad[0][1] == no_grad[1][0] and no_grad[1][1] is None
        # plans: the two chunks (one prefetched, then kept) and the policy's micro-batch of both
        assert (
            stats.simulations_built == 2 and stats.device_plans_built == 3 and stats.device_plans_reused >= 1
        )
    logged = [
        h["replay/max_abs_logprob_diff"]
        for h in trainer.state.log_history
        if "replay/max_abs_logprob_diff" in h
    ]
    assert logged and max(logged) < 1e-4

"""GJSDistillationTrainer: GJS from step 1 (logged, TensorBoard), exact IS ratios, compacted 3-step runs, CLI."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.gjs import DIVERGENCE_MODES


def _config(tmp_path: Path, **kwargs):
    from compaction_gym.trainers.gjs.gjs_config import GJSDistillationConfig

    defaults = dict(
        env_id="AttnMatch-Math-v0",
        prompt_format="raw",
        num_episodes=8,
        max_turn_tokens=12,
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        per_device_train_batch_size=2,
        num_generations=2,
        learning_rate=1e-3,
        gjs_k=4,
        report_to="none",
    )
    return GJSDistillationConfig(str(tmp_path / "out"), **{**defaults, **kwargs})


def _trainer(model_path, args, cls=None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compaction_gym.trainers.gjs.gjs_trainer import GJSDistillationTrainer

    cls = cls or GJSDistillationTrainer
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return cls(model, args, processing_class=tokenizer)


def _plain_logprobs(model, input_ids, attention_mask, completion_len, temperature):
    """Independent reference: float64 log_softmax of a plain HF forward, at the last C positions."""
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    return (logits[:, -(completion_len + 1) : -1].double() / temperature).log_softmax(-1)


def _gather(logprobs, ids):
    return logprobs.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def _reference_topk_gjs(student_lp, teacher_lp, k, alpha):
    """Float64 numpy GJS_α over the teacher's top-k plus a tail bucket, per position ([N, V] -> [N])."""
    s, t = np.exp(student_lp), np.exp(teacher_lp)
    out = []
    for s_row, t_row in zip(s, t):
        top = np.argsort(-t_row)[:k]
        tb = np.append(t_row[top], 1.0 - t_row[top].sum())
        sb = np.append(s_row[top], 1.0 - s_row[top].sum())
        m = alpha * tb + (1 - alpha) * sb
        out.append(alpha * np.sum(tb * np.log(tb / m)) + (1 - alpha) * np.sum(sb * np.log(sb / m)))
    return np.array(out)


def _scalars(output_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list(output_dir.rglob("events.out.tfevents*"))
    assert files, f"no TensorBoard event file under {output_dir}"
    acc = EventAccumulator(str(files[0].parent))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# ------------------------------------------------------------------------------------ step 1 is GJS
def test_first_step_is_topk_gjs_logged_to_tensorboard(tiny_model_path, tmp_path):
    from compaction_gym.trainers.gjs.gjs_trainer import GJSDistillationTrainer

    seen = {}

    class Recorder(GJSDistillationTrainer):
        def _compute_loss(self, model, inputs):
            if not seen:  # step 1, before the update: independent student and teacher distributions
                c = inputs["completion_ids"].size(1)
                ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
                mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
                seen["student"] = _plain_logprobs(model, ids, mask, c, self.temperature)
                seen["teacher"] = _plain_logprobs(
                    model, inputs["teacher_input_ids"], inputs["teacher_attention_mask"], c, self.temperature
                )
                seen["inputs"] = inputs
            return super()._compute_loss(model, inputs)

    args = _config(tmp_path, max_steps=1, gjs_alpha=0.3, distillation_coef=0.5, report_to="tensorboard")
    trainer = _trainer(tiny_model_path, args, Recorder)
    trainer.train()

    assert trainer.divergence_mode == "topk_gjs"
    logs = trainer.state.log_history[0]
    logged_modes = [m for m in DIVERGENCE_MODES if f"distill/{m}" in logs]
    assert logged_modes == ["topk_gjs"]
    assert logs["distill/context_fraction"] == 1.0  # nothing solved: every teacher reads env feedback

    # The logged value is the top-K GJS of the cached teacher vs the student, from an independent reference.
    inputs = seen["inputs"]
    mask = (inputs["completion_mask"] * inputs["tool_mask"] * inputs["distill_mask"][:, None]).bool()
    ref = _reference_topk_gjs(seen["student"][mask].numpy(), seen["teacher"][mask].numpy(), k=4, alpha=0.3)
    assert ref.mean() > 1e-3
    assert logs["distill/topk_gjs"] == pytest.approx(ref.mean(), rel=1e-4)
    assert logs["loss"] == pytest.approx(0.5 * ref.mean(), rel=1e-4)  # distillation_coef, separate from α

    # The teacher read the student's own completion after a reprompt carrying the env feedback.
    c = inputs["completion_ids"].size(1)
    assert torch.equal(inputs["teacher_input_ids"][:, -c:], inputs["completion_ids"])
    teacher_prompt = trainer.processing_class.decode(inputs["teacher_input_ids"][0, :-c])
    assert "feedback from your unsuccessful earlier attempt" in teacher_prompt
    assert "could not be scored" in teacher_prompt or "is incorrect" in teacher_prompt

    scalars = _scalars(Path(args.output_dir))
    assert scalars["train/distill/topk_gjs"] == [pytest.approx(logs["distill/topk_gjs"], rel=1e-5)]
    assert not [
        t for t in scalars if t.startswith("train/distill/") and t.split("/")[-1] in DIVERGENCE_MODES[1:]
    ]


# ------------------------------------------------------------------------------------ IS ratios
def test_is_ratios_are_exact_for_tokens_outside_the_topk(tiny_model_path, tmp_path):
    from compaction_gym.trainers.gjs.gjs_trainer import GJSDistillationTrainer

    steps = []

    class Recorder(GJSDistillationTrainer):
        def _compute_loss(self, model, inputs):
            c = inputs["completion_ids"].size(1)
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            ref = _gather(_plain_logprobs(model, ids, mask, c, self.temperature), inputs["completion_ids"])
            loss = super()._compute_loss(model, inputs)
            steps.append((inputs, ref, self.last_distillation))
            return loss

    # num_iterations=2: step 2 reuses step 1's rollouts after an update (off-policy); k=1 and a hot sampler
    # put most sampled tokens outside the top-K lists.
    args = _config(
        tmp_path,
        max_steps=2,
        num_iterations=2,
        gjs_k=1,
        temperature=2.0,
        distill_is_clip=None,
        optim="sgd",
        learning_rate=1.0,
        lr_scheduler_type="constant",
    )
    trainer = _trainer(tiny_model_path, args, Recorder)
    trainer.train()

    (in1, ref1, st1), (in2, ref2, st2) = steps
    assert torch.equal(
        in1["completion_ids"], in2["completion_ids"]
    )  # the same rollouts, before/after an update
    mask = (in1["completion_mask"] * in1["tool_mask"]).bool()
    outside = mask & (in1["completion_ids"] != in1["teacher_topk_ids"][..., 0])
    assert outside.sum() >= 3

    # Behaviour log-probs are exact: TRL's old log-probs (our recompute) and the engine's sampling log-probs.
    torch.testing.assert_close(in1["old_per_token_logps"][mask].double(), ref1[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(in1["sampling_per_token_logps"][mask].double(), ref1[mask], atol=1e-4, rtol=0)
    torch.testing.assert_close(st1.is_ratio[mask].double(), torch.ones_like(ref1[mask]), atol=1e-5, rtol=0)

    expected = torch.exp(ref2 - ref1)
    assert (expected[mask] - 1).abs().max() > 1e-3  # the policy moved: the check below is not vacuous
    torch.testing.assert_close(st2.is_ratio[mask].double(), expected[mask], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(st2.new_logps[mask].double(), ref2[mask], atol=1e-5, rtol=0)
    # The seed's reconstruction (old log-prob floored at -20 when the token is not listed) is far off.
    floored = torch.exp(ref2 - (-20.0))
    assert not torch.allclose(floored[outside], expected[outside], rtol=0.5)


# ------------------------------------------------------------------------------------ a 3-step run
def test_three_step_run_with_compacted_rollouts(tiny_model_path, tmp_path):
    from compaction_gym.trainers.gjs.gjs_trainer import GJSDistillationTrainer

    seen = []

    class Recorder(GJSDistillationTrainer):
        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            seen.append((inputs, self.last_distillation))
            return loss

    args = _config(
        tmp_path,
        max_steps=3,
        max_turn_tokens=24,
        report_to="tensorboard",
        compaction={"mode": "attention_matching", "max_kv_len": 40, "compact_window": 8},
        distill_is_behavior="sampler",  # ratios against the engine's own sampled-token log-probs
        distill_is_clip=None,
        teacher_kind="ema",
        teacher_scoring="loss",
        gjs_support="union",
        policy_loss_coef=0.5,
    )
    trainer = _trainer(tiny_model_path, args, Recorder)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    teacher_before = [p.detach().clone() for p in trainer.teacher_model.parameters()]
    result = trainer.train()

    assert result.global_step == 3
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert all(h["distill/topk_gjs"] > 0 for h in trainer.state.log_history if "loss" in h)
    assert len(_scalars(Path(args.output_dir))["train/distill/topk_gjs"]) == 3

    # Rollouts were compacted, and replay makes the student's log-probs those the engine sampled with.
    inputs, stats = seen[0]
    assert all(len(t.events) > 0 for t in inputs["trajectories"])
    mask = stats.mask.bool()
    assert (stats.is_ratio[mask] - 1).abs().max() < 1e-3
    assert max(h["replay/max_abs_logprob_diff"] for h in trainer.state.log_history if "loss" in h) < 1e-4
    # Negative control: a plain forward over the full history is not what the compacted sessions sampled.
    c = inputs["completion_ids"].size(1)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    plain = _gather(_plain_logprobs(policy, ids, att, c, trainer.temperature), inputs["completion_ids"])
    assert (plain - inputs["sampling_per_token_logps"].double())[mask].abs().max() > 1e-2

    # The EMA teacher moved towards the policy, and is not the policy.
    moved = [not torch.equal(a, b) for a, b in zip(teacher_before, trainer.teacher_model.parameters())]
    assert any(moved)
    assert any(not torch.equal(a, b) for a, b in zip(policy.parameters(), trainer.teacher_model.parameters()))


# ------------------------------------------------------------------------------------ policy term
def test_policy_term_matches_trl_grpo_loss(tiny_model_path, tmp_path):
    """With policy_loss_coef=1 and no distillation, the loss and gradients equal TRL's fused-head GRPO loss."""
    from trl import GRPOTrainer

    args = _config(tmp_path, distillation_coef=0.0, policy_loss_coef=1.0, loss_type="grpo", beta=0.0)
    trainer = _trainer(tiny_model_path, args)
    trainer.current_gradient_accumulation_steps = 1
    model = trainer.model
    model.train()
    rows = [dict(trainer.train_dataset[0]) for _ in range(2)]  # one group: an env seed played twice
    batch = trainer._generate_and_score_completions(rows)
    batch["advantages"] = torch.tensor([1.0, -0.5])

    def loss_and_grads(fn):
        model.zero_grad()
        loss = fn()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    ours, g_ours = loss_and_grads(lambda: trainer._compute_loss(model, batch))
    fused = types.MethodType(GRPOTrainer._get_per_token_logps_and_entropies, trainer)
    trainer._get_per_token_logps_and_entropies = fused  # TRL's own fused-LM-head path
    try:
        ref, g_ref = loss_and_grads(lambda: GRPOTrainer._compute_loss(trainer, model, batch))
    finally:
        del trainer._get_per_token_logps_and_entropies
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7)
    assert len(g_ours) == len(g_ref) > 0
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------ pieces
def test_choose_contexts():
    from compaction_gym.trainers.gjs.teacher import choose_contexts

    ok = [False, True, True, False, False, False]
    fb = ["bad", None, None, "worse", " ", None]
    got = choose_contexts(ok, fb, num_generations=3, mode="success_or_feedback")
    assert [(c.demo, c.feedback) for c in got] == [
        (1, None), (2, None), (1, None), (None, "worse"), (None, None), (None, None)
    ]  # fmt: skip
    assert [c.active for c in got] == [True, True, True, True, False, False]
    both = choose_contexts(ok, fb, num_generations=3, mode="success_and_feedback", exclude_self=False)
    assert [(c.demo, c.feedback) for c in both[:3]] == [(1, "bad"), (1, None), (1, None)]
    assert [c.demo for c in choose_contexts(ok, fb, num_generations=3, mode="feedback")] == [None] * 6
    assert [c.feedback for c in choose_contexts(ok, fb, num_generations=3, mode="success")] == [None] * 6


def test_config_validation(tmp_path):
    from compaction_gym.trainers.gjs.gjs_config import GJSDistillationConfig

    args = _config(tmp_path, gjs_k=7, gjs_alpha=0.25, gjs_support="union", gjs_normalize=True)
    cfg = args.gjs_loss_config
    assert (cfg.k, cfg.alpha, cfg.support, cfg.tail, cfg.normalize) == (7, 0.25, "union", True, True)
    assert args.teacher_cache_k == 7
    assert GJSDistillationConfig(str(tmp_path / "d"), use_cpu=True).report_to == ["tensorboard"]
    with pytest.raises(InvalidArgumentError, match=r"gjs_alpha must be in \[0, 1\]"):
        _config(tmp_path, gjs_alpha=1.5)
    with pytest.raises(InvalidArgumentError, match=r"teacher_kind must be one of \['policy', 'ema'\]"):
        _config(tmp_path, teacher_kind="frozen")
    with pytest.raises(InvalidArgumentError, match="teacher_cache_k must be >= gjs_k"):
        _config(tmp_path, gjs_k=8, teacher_cache_k=4)
    with pytest.raises(InvalidArgumentError, match="nothing to train"):
        _config(tmp_path, distillation_coef=0.0)


def test_clone_model_runs_its_own_weights(tiny_model):
    """A copy of a TRL-patched model (fused LM head) must not call back into the original's forward."""
    import copy

    from trl.trainer.utils import add_fused_lm_head

    from compaction_gym.trainers.gjs.teacher import clone_model

    model = copy.deepcopy(tiny_model)
    add_fused_lm_head(model, outputs=("log_probs",))
    clone = clone_model(model)
    with torch.no_grad():
        clone.lm_head.weight.zero_()
        ids = torch.tensor([[5, 6, 7]])
        assert clone(input_ids=ids).logits.abs().max() == 0
        assert model(input_ids=ids).logits.abs().max() > 0
    assert not clone.training and not any(p.requires_grad for p in clone.parameters())


def test_cli_trains_one_step(tiny_model_path, tmp_path, capsys):
    from compaction_gym.trainers.gjs.cli import cli

    argv = [
        "--model", str(tiny_model_path), "--env", "AttnMatch-Math-v0", "--env-kwargs", '{"dataset": "basic_arithmetic"}',
        "--episodes", "2", "--num-generations", "2", "--per-device-train-batch-size", "2",
        "--max-turn-tokens", "8", "--max-steps", "1", "--report-to", "none", "--no-save",
        "--output-dir", str(tmp_path / "cli"),
    ]  # fmt: skip
    assert cli(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["steps"] == 1 and out["divergence_mode"] == "topk_gjs"
    assert cli(["--episodes", "2"]) == 2
    assert "--model is required" in capsys.readouterr().err

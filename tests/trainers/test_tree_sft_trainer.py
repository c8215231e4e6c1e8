"""TreeSFTTrainer: expert BabyAI demonstrations, loss normalisation, config validation, the CLI."""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch
import torch.nn.functional as F
from tree_helpers import random_tree

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.tree_sft import Tree, TreeNode, tree_from_trajectories, trees_to_dataset


@pytest.fixture(scope="module")
def demonstrations(tiny_model_path):
    """Expert-bot BabyAI GoTo episodes, teacher-forced into agent sessions on the tiny model."""
    import gymnasium as gym

    from compaction_gym.agents import CompactionAgent, run_episode
    from compaction_gym.backends import LocalBackend
    from compaction_gym.envs.babyai.expert import expert_action

    backend = LocalBackend.from_pretrained(str(tiny_model_path), max_slots=1)
    agent = CompactionAgent(backend, prompt="balrog")
    env = gym.make("AttnMatch-BabyAI-GoTo-v0")
    trajectories = []
    for seed in range(60):
        traj = run_episode(env, agent, seed=seed, teacher=expert_action)
        assert traj.success and all(t.forced for t in traj.turns)
        if len(traj.turns) <= 2:  # short episodes keep the CPU test quick
            trajectories.append(traj)
        if len(trajectories) == 8:
            break
    env.close()
    assert len(trajectories) == 8
    return trajectories


@pytest.fixture(scope="module")
def demo_trees(demonstrations):
    """Pairs of demonstrations merged on their shared prompt: 4 trees of 2 branches."""
    trees = [tree_from_trajectories(demonstrations[i : i + 2]) for i in range(0, 8, 2)]
    assert all(t.num_leaves == 2 and t.num_tokens < t.branch_tokens for t in trees)
    return trees


def _config(tmp_path, name, **kwargs):
    from compaction_gym.trainers.tree_sft.tree_sft_config import TreeSFTConfig

    defaults = dict(
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        optim="sgd",
        learning_rate=0.05,
        lr_scheduler_type="constant",
        seed=0,
        disable_tqdm=True,
        max_length=None,
    )
    return TreeSFTConfig(str(tmp_path / name), **{**defaults, **kwargs})


def _train(model_path, tokenizer, args, trees):
    from transformers import AutoModelForCausalLM

    from compaction_gym.trainers.tree_sft.tree_sft_trainer import TreeSFTTrainer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    trainer = TreeSFTTrainer(model, args, train_dataset=trees, processing_class=tokenizer)
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    return trainer, history


def test_five_steps_on_expert_babyai_trees_match_the_per_branch_baseline(
    tmp_path, tiny_model_path, tiny_tokenizer, demo_trees
):
    runs = {}
    for mode in ("tree", "per_branch"):
        args = _config(tmp_path, mode, tree_mode=mode, max_steps=5)
        runs[mode] = _train(tiny_model_path, tiny_tokenizer, args, demo_trees)
    (tree_trainer, tree_log), (branch_trainer, branch_log) = runs["tree"], runs["per_branch"]
    assert [h["step"] for h in tree_log] == [1, 2, 3, 4, 5]
    tree_losses = [h["loss"] for h in tree_log]
    branch_losses = [h["loss"] for h in branch_log]
    assert all(torch.isfinite(torch.tensor(tree_losses)))
    assert tree_losses[-1] < tree_losses[0]  # it learns the expert's actions
    for a, b in zip(tree_losses, branch_losses):
        assert abs(a - b) <= 1e-6 * abs(b)
    for a, b in zip(tree_log, branch_log):
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 * b["grad_norm"]
    # tree packing processes fewer tokens for the same branches
    assert tree_log[0]["tree/packed_tokens"] < tree_log[0]["tree/branch_tokens"]
    for p, q in zip(tree_trainer.model.parameters(), branch_trainer.model.parameters()):
        assert (p - q).abs().max().item() <= 1e-6 * max(q.abs().max().item(), 1e-12)


def test_loss_is_normalised_over_the_whole_accumulated_step(tmp_path, tiny_model_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float64)
    rng = random.Random(11)
    trees = []
    while len(trees) < 3:
        tree = random_tree(rng, model.config.vocab_size, max_nodes=6, max_len=8)
        if all(sum(m[1:]) > 0 for _, m in tree.branches()) and tree.num_leaves > 1:
            trees.append(tree)
    with torch.no_grad():
        token_num = token_den = seq_sum = 0.0
        for tree in trees:
            means = []
            for ids, mask in tree.branches():
                logits = model(torch.tensor([ids])).logits[0]
                targets = [j for j in range(1, len(ids)) if mask[j]]
                ce = F.cross_entropy(
                    logits[[j - 1 for j in targets]], torch.tensor([ids[j] for j in targets]), reduction="sum"
                )
                token_num += ce.item() / tree.num_leaves
                token_den += len(targets) / tree.num_leaves
                means.append(ce.item() / len(targets))
            seq_sum += sum(means) / len(means)
    expected = {"token": token_num / token_den, "sequence": seq_sum / len(trees)}
    for normalizer in ("token", "sequence"):
        args = _config(
            tmp_path,
            f"norm-{normalizer}",
            max_steps=1,
            gradient_accumulation_steps=3,
            learning_rate=0.0,
            loss_normalizer=normalizer,
        )
        _, history = _train(tiny_model_path, tiny_tokenizer, args, trees)
        assert abs(history[0]["loss"] - expected[normalizer]) <= 1e-6 * expected[normalizer], normalizer


def test_config_validation(tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"tree_mode must be one of \('tree', 'per_branch'\)"):
        _config(tmp_path, "x", tree_mode="branches")
    with pytest.raises(InvalidArgumentError, match="one tree per micro-batch"):
        _config(tmp_path, "x", per_device_train_batch_size=2)
    with pytest.raises(InvalidArgumentError, match=r"tree_attn_implementation must be one of"):
        _config(tmp_path, "x", tree_attn_implementation="flash_attention_2")
    with pytest.raises(InvalidArgumentError, match="packing and padding_free must be False"):
        _config(tmp_path, "x", packing=True)
    args = _config(tmp_path, "x", max_length=512)
    assert args.seq_len == 512 and args.dataset_kwargs["skip_prepare_dataset"] is True


def test_trainer_data_checks(tmp_path, tiny_model_path, tiny_tokenizer, caplog):
    from transformers import AutoModelForCausalLM

    from compaction_gym.trainers.tree_sft.tree_sft_trainer import TreeCollator, TreeSFTTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float64)
    long_tree = Tree([TreeNode(-1, [5] * 30), TreeNode(0, [6, 7]), TreeNode(0, [8, 9])])
    short_tree = Tree([TreeNode(-1, [5, 6]), TreeNode(0, [6, 7]), TreeNode(0, [8, 9])])
    no_target = Tree([TreeNode(-1, [5, 6], [1, 0])])
    with pytest.raises(InvalidArgumentError, match="1 of 2 train trees exceed seq_len=16"):
        TreeSFTTrainer(
            model,
            _config(tmp_path, "e", seq_len=16, overlong_trees="error"),
            train_dataset=[long_tree, short_tree],
            processing_class=tiny_tokenizer,
        )
    with caplog.at_level(logging.WARNING):
        trainer = TreeSFTTrainer(
            model,
            _config(tmp_path, "d", max_packed_tokens=30),
            train_dataset=trees_to_dataset([long_tree, short_tree, no_target]),
            processing_class=tiny_tokenizer,
        )
    assert len(trainer.train_dataset) == 1
    assert "dropped" in caplog.text and "without a target token" in caplog.text
    import compaction_gym.trainers.tree_sft.loss as tree_loss_module

    tree_loss_module._warned_cpu_flex = False
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        flex = TreeSFTTrainer(  # FlexAttention on CPU: SDPA instead, with the reason logged
            model,
            _config(tmp_path, "f", tree_attn_implementation="flex_attention"),
            train_dataset=[short_tree],
            processing_class=tiny_tokenizer,
        )
    assert flex._attn == "sdpa" and model.config._attn_implementation == "sdpa"
    assert "flex_attention on CPU" in caplog.text and "using sdpa" in caplog.text
    with pytest.raises(InvalidArgumentError, match="lacks tree columns"):
        from datasets import Dataset

        TreeSFTTrainer(
            model,
            _config(tmp_path, "g"),
            train_dataset=Dataset.from_dict({"text": ["hi"]}),
            processing_class=tiny_tokenizer,
        )
    collate = TreeCollator()
    with pytest.raises(InvalidArgumentError, match="one tree per micro-batch"):
        collate([short_tree.to_dict(), short_tree.to_dict()])
    batch = collate([short_tree.to_dict()])
    assert batch["input_ids"].shape == (1, 6) and float(batch["loss_weight_sum"]) == pytest.approx(3.0)
    per_branch = TreeCollator(tree_mode="per_branch")([short_tree])
    assert per_branch["input_ids"].shape == (2, 4)
    assert float(per_branch["weights"].sum()) == pytest.approx(float(batch["loss_weight_sum"]))


def test_cli_train_sft(tmp_path, tiny_model_path, demonstrations, capsys):
    from compaction_gym.agents import write_jsonl
    from compaction_gym.cli import main

    demos = tmp_path / "demos.jsonl"
    write_jsonl(demos, demonstrations[:4])
    config = tmp_path / "sft.toml"
    config.write_text(
        f'model = "{tiny_model_path}"\ndataset = "{demos}"\ngroup_size = 4\nmax_steps = 3\n'
        f'output_dir = "{tmp_path / "run"}"\n[training]\nlearning_rate = 0.01\ndisable_tqdm = true\n'
    )
    assert main(["train", "sft", "--config", str(config), "--dry-run"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (
        summary["trees"] == 1 and summary["mean_leaves"] == 4 and summary["branch_tokens/packed_tokens"] > 1
    )
    more = tmp_path / "more.jsonl"
    write_jsonl(more, demonstrations[:4])
    assert main(["train", "sft", "--config", str(config), "--dry-run", "--dataset", str(demos), str(more)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["trees"] == 2  # files concatenated
    assert main(["train", "sft", "--config", str(config), "--dry-run", "--dataset", str(demos), "nope.jsonl"]) == 2
    assert "--dataset nope.jsonl: no such file or directory" in capsys.readouterr().err

    assert (
        main(["train", "sft", "--config", str(config), "--max-steps", "1", "--tree-mode", "per_branch", "--dtype", "float64"])
        == 0
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["steps"] == 1  # the flag overrode the file's max_steps = 3
    assert (tmp_path / "run" / "config.json").is_file()

    config.write_text('model = "m"\nbogus = 1\n')
    assert main(["train", "sft", "--config", str(config)]) == 2
    assert "unknown keys ['bogus']" in capsys.readouterr().err
    assert main(["train", "sft", "--dataset", str(demos)]) == 2
    assert "--model is required" in capsys.readouterr().err

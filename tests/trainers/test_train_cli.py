"""``compaction-gym train sft|grpo|gjs``: one command shape built from the command table."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from compaction_gym.trainers.cli import TRAIN_COMMANDS, build_parser, command, merge_arguments

RECIPES = Path(__file__).resolve().parents[2] / "benchmarks" / "recipes"


def _merged(name: str, argv: list[str]):
    cmd = command(name)
    p = build_parser(cmd)
    return merge_arguments(cmd, p, p.parser.parse_args(argv))


@pytest.mark.parametrize("name", [c.name for c in TRAIN_COMMANDS])
def test_every_command_has_the_same_shape(name):
    cmd = command(name)
    parser = build_parser(cmd).parser
    flags = parser._option_string_actions
    for option in (
        "--per_device_train_batch_size", "--per-device-train-batch-size", "--bf16", "--output_dir", "--output-dir",
        "--report_to", "--resume_from_checkpoint", "--learning_rate", "--seed", "--push_to_hub",
        "--model", "--dtype", "--lora-r", "--lora-alpha", "--lora-dropout", "--lora-target-modules", "--config",
    ):  # fmt: skip
        assert option in flags, option
    assert ("--max-kv-len" in flags and "--ratio" in flags and "--mode" in flags) == cmd.sessions
    undocumented = [a.dest for a in parser._actions if not isinstance(a, argparse._HelpAction) and not a.help]
    assert undocumented == []
    # TensorBoard by default for every trainer
    _, training = _merged(name, ["--model", "m"])
    config = build_parser(cmd).config_cls(**training)
    assert config.report_to == ["tensorboard"]


def test_trl_flags_in_both_spellings_and_the_toml_layers(tmp_path):
    a = _merged("grpo", ["--model", "m", "--per_device_train_batch_size", "2", "--bf16", "false"])[1]
    b = _merged("grpo", ["--model", "m", "--per-device-train-batch-size", "2", "--bf16", "false"])[1]
    assert a == b and a["per_device_train_batch_size"] == 2 and a["bf16"] is False
    assert _merged("sft", ["--model", "m", "--bf16"])[1]["bf16"] is True  # bare, as for plain bool flags
    toml = tmp_path / "g.toml"
    toml.write_text(
        'model = "m"\nenv = "AttnMatch-BabyAI-GoTo-v0"\nlearning_rate = 0.5\nmax_kv_len = 300\n'
        "[compaction]\nmode = \"attention_matching\"\ncompact_window = 100\n[training]\nbeta = 0.25\n"
    )
    script, training = _merged("grpo", ["--config", str(toml), "--ratio", "0.5", "--learning-rate", "0.125"])
    assert script.model == "m"
    assert training["env_id"] == "AttnMatch-BabyAI-GoTo-v0" and training["beta"] == 0.25
    assert training["learning_rate"] == 0.125  # flag > file
    assert training["compaction"] == {
        "max_kv_len": 300, "mode": "attention_matching", "compact_window": 100, "compact_target_ratio": 0.5,
    }  # fmt: skip
    # GJS: the same episode options (episodes/first-seed are the configs' num_episodes/episode_seed)
    _, gjs = _merged("gjs", ["--model", "m", "--episodes", "7", "--first-seed", "3", "--lora-r", "4"])
    assert gjs["num_episodes"] == 7 and gjs["episode_seed"] == 3
    _, grpo = _merged("grpo", ["--model", "m", "--num-episodes", "7", "--episode-seed", "3"])
    assert grpo["num_episodes"] == 7 and grpo["episode_seed"] == 3


def test_bad_keys_and_missing_model(tmp_path, capsys):
    from compaction_gym.cli import main

    toml = tmp_path / "bad.toml"
    toml.write_text('model = "m"\nbogus = 1\n')
    assert main(["train", "grpo", "--config", str(toml)]) == 2
    assert "unknown keys ['bogus']" in capsys.readouterr().err
    assert main(["train", "gjs"]) == 2
    assert "--model is required" in capsys.readouterr().err
    assert main(["train", "grpo", "--model", "./no/such/dir"]) == 2
    assert "does not exist (registered model names:" in capsys.readouterr().err


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("babyai_tiny*.toml") if "demos" not in p.name))
def test_sft_recipes_still_parse(recipe):
    script, training = _merged("sft", ["--config", str(RECIPES / recipe)])
    assert script.model and script.dataset
    assert training["tree_attn_implementation"] == "sdpa" and training["loss_normalizer"] == "token"
    assert "attn" not in training and "normalizer" not in training


def test_old_sft_names_are_aliases():
    _, training = _merged("sft", ["--model", "m", "--attn", "eager", "--normalizer", "sequence"])
    assert training["tree_attn_implementation"] == "eager" and training["loss_normalizer"] == "sequence"


def test_registered_model_lora_and_offline_push_to_hub(tmp_path, capsys, monkeypatch):
    """``--model tiny-random`` resolves for sft (dry run) — the same resolve_model call serves every
    command; --lora-r builds a LoraConfig; an offline --push_to_hub is one line, not a traceback."""
    from huggingface_hub import constants

    from compaction_gym.cli import main
    from compaction_gym.trainers.tree_sft import Tree, TreeNode

    demos = tmp_path / "trees.jsonl"
    trees = [Tree([TreeNode(-1, [5, 6, 7]), TreeNode(0, [8, 9]), TreeNode(0, [10])]) for _ in range(2)]
    demos.write_text("".join(json.dumps(t.to_dict()) + "\n" for t in trees))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    argv = ["train", "sft", "--model", "tiny-random", "--dataset", str(demos), "--dry-run"]
    assert main([*argv, "--push_to_hub", "true", "--output_dir", str(tmp_path / "o")]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["trees"] == 2
    lines = [line for line in captured.err.splitlines() if "push_to_hub" in line]
    assert len(lines) == 1 and "offline" in lines[0]
    script, _ = _merged("sft", ["--model", "m", "--lora-r", "4", "--lora-target-modules", "q_proj", "v_proj"])
    lora = script.peft_config()
    assert lora.r == 4 and lora.lora_alpha == 8 and set(lora.target_modules) == {"q_proj", "v_proj"}
    assert _merged("grpo", ["--model", "m"])[0].peft_config() is None


def test_prompt_format_defaults_and_reasoning_action_parsing():
    from compaction_gym.trainers.grpo.cli import prepare
    from compaction_gym.trainers.rollouts import resolve_envs

    script, training = _merged("gjs", ["--model", "m"])
    prepare(script, training)
    assert training["prompt_format"] == "raw"  # Math env
    script, training = _merged("grpo", ["--model", "m", "--env-max-steps", "4"])
    prepare(script, training)
    assert training["prompt_format"] == "balrog" and training["env_kwargs"] == {"max_episode_steps": 4}
    # with prompt_format="reasoning" BabyAI ids parse <action> tags, as `compaction-gym eval` sets them
    envs = resolve_envs("AttnMatch-BabyAI-GoTo-v0,AttnMatch-Math-v0", prompt_format="reasoning")
    assert envs["AttnMatch-BabyAI-GoTo-v0"]().unwrapped.action_parsing == "tag"
    envs["AttnMatch-Math-v0"]().close()  # non-BabyAI ids get no action_parsing
    kept = resolve_envs("AttnMatch-BabyAI-GoTo-v0", {"action_parsing": "lenient"}, prompt_format="reasoning")
    assert kept["AttnMatch-BabyAI-GoTo-v0"]().unwrapped.action_parsing == "lenient"


def test_unreachable_hub_is_one_line(tmp_path, capsys, monkeypatch):
    """--push_to_hub with the Hub unreachable (simulated: no network in tests) ends in one line."""
    import transformers
    from huggingface_hub import constants

    from compaction_gym.cli import main
    from compaction_gym.trainers.tree_sft import Tree, TreeNode

    def unreachable(self, *args, **kwargs):
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(transformers.Trainer, "init_hf_repo", unreachable)
    data = tmp_path / "trees.jsonl"
    data.write_text(json.dumps(Tree([TreeNode(-1, [5, 6, 7]), TreeNode(0, [8])]).to_dict()) + "\n")
    argv = ["train", "sft", "--model", "tiny-random", "--dataset", str(data), "--max_steps", "1"]
    assert main([*argv, "--output_dir", str(tmp_path / "o"), "--push_to_hub", "true", "--report_to", "none"]) == 1
    err = capsys.readouterr().err
    assert err.count("push_to_hub failed") == 1 and "Traceback" not in err

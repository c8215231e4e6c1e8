"""``compaction-gym eval`` flags: built from EvalConfig / CompactionConfig / SamplingParams, ``--config``
TOML, the old spellings, and the help text."""

from __future__ import annotations

import argparse
import json

import pytest

from compaction_gym.cli import main, make_parser
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.evaluation.cli import load_configs


def _parse(argv: list[str]) -> argparse.Namespace:
    return make_parser().parse_args(["eval", *argv])


def test_old_flag_spellings_still_work():
    args = _parse(
        ["--model", "tiny-random", "--mode", "attention_matching", "--max-kv-len", "1024", "--ratio", "0.5",
         "--compute-beta", "--queries", "keys", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "5",
         "--max-new-tokens", "12", "--episodes", "3", "--batch", "2", "--seed", "4", "--no-progress",
         "--task", "goto", "--task", "open", "--max-steps", "8", "--env-kwargs", '{"num_dists": 0}']
    )  # fmt: skip
    cfg, comp, samp = load_configs(args)
    assert (comp.mode, comp.max_kv_len, comp.compact_window, comp.compact_target_ratio) == (
        "attention_matching", 1024, 512, 0.5,
    )  # fmt: skip
    assert comp.compute_beta and comp.queries == "keys"
    assert (samp.temperature, samp.top_p, samp.top_k, samp.max_new_tokens) == (0.7, 0.9, 5, 12)
    assert cfg.task == ["goto", "open"] and cfg.episodes == 3 and cfg.seed == 4 and not cfg.progress
    assert cfg.max_steps == 8 and cfg.env_kwargs == {"num_dists": 0}


def test_defaults_are_greedy_with_the_prompt_formats_budget():
    cfg, comp, samp = load_configs(_parse(["--model", "tiny-random"]))
    assert comp.mode == "none" and samp.temperature == 0.0 and samp.max_new_tokens == 32  # balrog's
    assert cfg.prompt == "balrog" and cfg.env == "AttnMatch-BabyAI-v0" and cfg.episodes == 10
    _, _, samp = load_configs(_parse([]))  # the bundled model declares its own budget
    assert samp.max_new_tokens == 64


def test_config_toml_then_flags(tmp_path):
    path = tmp_path / "eval.toml"
    path.write_text(
        'env = "AttnMatch-Math-v0"\nepisodes = 4\nmodel = "tiny-random"\n'
        '[compaction]\nmode = "markovian"\nmax_kv_len = 256\n[sampling]\nmax_new_tokens = 100\nseed = 9\n'
    )
    cfg, comp, samp = load_configs(_parse(["--config", str(path), "--episodes", "6", "--ratio", "0.5"]))
    assert cfg.env == "AttnMatch-Math-v0" and cfg.episodes == 6 and cfg.prompt == "raw"
    assert comp.mode == "markovian" and comp.max_kv_len == 256 and comp.compact_target_ratio == 0.5
    assert samp.max_new_tokens == 100 and samp.seed == 9
    path.write_text("episods = 3\n")
    with pytest.raises(InvalidArgumentError, match="unknown keys \\['episods'\\]"):
        load_configs(_parse(["--config", str(path)]))
    path.write_text("[compaction]\nmax_kv = 3\n")
    with pytest.raises(InvalidArgumentError, match="max_kv"):
        load_configs(_parse(["--config", str(path)]))


def test_help_lists_every_group(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = capsys.readouterr().out
    for flag in (
        "--config",
        "--mode",
        "--ratio",
        "--compact-target-ratio",
        "--n-probe-queries",
        "--top-p",
        "--ignore-eos",
    ):
        assert flag in text
    assert "(default: 0.0 (greedy))" in " ".join(text.split())


def test_eval_runs_from_a_config_file(tiny_model_path, tmp_path):
    path = tmp_path / "eval.toml"
    path.write_text(
        f'model = "{tiny_model_path}"\ntask = ["goto"]\nepisodes = 2\nmax_steps = 2\nprogress = false\n'
        f'output = "{tmp_path / "out"}"\n[compaction]\nmode = "markovian"\nmax_kv_len = 448\ncompact_window = 96\n'
        "[sampling]\nmax_new_tokens = 3\n"
    )
    assert main(["eval", "--config", str(path)]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (
        summary["config"]["compaction"]["mode"] == "markovian" and summary["tasks"]["goto"]["episodes"] == 2
    )
    assert summary["config"]["sampling"]["max_new_tokens"] == 3


def test_eval_plays_the_recall_env(tiny_model_path, tmp_path):
    out = tmp_path / "recall"
    argv = ["eval", "--env", "AttnMatch-Recall-v0", "--task", "short", "--model", str(tiny_model_path)]
    argv += [
        "--episodes",
        "2",
        "--max-new-tokens",
        "3",
        "--batch",
        "2",
        "--output",
        str(out),
        "--no-progress",
    ]
    argv += ["--mode", "markovian", "--max-kv-len", "448", "--compact-window", "96"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    stats = summary["tasks"]["short"]
    assert summary["config"]["prompt"] == "raw" and stats["episodes"] == 2
    assert stats["turns_mean"] == 1 + 2 + 3  # facts, 2 filler turns, 3 questions
    assert stats["progression"]["mean"] == 0.0  # a random model answers nothing right


def test_readme_command_reproduces_the_model_cards_numbers(tmp_path, capsys):
    """The README's main command (on its two quickest tasks) prints and writes exactly the numbers
    recorded in the model card's ``eval/quickstart.json`` (only wall times may differ)."""
    from compaction_gym.models import path as model_path

    argv = ["eval", "--env", "AttnMatch-BabyAI-v0", "--mode", "attention_matching", "--max-kv-len", "1024"]
    argv += ["--episodes", "10", "--batch", "4", "--task", "goto", "pickup", "--output", str(tmp_path)]
    assert main([*argv, "--no-progress", "--device", "cpu"]) == 0
    card = json.loads((model_path("babyai-tiny") / "eval" / "quickstart.json").read_text())
    summary = json.loads((tmp_path / "summary.json").read_text())
    timing = {"wall_time_s", "episode_wall_time_mean_s"}
    for task in ("goto", "pickup"):
        ours = {k: v for k, v in summary["tasks"][task].items() if k not in timing}
        assert ours == {k: v for k, v in card["tasks"][task].items() if k not in timing}
    printed = capsys.readouterr().out
    assert "100.0 ± 0.0" in printed and "544" in printed and "633" in printed

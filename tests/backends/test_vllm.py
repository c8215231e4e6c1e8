"""VLLMBackend on vLLM's CPU build: sessions inside vLLM's workers equal the embedded engine's.

Runs in the second environment (docs/vllm.md, ``.ci/run``); skipped where ``vllm`` is not
importable. Two models: the tiny random Qwen3 (head_dim 64) and the real SmolLM2 (a Llama). The
references are :class:`LocalBackend` on the same weights (same tokens, events and log-probs within
1e-3) and vLLM's own ``generate`` (its attention and paged cache) for the uncompacted greedy case.
"""

from __future__ import annotations

import gymnasium as gym
import pytest

pytest.importorskip("vllm")

import compaction_gym  # noqa: F401,E402
from compaction_gym.agents import CompactionAgent, run_episode  # noqa: E402
from compaction_gym.backends import Backend, LocalBackend  # noqa: E402
from compaction_gym.backends.vllm_backend import VLLMBackend  # noqa: E402
from compaction_gym.engine import CompactionConfig, SamplingParams  # noqa: E402
from compaction_gym.engine.types import CreateRequest, StepRequest  # noqa: E402
from compaction_gym.errors import InvalidArgumentError, UnknownSessionError  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_torch_thread")]

LOGPROB_TOL = 1e-3
SLOTS, CAPACITY = 4, 1024
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
#: one config per trigger kind, each firing within the sessions below
CONFIGS = {
    "none": CompactionConfig(),
    "attention_matching": CompactionConfig(
        mode="attention_matching", max_kv_len=96, compact_window=32, compact_target_ratio=0.25
    ),
    "attention_matching_beta": CompactionConfig(
        mode="attention_matching", compute_beta=True, max_kv_len=96, compact_window=32, compact_target_ratio=0.25
    ),
    "snapkv_turns": CompactionConfig(mode="snapkv", n_protect_turns=0),
    "markovian": CompactionConfig(mode="markovian", max_kv_len=96, compact_window=32),
}


def make_tiny_qwen2(path, tokenizer_dir) -> str:
    """A random Qwen2 (q/k/v biases, head_dim 64) beside the tiny Qwen3's tokenizer."""
    import shutil

    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=4096, initializer_range=0.1, tie_word_embeddings=False,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(1)
        model = Qwen2ForCausalLM(config)
        for module in model.modules():  # random biases, so the bias path is exercised
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                torch.nn.init.normal_(module.bias, std=0.1)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    for extra in ("chat_template.jinja",):
        if (tokenizer_dir / extra).exists():
            shutil.copy(tokenizer_dir / extra, path / extra)
    return str(path)


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen2", "smollm2"])
def pair(request, tiny_model_path, tmp_path_factory):
    """``(VLLMBackend, LocalBackend)`` on the same weights, float32, CPU: Qwen3, Qwen2 and Llama."""
    if request.param == "tiny":
        model = str(tiny_model_path)
    elif request.param == "tiny-qwen2":
        model = make_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"), tiny_model_path)
    else:
        from compaction_gym.models.registry import resolve_model
        from compaction_gym.models.smollm2 import SMOLLM2_NAME, gguf_path

        try:
            gguf_path()
        except InvalidArgumentError as exc:
            pytest.skip(str(exc))
        model = str(resolve_model(SMOLLM2_NAME))  # converted once into the cache (docs/models.md)
    vllm_backend = VLLMBackend(model, max_slots=SLOTS, capacity=CAPACITY)
    local = LocalBackend.from_pretrained(model, max_slots=SLOTS, capacity=CAPACITY, device="cpu", dtype="float32")
    yield vllm_backend, local
    vllm_backend.shutdown()


def prompt(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def assert_same(a, b) -> None:
    """Same tokens, mask, events (spans, kept rows, lengths) and log-probs within LOGPROB_TOL."""
    assert a.token_ids == b.token_ids
    assert a.completion_mask == b.completion_mask and a.finish_reason == b.finish_reason
    assert (a.kv_len, a.total_tokens, a.prompt_len) == (b.kv_len, b.total_tokens, b.prompt_len)
    assert a.logprobs == pytest.approx(b.logprobs, abs=LOGPROB_TOL)
    assert len(a.events) == len(b.events)
    for ea, eb in zip(a.events, b.events):
        assert (ea.trigger, ea.mode, ea.span, ea.logical_span) == (eb.trigger, eb.mode, eb.span, eb.logical_span)
        assert (ea.kv_len_before, ea.kv_len_after, ea.position_offset) == (eb.kv_len_before, eb.kv_len_after, eb.position_offset)
        assert ea.indices.tolist() == eb.indices.tolist()
        if eb.beta is not None:
            assert ea.beta.shape == eb.beta.shape
            assert (ea.beta - eb.beta).abs().max().item() < 1e-2


def test_is_a_backend_with_the_engines_facts(pair):
    vb, local = pair
    assert isinstance(vb, Backend)
    assert vb.eos_token_ids == local.eos_token_ids
    assert vb.capacity == CAPACITY and vb.max_slots == SLOTS and vb.num_free_slots == SLOTS
    assert vb.vocab_size == local.engine.layout.vocab_size
    assert vb.layouts == [local.engine.layout]
    assert "VLLMBackend" in repr(vb)


def test_uncompacted_greedy_equals_vllms_own_generate(pair):
    """vLLM's attention and paged cache are the independent reference when nothing is compacted."""
    from vllm import SamplingParams as VSamplingParams

    vb, _ = pair
    ids = prompt(vb.tokenizer, "Name three colours.")
    r = vb.create_session(ids, CompactionConfig(), GREEDY)
    out = vb.llm.generate(
        [{"prompt_token_ids": ids}],
        VSamplingParams(temperature=0.0, max_tokens=GREEDY.max_new_tokens, ignore_eos=True, logprobs=0),
        use_tqdm=False,
    )[0].outputs[0]
    assert r.token_ids == list(out.token_ids)
    theirs = [step[tok].logprob for step, tok in zip(out.logprobs, out.token_ids)]
    assert r.logprobs == pytest.approx(theirs, abs=LOGPROB_TOL)
    vb.close(r.session_id)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_multi_turn_greedy_sessions_equal_local(pair, name):
    """create + two steps (the session persists in the worker): same tokens, events and log-probs."""
    vb, local = pair
    tok = vb.tokenizer
    first = prompt(tok, "Tell me a long story about a robot.")
    turns = [tok("\nContinue, please.", add_special_tokens=False)["input_ids"], tok("\nAnd then?", add_special_tokens=False)["input_ids"]]
    results, views, caches = [], [], []
    for backend in (vb, local):
        r = backend.create_session(first, CONFIGS[name], GREEDY)
        try:
            results.append([r] + [backend.step(r.session_id, t) for t in turns])
            engine = getattr(backend, "engine", backend)  # LocalBackend: its engine's
            views.append(engine.session(r.session_id))
            caches.append(engine.read_cache(r.session_id))
        finally:
            backend.close(r.session_id)
    (mine_cache,), ref_cache = caches  # one tensor-parallel rank
    for a, b, tol in zip(mine_cache, ref_cache, (1e-3, 1e-3, 1e-2)):  # K, V, β rows of the compacted cache
        assert a.shape == b.shape and (a - b).abs().max().item() < tol
    for a, b in zip(*results):
        assert_same(a, b)
    mine, ref = views
    assert len(mine.token_ids) == results[0][-1].total_tokens and mine.kv_len == results[0][-1].kv_len
    assert (mine.token_ids, mine.completion_mask, mine.kv_len) == (ref.token_ids, ref.completion_mask, ref.kv_len)
    assert mine.logprobs == pytest.approx(ref.logprobs, abs=LOGPROB_TOL)
    if name != "none":
        assert any(r.events for r in results[1])  # the trigger fired
    assert vb.num_free_slots == SLOTS


def test_batched_steps_sampling_and_scoring_equal_local(pair):
    vb, local = pair
    tok = vb.tokenizer
    cfg = CONFIGS["attention_matching"]
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=16, ignore_eos=True)
    outs = []
    for backend in (vb, local):
        a, b = backend.step_batch(
            [CreateRequest(prompt(tok, "Hi!"), cfg, GREEDY), CreateRequest(prompt(tok, "Count to ten."), cfg, sampled, score_input=True)]
        )
        more = backend.step_batch([StepRequest(a.session_id, [5, 6, 7], score_input=True), StepRequest(b.session_id, [8, 9])])
        outs.append([a, b, *more])
        for r in (a, b):
            backend.close(r.session_id)
    for a, b in zip(*outs):
        assert_same(a, b)
        if b.input_logprobs is not None:
            assert [x is None for x in a.input_logprobs] == [x is None for x in b.input_logprobs]
            assert [x or 0.0 for x in a.input_logprobs] == pytest.approx([x or 0.0 for x in b.input_logprobs], abs=LOGPROB_TOL)


def test_bad_input_errors_cleanly_and_the_backend_stays_usable(pair):
    vb, _ = pair
    with pytest.raises(UnknownSessionError):
        vb.step("no-such-session", [1, 2])
    with pytest.raises(InvalidArgumentError, match="vocab|range|id"):
        vb.create_session([vb.vocab_size + 5])
    with pytest.raises(InvalidArgumentError):
        vb.create_session([])
    r = vb.create_session([5, 6, 7], sampling=SamplingParams(temperature=0.0, max_new_tokens=2))
    try:
        with pytest.raises(InvalidArgumentError):  # a session twice in one batch
            vb.step_batch([StepRequest(r.session_id, [1]), StepRequest(r.session_id, [2])])
        assert vb.step(r.session_id, [8]).total_tokens == r.total_tokens + 1 + 2
    finally:
        vb.close(r.session_id)
    assert vb.num_free_slots == SLOTS


def test_agent_episode_on_vllm_equals_local(pair):
    vb, local = pair
    cfg = CompactionConfig(mode="attention_matching", max_kv_len=448, compact_window=96)
    trajs = []
    for backend in (vb, local):
        agent = CompactionAgent(backend, compaction=cfg, sampling=SamplingParams(temperature=0.0, max_new_tokens=6))
        env = gym.make("AttnMatch-BabyAI-GoTo-v0", max_episode_steps=3)
        trajs.append(run_episode(env, agent, seed=0))
    a, b = trajs
    a.validate()
    assert a.token_ids == b.token_ids and a.completion_mask == b.completion_mask
    assert a.logprobs == pytest.approx(b.logprobs, abs=LOGPROB_TOL)
    assert [e.indices.tolist() for e in a.events] == [e.indices.tolist() for e in b.events]
    assert [t.action_text for t in a.turns] == [t.action_text for t in b.turns]
    assert vb.num_free_slots == SLOTS


def test_http_api_served_from_the_vllm_backend_equals_local(pair):
    """``compaction-gym serve --backend vllm`` serves this object through the same app."""
    from fastapi.testclient import TestClient

    from compaction_gym.servers.app import create_app
    from compaction_gym.servers.args import ServerArgs

    vb, local = pair
    ids = prompt(vb.tokenizer, "Say something.")
    body = {"prompt_ids": ids, "temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True,
            "compaction_mode": "attention_matching", "max_kv_len": 56, "compact_window": 16}  # fmt: skip
    cfg = CompactionConfig(mode="attention_matching", max_kv_len=56, compact_window=16)
    ref = local.create_session(ids, cfg, SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True))
    ref2 = local.step(ref.session_id, [5, 6])
    local.close(ref.session_id)
    assert ref.events or ref2.events
    with TestClient(create_app(vb, ServerArgs(model=vb.name, session_ttl_s=None))) as client:
        health = client.get("/health").json()
        assert health["free_slots"] == SLOTS and health["eos_token_ids"] == vb.eos_token_ids
        created = client.post("/compact_session/create", json=body)
        assert created.status_code == 200, created.text
        r = created.json()
        stepped = client.post("/compact_session/step", json={"session_id": r["session_id"], "new_token_ids": [5, 6]}).json()
        assert r["all_token_ids"] == ref.token_ids and stepped["all_token_ids"] == ref2.token_ids
        assert r["all_logprobs"] == pytest.approx(ref.logprobs, abs=LOGPROB_TOL)
        assert stepped["current_seq_len"] == ref2.kv_len
        assert len(r["diagnostics"]["compaction_events"]) + len(stepped["diagnostics"]["compaction_events"]) == len(
            ref.events
        ) + len(ref2.events)
        missing = client.post("/compact_session/step", json={"session_id": "nope", "new_token_ids": [1]})
        assert missing.status_code == 404
        assert client.delete(f"/compact_session/{r['session_id']}").status_code == 200
    assert vb.num_free_slots == SLOTS


def test_leaderboard_suite_runs_unchanged_on_vllm(pair, tiny_model_path, tmp_path, write_tiny_suite):
    """The tiny leaderboard suite (tests/leaderboard) on both backends: valid records, same episodes."""
    import json

    from compaction_gym.leaderboard import check_record, load_suite, run_suite

    vb, local = pair
    if vb.path != str(tiny_model_path):
        pytest.skip("the suite is written for the tiny model")
    suite = load_suite(write_tiny_suite(tmp_path, vb.path))
    trajectories = []
    for label, backend in (("vllm", vb), ("local", local)):
        run_suite(suite, output=tmp_path / label, backend=backend, progress=False)
        cell = tmp_path / label / "tiny" / "attention_matching" / "r0.5"
        assert check_record(cell).ok, check_record(cell).failures
        lines = (cell / "trajectories.jsonl").read_text().splitlines()
        trajectories.append([(d["token_ids"], d["completion_mask"]) for d in map(json.loads, lines)])
    assert trajectories[0] == trajectories[1] and len(trajectories[0]) == 4
    assert vb.num_free_slots == SLOTS


@pytest.fixture(scope="module")
def tp_pair(tiny_model_path):
    """``(VLLMBackend with tensor_parallel_size=2, LocalBackend)`` on the tiny model (one core per rank)."""
    import os

    if (os.cpu_count() or 1) < 2:
        pytest.skip("two tensor-parallel ranks need two cores")
    before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # "auto" keeps a core free, leaving one for two ranks
    try:
        vllm_backend = VLLMBackend(str(tiny_model_path), max_slots=2, capacity=512, tensor_parallel_size=2)
    finally:
        if before is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND")
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = before
    yield vllm_backend, LocalBackend.from_pretrained(str(tiny_model_path), max_slots=2, capacity=512, device="cpu")
    vllm_backend.shutdown()


def test_tensor_parallel_ranks_merge_into_the_single_device_session(tp_pair):
    """Two ranks, each with half the KV heads: same tokens, and events whose per-rank kept rows and β
    join (rank order) into the single-device event."""
    vb, local = tp_pair
    assert [lay.n_kv_heads for lay in vb.layouts] == [local.engine.layout.n_kv_heads // 2] * 2
    cfg = CompactionConfig(mode="attention_matching", compute_beta=True, max_kv_len=48, compact_window=16)
    outs = []
    for backend in (vb, local):
        r = backend.create_session(list(range(5, 20)), cfg, GREEDY)  # no session id, no seed: drawn once
        outs.append([r, backend.step(r.session_id, [7, 8, 9])])
        backend.close(r.session_id)
    for a, b in zip(*outs):
        assert all(e.indices.shape[1] == local.engine.layout.n_kv_heads for e in a.events)
        assert_same(a, b)
    assert any(r.events for r in outs[0])
    with pytest.raises(InvalidArgumentError, match="fork"):
        vb.fork("any")
    assert vb.num_free_slots == 2

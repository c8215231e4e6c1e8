"""The persistent decode kernel (every layer of a batch-1 step in one launch) against the layered path.

References: a float32 run of the same model (the layered path in float32 tracks the generic path to
the last bit, ``test_fast_path.py``), and the layered bf16 path run on the same cache. The
persistent kernel has the layered path's roundings but other float32 summation orders, so in bf16
it is held to be as close to float32 as the layered path is.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compaction_gym.engine.config import SamplingParams
from compaction_gym.engine.fast import FastModelRunner, persistent
from compaction_gym.engine.fast.attention import decode_attention, num_splits_for
from compaction_gym.engine.fast.persistent import persistent_supported
from compaction_gym.engine.model_runner import DecodeRow, ModelLayout, RowFeed
from compaction_gym.engine.sampler import SampleStream
from compaction_gym.engine.session import ProbeRing
from compaction_gym.engine.slot_cache import SlotKVCache

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def _fast_runner(model, dtype, capacity=512, slots=4):
    layout = ModelLayout.from_model(model)
    cache = SlotKVCache(layout.n_layers, layout.n_kv_heads, layout.head_dim, slots, capacity, dtype, CUDA)
    return FastModelRunner(model, cache, layout)


def _load(path, dtype):
    from transformers import AutoModelForCausalLM

    from compaction_gym.engine.attention import register_attention

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=register_attention())
    return model.to(CUDA).eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def test_supported_where_expected(tiny_model_path):
    assert (
        persistent_supported(_fast_runner(_load(tiny_model_path, torch.bfloat16), torch.bfloat16).decoder)
        is None
    )
    assert "bf16" in persistent_supported(
        _fast_runner(_load(tiny_model_path, torch.float32), torch.float32).decoder
    )


@pytest.mark.parametrize("tile", [None, 64], ids=["default-tiles", "pipelined-chunks"])
def test_bf16_decode_as_close_to_fp32_as_layered(tiny_model_path, tile, monkeypatch, tmp_path):
    """One row with β decoding 40 CUDA-graph steps, teacher-forced on float32's greedy tokens: the
    persistent kernel's log-probs are as close to float32 as the layered path's. With 64-element
    tiles (on a model twice as wide) every projection takes more than two chunks, so the
    shared-memory pipeline that 1B-class widths use streams them all."""
    if tile is not None:
        from compaction_gym.models.tiny import make_tiny_model

        monkeypatch.setattr(persistent, "TILE_ELEMENTS", tile)
        tiny_model_path = make_tiny_model(tmp_path / "wide", hidden=256)
    ref = _fast_runner(_load(tiny_model_path, torch.float32), torch.float32)
    bf16 = _load(tiny_model_path, torch.bfloat16)
    runners = {
        "layered": _fast_runner(bf16, torch.bfloat16),
        "persistent": _fast_runner(bf16, torch.bfloat16),
    }
    runners["layered"].decoder.use_persistent = False
    assert runners["persistent"].decoder.persistent_ready()
    prompt = list(range(40, 140))
    out = {}
    for name, runner in (("ref", ref), *runners.items()):
        runner.cache.beta[1, :, :, :60] = torch.linspace(-3, 2, 60, device=CUDA)
        runner.cache.has_beta[1] = True
        out[name] = torch.log_softmax(runner.forward([RowFeed(1, prompt, 0)]), -1)
    err = {"layered": [], "persistent": []}
    agree = {"layered": 0, "persistent": 0}
    for step in range(40):
        token = out["ref"].argmax(-1).item()
        for name, runner in (("ref", ref), *runners.items()):
            out[name] = torch.log_softmax(runner.forward([RowFeed(1, [token], len(prompt) + step)]), -1)
        for name in err:
            err[name].append((out[name] - out["ref"]).abs().max().item())
            agree[name] += int(out[name].argmax(-1).item() == out["ref"].argmax(-1).item())
    plan = runners["persistent"].decoder._plan
    assert plan is not None  # the persistent launch ran
    if tile is not None:
        m = plan.meta
        chunks = (m["H"] // m["KC_QKV"], m["NQ"] * m["D"] // m["KC_O"], m["H"] // m["KC_I"], m["FF"] // m["KC_DOWN"])
        assert min(chunks) > 2
    assert runners["layered"].decoder._plan is None
    assert max(err["persistent"]) < 1.5 * max(err["layered"]) + 0.02
    assert agree["persistent"] >= agree["layered"] - 2
    n = len(prompt) + 40
    k = {name: r.cache.k[1, :, :, :n] for name, r in runners.items()}
    assert (
        _rel(k["persistent"], ref.cache.k[1, :, :, :n])
        < 1.5 * _rel(k["layered"], ref.cache.k[1, :, :, :n]) + 1e-3
    )


@pytest.fixture(scope="module")
def bf16_runner(tiny_model_path):
    runner = _fast_runner(_load(tiny_model_path, torch.bfloat16), torch.bfloat16, capacity=1100, slots=2)
    torch.manual_seed(0)
    runner.cache.k.normal_()
    runner.cache.v.normal_()
    runner.cache.beta.normal_().mul_(2.0)
    return runner


def _step_both(runner, n: int, slot: int = 0, token: int = 11):
    """One token at cache row ``n`` of ``slot`` through the layered and the persistent path (eager);
    returns (logits, new K row, new V row, queries) of each, the cache restored after each."""
    dec, c = runner.decoder, runner.cache
    t = lambda v: torch.tensor([v], device=CUDA)  # noqa: E731
    ids, pos, slots, rows, lens = t(token), t(n), t(slot), t(n), t(n + 1)
    splits = num_splits_for(1, c.n_kv_heads, c.capacity, dec.sm_count)

    def attend(i, q):
        return decode_attention(q, c.k[:, i], c.v[:, i], c.beta[:, i], slots, lens, dec.scale, splits)

    saved = c.k[slot, :, :, n].clone(), c.v[slot, :, :, n].clone()
    out = {}
    for name in ("layered", "persistent"):
        q = torch.zeros(dec.n_layers, 1, dec.n_q, dec.head_dim, dtype=dec.dtype, device=CUDA)
        with torch.no_grad():
            if name == "layered":
                logits = dec.run(ids, pos, slots, rows, c.k, c.v, attend, q_out=q)
            else:
                logits = dec.run_persistent(ids, pos, slots, rows, lens, c.k, c.v, c.beta, q_out=q)
        out[name] = (logits.float(), c.k[slot, :, :, n].clone(), c.v[slot, :, :, n].clone(), q)
        c.k[slot, :, :, n], c.v[slot, :, :, n] = saved
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.one_of(st.sampled_from([0, 1, 63, 64, 65, 127, 128, 1000, 1098]), st.integers(0, 1098)))
def test_one_step_matches_layered_at_any_length(bf16_runner, n):
    """Any cache length (empty, one key, block edges, splits left empty, the full capacity), with
    β on every key: logits, the stored K/V row and the recorded queries match the layered path's
    to bf16 noise (layer 0's K and V within a rounding step)."""
    out = _step_both(bf16_runner, n)
    (la, ka, va, qa), (lb, kb, vb, qb) = out["layered"], out["persistent"]
    assert _rel(lb, la) < 0.05
    assert _rel(kb, ka) < 0.05 and _rel(vb, va) < 0.05 and _rel(qb, qa) < 0.05
    assert (kb[0] - ka[0]).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * ka[0].abs().max()
    assert (vb[0] - va[0]).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * va[0].abs().max()


def test_beta_is_applied(bf16_runner):
    """Pushing β of half the keys to −30 changes the output as it changes the layered path's."""
    c = bf16_runner.cache
    saved = c.beta.clone()
    try:
        base = _step_both(bf16_runner, 500)
        c.beta[0, :, :, :250] = -30.0
        masked = _step_both(bf16_runner, 500)
    finally:
        c.beta.copy_(saved)
    assert _rel(masked["persistent"][0], masked["layered"][0]) < 0.05
    assert _rel(masked["persistent"][0], base["persistent"][0]) > 5 * _rel(
        masked["persistent"][0], masked["layered"][0]
    )


def test_padding_row_writes_and_reads_nothing(bf16_runner):
    dec, c = bf16_runner.decoder, bf16_runner.cache
    before = c.k.clone(), c.v.clone()
    t = lambda v: torch.tensor([v], device=CUDA)  # noqa: E731
    with torch.no_grad():
        logits = dec.run_persistent(t(5), t(0), t(-1), t(0), t(0), c.k, c.v, c.beta)
    assert torch.isfinite(logits).all()
    assert torch.equal(c.k, before[0]) and torch.equal(c.v, before[1])
    assert (
        int(dec._plan.bar.abs().sum()) == 0 and int(dec._plan.head_cnt.abs().sum()) == 0
    )  # ready for the next launch


def test_fp16_one_step_matches_layered(tiny_model_path):
    runner = _fast_runner(_load(tiny_model_path, torch.float16), torch.float16, capacity=600)
    torch.manual_seed(1)
    runner.cache.k.normal_()
    runner.cache.v.normal_()
    runner.cache.beta.normal_()
    assert runner.decoder.persistent_ready()
    for n in (0, 100, 599):
        out = _step_both(runner, n)
        for i in range(4):  # logits, K row, V row, queries
            assert _rel(out["persistent"][i], out["layered"][i]) < 0.01


def test_qwen2_with_qkv_bias_and_no_qk_norm():
    """A Qwen2 layout (q/k/v bias, no per-head norm, four query heads per KV head)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=512, hidden_size=256, intermediate_size=640, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(CUDA):
        model = Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # HF initialises biases to zero: make them count
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()
    runner = _fast_runner(model, torch.bfloat16, capacity=300)
    runner.cache.k.normal_()
    runner.cache.v.normal_()
    assert runner.decoder.layers[0].qkv_bias is not None and runner.decoder.layers[0].q_norm is None
    for n in (0, 7, 250):
        out = _step_both(runner, n, token=3)
        assert _rel(out["persistent"][0], out["layered"][0]) < 0.05
        assert _rel(out["persistent"][1], out["layered"][1]) < 0.05


#: Llama layouts: Llama-3.2's (llama3 RoPE scaling, four query heads per KV head) and SmolLM2-135M's
#: (three query heads per KV head, a width that is no power of two), both with tied embeddings.
LLAMA_LAYOUTS = {
    "llama-3.2": dict(
        vocab_size=512, hidden_size=256, intermediate_size=640, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True,
        rope_theta=500_000.0, rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                                high_freq_factor=4.0, original_max_position_embeddings=256),
    ),
    "smollm2-135m": dict(
        vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True,
        rope_theta=100_000.0, rms_norm_eps=1e-5,
    ),
}  # fmt: skip


@pytest.mark.parametrize("layout", list(LLAMA_LAYOUTS))
def test_llama_layouts(layout):
    """Llama layouts as shipped (no per-head norm, no bias), at positions past Llama-3.2's original
    RoPE context: one step matches the layered path, and layer 0's new key matches HF's own
    projection and rotation."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    config = LlamaConfig(**LLAMA_LAYOUTS[layout])
    torch.manual_seed(0)
    with torch.device(CUDA):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    runner = _fast_runner(model, torch.bfloat16, capacity=600)
    runner.cache.k.normal_()
    runner.cache.v.normal_()
    runner.cache.beta.normal_()
    assert runner.decoder.layers[0].qkv_bias is None and runner.decoder.layers[0].q_norm is None
    assert runner.decoder.persistent_ready()
    layer0, n_kv, d = model.model.layers[0], config.num_key_value_heads, config.head_dim
    for n in (0, 300, 599):
        out = _step_both(runner, n, token=3)
        for i in range(4):  # logits, K row, V row, queries
            assert _rel(out["persistent"][i], out["layered"][i]) < 0.05
        with torch.no_grad():
            x = layer0.input_layernorm(model.model.embed_tokens(torch.tensor([[3]], device=CUDA)))
            k = layer0.self_attn.k_proj(x).view(1, 1, n_kv, d).transpose(1, 2)
            cos, sin = model.model.rotary_emb(x, torch.tensor([[n]], device=CUDA))
            k_ref = apply_rotary_pos_emb(k, k, cos, sin)[1][0, :, 0]
        k_got = out["persistent"][1][0]
        assert (k_got - k_ref).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * k_ref.abs().max()


def test_generate_turns_on_and_off(tiny_model_path, monkeypatch):
    """``COMPACTION_GYM_PERSISTENT=0`` keeps new decoders on the layered path; left to choose, the
    runner times both batch-1 graphs once; forced on, graph decode replays the persistent kernel
    (its barrier resets between launches) and emits the log-probs of its tokens."""
    monkeypatch.setenv("COMPACTION_GYM_PERSISTENT", "0")
    model = _load(tiny_model_path, torch.bfloat16)
    assert not _fast_runner(model, torch.bfloat16).decoder.persistent_ready()
    monkeypatch.delenv("COMPACTION_GYM_PERSISTENT")
    prompt = list(range(30, 90))
    greedy = [SamplingParams(temperature=0.0)]
    auto = _fast_runner(model, torch.bfloat16, capacity=512)
    assert auto.decoder.use_persistent is None
    first = auto.forward([RowFeed(0, prompt, 0)]).argmax(-1).tolist()
    prefilled = auto.cache.k[0, :, :, : len(prompt)].clone()
    auto.generate([0], first, [len(prompt)], greedy, 4)  # the first batch-1 capture times both paths
    assert (
        torch.equal(auto.cache.k[0, :, :, : len(prompt)], prefilled)
        and auto.cache.length(0) == len(prompt) + 4
    )
    dec = auto.decoder
    assert dec.persistent_max_len is not None
    assert set(dec.persistent_times) == {(use, n) for use in (False, True) for n in (255, 511)}
    assert all(0 < t < 0.1 for t in dec.persistent_times.values())
    # rows are routed by their length
    for max_len, use in ((10**6, True), (0, False)):
        dec.persistent_max_len = max_len
        auto.generate([0], first, [len(prompt)], greedy, 2)
        assert (1, "greedy", False, use) in auto._graphs

    runner = _fast_runner(model, torch.bfloat16)
    runner.decoder.use_persistent = True
    first = runner.forward([RowFeed(0, prompt, 0)]).argmax(-1).tolist()
    toks, lps = runner.generate([0], first, [len(prompt)], greedy, 64)
    assert (
        runner.decoder._plan is not None and runner.decoder.persistent_max_len is None and len(toks[0]) == 64
    )
    assert int(runner.decoder._plan.bar.abs().sum()) == 0
    hot = [SamplingParams(temperature=1.5, top_p=0.95)]  # sampled at temperature 1.5, nucleus-filtered
    n = runner.cache.length(0)
    sampled, sampled_lps = runner.generate([0], [toks[0][-1]], [n], hot, 40, seeds=[7])
    assert len(sampled[0]) == 40 and all(0 <= t < model.config.vocab_size for t in sampled[0])
    assert all(lp <= 0 and lp == lp for lp in sampled_lps[0])
    assert runner.cache.length(0) == n + 40
    # the same tokens fed through the layered path give the emitted log-prob of the last one
    ref = _fast_runner(model, torch.bfloat16)
    ref.decoder.use_persistent = False
    logits = ref.forward([RowFeed(0, prompt + first + toks[0][:-1], 0)])
    last_lp = torch.log_softmax(logits.float(), -1)[0, toks[0][-1]].item()
    assert abs(last_lp - lps[0][-1]) < 0.1


def test_decode_chunk_records_queries_only_where_read(tiny_model_path):
    """A persistent chunk at temperature 1.5 with β on records each fed token's rotated queries
    (against the layered path's prefill of the same tokens); a row without a recorder, whose launch
    stores no queries, samples the same tokens with the same log-probs to the last bit."""
    model = _load(tiny_model_path, torch.bfloat16)
    layout = ModelLayout.from_model(model)
    prompt = list(range(30, 90))

    def runner_with_beta(persistent: bool) -> FastModelRunner:
        runner = _fast_runner(model, torch.bfloat16)
        runner.decoder.use_persistent = persistent
        runner.cache.beta[0, :, :, :40] = torch.linspace(-2, 1, 40, device=CUDA)
        runner.cache.has_beta[0] = True
        return runner

    def ring() -> ProbeRing:
        return ProbeRing(layout.n_layers, layout.n_q_heads, layout.head_dim, 8, torch.float32, CUDA)

    out = {}
    for recorded in (True, False):
        runner = runner_with_beta(True)
        first = runner.forward([RowFeed(0, prompt, 0)]).argmax(-1).item()
        recorder = ring() if recorded else None
        row = DecodeRow(0, first, len(prompt), 12, SamplingParams(temperature=1.5), SampleStream(3), (), recorder)
        ((toks, lps),) = runner.decode_chunk([row], 12)
        assert (1, "sample", recorded, True) in runner._graphs  # the persistent graph ran
        out[recorded] = (first, toks, lps, recorder)
    assert out[False][:3] == out[True][:3]
    first, toks, _, recorder = out[True]
    fed = [first, *toks[:-1]]
    q_persistent, span = recorder.select(0)
    assert span == (len(prompt) + len(fed) - 8, len(prompt) + len(fed))
    ref_ring = ring()
    runner_with_beta(False).forward([RowFeed(0, prompt + fed, 0, recorder=ref_ring)])
    q_ref, ref_span = ref_ring.select(0)
    assert ref_span == span
    assert _rel(q_persistent, q_ref) < 0.05

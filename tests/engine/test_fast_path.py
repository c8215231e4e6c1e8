"""The GPU fast path equals the generic path and its references (run on a CUDA machine).

Kernels are compared with their torch references on fresh random inputs (outputs poisoned
first; the small-batch GEMVs and β's FISTA kernel too); the fast runner with the generic runner on the tiny Qwen3 (greedy tokens identical,
logprobs within float32 / bf16 tolerance); ``compact_fast`` with ``compact``; and the engine with
``fast=True`` with the engine with ``fast=False`` through KV-budget compaction with β.
"""

from __future__ import annotations

import math

import pytest
import torch

from compaction_gym.compaction import compact
from compaction_gym.engine import CompactionConfig, Engine, SamplingParams, StepRequest
from compaction_gym.engine.config import SamplingParams as SP
from compaction_gym.engine.fast import FastModelRunner, compact_fast
from compaction_gym.engine.fast import kernels as K
from compaction_gym.engine.fast.attention import (
    decode_attention,
    decode_attention_ref,
    decode_attention_sdpa,
    prefill_attention,
    prefill_attention_torch,
)
from compaction_gym.engine.fast.gemv import GEMV_CANDIDATES, gemv, gemv_ref
from compaction_gym.engine.fast.nnls import nnls_fista, nnls_fista_torch
from compaction_gym.engine.model_runner import ModelLayout, ModelRunner, RowFeed
from compaction_gym.engine.slot_cache import SlotKVCache

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_kernels_match_references(dtype):
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(7, 1000, generator=g, device=CUDA).to(dtype)
    r = torch.randn(7, 1000, generator=g, device=CUDA).to(dtype)
    w = torch.randn(1000, generator=g, device=CUDA).to(dtype)
    r1, r2 = r.clone(), r.clone()
    assert rel(K.rms_norm(x, w, 1e-6, r1), K.rms_norm_ref(x, w, 1e-6, r2)) < TOL[dtype] / 4
    assert torch.equal(r1, r2)
    gu = torch.randn(5, 2 * 3000, generator=g, device=CUDA).to(dtype)
    assert rel(K.silu_mul(gu), K.silu_mul_ref(gu)) < TOL[dtype] / 4
    n_q, n_kv, d = 8, 2, 128
    qkv = torch.randn(9, (n_q + 2 * n_kv) * d, generator=g, device=CUDA).to(dtype)
    pos = torch.randint(0, 500, (9,), generator=g, device=CUDA)
    ang = torch.arange(512, device=CUDA)[:, None] * 1e4 ** (-torch.arange(0, d, 2, device=CUDA) / d)[None]
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    qn, kn = (torch.rand(d, generator=g, device=CUDA) + 0.5).to(dtype), (torch.rand(d, generator=g, device=CUDA) + 0.5).to(dtype)
    slots = torch.tensor([0, 1, -1, 2, 0, 1, 2, 0, 1], device=CUDA)
    rows = torch.arange(9, device=CUDA) + 3
    for norms in ((qn, kn), (None, None)):
        caches = [torch.full((3, 4, n_kv, 16, d), float("nan"), device=CUDA, dtype=dtype) for _ in range(4)]
        q1 = K.qkv_rope_store(qkv, pos, cos, sin, *norms, 1e-6, caches[0][:, 2], caches[1][:, 2], slots, rows, n_q, n_kv)
        q2 = K.qkv_rope_store_ref(qkv, pos, cos, sin, *norms, 1e-6, caches[2][:, 2], caches[3][:, 2], slots, rows, n_q, n_kv)
        assert rel(q1, q2) < TOL[dtype] / 4
        for a, b in ((caches[0], caches[2]), (caches[1], caches[3])):
            assert torch.equal(a.isnan(), b.isnan())  # the same rows written, the padding row skipped
            assert rel(a.nan_to_num(), b.nan_to_num()) < TOL[dtype] / 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemv_matches_torch(dtype):
    """Split-K GEMV (plain, bias, fused RMSNorm ± residual, fused SiLU·mul) vs torch; graph replays too."""
    g = torch.Generator(device="cuda").manual_seed(11)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=CUDA).to(dtype)

    cases = [(1, 1000, 1024, None, None), (5, 300, 700, 3, 16), (16, 2048, 512, None, 64), (8, 50, 3000, None, None)]
    cases += [(32, 1024, 2048, None, None), (17, 300, 700, 3, 64), (24, 96, 3000, None, 32)]  # the 32-row tile
    for m, n, k, split, bn in cases:
        x, w, b, nw = rnd(m, k), rnd(n, k) * k**-0.5, rnd(n), (torch.rand(k, generator=g, device=CUDA) + 0.5).to(dtype)
        r, gu = rnd(m, k), rnd(m, 2 * k)
        tiling = dict(split=split, block_n=bn)
        for candidate in [*GEMV_CANDIDATES, dict(programs_per_sm=8, num_warps=8), dict(num_stages=2, block_n=16)]:
            assert rel(gemv(x, w, **candidate), gemv_ref(x, w)) < tol
        assert rel(gemv(x, w, **tiling), gemv_ref(x, w)) < tol
        assert rel(gemv(x, w, b, **tiling), gemv_ref(x, w, b)) < tol
        assert rel(gemv(x, w, norm_weight=nw, **tiling), gemv_ref(x, w, norm_weight=nw)) < tol
        assert rel(gemv(gu, w, silu=True, **tiling), gemv_ref(gu, w, silu=True)) < tol
        if n % 2 == 0:  # w as [gate; up] with the SiLU·mul epilogue
            assert rel(gemv(x, w, b, act="silu_mul", **tiling), gemv_ref(x, w, b, act="silu_mul")) < tol
        outs = [torch.full_like(r, float("nan")) for _ in range(2)]
        y = gemv(x, w, b, norm_weight=nw, residual=r, residual_out=outs[0], **tiling)
        y_ref = gemv_ref(x, w, b, norm_weight=nw, residual=r, residual_out=outs[1])
        assert rel(y, y_ref) < tol
        assert torch.equal(outs[0], outs[1])  # every element of residual + x written, same rounding
    # a split launch replayed in a CUDA graph: counters reset, results identical
    x, w = rnd(4, 4096), rnd(256, 4096)
    ref = gemv_ref(x, w)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gemv(x, w, split=8)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv(x, w, split=8)
    outs = []
    for _ in range(3):
        y.fill_(float("nan"))
        graph.replay()
        outs.append(y.clone())
    assert rel(outs[0], ref) < tol and torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])


@pytest.mark.parametrize("t", [37, 256, 300])
def test_nnls_fista_kernel_matches_torch_loop(t):
    """β's FISTA kernel (Ĝ float32 or float16) = its torch loop; near NNLS's optimum."""
    from compaction_gym.compaction.beta import nnls

    g = torch.Generator(device="cuda").manual_seed(t)
    a = torch.rand(6, 512, t, generator=g, device=CUDA) ** 4
    gram, rhs = a.mT @ a, a.sum(1)
    for g_dtype in (torch.float32, torch.float16):  # float16 with t ≤ 256: Ĝ resident, tensor-core products
        out = nnls_fista(gram, rhs, 64, g_dtype=g_dtype)
        ref = nnls_fista_torch(gram, rhs, 64, g_dtype=g_dtype)
        assert bool((out >= 0).all()) and rel(out, ref) < 1e-3
        box = dict(lower=math.exp(-3), upper=math.exp(3))  # β's box, binding on some variables
        out = nnls_fista(gram, rhs, 64, g_dtype=g_dtype, **box)
        ref = nnls_fista_torch(gram, rhs, 64, g_dtype=g_dtype, **box)
        assert bool((out >= box["lower"] * (1 - 1e-6)).all()) and bool((out <= box["upper"] * (1 + 1e-6)).all())
        assert rel(out, ref) < 1e-3

    def objective(w):
        return ((a @ w[:, :, None])[..., 0] - 1).pow(2).sum().item()

    assert objective(nnls_fista(gram, rhs, g_dtype=torch.float16)) < 1.01 * objective(nnls(gram, rhs)) + 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [2, 4])
def test_decode_attention_matches_reference(dtype, group):
    g = torch.Generator(device="cuda").manual_seed(group)
    n_kv, d, cap = 2, 128, 700
    kc = torch.randn(5, n_kv, cap, d, generator=g, device=CUDA).to(dtype)
    vc = torch.randn(5, n_kv, cap, d, generator=g, device=CUDA).to(dtype)
    beta = torch.randn(5, n_kv, cap, generator=g, device=CUDA) * 3
    q = torch.randn(6, n_kv * group, d, generator=g, device=CUDA).to(dtype)
    slots = torch.tensor([4, 0, 2, 1, 3, 0], device=CUDA)
    lens = torch.tensor([700, 1, 0, 65, 333, 129], device=CUDA)
    ref = decode_attention_ref(q, kc, vc, beta, slots, lens, 0.09)
    for splits in (1, 4, 16):
        outs = []
        for fused in (True, False):  # one launch (the last split merges) / split + merge kernels
            out = decode_attention(q, kc, vc, beta, slots, lens, 0.09, num_splits=splits, fused_merge=fused)
            assert out[2].abs().max() == 0  # a zero-length (padding) row
            assert rel(out, ref) < TOL[dtype]
            outs.append(out)
        assert rel(outs[0], outs[1]) < TOL[dtype] / 10
    assert rel(decode_attention_sdpa(q, kc, vc, beta, slots, lens, 0.09), ref) < TOL[dtype]


@pytest.mark.parametrize("shape", [(16, 8), (32, 8)])  # Qwen3-0.6B / 4B query and KV heads (d = 128)
def test_fused_decode_attention_real_shapes_and_graph_replay(shape):
    """Single-launch attention = two-kernel attention (bf16) at the runner's split counts; replayed
    in a CUDA graph its counters reset (identical outputs)."""
    from compaction_gym.engine.fast.attention import num_splits_for

    n_q, n_kv = shape
    g = torch.Generator(device="cuda").manual_seed(n_q)
    d, cap = 128, 4096
    kc = torch.randn(32, n_kv, cap, d, generator=g, device=CUDA).to(torch.bfloat16)
    vc = torch.randn(32, n_kv, cap, d, generator=g, device=CUDA).to(torch.bfloat16)
    beta = torch.randn(32, n_kv, cap, generator=g, device=CUDA)
    for batch in (1, 8, 32):
        q = torch.randn(batch, n_q, d, generator=g, device=CUDA).to(torch.bfloat16)
        slots = torch.randperm(32, generator=g, device=CUDA)[:batch]
        lens = torch.randint(0, cap + 1, (batch,), generator=g, device=CUDA)
        splits = num_splits_for(batch, n_kv, cap)
        args = (q, kc, vc, beta, slots, lens, d**-0.5, splits)
        two = decode_attention(*args, fused_merge=False)
        fused = decode_attention(*args)
        assert rel(fused, two) < 1e-2 and rel(fused, decode_attention_ref(*args[:7])) < TOL[torch.bfloat16]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            decode_attention(*args)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = decode_attention(*args)
        outs = []
        for _ in range(3):
            y.fill_(float("nan"))
            graph.replay()
            outs.append(y.clone())
        assert torch.equal(outs[0], fused) and torch.equal(outs[1], fused) and torch.equal(outs[2], fused)


@pytest.mark.parametrize("shape", [(6144, 1024), (19456, 2560)])  # Qwen3-0.6B / 4B gate_up
def test_fused_gate_up_real_shapes(shape):
    """The GEMV with the SiLU·mul epilogue = cuBLAS + ``silu_mul`` (bf16) for every candidate tiling."""
    n, k = shape
    g = torch.Generator(device="cuda").manual_seed(n)
    w = (torch.randn(n, k, generator=g, device=CUDA) * k**-0.5).to(torch.bfloat16)
    for m in (1, 8, 16, 32):
        x = torch.randn(m, k, generator=g, device=CUDA).to(torch.bfloat16)
        ref = K.silu_mul(torch.nn.functional.linear(x, w))
        for tiling in GEMV_CANDIDATES:
            y = gemv(x, w, act="silu_mul", **tiling)
            assert rel(y, ref) < TOL[torch.bfloat16]
            assert rel(y, K.silu_mul(gemv(x, w, **tiling))) < 1e-3  # the same products, one launch fewer


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_matches_reference(dtype):
    g = torch.Generator(device="cuda").manual_seed(3)
    n_q, n_kv, d = 8, 2, 128
    kc = torch.randn(4, n_kv, 400, d, generator=g, device=CUDA).to(dtype)
    vc = torch.randn(4, n_kv, 400, d, generator=g, device=CUDA).to(dtype)
    beta = torch.randn(4, n_kv, 400, generator=g, device=CUDA)
    starts, n_new = [0, 37, 250, 5], [70, 1, 100, 17]
    tok0 = [0, 70, 71, 171]
    q = torch.randn(sum(n_new), n_q, d, generator=g, device=CUDA).to(dtype)
    args = [torch.tensor(x, device=CUDA) for x in ([2, 0, 3, 1], starts, tok0, n_new)]
    out = prefill_attention(q, kc, vc, beta, *args, max(n_new), 0.1)
    ref = prefill_attention_torch(q.double(), kc.double(), vc.double(), beta.double(), *args, 0.1)
    assert rel(out, ref) < TOL[dtype]


def _runners(path, dtype):
    from transformers import AutoModelForCausalLM

    from compaction_gym.engine.attention import register_attention

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=register_attention()).to(CUDA)
    layout = ModelLayout.from_model(model.eval())
    caches = [SlotKVCache(layout.n_layers, layout.n_kv_heads, layout.head_dim, 4, 512, dtype, CUDA) for _ in range(2)]
    return ModelRunner(model, caches[0], layout), FastModelRunner(model, caches[1], layout)


def _prefill_with_beta(runner, prompts):
    runner.cache.beta[2, :, :, :30] = torch.linspace(-2, 2, 30, device=CUDA)  # a slot carrying β
    runner.cache.has_beta[2] = True
    return runner.forward([RowFeed(s, ids, 0) for s, ids in prompts.items()])


PROMPTS = {2: list(range(40, 100)), 0: list(range(300, 307)), 3: [9]}


def test_fast_runner_equals_generic_runner_fp32(tiny_model_path):
    """Float32: greedy tokens identical over 40 CUDA-graph decode steps, logprobs to 1e-4."""
    generic, fast = _runners(tiny_model_path, torch.float32)
    logits = {"generic": _prefill_with_beta(generic, PROMPTS), "fast": _prefill_with_beta(fast, PROMPTS)}
    assert (logits["generic"] - logits["fast"]).abs().max() < 1e-3
    toks = {k: [v.argmax(-1).tolist()] for k, v in logits.items()}
    lp_diff = 0.0
    for step in range(40):
        for name, runner in (("generic", generic), ("fast", fast)):
            rows = [RowFeed(s, [t], len(PROMPTS[s]) + step) for s, t in zip(PROMPTS, toks[name][-1])]
            logits[name] = torch.log_softmax(runner.forward(rows), -1)  # fast: a CUDA-graph replay
            toks[name].append(logits[name].argmax(-1).tolist())
        lp_diff = max(lp_diff, (logits["generic"] - logits["fast"]).abs().max().item())
    assert toks["generic"] == toks["fast"]
    assert lp_diff < 1e-4
    for s in PROMPTS:
        n = generic.cache.lengths[s]
        assert n == fast.cache.lengths[s]
        assert rel(fast.cache.k[s, :, :, :n], generic.cache.k[s, :, :, :n]) < 1e-5


def test_fast_runner_bf16_as_close_to_fp32_as_generic(tiny_model_path):
    """bf16: teacher-forced on float32 greedy tokens, the fast path is as close to float32 as the generic one."""
    ref, _ = _runners(tiny_model_path, torch.float32)
    runners = dict(zip(("generic", "fast"), _runners(tiny_model_path, torch.bfloat16)))
    out = {"ref": _prefill_with_beta(ref, PROMPTS)}
    out.update({k: _prefill_with_beta(r, PROMPTS) for k, r in runners.items()})
    err = {"generic": [], "fast": []}
    agree = {"generic": [], "fast": []}
    for step in range(40):
        tokens = out["ref"].argmax(-1).tolist()
        for name, runner in (("ref", ref), *runners.items()):
            rows = [RowFeed(s, [t], len(PROMPTS[s]) + step) for s, t in zip(PROMPTS, tokens)]
            out[name] = torch.log_softmax(runner.forward(rows), -1)
        for name in err:
            err[name].append((out[name] - out["ref"]).abs().max().item())
            agree[name].append((out[name].argmax(-1) == out["ref"].argmax(-1)).float().mean().item())
    assert max(err["fast"]) < 1.5 * max(err["generic"]) + 0.02
    assert sum(agree["fast"]) >= sum(agree["generic"]) - 2


def test_decode_graph_gemv_forced_equals_cublas(tiny_model_path):
    """Decode graphs with every projection forced onto the GEMV (gate/up with its SiLU·mul epilogue)
    and single-launch attention give the tokens of cuBLAS graphs without fusions (float32)."""
    _, fast = _runners(tiny_model_path, torch.float32)
    prompts = {1: list(range(50, 90)), 3: list(range(7, 19))}
    first = fast.forward([RowFeed(s, ids, 0) for s, ids in prompts.items()]).argmax(-1).tolist()
    saved = fast.cache.k.clone(), fast.cache.v.clone(), list(fast.cache.lengths)
    greedy = [SP(temperature=0.0)] * 2
    dec = fast.decoder
    assert dec.fuse_attention is None and dec.fuse_mlp  # the defaults (attention: one launch at one split)
    dec.use_gemv = dec.fuse_attention = dec.fuse_mlp = False
    starts = [len(p) for p in prompts.values()]
    toks_cublas, lps_cublas = fast.generate(list(prompts), first, starts, greedy, 20)
    fast.cache.k.copy_(saved[0])
    fast.cache.v.copy_(saved[1])
    fast.cache.restore_lengths(saved[2])
    fast.recapture()
    dec.use_gemv = dec.fuse_attention = dec.fuse_mlp = True
    dec._tune = lambda x, w, b, act=None: ("gemv", {})  # every projection of the graph on the GEMV
    toks, lps = fast.generate(list(prompts), first, starts, greedy, 20)
    assert dec._gemv_choice and all(dec._gemv_choice.values())
    assert any(key[-1] == "silu_mul" for key in dec._gemv_choice)  # gate/up took the fused epilogue
    assert toks == toks_cublas
    assert max(abs(a - b) for r1, r2 in zip(lps, lps_cublas) for a, b in zip(r1, r2)) < 1e-4


def test_programmatic_dependent_launch_changes_nothing(tiny_model_path, monkeypatch):
    """Programmatic dependent launch (the default; ``COMPACTION_GYM_PDL=0`` turns it off): decode
    graphs (every projection on the GEMV, both fusions) give bit-identical tokens and logprobs
    (the kernels only start earlier)."""
    from compaction_gym.engine.fast.kernels import _pdl_supported, pdl_enabled

    if not _pdl_supported(torch.cuda.current_device()):
        pytest.skip("programmatic dependent launch needs compute capability >= 9 and Triton >= 3.4")
    _, fast = _runners(tiny_model_path, torch.bfloat16)
    prompts = {1: list(range(50, 90)), 3: list(range(7, 19))}
    first = fast.forward([RowFeed(s, ids, 0) for s, ids in prompts.items()]).argmax(-1).tolist()
    saved = fast.cache.k.clone(), fast.cache.v.clone(), list(fast.cache.lengths)
    greedy = [SP(temperature=0.0)] * 2
    fast.decoder._tune = lambda x, w, b, act=None: ("gemv", {})
    out = {}
    for pdl in ("0", "1"):
        if pdl == "1":
            monkeypatch.delenv("COMPACTION_GYM_PDL", raising=False)
        else:
            monkeypatch.setenv("COMPACTION_GYM_PDL", pdl)
        assert pdl_enabled(fast.cache.k) == (pdl == "1")
        fast.cache.k.copy_(saved[0])
        fast.cache.v.copy_(saved[1])
        fast.cache.restore_lengths(saved[2])
        fast.recapture()
        out[pdl] = fast.generate(list(prompts), first, [len(p) for p in prompts.values()], greedy, 24)
    assert out["0"] == out["1"]


def test_generate_equals_forward_loop(tiny_model_path):
    _, fast = _runners(tiny_model_path, torch.float32)
    cache = fast.cache
    prompts = {1: list(range(50, 90)), 3: list(range(7, 19))}
    first = fast.forward([RowFeed(s, ids, 0) for s, ids in prompts.items()]).argmax(-1).tolist()
    saved_k, saved_v, saved_len = cache.k.clone(), cache.v.clone(), list(cache.lengths)
    loop, cur = [[], []], first
    for step in range(45):
        cur = fast.forward([RowFeed(s, [t], len(prompts[s]) + step) for s, t in zip(prompts, cur)]).argmax(-1).tolist()
        loop[0].append(cur[0])
        loop[1].append(cur[1])
    cache.k.copy_(saved_k)
    cache.v.copy_(saved_v)
    cache.restore_lengths(saved_len)
    greedy = [SP(temperature=0.0)] * 2
    toks, lps = fast.generate(list(prompts), first, [len(p) for p in prompts.values()], greedy, 45)
    assert toks == loop
    stop = loop[0][10]
    toks2, _ = fast.generate(list(prompts), [11, 12], [100, 100], greedy, 40, stop_token_ids=[stop])
    for row in toks2:
        assert stop not in row[:-1] and (row[-1] == stop or len(row) == 40)


@pytest.mark.parametrize("beta", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("target, n", [(150, 256), (300, 512)])  # C2's softmax in one tile / two passes
def test_compact_fast_equals_compact(dtype, beta, target, n):
    g = torch.Generator(device="cuda").manual_seed(7)
    rows, T, d = 24, 900, 128
    span = (100, 700)
    keys = torch.randn(rows, T, d, generator=g, device=CUDA).to(dtype)
    values = torch.randn(rows, T, d, generator=g, device=CUDA).to(dtype)
    queries = (1.5 * torch.randn(rows, n, d, generator=g, device=CUDA)).to(dtype)
    bias = torch.zeros(rows, T, device=CUDA)
    bias[:, 100:300] = torch.randn(rows, 200, generator=g, device=CUDA)
    for key_bias in (None, bias):
        kw = dict(compute_beta=beta, scale=d**-0.5, key_bias=key_bias)
        ref = compact(keys, values, queries, span, target, **kw)
        out = compact_fast(keys, values, queries, span, target, **kw)
        assert torch.equal(ref.indices, out.indices)
        assert torch.equal(ref.keys, out.keys)
        if beta:  # the fast NNLS stops earlier: judge β by what it is for, the span's mass and output
            objective = [mass_objective(keys, queries, span, r, key_bias) for r in (out, ref)]
            assert objective[0] < 1.01 * objective[1] + 1e-6
            errors = [output_error(keys, values, queries, span, r, key_bias) for r in (out, ref)]
            assert errors[0] < 1.05 * errors[1] + 1e-4
        else:
            # the reference solves C2 in float64, the fast path in the cache dtype: compare the values
            # loosely and the output error they give tightly
            assert rel(out.values, ref.values) < (5e-3 if dtype == torch.float32 else 2e-2)
            errors = [output_error(keys, values, queries, span, r, key_bias) for r in (out, ref)]
            assert errors[0] < 1.01 * errors[1] + (1e-5 if dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize("beta", [False, True])
def test_compact_fast_has_no_host_sync(beta):
    """One compaction over all rows (β's NNLS, C2's Cholesky and triangular solves) never waits
    for the device from the host (``torch.cuda.set_sync_debug_mode("error")`` raises if it does)."""
    g = torch.Generator(device="cuda").manual_seed(9)
    rows, T, d, n = 16, 600, 128, 128
    keys, values = (torch.randn(rows, T, d, generator=g, device=CUDA).to(torch.bfloat16) for _ in range(2))
    queries = torch.randn(rows, n, d, generator=g, device=CUDA).to(torch.bfloat16)
    bias = torch.randn(rows, T, generator=g, device=CUDA)
    kw = dict(compute_beta=beta, scale=d**-0.5, key_bias=bias)
    first = compact_fast(keys, values, queries, (50, 450), 100, **kw)  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = compact_fast(keys, values, queries, (50, 450), 100, **kw)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(out.indices, first.indices) and torch.equal(out.values, first.values)


def output_error(keys, values, queries, span, result, key_bias) -> float:
    """Relative error of the probes' attention output over the compacted cache (float64)."""
    k, v, q = keys.double(), values.double(), queries.double()
    bias = torch.zeros(k.shape[:2], dtype=torch.float64, device=k.device) if key_bias is None else key_bias.double()
    s = q @ k.mT * k.shape[-1] ** -0.5
    full = torch.softmax(s + bias[:, None], -1) @ v
    beta = result.beta.double() if result.beta is not None else torch.zeros_like(result.indices, dtype=torch.float64)
    kk = torch.cat([k[:, : span[0]], result.keys.double(), k[:, span[1] :]], 1)
    vv = torch.cat([v[:, : span[0]], result.values.double(), v[:, span[1] :]], 1)
    bb = torch.cat([bias[:, : span[0]], beta, bias[:, span[1] :]], 1)
    comp = torch.softmax(q @ kk.mT * k.shape[-1] ** -0.5 + bb[:, None], -1) @ vv
    return ((comp - full).norm() / full.norm()).item()


def mass_objective(keys, queries, span, result, key_bias) -> float:
    """Σ_i (Σ_sel exp(S_ij + β_j − lse_W(S_i + bias)) − 1)²: the span-mass error of the result's keys and β."""
    s = queries.double() @ keys.double().mT * keys.shape[-1] ** -0.5
    biased = s if key_bias is None else s + key_bias.double()[:, None, :]
    lse = torch.logsumexp(biased[:, :, span[0] : span[1]], -1, keepdim=True)
    kept = torch.gather(s, 2, result.indices[:, None, :].expand(-1, s.shape[1], -1))
    mass = torch.exp(kept + result.beta.double()[:, None, :] - lse).sum(-1)
    return (mass - 1).pow(2).sum().item()


@pytest.mark.parametrize("mode", ["attention_matching", "h2o"])
def test_engine_fast_equals_generic(tiny_model_path, mode):
    """Sessions through KV-budget compaction (suffix probes): same tokens, events and logprobs (float32)."""
    engines = {
        fast: Engine.from_pretrained(tiny_model_path, dtype=torch.float32, device="cuda", max_slots=4, capacity=1024, fast=fast)
        for fast in (False, True)
    }
    assert isinstance(engines[True].runner, FastModelRunner)
    cfg = CompactionConfig(mode=mode, max_kv_len=160, compact_window=64)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=48, ignore_eos=True)
    out = {}
    for fast, eng in engines.items():
        a = eng.create_session(list(range(20, 60)), cfg, greedy)
        b = eng.create_session(list(range(100, 111)), cfg, greedy)
        rs = eng.step_batch([StepRequest(a.session_id, list(range(5, 70))), StepRequest(b.session_id, [7, 8, 9])])
        out[fast] = [a, b, *rs]
    for r_gen, r_fast in zip(out[False], out[True]):
        assert r_gen.token_ids == r_fast.token_ids and r_gen.finish_reason == r_fast.finish_reason
        assert len(r_gen.events) == len(r_fast.events)
        for e1, e2 in zip(r_gen.events, r_fast.events):
            assert torch.equal(e1.indices, e2.indices)
        assert max(abs(x - y) for x, y in zip(r_gen.logprobs, r_fast.logprobs)) < 1e-3
    assert sum(len(r.events) for r in out[True]) > 0


def test_engine_fast_samples_the_generic_stream(tiny_model_path):
    """Sampled sessions (float32): the device sampler draws the generic sampler's stream, so the
    fast engine samples the generic engine's tokens, stops included."""
    engines = {
        fast: Engine.from_pretrained(tiny_model_path, dtype=torch.float32, device="cuda", max_slots=4, capacity=1024, fast=fast)
        for fast in (False, True)
    }
    cfg = CompactionConfig(mode="attention_matching", max_kv_len=128, compact_window=64)
    params = [SP(temperature=0.8, top_k=40, seed=1, max_new_tokens=90, ignore_eos=True),
              SP(temperature=1.0, top_p=0.9, seed=2, max_new_tokens=90, stop_token_ids=tuple(range(5, 300, 40)))]  # fmt: skip
    out = {}
    for fast, eng in engines.items():
        out[fast] = [eng.create_session(list(range(20 + 9 * i, 60 + 9 * i)), cfg, p) for i, p in enumerate(params)]
    for r_gen, r_fast in zip(out[False], out[True]):
        assert (r_gen.token_ids, r_gen.finish_reason) == (r_fast.token_ids, r_fast.finish_reason)
        assert max(abs(x - y) for x, y in zip(r_gen.logprobs, r_fast.logprobs)) < 1e-3
    assert out[True][0].events


def test_fast_engine_continuous_batching_equals_calls_one_by_one(tiny_model_path):
    """Fast path, float32: requests submitted between decode rounds of 1–32 steps (graph buckets
    change as rows join and leave) give the tokens of the same calls made one by one, through
    KV-budget compaction and seeded sampling."""
    from compaction_gym.engine import CreateRequest

    eng, ref = (
        Engine.from_pretrained(tiny_model_path, dtype=torch.float32, device="cuda", max_slots=8, capacity=1024, fast=True)
        for _ in range(2)
    )
    cfg = CompactionConfig(mode="attention_matching", max_kv_len=128, compact_window=64)
    reqs = [
        CreateRequest(list(range(20 + 7 * i, 40 + 9 * i)), cfg if i % 2 else None,
                      SP(temperature=0.0 if i % 3 else 0.9, seed=i, max_new_tokens=30 + 40 * i, ignore_eos=True), f"s{i}")
        for i in range(6)
    ]  # fmt: skip
    arrivals = {0: reqs[:2], 1: reqs[2:3], 3: reqs[3:5], 6: reqs[5:]}
    got, k = {}, 0
    while len(got) < len(reqs):
        if k in arrivals:
            eng.submit(arrivals[k])
        for r in eng.advance((1, 5, 32, 3)[k % 4]):
            got[r.session_id] = r
        k += 1
    for r in reqs:
        want = ref.create_session(r.prompt_ids, r.config, r.sampling, session_id=r.session_id)
        assert (got[r.session_id].token_ids, got[r.session_id].finish_reason) == (want.token_ids, want.finish_reason)
        assert [e.indices.tolist() for e in got[r.session_id].events] == [e.indices.tolist() for e in want.events]
        assert max(abs(x - y) for x, y in zip(got[r.session_id].logprobs, want.logprobs)) < 1e-4
    assert any(got[r.session_id].events for r in reqs)


def test_engine_decode_syncs_once_per_chunk(tiny_model_path, monkeypatch):
    """Decode through ``Engine.step`` waits for the device a few times per 32-step chunk, not per
    token: counting the synchronising calls ``torch.cuda.set_sync_debug_mode`` sees (pageable
    copies, ``tolist``) and every ``Event.synchronize``, 64 more tokens add a handful, where the
    token-by-token loop (chunks of one step) adds 64 or more."""
    import warnings

    waits = []
    plain_wait = torch.cuda.Event.synchronize
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: (waits.append(1), plain_wait(self))[1])
    eng = Engine.from_pretrained(tiny_model_path, dtype=torch.bfloat16, device="cuda", max_slots=2, capacity=1024)
    sid = eng.create_session(list(range(20, 60)), None, SP(temperature=0.0, max_new_tokens=8)).session_id

    def syncs(new_tokens: int) -> int:
        params = SP(temperature=0.7, seed=new_tokens, max_new_tokens=new_tokens, ignore_eos=True)
        torch.cuda.synchronize()
        waits.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                r = eng.step(sid, [7, 8, 9], params)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        assert len(r.token_ids) == new_tokens
        return len(waits) + sum("synchronizing" in str(w.message) for w in caught)

    syncs(32)  # captures the graphs
    few, many = syncs(32), syncs(96)
    eng.runner.chunk_steps = 1  # the token-by-token loop, for scale
    per_token = syncs(96) - syncs(32)
    print(f"waits for the device: 32 tokens {few}, 96 tokens {many}; token by token: +{per_token} for 64 tokens")
    assert many - few <= 8 and per_token >= 64


def test_engine_fast_bf16_with_beta_runs(tiny_model_path):
    """bf16 with β compaction and sampling: events fire, logprobs are finite, sessions stay consistent."""
    eng = Engine.from_pretrained(tiny_model_path, dtype=torch.bfloat16, device="cuda", max_slots=4, capacity=1024)
    assert eng.fast
    cfg = CompactionConfig(mode="attention_matching", max_kv_len=160, compact_window=64, compute_beta=True)
    r = eng.create_session(list(range(20, 60)), cfg, SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_new_tokens=150))
    assert r.events and all(torch.isfinite(torch.tensor(r.logprobs)))
    view = eng.session(r.session_id)
    assert view.kv_len == eng.read_cache(r.session_id)[0].shape[2] <= 160

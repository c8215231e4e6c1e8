"""Parts of the fast path that run on CPU: the decoder's layer loop and the device sampler.

On CPU (or without Triton) the fast decoder runs its torch references, so its packed weights,
rotary tables, flat varlen batches and device-resident ``generate`` loop are checked here against
the generic runner; the GPU kernels themselves are tested in ``test_fast_path.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from compaction_gym.engine.config import SamplingParams
from compaction_gym.engine.fast import FastModelRunner, graph_buckets, unsupported_reason
from compaction_gym.engine.fast.kernels import HAS_TRITON, _interpreting
from compaction_gym.engine.fast.sampler import DeviceSampling, sample_device
from compaction_gym.engine.model_runner import DecodeRow, ModelLayout, ModelRunner, RowFeed
from compaction_gym.engine.sampler import SampleStream, counter_uniform, sample, sampling_logprobs
from compaction_gym.engine.session import ProbeRing
from compaction_gym.engine.slot_cache import SlotKVCache


@pytest.fixture
def runners(tiny_model_path):
    from transformers import AutoModelForCausalLM

    from compaction_gym.engine.attention import register_attention

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_path, dtype=torch.float32, attn_implementation=register_attention()
    ).eval()
    layout = ModelLayout.from_model(model)
    caches = [SlotKVCache(layout.n_layers, layout.n_kv_heads, layout.head_dim, 4, 256, torch.float32, torch.device("cpu")) for _ in range(2)]
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    fast = FastModelRunner(model, caches[1], layout, cuda_graphs=False)
    for n, p in model.named_parameters():  # packing q/k/v and gate/up kept every value
        assert torch.equal(p, weights[n]), n
    return ModelRunner(model, caches[0], layout), fast


def test_decoder_equals_generic_runner(runners):
    generic, fast = runners
    for c in (generic.cache, fast.cache):
        c.beta[1, :, :, :6] = torch.linspace(-1, 1, 6)
        c.has_beta[1] = True
    feeds = lambda: [RowFeed(1, list(range(10, 30)), 0), RowFeed(3, list(range(40, 47)), 4), RowFeed(0, [5], 0)]  # noqa: E731
    assert torch.allclose(generic.forward(feeds()), fast.forward(feeds()), atol=1e-4)
    for step in range(3):  # mixed widths: decode rows beside a two-token row
        rows = lambda: [RowFeed(1, [7 + step], 20 + step), RowFeed(3, [9], 111 + step), RowFeed(0, [11, 12], 1 + 2 * step)]  # noqa: E731, B023
        assert torch.allclose(generic.forward(rows()), fast.forward(rows()), atol=1e-4)
    assert generic.cache.lengths == fast.cache.lengths
    n = generic.cache.lengths[1]
    assert torch.allclose(generic.cache.k[1, :, :, :n], fast.cache.k[1, :, :, :n], atol=1e-5)


def test_generate_equals_greedy_loop(runners):
    generic, fast = runners
    feeds = lambda: [RowFeed(1, list(range(10, 30)), 0), RowFeed(3, list(range(40, 47)), 5)]  # noqa: E731
    first = generic.forward(feeds()).argmax(-1).tolist()
    fast.forward(feeds())
    toks, cur = [[], []], first
    for t in range(6):
        cur = generic.forward([RowFeed(1, [cur[0]], 20 + t), RowFeed(3, [cur[1]], 12 + t)]).argmax(-1).tolist()
        toks[0].append(cur[0])
        toks[1].append(cur[1])
    out, lps = fast.generate([1, 3], first, [20, 12], [SamplingParams(temperature=0.0)] * 2, 6)
    assert out == toks
    assert generic.cache.lengths == fast.cache.lengths
    assert all(lp <= 0 for row in lps for lp in row)


def _chunk_rows(layout, stops: dict[int, frozenset[int]]) -> list[DecodeRow]:
    def ring():
        return ProbeRing(layout.n_layers, layout.n_q_heads, layout.head_dim, 6, torch.float32, torch.device("cpu"))

    SP = SamplingParams
    return [
        DecodeRow(0, 31, 20, 9, SP(temperature=0.0)),
        DecodeRow(1, 32, 7, 12, SP(temperature=0.9, top_k=20), SampleStream(5), recorder=ring()),
        DecodeRow(2, 33, 15, 30, SP(temperature=0.0), stop_ids=stops[2]),
        DecodeRow(3, 34, 4, 30, SP(temperature=1.2, top_p=0.8), SampleStream(6, 40), stops[3], ring()),
    ]


def test_decode_chunk_equals_generic_runner(runners):
    """The device loop (stops and limits applied on the device, per-step query recording) against
    the generic runner's step-by-step chunk: same tokens, streams, cache, recorded queries."""
    generic, fast = runners
    prompts = {0: range(10, 30), 1: range(40, 47), 2: range(60, 75), 3: range(5, 9)}
    for r in (generic, fast):
        r.forward([RowFeed(s, list(p), 0) for s, p in prompts.items()])
    # stop ids that end rows 2 and 3 mid-chunk: tokens the generic runner samples there (dry run)
    saved = generic.cache.k.clone(), generic.cache.v.clone(), list(generic.cache.lengths)
    dry = generic.decode_chunk(_chunk_rows(generic.layout, {2: frozenset(), 3: frozenset()}), 5)
    generic.cache.k.copy_(saved[0]), generic.cache.v.copy_(saved[1])
    generic.cache.restore_lengths(saved[2])
    stops = {2: frozenset({dry[2][0][3], 9999}), 3: frozenset({dry[3][0][2]})}
    results = {}
    for r in (generic, fast):
        rows = _chunk_rows(r.layout, stops)
        first = r.decode_chunk(rows, 5)
        going_on = [b for b, (t, _) in enumerate(first) if len(t) == 5 and rows[b].max_steps > 5]
        more = [DecodeRow(rows[b].slot, first[b][0][-1], rows[b].start + 5, rows[b].max_steps - 5, rows[b].params,
                          rows[b].stream, rows[b].stop_ids, rows[b].recorder) for b in going_on]  # fmt: skip
        second = r.decode_chunk(more, 32)
        results[r] = (first, second, rows)
    (g1, g2, grows), (f1, f2, frows) = results[generic], results[fast]
    assert [len(t) for t, _ in g1] == [5, 5, 4, 3] and [len(t) for t, _ in g2] == [4, 7]
    for a, b in zip(g1 + g2, f1 + f2):
        assert a[0] == b[0]
        assert max(abs(x - y) for x, y in zip(a[1], b[1])) < 1e-4
    assert [r.stream and r.stream.counter for r in grows] == [r.stream and r.stream.counter for r in frows]
    assert grows[1].stream.counter == 12 and grows[3].stream.counter == 43
    assert generic.cache.lengths == fast.cache.lengths == (29, 19, 19, 7)
    for slot, n in enumerate(generic.cache.lengths):
        assert torch.allclose(generic.cache.k[slot, :, :, :n], fast.cache.k[slot, :, :, :n], atol=1e-5)
    for b, fed in ((1, 12), (3, 3)):  # the queries of the last 6 tokens each row fed, in order
        (q_g, span_g), (q_f, span_f) = grows[b].recorder.select(0), frows[b].recorder.select(0)
        assert span_g == span_f == (grows[b].start + fed - min(fed, 6), grows[b].start + fed)
        assert torch.allclose(q_g, q_f, atol=1e-5)


def test_unsupported_reason(tiny_model):
    assert unsupported_reason(tiny_model) is None
    assert unsupported_reason(torch.nn.Linear(2, 2)) == "the model has no config"
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40]


def test_counter_uniform_is_uniform_and_reproducible():
    seeds = torch.full((20000,), 123, dtype=torch.long)
    u = counter_uniform(seeds, torch.arange(20000))
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.003
    hist = torch.histc(u, bins=10, min=0, max=1)
    assert (hist - 2000).abs().max() < 200
    assert torch.equal(u, counter_uniform(seeds, torch.arange(20000)))
    assert not torch.equal(u, counter_uniform(seeds + 1, torch.arange(20000)))


def test_device_and_host_samplers_share_the_stream():
    """Same seeds and counters, same logits: the device sampler picks the host sampler's tokens."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 80, generator=g) * 2
    params = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.1, top_k=9), SamplingParams(temperature=1.0, top_p=0.7)]
    streams = [SampleStream(11), SampleStream(12, 5), SampleStream(2**61 + 3, 7)]
    state = DeviceSampling(3, torch.device("cpu"))
    state.set(params, [st.seed for st in streams], [st.counter for st in streams])
    for _ in range(50):
        host, host_lp = sample(logits, params, streams)
        dev, dev_lp = sample_device(logits, state, greedy_only=False, filtered=True)
        assert dev.tolist() == host and torch.allclose(dev_lp, torch.tensor(host_lp), atol=1e-6)
    assert [st.counter for st in streams] == state.counter.tolist() == [50, 55, 57]


def test_device_sampler_matches_sampling_distribution():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=1.0),
    ]
    state = DeviceSampling(4, torch.device("cpu"))
    state.set(params, seeds=[1, 2, 3, 4], counters=[0, 0, 0, 0])
    ref = sampling_logprobs(logits, params)
    counts = torch.zeros(4, 50)
    for _ in range(3000):
        tok, lp = sample_device(logits, state, greedy_only=False, filtered=True)
        assert torch.allclose(lp, ref.gather(1, tok[:, None])[:, 0], atol=1e-5)
        counts[torch.arange(4), tok] += 1
    assert counts[0].argmax() == logits[0].argmax() and counts[0].max() == 3000
    assert torch.equal(state.counter, torch.tensor([0, 3000, 3000, 3000]))
    freq = counts[1:] / 3000
    assert (freq - ref[1:].exp()).abs().max() < 0.05  # every sampled row follows its distribution
    assert (counts[1:][ref[1:].isinf()] == 0).all()  # never outside the top-k / top-p support


def test_nnls_fista_reaches_the_nnls_optimum():
    """The FISTA NNLS of the fast compaction path (torch loop on CPU) vs the package's projected Newton."""
    from compaction_gym.compaction.beta import nnls
    from compaction_gym.engine.fast.nnls import nnls_fista, nnls_fista_torch

    g = torch.Generator().manual_seed(5)
    a = torch.rand(4, 200, 40, generator=g) ** 3
    a[1, :, 7] = 0  # a variable that no probe sees
    gram, rhs = a.mT @ a, a.sum(1)
    w = nnls_fista(gram, rhs)
    if HAS_TRITON and _interpreting():  # the kernel itself ran (interpreted), with its own rounding
        assert torch.allclose(w, nnls_fista_torch(gram, rhs), rtol=1e-4, atol=1e-5)
    else:
        assert torch.equal(w, nnls_fista_torch(gram, rhs))
    assert bool((w >= 0).all())

    def objective(w):
        return ((a @ w[:, :, None])[..., 0] - 1).pow(2).sum(-1)

    assert bool((objective(w) <= 1.01 * objective(nnls(gram, rhs)) + 1e-9).all())


def test_nnls_fista_respects_a_box_and_reaches_its_optimum():
    """β's box ``w ∈ [e⁻³, e³]`` in the FISTA NNLS (torch loop on CPU, the kernel when interpreted) vs the
    package's box-constrained projected Newton."""
    from compaction_gym.compaction.beta import nnls
    from compaction_gym.engine.fast.nnls import nnls_fista, nnls_fista_torch

    g = torch.Generator().manual_seed(6)
    a = torch.rand(4, 30, 40, generator=g) ** 4  # fewer probes than variables: the box binds
    gram, rhs = a.mT @ a + 1e-4 * torch.eye(40), a.sum(1) + 1e-4
    lo, hi = math.exp(-3), math.exp(3)
    w = nnls_fista(gram, rhs, 400, lower=lo, upper=hi)
    if HAS_TRITON and _interpreting():
        assert torch.allclose(w, nnls_fista_torch(gram, rhs, 400, lower=lo, upper=hi), rtol=1e-4, atol=1e-5)
    assert bool((w >= lo * (1 - 1e-6)).all()) and bool((w <= hi * (1 + 1e-6)).all())
    ref = nnls(gram.double(), rhs.double(), lower=lo, upper=hi)
    assert bool((ref <= lo * (1 + 1e-9)).any() | (ref >= hi * (1 - 1e-9)).any())  # a bound is active

    def objective(x):
        return 0.5 * torch.einsum("bi,bij,bj->b", x, gram.double(), x) - (rhs.double() * x).sum(-1)

    gap = objective(w.double()) - objective(ref)
    assert bool((gap <= 1e-3 * objective(ref).abs() + 1e-7).all())


@pytest.mark.parametrize("n", [8, 48, 200])
def test_fast_beta_weights_match_the_reference_fit(n):
    """The fast path's β fit (probe guard, ridge, box, safeguard) vs the package's float64 fit."""
    from compaction_gym.compaction.beta import BETA_BOUNDS, BETA_RIDGE, beta_weights, regularised_system
    from compaction_gym.engine.fast.compaction import fast_beta_weights

    g = torch.Generator().manual_seed(n)
    keys, queries = torch.randn(6, 80, 32, generator=g), 1.5 * torch.randn(6, n, 32, generator=g)
    span, t = (10, 70), 16
    s = queries @ keys.mT / 32**0.5
    idx = torch.sort(torch.randperm(60, generator=g)[:t]).values + span[0]
    kept = s[:, :, idx]
    lse_span = torch.logsumexp(s[:, :, span[0] : span[1]], -1)
    w = fast_beta_weights(kept, lse_span, half=False, iters=400)
    design = torch.exp(kept.double() - lse_span.double()[:, :, None])
    ref = beta_weights(design)
    if n < t:  # the guard: no β at all
        assert torch.equal(w, torch.ones_like(w)) and torch.equal(ref, torch.ones_like(ref))
        return
    lo, hi = (math.exp(b) for b in BETA_BOUNDS)
    assert bool((w >= lo * (1 - 1e-6)).all()) and bool((w <= hi * (1 + 1e-6)).all())

    gram, rhs = regularised_system(design.mT @ design, design.sum(1), BETA_RIDGE)

    def objective(x):
        return 0.5 * torch.einsum("bi,bij,bj->b", x, gram, x) - (rhs * x).sum(-1)

    assert bool((objective(w.double()) <= objective(ref) + 1e-3 * objective(ref).abs() + 1e-7).all())
    assert bool((objective(w.double()) <= objective(torch.ones_like(ref)) + 1e-7).all())


@pytest.mark.parametrize("mode", ["tova", "knorm"])
def test_engine_sessions_run_the_new_baselines(tiny_model_path, mode):
    """TOVA (suffix probes: the session records queries) and key norm (no probes) through KV-budget
    events, on the generic runner and the fast runner's CPU path: same tokens and kept rows for TOVA.
    (Key norm is not compared across runners: the tiny Qwen3 RMS-normalises keys (QK-norm), so span
    key norms nearly tie and rounding picks among them; docs/compaction.md.)"""
    from compaction_gym.engine import CompactionConfig, Engine
    from compaction_gym.engine.compactor import records_queries

    cfg = CompactionConfig(mode=mode, max_kv_len=64, compact_window=32, n_probe_queries=8)
    assert records_queries(cfg) == (mode == "tova")
    out = []
    for fast in (False, True):
        eng = Engine.from_pretrained(tiny_model_path, dtype=torch.float32, device="cpu", max_slots=1, capacity=256)
        if fast:
            eng.runner = eng.scheduler.runner = FastModelRunner(eng.model, eng.cache, eng.layout, cuda_graphs=False)
        out.append(eng.create_session(list(range(30, 46)), cfg, SamplingParams(temperature=0.0, max_new_tokens=130, ignore_eos=True)))
    ref, got = out
    assert len(ref.events) == len(got.events) >= 3 and ref.kv_len == got.kv_len <= 64
    for e1, e2 in zip(ref.events, got.events, strict=True):
        for e in (e1, e2):
            assert e.mode == mode and e.target == 8 and e.indices.shape[-1] == 8
            assert bool(((e.indices >= e.span[0]) & (e.indices < e.span[1])).all())
            assert bool((e.indices.diff(dim=-1) > 0).all())
        if mode == "tova":
            assert torch.equal(e1.indices, e2.indices)
    if mode == "tova":
        assert ref.token_ids == got.token_ids


def _play(tiny_model_path, fast: bool, chunk_steps: int) -> list:
    """Sessions through KV-budget events with suffix probes and budget messages, periodic budget
    messages (``inject_budget_every``), a stop token, sampled and greedy rows, on an engine whose
    runner runs ``chunk_steps``-step chunks."""
    from compaction_gym.engine import CompactionConfig, Engine, StepRequest

    eng = Engine.from_pretrained(tiny_model_path, dtype=torch.float32, device="cpu", max_slots=3, capacity=400)
    if fast:  # the fast runner on CPU: its torch references, no graphs (Engine(fast=True) needs CUDA)
        eng.runner = eng.scheduler.runner = FastModelRunner(eng.model, eng.cache, eng.layout, cuda_graphs=False, chunk_steps=chunk_steps)
    else:
        eng.runner.chunk_steps = chunk_steps
    am = CompactionConfig(mode="attention_matching", max_kv_len=136, compact_window=96, n_probe_queries=16,
                          inject_budget_message=True, max_total_tokens=150)  # fmt: skip
    h2o = CompactionConfig(mode="h2o", max_kv_len=64, compact_window=32, n_probe_queries=24)
    a = eng.create_session(list(range(20, 44)), am, SamplingParams(temperature=0.9, top_k=30, seed=1, max_new_tokens=120, ignore_eos=True))
    b = eng.create_session(list(range(50, 60)), h2o, SamplingParams(temperature=0.0, max_new_tokens=0))
    every = CompactionConfig(inject_budget_every=7, max_total_tokens=200)
    c = eng.create_session(list(range(7, 30)), every, SamplingParams(temperature=0.0, max_new_tokens=23, ignore_eos=True))
    stops = tuple(range(3, eng.layout.vocab_size, 9))  # a few tokens in
    rs = eng.step_batch([
        StepRequest(a.session_id, list(range(300, 340))),
        StepRequest(b.session_id, list(range(60, 75)), SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True)),
        StepRequest(c.session_id, [5, 6], SamplingParams(temperature=1.0, seed=4, max_new_tokens=40, stop_token_ids=stops)),
    ])  # fmt: skip
    return [a, b, c, *rs]


def test_engine_results_do_not_depend_on_runner_or_chunk_length(tiny_model_path):
    """Chunks of 1 step are the token-by-token loop; 5 and 32 steps cut the responses differently
    (events and stops inside and at the ends of chunks): same tokens, events and finish reasons,
    on the generic runner and on the fast runner's device loop."""
    ref = _play(tiny_model_path, fast=False, chunk_steps=1)
    assert sum(len(r.events) for r in ref) >= 4 and any(r.inject_ranges for r in ref)
    assert ref[-1].finish_reason == "stop" and len(ref[-1].token_ids) > 3
    assert len(ref[2].inject_ranges) == 3  # the periodic messages after sampled tokens 7, 14, 21
    for fast, chunk in ((False, 5), (False, 32), (True, 1), (True, 5), (True, 32)):
        for want, got in zip(ref, _play(tiny_model_path, fast, chunk)):
            assert (got.token_ids, got.finish_reason, got.kv_len) == (want.token_ids, want.finish_reason, want.kv_len)
            assert got.inject_ranges == want.inject_ranges
            assert [torch.equal(e1.indices, e2.indices) for e1, e2 in zip(want.events, got.events)] == [True] * len(want.events)
            assert len(got.events) == len(want.events)
            assert max((abs(x - y) for x, y in zip(want.logprobs, got.logprobs)), default=0) < 1e-4


def test_a_chunk_raises_when_a_tagged_hand_off_was_lost(runners):
    """A decode chunk checks the tagged launch's count of polls that gave up (CPU: the count set by
    hand, as a lost hand-off would leave it): it raises naming it, and the count restarts."""
    from compaction_gym.engine.fast.tagged import TaggedPlan

    _, fast = runners
    dec = fast.decoder
    empty = torch.zeros(0)
    dec._tagged = TaggedPlan(
        weights=empty, norms=empty, table=empty, words=empty, part=empty,
        state=torch.tensor([5, 0, 3], dtype=torch.int32), h0=empty, out=empty, versions=(),
    )  # fmt: skip
    try:
        fast.forward([RowFeed(0, list(range(10, 20)), 0)])
        rows = [DecodeRow(slot=0, token=3, start=10, params=SamplingParams(temperature=0.0), max_steps=4)]
        with pytest.raises(RuntimeError, match="gave up on 3 hand-off polls"):
            fast.decode_chunk(rows, 4)
        assert dec._tagged.faults() == 0 and fast.cache.length(0) == 10  # the chunk's steps not kept
        assert len(fast.decode_chunk(rows, 2)[0][0]) == 2 and fast.cache.length(0) == 12
    finally:
        dec._tagged = None

"""Parts of the fast path that run on CPU: the decoder's layer loop and the device sampler.

On CPU (or without Triton) the fast decoder runs its torch references, so its packed weights,
rotary tables, flat varlen batches and device-resident ``generate`` loop are checked here against
the generic runner; the GPU kernels themselves are tested in ``test_fast_path.py``.
"""

from __future__ import annotations

import pytest
import torch

from compaction_gym.engine.config import SamplingParams
from compaction_gym.engine.fast import FastModelRunner, graph_buckets, unsupported_reason
from compaction_gym.engine.fast.kernels import HAS_TRITON, _interpreting
from compaction_gym.engine.fast.sampler import DeviceSampling, counter_uniform, sample_device
from compaction_gym.engine.model_runner import ModelLayout, ModelRunner, RowFeed
from compaction_gym.engine.sampler import sampling_logprobs
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

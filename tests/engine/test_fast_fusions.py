"""The fast path's fused launches vs their references and vs the unfused kernels.

* single-launch split-K decode attention (the last split program of a (row, KV head) merges) vs
  ``decode_attention_ref`` and the two-kernel path;
* the gate/up GEMV with the SiLU·mul epilogue vs ``silu_mul_ref(linear(x, gate_up))`` and vs the
  plain GEMV followed by ``silu_mul``;
* the fast decoder with every projection on the GEMV and both fusions on vs the generic runner;
* greedy sampling's fused argmax + log-probability vs float64 ``log_softmax`` and a brute-force
  first-maximum search;
* the decode step's bookkeeping (record, stop, feed back) vs a row-by-row Python version.

They run the Triton kernels: under ``TRITON_INTERPRET=1`` on CPU (small shapes), or on a CUDA
device when one is present; without Triton, or on CPU without the interpreter, they skip. The
interpreter's ``tl.dot`` mishandles bfloat16, so it checks float16 instead (bf16 runs on CUDA).
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import triton_device

from compaction_gym.engine.fast.kernels import (
    _COUNTERS,
    argmax_logprob,
    argmax_logprob_ref,
    decode_advance,
    decode_advance_ref,
    silu_mul,
    silu_mul_ref,
)

DEV = triton_device()

from compaction_gym.engine.fast import attention as A  # noqa: E402
from compaction_gym.engine.fast.gemv import gemv, gemv_ref  # noqa: E402

HALF = torch.float16 if DEV.type == "cpu" else torch.bfloat16
SMS = 8  # multiprocessor count handed to the GEMV's split-K choice (any value is valid)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _attention_inputs(batch: int, group: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    n_kv, d, cap, n_slots = 2, 32, 96, 4
    kc = torch.randn(n_slots, n_kv, cap, d, generator=g).to(dtype)
    vc = torch.randn(n_slots, n_kv, cap, d, generator=g).to(dtype)
    beta = torch.randn(n_slots, n_kv, cap, generator=g) * 2  # β ≠ 0
    q = torch.randn(batch, n_kv * group, d, generator=g).to(dtype)
    slots = torch.randint(0, n_slots, (batch,), generator=g)
    lens = torch.tensor([96, 0, 17, 1, 64, 33][:batch])  # a zero-length (padding) row from batch 2 on
    return [t.to(DEV) for t in (q, kc, vc, beta, slots, lens)]


@pytest.mark.parametrize("batch, group", [(1, 1), (3, 2), (5, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_single_launch_decode_attention(batch, group, dtype):
    q, kc, vc, beta, slots, lens = _attention_inputs(batch, group, dtype, seed=batch * 10 + group)
    ref = A.decode_attention_ref(q, kc, vc, beta, slots, lens, 0.2)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    for splits in (1, 4, 8):
        kw = dict(num_splits=splits, block_n=16)
        fused = A.decode_attention(q, kc, vc, beta, slots, lens, 0.2, fused_merge=True, **kw)
        two = A.decode_attention(q, kc, vc, beta, slots, lens, 0.2, fused_merge=False, **kw)
        assert fused.dtype == dtype and fused.shape == q.shape
        assert rel(fused, ref) < tol, splits
        assert rel(fused, two) < (1e-6 if dtype == torch.float32 else 2e-3), splits
        if batch > 1:
            assert fused[1].abs().max() == 0  # the zero-length row
        again = A.decode_attention(q, kc, vc, beta, slots, lens, 0.2, fused_merge=True, **kw)
        assert torch.equal(fused, again)  # deterministic: splits merged in a fixed order
    for cnt in _COUNTERS.values():
        assert int(cnt.abs().sum()) == 0  # every launch left its counters at zero


def test_single_split_needs_no_workspace(monkeypatch):
    """num_splits == 1 stores the output directly: no partials, no counters, one launch."""
    q, kc, vc, beta, slots, lens = _attention_inputs(3, 2, torch.float32, seed=1)
    launches = []
    for name in ("_split_kernel", "_merge_kernel"):
        kernel = getattr(A, name)
        monkeypatch.setattr(A, name, _Spy(kernel, name, launches))
    monkeypatch.setattr(A, "launch_counters", lambda *a: pytest.fail("counters asked for"))
    out = A.decode_attention(q, kc, vc, beta, slots, lens, 0.2, num_splits=1, block_n=16)
    assert launches == ["_split_kernel"]
    assert rel(out, A.decode_attention_ref(q, kc, vc, beta, slots, lens, 0.2)) < 1e-5
    launches.clear()
    monkeypatch.undo()
    for name in ("_split_kernel", "_merge_kernel"):
        monkeypatch.setattr(A, name, _Spy(getattr(A, name), name, launches))
    A.decode_attention(q, kc, vc, beta, slots, lens, 0.2, num_splits=4, block_n=16)
    A.decode_attention(q, kc, vc, beta, slots, lens, 0.2, num_splits=4, block_n=16, fused_merge=False)
    assert launches == ["_split_kernel", "_split_kernel", "_merge_kernel"]


def _logits_with_ties(batch: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random logits with the cases a chunked argmax can get wrong planted in them."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, vocab, generator=g) * 4).to(dtype)
    top = float(logits.float().max()) + 1
    logits[0, vocab - 1] = logits[0, 3] = top  # equal maxima in the first and the last chunk
    if batch > 1:
        logits[1] = 0.5  # every logit equal: token 0, log-probability −log V
    if batch > 2:
        logits[2, : vocab // 2] = float("-inf")  # whole chunks of −inf
        logits[2, vocab - 2] = logits[2, vocab - 5] = top + 2  # equal maxima inside one chunk
    return logits


@pytest.mark.parametrize(
    "batch, vocab, block", [(1, 1000, 128), (5, 517, 64), (3, 4096, 4096), (4, 300, 4096), (32, 151936, 4096)]
)
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_argmax_logprob_matches_float64(batch, vocab, block, dtype):
    """Tokens: the first maximum of each row (brute force); log-probabilities: float64 ``log_softmax``."""
    if DEV.type == "cpu" and vocab > 10_000:
        pytest.skip("the real vocabulary is slow under the interpreter")
    logits = _logits_with_ties(batch, vocab, dtype, seed=vocab + batch)
    tokens, logp = argmax_logprob(logits.to(DEV), block=block)
    assert tokens.dtype == torch.long and logp.dtype == torch.float32 and tokens.shape == logp.shape == (batch,)
    exact = logits.double()
    first_max = [values.index(max(values)) for values in exact.tolist()]  # list.index: the first one
    assert tokens.cpu().tolist() == first_max
    want = exact.log_softmax(-1).gather(1, torch.tensor(first_max)[:, None])[:, 0]
    assert torch.allclose(logp.cpu().double(), want, rtol=1e-5, atol=1e-5)
    ref_tok, ref_lp = argmax_logprob_ref(logits.to(DEV))  # the torch path it replaces
    assert torch.equal(tokens, ref_tok) and torch.allclose(logp, ref_lp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch", [1, 5, 40])
@pytest.mark.parametrize("n_stops", [0, 3])
def test_decode_advance_matches_row_by_row(batch, n_stops):
    """Each live row records its sample at column ``step``, stops on a stop id or its last step
    (length 0, slot −1), else advances position, row and length; stopped and padding rows stay."""
    g = torch.Generator().manual_seed(batch + n_stops)
    tokens = torch.randint(0, 50, (batch,), generator=g)
    logprobs = -torch.rand(batch, generator=g)
    lens = torch.randint(0, 4, (batch,), generator=g) * torch.randint(1, 90, (batch,), generator=g)  # some 0
    lens[0] = 5
    state = torch.stack([
        torch.randint(0, 50, (batch,), generator=g), torch.randint(0, 900, (batch,), generator=g),
        torch.where(lens > 0, torch.randint(0, 8, (batch,), generator=g), -1), lens - 1, lens,
        torch.randint(1, 4, (batch,), generator=g),
        *[torch.where(torch.rand(batch, generator=g) < 0.3, tokens, torch.randint(-1, 50, (batch,), generator=g))
          for _ in range(n_stops)],
    ])  # fmt: skip
    state[5, 0] = 1  # row 0 uses its last step
    cols, step = 6, 2
    out_tok = torch.full((batch, cols), -7)
    out_lp = torch.zeros(batch, cols)
    want_state, want_tok, want_lp = state.clone(), out_tok.clone(), out_lp.clone()
    for b in range(batch):
        ids, pos, slot, row, n, left, *stops = state[:, b].tolist()
        tok = int(tokens[b])
        want_tok[b, step], want_lp[b, step] = tok, logprobs[b]
        if n > 0:
            left -= 1
            stopped = tok in stops or left <= 0
            want_state[:, b] = torch.tensor([tok, pos + 1, -1 if stopped else slot, row + 1, 0 if stopped else n + 1, left, *stops])
        else:
            want_state[0, b] = tok
    for impl in (decode_advance, decode_advance_ref):
        st, ot, ol, sp = state.clone().to(DEV), out_tok.clone().to(DEV), out_lp.clone().to(DEV), torch.tensor([step], device=DEV)
        impl(tokens.to(DEV), logprobs.to(DEV), st, ot, ol, sp)
        assert torch.equal(st.cpu(), want_state) and torch.equal(ot.cpu(), want_tok)
        assert torch.equal(ol.cpu(), want_lp) and int(sp) == step + 1
    assert int((want_state[4] == 0).sum()) > int((lens == 0).sum())  # some rows stopped


class _Spy:
    """Records ``kernel[grid](...)`` launches by name."""

    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.kernel[grid]


@pytest.mark.parametrize("m", [1, 3, 16, 17, 32])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_gemv_silu_mul_epilogue(m, dtype):
    """``gemv(x, [G; U], act="silu_mul")`` = ``silu_mul_ref(linear(x, [G; U]))``, split-K off and on."""
    g = torch.Generator().manual_seed(m)
    k, inter = 192, 72  # 72 output columns: the last tile is partial for every block_n
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    gate_up = (torch.randn(2 * inter, k, generator=g) * k**-0.5).to(dtype).to(DEV)
    bias = torch.randn(2 * inter, generator=g).to(dtype).to(DEV)
    ref = silu_mul_ref(torch.nn.functional.linear(x, gate_up))
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    for split in (1, 3):
        for bn in (16, 32):
            tiling = dict(split=split, block_n=bn, block_k=64, sm_count=SMS)
            y = gemv(x, gate_up, act="silu_mul", **tiling)
            assert y.shape == (m, inter) and y.dtype == dtype
            assert rel(y, ref) < tol, (split, bn)
            unfused = silu_mul(gemv(x, gate_up, **tiling))
            assert rel(y, unfused) < (1e-6 if dtype == torch.float32 else 2e-3)
            yb = gemv(x, gate_up, bias, act="silu_mul", **tiling)
            assert rel(yb, gemv_ref(x, gate_up, bias, act="silu_mul")) < tol
    # rows past the GEMV's 32 (and any unsupported operand) take the reference: same function
    x33 = torch.randn(33, k, generator=g).to(dtype).to(DEV)
    assert torch.equal(
        gemv(x33, gate_up, act="silu_mul"), silu_mul_ref(torch.nn.functional.linear(x33, gate_up))
    )


@pytest.fixture
def runners(tiny_model_path):
    from transformers import AutoModelForCausalLM

    from compaction_gym.engine.attention import register_attention
    from compaction_gym.engine.fast import FastModelRunner
    from compaction_gym.engine.model_runner import ModelLayout, ModelRunner
    from compaction_gym.engine.slot_cache import SlotKVCache

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_path, dtype=torch.float32, attn_implementation=register_attention()
    ).eval()
    model.to(DEV)
    layout = ModelLayout.from_model(model)
    caches = [
        SlotKVCache(layout.n_layers, layout.n_kv_heads, layout.head_dim, 4, 128, torch.float32, DEV)
        for _ in range(2)
    ]
    return ModelRunner(model, caches[0], layout), FastModelRunner(model, caches[1], layout, cuda_graphs=False)


class _EveryGemv(dict):
    """A tuner's choices that put every projection on the GEMV (fused where it can be)."""

    def get(self, key, default=None):
        return ("gemv", {"block_k": 64})


def test_decoder_all_fusions_equals_generic_runner(runners, monkeypatch):
    """Decode steps with fused attention, the fused gate/up epilogue and every projection on the
    GEMV (the kernels a captured graph holds, run eagerly here) give the generic runner's tokens."""
    from compaction_gym.engine.config import SamplingParams
    from compaction_gym.engine.model_runner import RowFeed

    generic, fast = runners
    dec = fast.decoder
    assert dec.fuse_attention is None and dec.fuse_mlp  # defaults: single-launch attention at one split
    dec.fuse_attention = True  # at every split count
    for c in (generic.cache, fast.cache):
        c.beta[1, :, :, :6] = torch.linspace(-1, 1, 6)
        c.has_beta[1] = True
    feeds = lambda: [RowFeed(1, list(range(10, 30)), 0), RowFeed(3, list(range(40, 47)), 5)]  # noqa: E731
    first = generic.forward(feeds()).argmax(-1).tolist()
    fast.forward(feeds())
    toks, cur = [[], []], first
    for t in range(5):
        cur = (
            generic.forward([RowFeed(1, [cur[0]], 20 + t), RowFeed(3, [cur[1]], 12 + t)]).argmax(-1).tolist()
        )
        toks[0].append(cur[0])
        toks[1].append(cur[1])
    calls = []
    real_gemv = gemv

    def spy_gemv(*args, **kw):
        calls.append(kw.get("act"))
        return real_gemv(*args, **kw)

    import compaction_gym.engine.fast.model as M

    monkeypatch.setattr(M, "gemv", spy_gemv)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # look choices up
    dec.graph_mode, dec._gemv_choice, dec.sm_count = True, _EveryGemv(), SMS
    out, _ = fast.generate([1, 3], first, [20, 12], [SamplingParams(temperature=0.0)] * 2, 5)
    assert out == toks
    layers = dec.n_layers
    assert calls.count("silu_mul") == 5 * layers and calls.count(None) == 5 * (3 * layers + 1)

"""One-pass replay (``method="one_pass"``) equals the segment-by-segment replay and the rollout.

The segment replay is the reference implementation (one forward per stretch between events, the
engine's own ``apply_event``); the rollout's recorded log-probs are the independent reference of
both. Sessions of several seeds, triggers and modes are replayed together (events of different
sessions at different tokens, several per session, chains of events that re-compact earlier
blocks), at temperature 1-2, with β on and off, gradients through the compacted blocks and stopped
at them: log-probs, entropies, logits and parameter gradients agree to float32 rounding.
"""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import example, given, settings
from replay_helpers import MODES, SAME, SAMPLING, TOL, TRIGGERS, max_sampled_diff, plain_session

from compaction_gym.engine import CompactionConfig
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.replay import replay_logprobs, replay_logprobs_batch
from compaction_gym.trainers.replay_plan import build_plan, one_pass_supported


def config(mode: str, trigger: str, **extra) -> CompactionConfig:
    return CompactionConfig(**MODES[mode], **TRIGGERS[trigger], n_probe_queries=16, **extra)


def both(model, views, **kwargs):
    """``(one_pass, segments)`` outputs, each with its parameter gradients when ``grad``."""
    results = []
    for method in ("one_pass", "segments"):
        model.zero_grad(set_to_none=True)
        out = replay_logprobs_batch(model, views, method=method, **kwargs)
        grads = None
        if kwargs.get("grad"):
            torch.stack([lp.sum() for lp in out.logprobs]).sum().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out, grads))
    model.zero_grad(set_to_none=True)
    return results


def assert_same(results, views) -> None:
    (a, ga), (b, gb) = results
    assert a.num_events == b.num_events
    for x, y, v in zip(a.logprobs, b.logprobs, views):
        assert (x.detach() - y.detach()).abs().max().item() < SAME
        assert max_sampled_diff(x, v) < TOL
    if ga is not None:
        assert ga.keys() == gb.keys() and ga
        for name in ga:
            scale = gb[name].abs().max().clamp_min(1e-12)
            assert ((ga[name] - gb[name]).abs().max() / scale).item() < 1e-4, name


@pytest.mark.parametrize("trigger", list(TRIGGERS))
@pytest.mark.parametrize("mode", list(MODES))
def test_one_pass_equals_segments_every_mode(engine, model, mode, trigger):
    views = [plain_session(engine, config(mode, trigger), seed=s, turns=4) for s in (5, 6)]
    assert all(len(v.events) >= 2 for v in views)
    assert_same(both(model, views, grad=True), views)


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    mode=st.sampled_from(["attention_matching+beta", "attention_matching", "markovian", "h2o"]),
    probes=st.sampled_from(["suffix", "keys", "random"]),
    temperature=st.sampled_from([1.0, 1.5, 2.0]),
    ratio=st.sampled_from([0.125, 0.25, 0.5]),
    through=st.booleans(),
)
def test_one_pass_equals_segments_batched(engine, model, seed, mode, probes, temperature, ratio, through):
    """Three sessions of other seeds, triggers and lengths in one call; gradients through the
    compacted blocks or stopped at them."""
    sampling = SAMPLING.replace(temperature=temperature)
    views = [
        plain_session(
            engine,
            config(mode, trigger, queries=probes, compact_target_ratio=ratio),
            seed=seed + k,
            turns=turns,
            sampling=sampling,
        )  # fmt: skip
        for k, (trigger, turns) in enumerate((("kv_budget", 4), ("turn", 3), ("kv_budget", 2)))
    ]
    results = both(model, views, grad=True, grad_through_compaction=through, temperature=temperature)
    assert_same(results, views)


def test_kv_budget_events_recompact_earlier_blocks(engine, model):
    """The KV-budget trigger's spans hold the previous event's block: C2 of one event reads the C2
    of the one before (a chain the one-pass replay solves level by level)."""
    views = [plain_session(engine, config("attention_matching+beta", "kv_budget"), seed=9, turns=5)]
    plan = build_plan(
        views, targets=[[p for p, m in enumerate(views[0].completion_mask) if m]], temperatures=[1.0],
        configs=[(16, 1e-4)], n_layers=2, n_kv_heads=2,
    )  # fmt: skip
    assert max(f.level for f in plan.fits) >= 3
    assert_same(both(model, views, grad=True), views)


def test_entropies_and_logits_match(engine, model):
    views = [
        plain_session(engine, config("attention_matching+beta", "kv_budget"), seed=11, turns=3),
        plain_session(engine, CompactionConfig(), seed=12, turns=1),
    ]
    a, b = (replay_logprobs_batch(model, views, method=m, compute_entropy=True, return_logits=True, temperature=1.3)
            for m in ("one_pass", "segments"))  # fmt: skip
    for x, y in zip(a.entropies, b.entropies):
        assert (x - y).abs().max().item() < SAME
    for x, y in zip(a.logits, b.logits):
        assert x.shape == y.shape and (x - y).abs().max().item() < 1e-4


def test_one_pass_refuses_what_it_cannot_replay(engine, model):
    """``repeat`` probes need a scratch forward over the cache: ``auto`` takes the segments, an explicit
    ``one_pass`` is refused with the reason; an unknown method is named."""
    view = plain_session(
        engine, config("attention_matching", "kv_budget", queries="repeat"), seed=13, turns=3
    )
    assert view.events and not one_pass_supported(list(view.events))
    with pytest.raises(InvalidArgumentError, match="repeat probes"):
        replay_logprobs(model, view, method="one_pass")
    assert max_sampled_diff(replay_logprobs(model, view, method="auto"), view) < TOL
    with pytest.raises(InvalidArgumentError, match="method must be one of"):
        replay_logprobs(model, view, method="layers")


def test_one_pass_checks_the_records_as_the_segments_do(engine, model):
    view = plain_session(engine, config("attention_matching", "kv_budget"), seed=41)
    first, *rest = view.events

    def with_first(**changes):
        return dataclasses.replace(view, events=(dataclasses.replace(first, **changes), *rest))

    for changes, message in (
        ({"kv_len_before": first.kv_len_before + 1}, "the rollout held"),
        ({"logical_span": (first.logical_span[0] + 1, first.logical_span[1])}, "stand for logical tokens"),
        ({"probe_logical_range": (0, first.logical_len + 5)}, "suffix probes need"),
        ({"kv_len_after": first.kv_len_after + 1}, "the rollout had"),
    ):
        for method in ("one_pass", "segments"):
            with pytest.raises(InvalidArgumentError, match=message):
                replay_logprobs(model, with_first(**changes), method=method)


def test_one_pass_refuses_kept_indices_outside_their_span(engine):
    """Kept indices out of order, past the span or far outside it (where their offset in the span
    would wrap in 16 bits and look ascending) are refused before anything is replayed."""
    view = plain_session(engine, config("attention_matching+beta", "kv_budget"), seed=43)
    first, *rest = view.events
    lo, hi = first.span
    n_layers, n_kv_heads = first.indices.shape[:2]

    def plan_with(indices):
        event = dataclasses.replace(first, indices=indices)
        build_plan([dataclasses.replace(view, events=(event, *rest))], targets=[[len(view.token_ids) - 1]],
                   temperatures=[1.0], configs=[(16, 1e-4)], n_layers=n_layers, n_kv_heads=n_kv_heads)  # fmt: skip

    plan_with(first.indices)  # as recorded: fine
    swapped, past, wrapped = first.indices.clone(), first.indices.clone(), first.indices.clone()
    swapped[0, 0, :2] = first.indices[0, 0, :2].flip(0)
    past[-1, -1, -1] = hi
    wrapped[0, 0, 1] = first.indices[0, 0, 0] + 1 + 2**16  # first + 1 + 65,536: "first + 1" in int16
    for indices in (swapped, past, wrapped):
        with pytest.raises(InvalidArgumentError, match=f"kept indices must be ascending inside span \\({lo}, {hi}\\)"):
            plan_with(indices)


def test_auto_is_segments_on_a_cpu(engine, model):
    view = plain_session(engine, config("attention_matching", "kv_budget"), seed=14, turns=2)
    auto = replay_logprobs(model, view)
    assert torch.equal(auto, replay_logprobs(model, view, method="segments"))


def test_fused_lm_head(engine, tiny_model_path):
    """With TRL's fused LM head the one pass scores through it (shifted labels), as the segments do."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    views = [
        plain_session(engine, config("attention_matching+beta", "kv_budget"), seed=16, turns=3),
        plain_session(engine, config("markovian", "turn"), seed=17, turns=2),
    ]
    a, b = (replay_logprobs_batch(model, views, method=m, fused_lm_head=True, compute_entropy=True)
            for m in ("one_pass", "segments"))  # fmt: skip
    for x, y, ex, ey, v in zip(a.logprobs, b.logprobs, a.entropies, b.entropies, views):
        assert (x - y).abs().max().item() < SAME and (ex - ey).abs().max().item() < SAME
        assert max_sampled_diff(x, v) < TOL


def test_a_failed_solve_falls_back_to_the_segments(engine, model, monkeypatch, caplog):
    """A value map whose normal equations do not factor sends the call to the segment replay (which
    has the pseudo-inverse fallback), found once after the forward."""
    import compaction_gym.trainers.replay_onepass as onepass

    real = onepass.factor_inverse

    def failing(chol):
        inv, finite = real(chol)
        return inv, finite & False

    monkeypatch.setattr(onepass, "factor_inverse", failing)
    view = plain_session(engine, config("attention_matching", "kv_budget"), seed=18, turns=3)
    with caplog.at_level("WARNING"):
        lp = replay_logprobs(model, view, method="one_pass")
    assert "replaying by segments" in caplog.text
    assert torch.equal(lp, replay_logprobs(model, view, method="segments"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_beta_folded_into_the_half_precision_product(dtype):
    """β carried by extra head-dim columns equals the float32 attention with β added to the logits
    (to the half-precision output's rounding), and differs from attention without β."""
    from compaction_gym.engine.attention import folded_bias_sdpa, grouped_sdpa

    g = torch.Generator().manual_seed(0)
    B, Hq, H, N, S, d = 3, 4, 2, 5, 9, 16
    q, k, v = (torch.randn(B, h, n, d, generator=g).to(dtype) for h, n in ((Hq, N), (H, S), (H, S)))
    beta = 3 * torch.randn(B, H, S, generator=g)
    allowed = torch.rand(B, 1, (Hq // H) * N, S, generator=g) < 0.7
    allowed[..., 0] = True
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    ref = grouped_sdpa(q, k, v, mask + beta[:, :, None, :], scaling=0.3, compute_dtype=torch.float32)
    out = folded_bias_sdpa(q, k, v, beta, mask.to(dtype), scaling=0.3)
    plain = grouped_sdpa(q, k, v, mask.to(dtype), scaling=0.3)
    tol = 2 * torch.finfo(dtype).eps * ref.float().abs().max().item()
    assert out.shape == ref.shape and out.dtype == dtype
    assert (out.float() - ref.float()).abs().max().item() < 4 * tol
    assert (plain.float() - ref.float()).abs().max().item() > 50 * tol


@pytest.mark.parametrize("grad", [False, True])
def test_beta_columns_added_once_per_layer_equal_folding_each_bucket(engine, model, monkeypatch, grad):
    """In a half-precision model one pass pads the layer's query, key and value rows once and writes
    β's columns into each bucket's gathered keys: log-probabilities and gradients equal folding each
    bucket separately through ``folded_bias_sdpa`` (the tested reference), several events per episode."""
    import copy

    from compaction_gym.engine.attention import folded_bias_sdpa, grouped_sdpa
    from compaction_gym.trainers import replay_onepass as rop

    views = [plain_session(engine, config("attention_matching+beta", "kv_budget"), seed=s, turns=4) for s in (0, 1)]
    assert all(v.events and len(v.events) >= 2 for v in views)
    half = copy.deepcopy(model).to(torch.bfloat16)

    def rows(x, idx, pieces):  # x[h, idx[h, j]] as [P, H, W, d] (a transposed view)
        H = x.shape[0]
        return torch.stack([x[h, idx[min(h, idx.shape[0] - 1)]] for h in range(H)]).reshape(
            H, pieces, -1, x.shape[-1]
        ).transpose(0, 1)

    def per_bucket(self, b, layer, q_rows, key_rows, value_rows, scaling):
        H, Hq, d = key_rows.shape[0], self._q_heads, q_rows.shape[-1]
        kp = rows(key_rows, b.keys.at(layer, H), b.pieces)
        vp = rows(value_rows, b.values.at(layer, H), b.pieces)
        qp = q_rows.index_select(0, b.qidx).reshape(b.pieces, Hq, b.queries, d)  # [P, H_q, n_q, d]
        mask = self._mask(b, q_rows.dtype, Hq // H)
        if b.bias is None:
            out = grouped_sdpa(qp, kp, vp, mask, scaling=scaling)
        else:
            bias = b.bias.at(layer, H).expand(H, -1).reshape(H, b.pieces, b.width).transpose(0, 1)
            out = folded_bias_sdpa(qp, kp, vp, bias, mask, scaling=scaling)
        return out.transpose(1, 2).reshape(b.pieces, H, -1, out.shape[-1])  # grouped by KV head

    def run():
        half.zero_grad(set_to_none=True)
        out = replay_logprobs_batch(half, views, method="one_pass", grad=grad)
        if grad:
            torch.stack([lp.float().sum() for lp in out.logprobs]).sum().backward()
        return [lp.detach() for lp in out.logprobs], {n: p.grad for n, p in half.named_parameters()}

    new, new_grads = run()
    monkeypatch.setattr(rop.OnePassReplay, "_folds", lambda self, x: False)
    monkeypatch.setattr(rop.OnePassReplay, "_bucket_attention", per_bucket)
    ref, ref_grads = run()
    for x, y in zip(new, ref):
        assert x.dtype == y.dtype and (x.float() - y.float()).abs().max().item() < 1e-6
    for name, g in new_grads.items():
        if grad:
            scale = ref_grads[name].float().abs().max().clamp_min(1e-12)
            assert ((g.float() - ref_grads[name].float()).abs().max() / scale).item() < 1e-2, name
        else:
            assert g is None and ref_grads[name] is None


@pytest.mark.parametrize("queries", ["suffix", "keys", "random"])
@pytest.mark.parametrize("mode", ["attention_matching+beta", "attention_matching"])
def test_value_map_backward_equals_autograd(engine, model, monkeypatch, mode, queries):
    """The value maps' hand-written backward equals autograd through the same float64 math (the
    solve, both softmaxes, the logits' product and the gathers), several chained events per
    session, two sessions batched, the padding probes of a short suffix included."""
    import copy

    import compaction_gym.trainers.replay_onepass as onepass

    views = [
        plain_session(engine, config(mode, "kv_budget", queries=queries), seed=s, turns=4) for s in (21, 22)
    ]
    assert all(len(v.events) >= 2 for v in views)
    model64 = copy.deepcopy(model).double()

    def grads() -> dict[str, torch.Tensor]:
        model64.zero_grad(set_to_none=True)
        out = replay_logprobs_batch(model64, views, method="one_pass", grad=True, temperature=1.5)
        torch.stack(
            [(lp * torch.linspace(0.5, 1.5, lp.numel(), dtype=lp.dtype)).sum() for lp in out.logprobs]
        ).sum().backward()
        return {n: p.grad.clone() for n, p in model64.named_parameters() if p.grad is not None}

    calls = []
    real = onepass._ValueMap.apply
    monkeypatch.setattr(onepass._ValueMap, "apply", lambda *a: calls.append(1) or real(*a))
    hand = grads()
    assert calls  # the hand-written backward ran
    monkeypatch.setattr(
        onepass._ValueMap, "apply", lambda replay, g, layer, tf32, q, k: replay._value_map(g, layer, q, k)
    )
    auto = grads()
    assert hand.keys() == auto.keys() and hand
    for name in hand:
        scale = auto[name].abs().max().clamp_min(1e-30)
        assert ((hand[name] - auto[name]).abs().max() / scale).item() < 1e-9, name


@settings(max_examples=40, deadline=None)
@example(seed=3, shape=(16, 32, 32), rank=1, noise=0.01, beta=2.0, padded=False)  # cond(A) 1.6e5
@given(
    seed=st.integers(0, 2**31 - 1),
    shape=st.sampled_from([(8, 32, 16), (16, 32, 32), (16, 64, 48), (32, 64, 40), (16, 32, 96)]),
    rank=st.integers(1, 4),
    noise=st.sampled_from([0.01, 0.05, 0.2, 1.0]),
    beta=st.sampled_from([0.0, 0.5, 2.0]),
    padded=st.booleans(),
)
def test_value_maps_round_as_the_least_squares_problem(seed, shape, rank, noise, beta, padded):
    """``C2 = M·V`` from the value maps is within ``4·eps·‖A⁻¹Xᵀ‖₂·‖P·V‖₂`` of the float64 solve of
    the same float32 designs ``X``, ``P``, per problem: the float32 rounding of the target ``P·V``
    amplified by the least-squares problem (``‖A⁻¹Xᵀ‖₂ ≤ 1/(2√λ)``), not by ``cond(A)`` (~1e5 at the
    ridge floor). Probes cluster around ``rank`` directions, as a sequence's queries do, which puts
    ``XᵀX``'s small eigenvalues below λ. The segment fit ``A⁻¹(Xᵀ(P·V) + λS·V)`` (the rollout's
    rounding) measured ≤ 0.86 of the bound, the value maps ≤ 1.5 (1,500 draws); the float32 ``XᵀP``
    they were once formed from, up to 80× (docs/grpo.md, "Numerics")."""
    from types import SimpleNamespace

    from compaction_gym.compaction.values import normal_matrix
    from compaction_gym.trainers.replay_onepass import OnePassReplay

    t, w, n = shape
    B, d = 8, 16
    g = torch.Generator().manual_seed(seed)
    keys, values = 2 * torch.randn(B, w, d, generator=g), torch.randn(B, w, d, generator=g)
    centres = torch.randn(B, rank, d, generator=g)[:, torch.arange(n) % rank]
    probes = 2 * (centres + noise * torch.randn(B, n, d, generator=g))
    kept = torch.sort(torch.rand(B, w, generator=g).argsort(-1)[:, :t], -1).values
    raw = (probes @ keys.mT) * d**-0.5
    bias = beta * torch.randn(B, 1, t, generator=g)
    x = torch.softmax(torch.gather(raw, 2, kept[:, None, :].expand(-1, n, -1)) + bias, -1)
    counts = torch.randint(n // 2, n + 1, (B,), generator=g) if padded else torch.full((B,), n)
    x = x * (torch.arange(n)[None, :] < counts[:, None])[:, :, None]  # padding probes' rows are zero
    attn = torch.softmax(raw, -1)
    group = SimpleNamespace(ridge=1e-4, probe_counts=counts, kept=kept[None], target=t)
    m, ok, _, _ = OnePassReplay._map_solve(None, group, 0, x, attn)  # reads nothing of the replay
    assert ok.all() and m.dtype == torch.float32

    x64, p64, v64 = x.double(), attn.double(), values.double()
    a, lam = normal_matrix(x64, 1e-4, counts)
    prior = lam[:, None, None] * torch.gather(v64, 1, kept[:, :, None].expand(-1, -1, d))
    exact = torch.linalg.solve(a, x64.mT @ (p64 @ v64) + prior)
    amplification = torch.linalg.matrix_norm(torch.linalg.solve(a, x64.mT), 2)
    bound = 4 * torch.finfo(torch.float32).eps * amplification * torch.linalg.matrix_norm(p64 @ v64, 2)
    error = (m.double() @ v64 - exact).abs().amax((1, 2))
    assert (error <= bound).all(), (error / bound).max().item()


@settings(max_examples=40, deadline=None)
@given(
    order=st.permutations([0, 1, 2]),
    shape=st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 5), st.integers(1, 4)),
    strided=st.booleans(),
)
def test_dense_rows_find_every_row(order, shape, strided):
    """The rows of an attention output ``[P, H, Q, D]`` in whatever memory order a kernel laid it out
    (a permutation of a contiguous tensor, or a strided view that must be copied) are found at
    ``piece·s_p + head·s_h + query·s_q`` (brute force over every index)."""
    from compaction_gym.trainers.replay_onepass import _dense_rows

    P, H, Q, D = shape
    base = torch.arange(P * H * Q * D * 2, dtype=torch.float64)
    physical = [shape[i] for i in order] + [D * (2 if strided else 1)]
    x = base[: int(torch.tensor(physical).prod())].reshape(physical)[..., :D]
    x = x.permute(*[order.index(i) for i in range(3)], 3)
    assert x.shape == (P, H, Q, D)
    rows, (n, sp, sh, sq) = _dense_rows(x)
    assert n == rows.shape[0] == P * H * Q and rows.shape[1] == D
    for p in range(P):
        for h in range(H):
            for q in range(Q):
                assert torch.equal(rows[p * sp + h * sh + q * sq], x[p, h, q])


@pytest.mark.parametrize("layout", [(0, 2, 1, 3), (2, 1, 0, 3)])
def test_attention_output_layout_does_not_change_the_replay(engine, model, monkeypatch, layout):
    """Attention kernels return their output in their own memory layout (cuDNN and flash: token-major);
    one pass reads the rows wherever they lie: log-probabilities and gradients equal those from a
    contiguous output, β on, several events."""
    import compaction_gym.trainers.replay_onepass as onepass

    views = [plain_session(engine, config("attention_matching+beta", "kv_budget"), seed=s, turns=4) for s in (5, 6)]
    assert all(len(v.events) >= 2 for v in views)

    def run():
        model.zero_grad(set_to_none=True)
        out = replay_logprobs_batch(model, views, method="one_pass", grad=True)
        torch.stack([lp.sum() for lp in out.logprobs]).sum().backward()
        return [lp.detach() for lp in out.logprobs], {n: p.grad.clone() for n, p in model.named_parameters()}

    ref, ref_grads = run()
    real = onepass.grouped_sdpa_heads
    inverse = [layout.index(i) for i in range(4)]

    def relaid(*args, **kwargs):
        out = real(*args, **kwargs)
        return out.permute(*layout).contiguous().permute(*inverse)

    monkeypatch.setattr(onepass, "grouped_sdpa_heads", relaid)
    got, grads = run()
    for x, y in zip(got, ref):
        assert torch.equal(x, y)
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name


def test_a_failing_flex_kernel_falls_back_once(engine, model, monkeypatch, caplog):
    """Where FlexAttention would run but fails to compile, the layer's β buckets take the float32
    path, the failure is logged once and later layers fold β into head-dim columns: log-probabilities
    within bf16 noise of the folded path (bf16, β, several events)."""
    import copy

    import compaction_gym.engine.fast.flex as flex
    import compaction_gym.trainers.replay_onepass as onepass

    views = [plain_session(engine, config("attention_matching+beta", "kv_budget"), seed=s, turns=4) for s in (7, 8)]
    half = copy.deepcopy(model).to(torch.bfloat16)
    folded = replay_logprobs_batch(half, views, method="one_pass")

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(flex, "_failure", None)
    monkeypatch.setattr(flex, "_compiled", broken)
    monkeypatch.setattr(onepass, "flex_bias_supported", lambda x: flex._failure is None)
    with caplog.at_level("WARNING"):
        got = replay_logprobs_batch(half, views, method="one_pass")
    assert flex._failure == "RuntimeError: no compiler here"
    assert caplog.text.count("FlexAttention failed") == 1
    for x, y in zip(got.logprobs, folded.logprobs):
        assert torch.isfinite(x).all() and (x.float() - y.float()).abs().max().item() < 0.1

"""``attention_mass_kept`` against a float64 loop, and the engine's ``CompactionEvent.mass_kept``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compaction_gym.compaction.events import CompactionEvent
from compaction_gym.compaction.mass import attention_mass_kept
from compaction_gym.errors import InvalidArgumentError


def reference_mass(keys, queries, span, indices, scale, key_bias=None, beta=None) -> float:
    """Mean over rows and probes of Σ_kept exp(s + b) / Σ_span exp(s + b), float64, one probe at a time."""
    k, q = keys.double().numpy(), queries.double().numpy()
    bias = np.zeros(k.shape[:2]) if key_bias is None else key_bias.double().numpy()
    ratios = []
    for b in range(k.shape[0]):
        kept = indices[b].tolist()
        block_bias = bias[b, kept] if beta is None else beta[b].double().numpy()
        for i in range(q.shape[1]):
            span_mass = sum(math.exp(scale * float(q[b, i] @ k[b, j]) + bias[b, j]) for j in range(*span))
            block_mass = sum(math.exp(scale * float(q[b, i] @ k[b, j]) + block_bias[m]) for m, j in enumerate(kept))
            ratios.append(block_mass / span_mass)
    return float(np.mean(ratios))


def _case(seed: int, b=3, total=20, n=5, d=8, span=(4, 16), t=5):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, total, d, generator=g)
    queries = torch.randn(b, n, d, generator=g)
    idx = torch.stack([torch.randperm(span[1] - span[0], generator=g)[:t].sort().values + span[0] for _ in range(b)])
    return keys, queries, idx, g


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_beta", [False, True])
def test_matches_a_float64_loop(with_bias, with_beta):
    keys, queries, idx, g = _case(0)
    bias = torch.randn(3, 20, generator=g) if with_bias else None
    beta = torch.randn(3, 5, generator=g) if with_beta else None
    got = attention_mass_kept(keys, queries, (4, 16), idx, scale=0.35, key_bias=bias, beta=beta)
    want = reference_mass(keys, queries, (4, 16), idx, 0.35, bias, beta)
    assert got == pytest.approx(want, rel=1e-5)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), t=st.integers(1, 12))
def test_a_selection_keeps_at_most_all_and_all_keeps_one(seed, t):
    keys, queries, idx, _ = _case(seed, t=t)
    assert 0.0 < attention_mass_kept(keys, queries, (4, 16), idx, scale=0.5) <= 1.0 + 1e-6
    whole = torch.arange(4, 16).expand(3, -1)
    assert attention_mass_kept(keys, queries, (4, 16), whole, scale=0.5) == pytest.approx(1.0, abs=1e-6)


def test_nothing_kept_is_zero_and_bad_shapes_are_named():
    keys, queries, _, _ = _case(1)
    assert attention_mass_kept(keys, queries, (4, 16), torch.zeros(3, 0, dtype=torch.long), scale=1.0) == 0.0
    with pytest.raises(InvalidArgumentError, match="span"):
        attention_mass_kept(keys, queries, (4, 30), torch.zeros(3, 1, dtype=torch.long), scale=1.0)
    with pytest.raises(InvalidArgumentError, match="queries"):
        attention_mass_kept(keys, queries[:2], (4, 16), torch.zeros(3, 1, dtype=torch.long), scale=1.0)
    with pytest.raises(InvalidArgumentError, match="beta"):
        attention_mass_kept(keys, queries, (4, 16), torch.full((3, 2), 5), scale=1.0, beta=torch.zeros(3, 3))


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(("mode", "beta"), [("h2o", False), ("attention_matching", True), ("markovian", False)])
def test_engine_events_record_the_mass_their_probes_keep(tiny_model_path, mode, beta):
    from compaction_gym.engine import CompactionConfig, Engine, SamplingParams

    engine = Engine.from_pretrained(
        tiny_model_path, dtype=torch.float32, device="cpu", max_slots=1, capacity=256, record_mass=True
    )
    cfg = CompactionConfig(mode=mode, queries="keys", n_probe_queries=8, compute_beta=beta)
    prompt = torch.randint(3, 400, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    r = engine.create_session(prompt, cfg, SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    keys, _, _ = engine.read_cache(r.session_id)  # [L, H, T, d]
    event = engine.compact(r.session_id, (4, 36), 0.25)
    lay = engine.layout
    if mode == "markovian":
        assert event.mass_kept == 0.0
    else:
        flat = keys.reshape(lay.n_layers * lay.n_kv_heads, keys.shape[2], keys.shape[3])
        lo, hi = event.probe_rows
        want = reference_mass(
            flat, flat[:, lo:hi], (4, 36), event.forced_indices(), lay.scale,
            beta=event.recorded_beta() if beta else None,
        )  # fmt: skip
        assert event.mass_kept == pytest.approx(want, rel=1e-4)
        assert (event.mass_kept < 1.0) if mode == "h2o" else (0.5 < event.mass_kept < 1.5)
    back = CompactionEvent.from_dict(event.to_dict())
    assert back.mass_kept == event.mass_kept and back == event
    old = event.to_dict()
    old.pop("mass_kept")
    assert CompactionEvent.from_dict(old).mass_kept is None and "mass_kept" not in CompactionEvent.from_dict(old).to_dict()
    engine.close(r.session_id)
    plain = Engine(engine.model, engine.tokenizer, max_slots=1, capacity=256)  # off by default
    r = plain.create_session(prompt, cfg, SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    assert plain.compact(r.session_id, (4, 36), 0.25).mass_kept is None


def test_chunks_of_rows_give_the_same_mean(monkeypatch):
    from compaction_gym.compaction import mass

    keys, queries, idx, g = _case(5, b=7)
    beta = torch.randn(7, 5, generator=g)
    whole = attention_mass_kept(keys, queries, (4, 16), idx, scale=0.3, beta=beta)
    monkeypatch.setattr(mass, "CHUNK_ELEMENTS", 2 * 5 * 12)  # two rows per chunk: 4 chunks, the last short
    assert attention_mass_kept(keys, queries, (4, 16), idx, scale=0.3, beta=beta) == pytest.approx(whole, rel=1e-6)
    assert whole == pytest.approx(reference_mass(keys, queries, (4, 16), idx, 0.3, beta=beta), rel=1e-5)

"""``repeat`` probes: the engine's scratch forward against a plain Hugging Face forward, and refusals.

The harvested queries of ``[prompt | probe tokens]`` fed over a session's (uncompacted) cache must
equal the post-RoPE queries of the same tokens in one plain HF forward of the whole sequence,
captured independently of the engine (docs/compaction.md, "Probes").
"""

from __future__ import annotations

import pytest
import torch

from compaction_gym.compaction import compact
from compaction_gym.engine import CompactionConfig, Engine, SamplingParams
from compaction_gym.engine.compactor import repeat_tokens
from compaction_gym.errors import InvalidArgumentError

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NO_SAMPLING = SamplingParams(max_new_tokens=0, seed=0)


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return Engine.from_pretrained(tiny_model_path, dtype=torch.float32, device="cpu", max_slots=2, capacity=256)


def hf_queries(model, ids: list[int], monkeypatch) -> torch.Tensor:
    """Post-RoPE queries ``[L, H_q, n, d]`` of a plain HF forward of ``ids`` (RoPE's output, captured)."""
    import importlib

    mod = importlib.import_module(type(model).__module__)
    captured = []
    orig = mod.apply_rotary_pos_emb

    def rope(q, k, cos, sin, *args, **kwargs):
        q2, k2 = orig(q, k, cos, sin, *args, **kwargs)
        captured.append(q2[0].detach())
        return q2, k2

    monkeypatch.setattr(mod, "apply_rotary_pos_emb", rope)
    with torch.no_grad():
        model(torch.tensor([ids]))
    return torch.stack(captured)


@pytest.mark.parametrize("chunk", [64, 5])
def test_harvested_queries_equal_a_plain_forward(engine, tiny_model, monkeypatch, chunk):
    prompt = list(range(3, 40))
    probe = [7, 8, 9, *range(50, 70)]
    r = engine.create_session(prompt, CompactionConfig(), NO_SAMPLING)
    slot = engine.scheduler.sessions[r.session_id].slot
    k0, v0, _ = (t.clone() for t in engine.cache.rows(slot))
    from compaction_gym.engine.compactor import harvest_queries

    got = harvest_queries(engine.runner, engine.cache, slot, probe, len(prompt), chunk)
    ref = hf_queries(tiny_model, prompt + probe, monkeypatch)[:, :, len(prompt) :]
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # the slot is unchanged: same length, same rows, and the session continues as before
    assert engine.cache.length(slot) == len(prompt)
    k1, v1, _ = engine.cache.rows(slot)
    assert torch.equal(k0, k1) and torch.equal(v0, v1)
    engine.close(r.session_id)


def test_repeat_event_records_its_tokens(engine):
    cfg = CompactionConfig(mode="attention_matching", queries="repeat", max_kv_len=48, n_probe_queries=8)
    r = engine.create_session(list(range(3, 19)), cfg, NO_SAMPLING)
    for a in range(30, 110, 8):  # the KV-budget trigger fires between steps
        engine.step(r.session_id, list(range(a, a + 8)), NO_SAMPLING)
    view = engine.session(r.session_id)
    assert len(view.events) >= 2
    prompt = engine.compactor.repeat_prompt
    assert prompt == engine.tokenizer.encode("\n\nRepeat the previous text exactly.\n\n", add_special_tokens=False)
    for e in view.events:
        a, b = e.logical_span
        assert e.probe_tokens == (*prompt, *view.token_ids[b - 8 : b])
    engine.close(r.session_id)


def test_repeat_tokens_fit_the_slot():
    assert repeat_tokens([1, 2], list(range(10, 20)), 4, 100) == [1, 2, 16, 17, 18, 19]
    assert repeat_tokens([1, 2], list(range(10, 20)), 40, 5) == [1, 2, 17, 18, 19]  # room for 3 span tokens
    with pytest.raises(InvalidArgumentError, match="queries='repeat'"):
        repeat_tokens([1, 2], [5], 4, 2)


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"queries": "repeats"}, "queries"),
        ({"queries": "repeat+suffix"}, "queries"),
        ({"refit_values": "no"}, "refit_values"),
        ({"refit_values": False, "mode": "h2o"}, "refit_values"),
    ],
)
def test_bad_values_are_refused_naming_the_field(fields, name):
    base = {"mode": "attention_matching", "max_kv_len": 64}
    with pytest.raises(InvalidArgumentError, match=name):
        CompactionConfig(**{**base, **fields})


def test_compact_refuses_a_non_bool_refit_values():
    k, v, q = torch.randn(2, 16, 8), torch.randn(2, 16, 8), torch.randn(2, 4, 8)
    with pytest.raises(InvalidArgumentError, match="refit_values"):
        compact(k, v, q, (0, 8), 2, refit_values=1)


def test_kept_values_keep_selection():
    """``refit_values=False``: same indices as the refit, values gathered (β: test_compaction_kept_values)."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 3, 32, 8, generator=g, dtype=torch.float64)
    q = torch.randn(3, 40, 8, generator=g, dtype=torch.float64)
    fit = compact(k, v, q, (4, 28), 6, compute_beta=True)
    kept = compact(k, v, q, (4, 28), 6, compute_beta=True, refit_values=False)
    assert torch.equal(fit.indices, kept.indices)
    assert torch.equal(kept.values, torch.stack([v[b, fit.indices[b]] for b in range(3)]))


def test_engine_without_tokenizer_refuses_repeat(tiny_model):
    eng = Engine(tiny_model, None, max_slots=1, capacity=64)
    cfg = CompactionConfig(mode="attention_matching", queries="repeat", max_kv_len=32)
    with pytest.raises(InvalidArgumentError, match="queries"):
        eng.create_session([3, 4, 5], cfg, NO_SAMPLING)

"""Who owns what: the caller's model is left alone, the cache alone writes slot lengths, the
scheduler opens, forks and drops sessions (docs/engine.md, "Ownership")."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import make_prompt, plain_logprobs
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from compaction_gym.engine import CompactionConfig, Engine, SamplingParams
from compaction_gym.engine.attention import ATTENTION_NAME, EngineForward
from compaction_gym.engine.sampler import SampleStream
from compaction_gym.engine.slot_cache import SlotKVCache

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


def _modes(model: torch.nn.Module) -> dict[str, bool]:
    return {name: m.training for name, m in model.named_modules()}


def test_engine_leaves_the_callers_model_alone(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model.train()
    model.model.layers[0].eval()  # mixed modes come back exactly
    attn, modes = model.config._attn_implementation, _modes(model)
    assert attn != ATTENTION_NAME
    probe = torch.tensor([make_prompt(20, seed=1)])
    with torch.no_grad():
        before = model(probe).logits

    engine = Engine(model, max_slots=2, capacity=256, fast=False)
    assert model.config._attn_implementation == attn and _modes(model) == modes
    cfg = CompactionConfig(mode="markovian", max_kv_len=20, compact_window=8)
    r = engine.create_session(make_prompt(10, seed=2), cfg, GREEDY)
    assert model.config._attn_implementation == attn and _modes(model) == modes
    fid = engine.fork(r.session_id)
    engine.step(r.session_id, [5, 6, 7])
    engine.step(fid, [8, 9])
    engine.compact(fid, span=(2, 6), ratio=0.5)
    assert engine.session(r.session_id).events  # KV-budget events ran through the engine too
    assert model.config._attn_implementation == attn and _modes(model) == modes
    with torch.no_grad():
        after = model(probe).logits
    assert torch.equal(before, after)


def test_engine_forwards_run_its_attention_in_eval_mode(tiny_model_path):
    """A training-mode model given to the engine scores like a plain eval-mode forward (reference:
    HF's own SDPA attention), and every module is in eval mode and on the engine's attention
    during the engine's forwards."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model.train()
    seen: list[tuple[str, bool]] = []
    layer = model.model.layers[1]
    hook = layer.register_forward_pre_hook(
        lambda m, a: seen.append((model.config._attn_implementation, m.training))
    )
    engine = Engine(model, max_slots=1, capacity=128, fast=False)
    prompt = make_prompt(16, seed=3)
    r = engine.create_session(prompt, sampling=GREEDY)
    hook.remove()
    assert seen and set(seen) == {(ATTENTION_NAME, False)}
    assert model.training and model.config._attn_implementation != ATTENTION_NAME
    model.eval()
    ref = plain_logprobs(model, prompt + r.token_ids)
    expected = [ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(r.token_ids)]
    assert r.token_ids == [int(ref[len(prompt) - 1 + i].argmax()) for i in range(len(r.token_ids))]
    assert r.logprobs == pytest.approx(expected, abs=1e-4)


def test_engine_forward_restores_every_config_even_on_error(tiny_model):
    config = tiny_model.config
    before = config._attn_implementation
    with pytest.raises(RuntimeError, match="boom"), EngineForward(tiny_model):
        assert config._attn_implementation == ATTENTION_NAME and not tiny_model.training
        raise RuntimeError("boom")
    assert config._attn_implementation == before


# ------------------------------------------------------------------ the slot cache's lengths
_OPS = st.lists(
    st.tuples(st.sampled_from(["alloc", "advance", "replace", "copy", "release"]), st.integers(0, 10**6)),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(_OPS)
def test_slot_lengths_follow_the_cache_methods(ops):
    """Against a plain-list model of the lengths: advance adds, replace_span sets
    ``start + t + (old - end)``, copy_slot copies, allocate/release reset; reads are copies."""
    cache = SlotKVCache(2, 1, 4, 3, 32, torch.float32, torch.device("cpu"))
    ref = [0, 0, 0]
    live: list[int] = []
    for op, x in ops:
        if op == "alloc" and cache.can_allocate():
            slot = cache.allocate()
            assert slot == min(set(range(3)) - set(live))
            live.append(slot)
            ref[slot] = 0
        elif op == "release" and live:
            slot = live.pop(x % len(live))
            cache.release(slot)
            ref[slot] = 0
        elif op == "advance" and live:
            slot = live[x % len(live)]
            n = x % (cache.capacity - ref[slot] + 1)
            assert cache.advance(slot, n) == ref[slot] + n
            ref[slot] += n
        elif op == "replace" and live:
            slot = live[x % len(live)]
            old = ref[slot]
            start = x % (old + 1)
            end = start + (x // 7) % (old - start + 1)
            t = (x // 11) % (end - start + 1)
            block = torch.zeros(2, t, 4)
            assert cache.replace_span(slot, (start, end), block, block, None) == start + t + old - end
            ref[slot] = start + t + old - end
        elif op == "copy" and len(live) >= 2:
            src, dst = live[x % len(live)], live[(x + 1) % len(live)]
            cache.copy_slot(src, dst)
            ref[dst] = ref[src]
        assert [cache.length(s) for s in range(3)] == ref == list(cache.lengths)
    with pytest.raises(TypeError):  # read-only: the cache is the only writer
        cache.lengths[0] = 99
    assert cache.length(0) == ref[0]


# ------------------------------------------------------------------ sessions and the scheduler
def test_scheduler_opens_forks_and_drops_sessions(engine):
    cfg = CompactionConfig(mode="attention_matching", max_kv_len=64, queries="suffix", n_probe_queries=8)
    r = engine.create_session(
        make_prompt(12, seed=4), cfg, SamplingParams(temperature=1.0, seed=5, max_new_tokens=4)
    )
    sched = engine.scheduler
    src = sched.get(r.session_id)
    assert src.probes is not None and src.probes.capacity == 8
    fid = engine.fork(r.session_id)
    new = sched.get(fid)
    assert new.slot != src.slot and engine.cache.length(new.slot) == engine.cache.length(src.slot)
    # the clone shares nothing mutable with its source
    for name in ("token_ids", "completion_mask", "logprobs", "events", "turn_starts"):
        assert getattr(new, name) == getattr(src, name) and getattr(new, name) is not getattr(src, name)
    assert new.row_map is not src.row_map and new.row_map.segments == src.row_map.segments
    assert new.probes is not src.probes and torch.equal(new.probes.queries, src.probes.queries)
    assert new.stream is not src.stream and (new.stream.seed, new.stream.counter) == (
        src.stream.seed,
        src.stream.counter,
    )
    assert new.config is src.config and new.sampling is src.sampling  # frozen: shared
    new.token_ids.append(1)
    new.stream.counter += 3
    assert len(src.token_ids) == len(new.token_ids) - 1 and src.stream.counter == new.stream.counter - 3
    free = engine.num_free_slots
    engine.close(fid)
    assert fid not in sched.sessions and engine.num_free_slots == free + 1


def test_session_clone_copies_kept_logits(engine):
    r = engine.create_session(make_prompt(9, seed=6), sampling=GREEDY.replace(max_new_tokens=0))
    src = engine.scheduler.get(r.session_id)
    clone = src.clone("other", slot=3)
    assert (clone.session_id, clone.slot) == ("other", 3) and (src.session_id, src.slot) != ("other", 3)
    assert clone.last_logits is not src.last_logits and torch.equal(clone.last_logits, src.last_logits)
    assert isinstance(clone.stream, SampleStream)

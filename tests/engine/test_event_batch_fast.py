"""Stacked events through the fused Attention Matching kernels (``compact_fast``): each event's block
equals the one ``compact_fast`` gives it alone, padding rows (bias −inf) and shifted spans included.

Run under ``TRITON_INTERPRET=1`` on CPU (small shapes, float32 and float16: the interpreter's
``tl.dot`` mishandles bfloat16) or on a CUDA device, where a Qwen3-4B-shaped group of 64 events (the
``bench_sessions`` shape) also runs; without Triton, or on CPU without the interpreter, they skip.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import stacked_blocks, triton_device

DEV = triton_device()

from types import SimpleNamespace  # noqa: E402

from compaction_gym.engine.event_batch import PendingEvent, group_events  # noqa: E402
from compaction_gym.engine.fast import compact_fast  # noqa: E402

HALF = torch.float16 if DEV.type == "cpu" else torch.bfloat16


def event(seed, rows, start, kv_len, span_len, n, d, with_bias, dtype):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def rand(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device=DEV) * s).to(dtype)

    bias = torch.randn(rows, kv_len, generator=g, device=DEV) * 0.5 if with_bias else None
    cfg = SimpleNamespace(mode="attention_matching", compute_beta=True, ridge=1e-4, refit_values=True)
    return PendingEvent(
        session=SimpleNamespace(config=cfg), span=(start, start + span_len), trigger="kv_budget",
        target=span_len // 4, index=0, logical_span=(start, start + span_len), kv_len_before=kv_len,
        keys=rand(rows, kv_len, d, s=2.0), values=rand(rows, kv_len, d), key_bias=bias,
        queries=rand(rows, n, d, s=2.0), query_positions=None,
    )  # fmt: skip


def run_alone(p):
    return compact_fast(p.keys, p.values, p.queries, p.span, p.target, compute_beta=True, key_bias=p.key_bias)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("probes", [(48, 48, 48), (48, 40, 33)])
def test_fused_stacked_events_match_each_alone(dtype, probes):
    """Events 0 and 1 start their span at the stacked start (the bench's case): their stacked rows
    are their own rows plus padding that adds exact zeros, and padding probes add exact zeros to the
    importance, so the kernels select what they select alone; event 2 is shifted, which moves the
    prefix's log-sum-exp blocks, a rounding-level change."""
    d, rows = 64, 4
    events = [
        event(0, rows, 20, 90, 32, probes[0], d, False, dtype),
        event(1, rows, 20, 120, 32, probes[1], d, True, dtype),
        event(2, rows, 8, 100, 32, probes[2], d, True, dtype),
    ]
    for i, (p, got) in enumerate(
        zip(events, stacked_blocks(events, compute_beta=True, compact_fn=compact_fast))
    ):
        ref = run_alone(p)
        if i < 2 or dtype == torch.float32:
            assert torch.equal(got.indices, ref.indices)
        else:
            assert (got.indices == ref.indices).float().mean() > 0.95
        same = (got.indices == ref.indices).all(dim=1)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert rel(got.beta[same], ref.beta[same]) < tol
        assert rel(got.values[same], ref.values[same]) < tol
        assert torch.equal(got.keys[same], ref.keys[same])


@pytest.mark.gpu
def test_bench_shaped_group_runs_and_matches():
    """64 Qwen3-4B-shaped events (288 rows each, 424 to 1,024 probes, 256-row spans → 64) as the
    engine splits them: every call fits, and sampled events equal their lone blocks."""
    d, rows, dtype = 128, 36 * 8, torch.bfloat16
    events = [
        event(i, rows, 200, 456 + (i * 7) % 56, 256, 1024 - 200 * (i % 4), d, i % 3 > 0, dtype)
        for i in range(64)
    ]
    calls = group_events(events, rows)
    assert sum(len(c) for c in calls) == 64 and len(calls) > 1
    for call in calls:
        blocks = stacked_blocks([events[i] for i in call], compute_beta=True, compact_fn=compact_fast)
        for i, got in zip(call, blocks):
            if i % 16 not in (0, 5):  # full and padded probe counts
                continue
            ref = run_alone(events[i])
            assert torch.equal(got.indices, ref.indices)
            assert rel(got.beta, ref.beta) < 2e-2 and rel(got.values, ref.values) < 2e-2
        del blocks


@pytest.mark.gpu
@pytest.mark.parametrize("compute_beta", [True, False])
def test_fast_engine_stacked_sessions_equal_lone_ones(tiny_model_path, compute_beta):
    """The fast engine (fused kernels, decode chunks on the device; float32, so that a cuBLAS
    product's rounding cannot flip a greedy token): four sessions of one prompt length (equal span
    starts, as in the bench) give the same tokens and events stacked and alone, and events were
    stacked."""
    from test_batched_events import BUDGET, GREEDY, assert_same_sessions, rollout, workload

    from compaction_gym.engine import CompactionConfig, Engine

    engine = Engine.from_pretrained(
        tiny_model_path, dtype=torch.float32, device="cuda", max_slots=4, capacity=512, fast=True
    )
    assert engine.fast and engine.compactor.batch_events  # on by default on CUDA
    cfg = CompactionConfig(mode="attention_matching", compute_beta=compute_beta, **BUDGET)
    prompts, inputs = workload(4, [16] * 4, seed=11)
    stacked = rollout(engine, [cfg] * 4, prompts, inputs, GREEDY, stacked=True)
    alone = rollout(engine, [cfg] * 4, prompts, inputs, GREEDY, stacked=False)
    rows = engine.layout.n_layers * engine.layout.n_kv_heads
    assert max(stacked[2]) > rows
    assert_same_sessions(stacked, alone, 1e-4)


@pytest.mark.gpu
def test_a_stacked_round_waits_for_the_device_only_for_its_copy_back(tiny_model_path, monkeypatch):
    """Every operation of a round (probes, stacking, scoring, write-back, records) is launched
    without a host synchronisation; the round waits once per call, on its copy back's CUDA event
    (which ``set_sync_debug_mode`` does not count). A Python number written through an index, or a
    blocking copy, would raise here (docs/engine.md, "Batched events")."""
    from test_batched_events import BUDGET, GREEDY, rollout, workload

    from compaction_gym.engine import CompactionConfig, Engine
    from compaction_gym.engine.compactor import Compactor

    engine = Engine.from_pretrained(
        tiny_model_path, dtype=torch.bfloat16, device="cuda", max_slots=4, capacity=512, fast=True
    )
    rounds = []
    compact_many = Compactor.compact_many

    def strict(self, requests):
        torch.cuda.set_sync_debug_mode("error")
        try:
            events = compact_many(self, requests)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        rounds.append(len(events))
        return events

    monkeypatch.setattr(Compactor, "compact_many", strict)
    cfg = CompactionConfig(mode="attention_matching", compute_beta=True, queries="suffix", **BUDGET)
    prompts, inputs = workload(4, [16] * 4, seed=11)
    rollout(engine, [cfg] * 4, prompts, inputs, GREEDY, stacked=True)
    assert max(rounds) > 1  # rounds of several events ran (and raised nothing)

"""``benchmarks/bench_tagged_layer.py``: the Qwen3-0.6B-shaped tagged stream computes the layer it
times (against float64 with the same bf16 roundings), under every ring, cap, pair layout, L2
prefetcher, sum order and input it offers, and the engine's launch it is compared with runs (GPU); its gate/up pair
layouts cover every pair once, bad ``--prefetch`` kinds are refused by name, and a layer's steps
come out of its per-block stamps (CPU)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.gpu
def test_tagged_layer_matches_float64(load_benchmark, capsys):
    bench = load_benchmark("bench_tagged_layer")
    argv = ["--layers", "6", "--check-layers", "2", "--ahead", "2", "20", "--round-robin"]
    argv += ["--slots", "5", "6", "--input", "shared", "held"]
    argv += ["--prefetch", "none", "loads:2", "bulk:8", "--sums", "independent", "chained"]
    argv += ["--unchecked", "--no-input", "--no-bytes", "--stamps"]
    assert bench.main([*argv, "--repeats", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    errors = dict(
        part.rsplit(" ", 1)
        for part in out.split("relative to the largest value: ")[1].splitlines()[0].split("; ")
    )
    # 2 inputs × 2 sums × 2 rings × 2 caps × 2 pair layouts × 3 prefetchers × (end to end, last phase)
    assert len(errors) == 192
    for name, error in errors.items():
        assert float(error) < (1e-2 if "end to end" in name else 1e-3), name
    assert "engine's persistent launch" in out and "gate/up round robin" in out
    assert "L2 asked 2 chunks ahead (loads)" in out and "tags unchecked" in out and "no weight bytes" in out
    assert "Where a layer goes" in out and "input held in registers" in out


def test_pairs_cover_every_gate_up_chunk_once(load_benchmark):
    bench = load_benchmark("bench_tagged_layer")
    for programs in (128, 132, 144):
        for balanced in (False, True):
            table = bench.gate_up_pairs(programs, balanced)
            assert table.shape == (programs, 4)
            assert sorted(int(j) for j in table.flatten() if j >= 0) == list(range(bench.D // 2))


def test_prefetch_spec_is_parsed_or_refused_by_name(load_benchmark):
    bench = load_benchmark("bench_tagged_layer")
    assert bench.prefetch_mode("none") == (0, 0)
    assert bench.prefetch_mode("loads") == (1, 4)
    assert bench.prefetch_mode("bulk:8") == (2, 8)
    with pytest.raises(ValueError, match="--prefetch"):
        bench.prefetch_mode("l2:4")


def test_step_medians_take_the_last_block_at_each_event(load_benchmark):
    bench = load_benchmark("bench_tagged_layer")
    layers, blocks = 4, 3
    stamps = torch.zeros(layers, bench.EVENTS, blocks, dtype=torch.int64)
    for layer in range(layers):
        for event in range(bench.EVENTS):
            at = 10_000 * layer + 500 * event + (300 if event == 5 else 0)  # step M 0.8 µs, the next 0.2
            stamps[layer, event, 0] = at - 100  # an earlier block
            stamps[layer, event, 1] = at
    steps = bench.step_medians(stamps)
    assert steps["M: merge"] == pytest.approx(0.8)
    assert steps["hand-off 2: attention output to the output projection"] == pytest.approx(0.2)
    assert steps["hand-off 5 and the norm: h to the next layer"] == pytest.approx(10 - 11 * 0.5)
    assert steps["the layer"] == pytest.approx(10.0)

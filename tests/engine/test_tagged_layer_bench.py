"""``benchmarks/bench_tagged_layer.py``: the Qwen3-0.6B-shaped tagged stream computes the layer it
times (against float64 with the same bf16 roundings), under every cap and pair layout it offers,
and the engine's launch it is compared with runs (GPU); its gate/up pair layouts cover every pair
once (CPU)."""

from __future__ import annotations

import pytest


@pytest.mark.gpu
def test_tagged_layer_matches_float64(load_benchmark, capsys):
    bench = load_benchmark("bench_tagged_layer")
    argv = ["--layers", "6", "--check-layers", "2", "--ahead", "1", "2", "20", "--round-robin"]
    assert bench.main([*argv, "--repeats", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    errors = dict(
        part.rsplit(" ", 1)
        for part in out.split("relative to the largest value: ")[1].splitlines()[0].split("; ")
    )
    assert len(errors) == 12  # 3 caps × 2 pair layouts × (end to end, last phase)
    for name, error in errors.items():
        assert float(error) < (1e-2 if "end to end" in name else 1e-3), name
    assert "engine's persistent launch" in out and "gate/up round robin" in out


def test_pairs_cover_every_gate_up_chunk_once(load_benchmark):
    bench = load_benchmark("bench_tagged_layer")
    for programs in (128, 132, 144):
        for balanced in (False, True):
            table = bench.gate_up_pairs(programs, balanced)
            assert table.shape == (programs, 4)
            assert sorted(int(j) for j in table.flatten() if j >= 0) == list(range(bench.D // 2))

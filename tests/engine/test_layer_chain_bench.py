"""``benchmarks/bench_layer_chain.py``: every synchronised design computes the synthetic chain it
times (its last phase against a float64 run of the same data flow), so its timings mean something."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_designs_match_float64(load_benchmark, capsys):
    bench = load_benchmark("bench_layer_chain")
    assert bench.main(["--layers", "3", "--repeats", "2", "--rounds", "1", "--ring", "3"]) == 0
    out = capsys.readouterr().out
    assert "barriers" in out and "flags" in out
    assert "flags, each thread spins on its own words, ~200 ns pauses" in out
    errors = out.split("relative to its largest value: ")[1].splitlines()[0]
    assert all(float(part.rsplit(" ", 1)[1]) < 1e-3 for part in errors.split("; "))
    assert "barriers, weights not evict-first" in errors
    if "CUDA C++" in errors:  # a CUDA compiler here: the hand-written design and its split counters too
        assert "barriers, CUDA C++, 16 counters" in errors
        assert "stream, CUDA C++, ring 6" in errors
        assert "stream, CUDA C++, ring 6, tagged inputs" in errors  # polled bf16 words, end to end over 3 layers
        for early in ("before polling", "once the input is there"):
            for poll in ("each thread spins on its own words", "the block checks all words"):
                assert f"tagged, CUDA C++, weights issued {early}, {poll}" in errors
        assert ", D+E as split-K" in errors  # reductions into the layer's sums
        for n in (1, 4, 8, 16):  # each cluster size ran (its edge at B, at B-E, with split-K) or said why not
            ran = [f"clusters of {n}, {rows}" in errors for rows in ("B reads", "B–E read", "D+E as split-K, B reads")]
            assert all(ran) or (n > 1 and not any(ran) and f"clusters of {n}: too few resident" in out)
        if "split: 2 grid edges" not in out.split("largest error")[0]:  # the split design fits: checked, stamped
            assert "split: 2 grid edges a layer" in errors and "MLP rows loaded after the attention side" in errors
            assert "µs a layer (medians over layers): attention: q/k/v rows" in out
    if "stream" in errors:  # Gluon here: the paced and the capped streams are checked too
        assert "stream, ring 3, paced" in errors
        assert "stream, ring 3, ≤ 16 KB in flight" in errors
